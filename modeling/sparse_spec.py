"""The spec base class of every sparse layer kind (`SparseSpec`: its hyperparameters and its kind facts) and the
helpers the kinds' specs validate and cite with.

Part of the Hub bundle: imports only the standard library.
"""

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, ClassVar


def _require_int(spec: "SparseSpec", name: str, minimum: int = 1) -> None:
    value = getattr(spec, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{spec.kind}.{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{spec.kind}.{name} must be >= {minimum}, got {value}")


def _require_bool(spec: "SparseSpec", name: str) -> None:
    value = getattr(spec, name)
    if not isinstance(value, bool):
        raise ValueError(f"{spec.kind}.{name} must be true or false, got {value!r}")


def _require_positive(spec: "SparseSpec", name: str) -> None:
    value = getattr(spec, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{spec.kind}.{name} must be a positive number, got {value!r}")


def _require_choice(spec: "SparseSpec", name: str, choices: Iterable[str]) -> None:
    value = getattr(spec, name)
    if value not in choices:
        raise ValueError(f"{spec.kind}.{name} must be one of {sorted(choices)}, got {value!r}")


def arxiv_bibtex(key: str, *, title: str, authors: list[str], year: int, arxiv_id: str) -> str:
    """BibTeX @article entry of an arXiv paper (the `citation` of a spec class)."""
    fields = {
        "title": title,
        "author": " and ".join(authors),
        "journal": f"arXiv preprint arXiv:{arxiv_id}",
        "year": year,
        "eprint": arxiv_id,
        "archivePrefix": "arXiv",
        "url": f"https://arxiv.org/abs/{arxiv_id}",
    }
    body = ",\n".join(f"  {name:<13} = {{{value}}}" for name, value in fields.items())
    return f"@article{{{key},\n{body}\n}}"


UNITS_FIELDS = ("num_experts", "num_latents")
"""The names a spec's `units_field` may have: the recipe's `layer:` section has a setting of each name (a kind's unit
count is set there, or sized by `layer.match_transcoder`)."""


@dataclasses.dataclass
class SparseSpec:
    """Hyperparameters of one sparse layer. Subclasses add fields and set `kind`.

    A spec validates itself on construction, counts its parameters and FLOPs, and round-trips through the plain JSON
    dict stored in the model config (`to_dict` / `from_dict`).
    """

    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # Checked where the kind is written, not where a recipe first reads it.
        if cls.units_field not in UNITS_FIELDS:
            raise TypeError(
                f"{cls.__name__}.units_field={cls.units_field!r}: a kind's units_field must be one of "
                f"{list(UNITS_FIELDS)} (the recipe settings that size a layer); name the unit count field so"
            )

    # -- Kind facts -------------------------------------------------------------------------------------------------
    # What the recipe, the model card and the docs know about a kind, declared once on its spec class: a new kind
    # sets these in its own file and registers itself in `sparse_layers.LAYER_KINDS`; no other file names it.

    title: ClassVar[str] = ""
    """The method's name in prose, e.g. "Mixture of Decoders (MxD)" (model card)."""
    unit_name: ClassVar[str] = "expert"
    """What the sparse code indexes: "expert" or "latent" (model card: "K of N experts active")."""
    units_field: ClassVar[str] = "num_experts"
    """The field counting the units (N): "num_experts" or "num_latents"."""
    match_field: ClassVar[str | None] = None
    """The field parameter matching (recipe `layer.match_transcoder`) chooses; None: `units_field`."""
    match_conventions: ClassVar[tuple[str, ...]] = ("exact",)
    """Parameter-matching conventions (recipe `layer.match_convention`). "exact": the largest `match_field` within
    the transcoder's parameter count; others are computed by `matched_size`."""
    init_modes: ClassVar[tuple[str, ...]] = ("default",)
    """Where the weights can start (recipe `layer.init`): "default" (`reset_parameters`), or modes built from the
    dense MLP ("split", "copy"): the spec gives their fields (`dense_init_fields`), the layer takes the MLP's weights
    (`SparseLayer.dense_init_groups`, `dense_fit_problems`, `init_from_dense`) and conversion/surgery/dense_init.py
    runs them."""
    citation: ClassVar[str] = ""
    """BibTeX of the paper behind the kind (cited by every model card that uses it)."""
    activation_meaning: ClassVar[str] = "the unit's coefficient in the sparse code; active where nonzero"
    """What one unit's activation (its weight in the code) is, for inspection reports and the explorer. Where a unit
    counts as active is `SparseLayer.active_entries`'s rule, the same for every reader."""
    auto_lr_factor: ClassVar[float] = 1.0
    """The kind's peak learning rate under `train.lr: auto`, as a multiple of the rule's (conversion/recipe/lr_rule.py):
    1 for kinds whose best rate was the rule's on the models measured; below 1 for kinds that train best slower."""
    code_unit_name: ClassVar[str | None] = None
    """What one id of the sparse code denotes, when it is not a `unit_name` (MoE-X: "hidden unit" of an expert)."""
    not_sparse_coder: ClassVar[str] = (
        "its output is not a sum of fixed decoder rows weighted by TopK(ReLU(W_enc x + b_enc))"
    )
    """Why this kind's layer is not a TopK sparse coder (`SparseLayer.sparse_coder` gives None), the one shape that
    sparsify and circuit-tracer hold: `expertize export` refuses such a layer with this reason."""

    coder_activation: ClassVar[str | None] = None
    """The activation of the layer's `Coder` ("topk", "jumprelu", "relu") where the layer is exactly a sparse coder
    (`SparseLayer.sparse_coder`), else None: what the exporters tell the tools that read coders."""
    cross_layer: ClassVar[bool] = False
    """Whether the kind's layers read each other's codes (a cross-layer transcoder): converted and exported as one."""

    d_in: int
    d_out: int

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _require_int(self, "d_in")
        _require_int(self, "d_out")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SparseSpec":
        data = dict(data)
        kind = data.pop("kind", cls.kind)
        if kind != cls.kind:
            raise ValueError(f"spec of kind {kind!r} cannot be read as {cls.kind!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown} for sparse layer kind {cls.kind!r}; valid fields: {sorted(names)}")
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        if missing:
            raise ValueError(f"sparse layer kind {cls.kind!r} needs field(s) {missing}")
        return cls(**data)

    @classmethod
    def code_unit(cls) -> str:
        """The name of what one code id denotes ("expert", "latent", "hidden unit", ...)."""
        return cls.code_unit_name or cls.unit_name

    @classmethod
    def has_selection_bias(cls) -> bool:
        """Whether the kind chooses its top K by a score a trainer can bias (its spec declares `selection_bias`):
        `train.balance` acts on it, and a health warning may advise it."""
        return "selection_bias" in {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def size_field(cls) -> str:
        """The field parameter matching chooses (`match_field`, else `units_field`)."""
        return cls.match_field or cls.units_field

    @classmethod
    def mlp_defaults(cls, shape: Any, *, init: str = "default", num_units: int | None = None) -> dict[str, Any]:
        """Field values derived from the dense MLP this layer replaces (the recipe's "auto" values; explicit recipe
        settings override them).

        `shape` is a `configuration_expertize.MlpShape` (d_model, d_hidden, activation, glu); `init` the recipe's
        `layer.init`; `num_units` the unit count when the recipe gives it. The activation is returned as the base
        model names it (the caller canonicalizes it). Kinds whose fields mirror the MLP differently override this.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        derived = {
            "d_hidden": shape.d_hidden,
            "encoder": "glu" if shape.glu else "mlp",
            "activation": shape.activation,
        }
        return {name: value for name, value in derived.items() if name in names}

    @classmethod
    def dense_init_fields(
        cls, method: str, dense: Any, *, num_units: int | None = None, k: int | None = None
    ) -> dict[str, Any]:
        """Field values of a layer that starts as the dense MLP `dense` by `method` (one of `init_modes` other than
        "default"), for `SparseLayer.init_from_dense`: the exact form (with all units on, the layer equals the MLP
        for "split"). `dense` has d_in, d_hidden, d_out, glu, bias (whether it has biases) and activation (canonical);
        `num_units` and `k` are the caller's choices when given. Kinds listing such modes override this."""
        raise NotImplementedError(f"{cls.kind} layers do not start from a dense MLP (init_modes: {cls.init_modes})")

    @classmethod
    def matched_size(cls, fields: dict[str, Any], num_latents: int, convention: str) -> int | None:
        """`size_field()`'s value under a parameter-matching convention (one of `match_conventions`) for a transcoder
        of `num_latents` latents, where the kind has a rule of its own (a transcoder: exactly `num_latents`; MxD's
        "paper" convention); None: the exact search (the largest value within the transcoder's parameter count)."""
        return None

    def at_layer(self, index: int, layer_ids: list[int]) -> "SparseSpec":
        """The spec of the layer this kind builds at model layer `index` when a recipe converts `layer_ids`: itself,
        for every kind whose layers are independent; a kind whose layers read each other (the cross-layer transcoder)
        names its sources here."""
        return self

    def num_parameters(self) -> int:
        raise NotImplementedError

    def active_parameters(self) -> int:
        """Parameters touched per token (dense parts + the K selected rows)."""
        raise NotImplementedError

    def flops_per_token(self) -> int:
        """Forward FLOPs per token (2 x multiply-accumulates), counting only the K selected rows of sparse parts."""
        raise NotImplementedError
