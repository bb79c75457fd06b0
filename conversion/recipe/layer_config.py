"""The recipe's `layer:` section (`LayerConfig`): which sparse layer kind replaces the MLPs, its size and options.

What a kind allows (its fields, unit count, matching conventions, init modes) is read from the kind's spec class in
`expertize.modeling.LAYER_KINDS`; nothing here names a kind. `layer_spec.py` turns a LayerConfig and the base MLP's
shape into the validated spec.
"""

import dataclasses
from typing import Any, Literal

from expertize.modeling.sparse_base import canonical_activation
from expertize.modeling.sparse_spec import SparseSpec
from expertize.modeling.sparse_layers import DEFAULT_KIND, LAYER_KINDS

from .coerce import check_field_types, did_you_mean, field_default

__all__ = ["DEFAULT_MATCH_TRANSCODER", "LayerConfig", "has_selection_bias", "spec_class", "spec_field_names"]


# Recipe fields that map onto sparse spec fields of the same name (when the spec has them); `options` may not repeat
# them, and the spec fields the recipe derives from the base model may not be set at all.
SPEC_FIELDS_FROM_RECIPE = ("k", "num_experts", "num_latents", "d_hidden", "encoder", "activation")
SPEC_FIELDS_FROM_MODEL = ("d_in", "d_out")


def spec_class(kind: str) -> type[SparseSpec]:
    return LAYER_KINDS[kind][0]


def spec_field_names(kind: str) -> set[str]:
    return {f.name for f in dataclasses.fields(spec_class(kind))}


def has_selection_bias(kind: str) -> bool:
    """Whether `kind` chooses a top K by a score that `train.balance` can bias (its spec declares it:
    `SparseSpec.has_selection_bias`); the other kinds train unbalanced whatever the recipe asks."""
    return spec_class(kind).has_selection_bias()


def has_preact_loss(kind: str) -> bool:
    """Whether `train.preact_coef` acts on `kind` (its layer class declares it: `SparseLayer.supports_preact_loss`,
    the threshold kinds)."""
    return bool(LAYER_KINDS[kind][1].supports_preact_loss)


DEFAULT_MATCH_TRANSCODER = 8.0
"""The size of a layer whose recipe gives neither its unit count nor layer.match_transcoder: the parameters of a
transcoder with 8 latents per input dimension (8 x d_in), the size every kind is compared at in docs/results/
(sparsify's default expansion factor is 32; SAELens's examples use 4-32)."""

ONE_KIND_PER_RECIPE = dict(mismatch_hint=(
    "; one recipe puts one sparse layer (its layer: section) at every index of layers; to mix kinds, convert in "
    "steps: a second recipe with base_model: the first run's output_dir and its own layers and layer: "
    "(docs/upcycle.md#stacking)"
))
"""Field metadata of the keys a newcomer bends to ask for a kind per layer (`layers`, `layer`, `layer.kind`): a value
of the wrong type there is refused with this hint (coerce.build)."""


@dataclasses.dataclass
class LayerConfig:
    """The sparse layer that replaces each target MLP (recipe section `layer:`)."""

    kind: str = dataclasses.field(default=DEFAULT_KIND, metadata=ONE_KIND_PER_RECIPE)
    """Sparse layer kind: any key of expertize.modeling.LAYER_KINDS (default: the registry's DEFAULT_KIND, MxD)."""

    k: int = 32
    """K: active experts (mxd, routed kinds) or latents (transcoders) per token; for kinds with a top-k only (a
    switch to a kind without one resets it: `--set layer.kind=mumoe_cp --set layer.k=null --set
    layer.num_experts=256`, μMoE also needing its expert count)."""

    num_experts: int | None = None
    """N, the number of experts (every kind except transcoders). Give it or `match_transcoder`, not both (neither:
    `match_transcoder` 8), unless the kind's parameter matching picks another field (μMoE: the rank)."""

    num_latents: int | None = None
    """transcoders: L, the dictionary size. Give it or `match_transcoder`, not both (neither: `match_transcoder`
    8)."""

    match_transcoder: float | None = None
    """Size the layer like a transcoder of `match_transcoder * d_in` latents (default 8 when the unit count is not
    given either: DEFAULT_MATCH_TRANSCODER): transcoders get exactly that many; mxd gets the N that matches that
    transcoder's parameter count (see `match_convention`); other kinds get the largest N (or the field their spec names as `match_field`, e.g. μMoE's rank) within that parameter count."""

    match_convention: Literal["exact", "paper"] = "exact"
    """mxd parameter matching: "exact" (largest N within the transcoder's parameter count) or "paper" (reproduces
    the MxD paper's Table 2: N = 21,490 for GPT-2)."""

    d_hidden: int | None = None
    """H, the width of the dense hidden code (mxd, μMoE) or the total expert width (Monet); default: the base
    MLP's width (mxd: half of it, so that its experts carry the layer; docs/results/code_share.md; the MxD paper's
    H is the full width). Kinds without the field reject it."""

    encoder: Literal["auto", "mlp", "glu"] = "auto"
    """Dense encoder of mxd and μMoE: "auto" (glu when the base MLP is gated, else mlp), "mlp" or "glu"."""

    activation: str = "auto"
    """Hidden activation of kinds that have one: "auto" (the base MLP's: gelu_new for GPT-2, gelu for Pythia, silu
    for Llama; MoE-X keeps its ReLU), or gelu, gelu_new, silu, relu, relu2."""

    init: Literal["default", "split", "copy"] = "default"
    """Where the layer's weights start: "default" (the layer's own init), or, for kinds whose spec lists them in
    `init_modes` (MoE-X), "split" (the dense MLP's hidden neurons partitioned over the experts; with all experts on
    and unscaled gates, k = num_experts and options {gate_scaling: none}, it equals the MLP; the default gates,
    k_softmax, start near it) or "copy" (every expert a noisy copy of the MLP); see conversion/surgery/dense_init.py."""

    init_clustering: Literal["random", "balanced_kmeans"] = "random"
    """split: how neurons are grouped into experts (random, or balanced k-means on their input weights)."""

    init_noise: float | None = None
    """copy: relative std of the noise on each expert's encoder (breaks the router's ties); null: the default 0.01."""

    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Further fields of the layer's spec, passed through and validated by it, e.g. {random_k: true} or
    {unit_norm_experts: true} or {encoder_bias: false} for mxd."""

    def __post_init__(self) -> None:
        check_field_types(self, "layer")
        if self.kind not in LAYER_KINDS:
            raise ValueError(
                f"layer.kind: unknown kind {self.kind!r}{did_you_mean(self.kind, LAYER_KINDS)}; "
                f"known kinds: {', '.join(sorted(LAYER_KINDS))}"
            )
        for name in ("k", "num_experts", "num_latents", "d_hidden"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"layer.{name}: must be >= 1, got {value}")
        if self.match_transcoder is not None and not self.match_transcoder > 0:
            raise ValueError(
                "layer.match_transcoder: must be a positive expansion factor (transcoder latents per input dim), "
                f"got {self.match_transcoder}"
            )
        if self.activation != "auto":
            try:
                self.activation = canonical_activation(self.activation)
            except ValueError as e:
                raise ValueError(f"layer.activation: {e}, or 'auto'") from None
        self._check_fields_apply()
        self._check_size()
        self._check_options()
        if self.init not in spec_class(self.kind).init_modes:
            kinds = [kind for kind, (spec_cls, _) in LAYER_KINDS.items() if self.init in spec_cls.init_modes]
            raise ValueError(
                f"layer.init={self.init!r}: initialization from the dense MLP is implemented for "
                f"{', '.join(kinds)}, not {self.kind!r}; use init: default"
            )
        if self.init_noise is not None and (self.init != "copy" or not self.init_noise >= 0):
            raise ValueError(f"layer.init_noise: a number >= 0 for init: copy only, got {self.init_noise!r} with "
                             f"init: {self.init}")

    def _check_fields_apply(self) -> None:
        """Fields the kind's spec does not have must keep their defaults (e.g. layer.encoder for a transcoder). The
        message lists every override a command-line kind switch needs at once (those fields reset, and a unit count
        the kind requires), so one retry succeeds."""
        spec_fields = spec_field_names(self.kind)
        for name in SPEC_FIELDS_FROM_RECIPE:
            value, default = getattr(self, name), field_default(LayerConfig, name)
            if name not in spec_fields and value != default:
                kinds = ", ".join(kind for kind in sorted(LAYER_KINDS) if name in spec_field_names(kind))
                # A kind switch from the command line (--set layer.kind=...) cannot delete a key of the file, but
                # `--set KEY=null` resets it to its default.
                resets = [n for n in SPEC_FIELDS_FROM_RECIPE
                          if n not in spec_fields and getattr(self, n) != field_default(LayerConfig, n)]
                switch = [f"--set layer.kind={self.kind}", *(f"--set layer.{n}=null" for n in resets)]
                if self._missing_unit_count():
                    switch.append(f"--set layer.{self.units_field}=N")
                why = f" ({self._unit_count_reason()}; e.g. 256)" if self._missing_unit_count() else ""
                raise ValueError(
                    f"layer.{name}={value!r} does not apply to layer.kind={self.kind!r} (it applies to kinds: "
                    f"{kinds}); remove it from the recipe, or switch kinds on the command line with "
                    f"{' '.join(switch)}{why}"
                )

    def _missing_unit_count(self) -> bool:
        """The kind needs its unit count given (parameter matching sizes another field, e.g. μMoE's rank) and it is
        not."""
        spec_cls = spec_class(self.kind)
        units = spec_cls.units_field
        return (spec_cls.size_field() != units and getattr(self, units, None) is None
                and field_default(spec_cls, units) is dataclasses.MISSING)

    def _unit_count_reason(self) -> str:
        spec_cls = spec_class(self.kind)
        return (f"layer.{spec_cls.units_field} is required: layer.match_transcoder sizes the {spec_cls.size_field()} "
                f"of layer.kind={self.kind!r}, not its {spec_cls.unit_name} count")

    def _check_size(self) -> None:
        """Exactly one of the explicit unit count and match_transcoder, unless matching sizes another field; neither
        given: match_transcoder defaults to DEFAULT_MATCH_TRANSCODER (a kind switch from the command line, or
        `layer: {kind: clt}`, trains at a documented size instead of stopping)."""
        spec_cls = spec_class(self.kind)
        units, match_field = spec_cls.units_field, spec_cls.size_field()
        if units not in spec_field_names(self.kind):
            raise ValueError(f"layer.kind={self.kind!r}: its spec has no field {units!r} (its units_field)")
        explicit = getattr(self, units)
        if match_field == units and explicit is None and self.match_transcoder is None:
            self.match_transcoder = DEFAULT_MATCH_TRANSCODER
        if match_field == units:
            if explicit is not None and self.match_transcoder is not None:
                raise ValueError(
                    f"layer: give at most one of layer.{units} (explicit size) and layer.match_transcoder (size "
                    f"matched to a transcoder of that expansion factor) for layer.kind={self.kind!r}; both are set "
                    f"(--set layer.match_transcoder=null keeps the {units})"
                )
        else:
            # e.g. μMoE: the expert count is a free choice and parameter matching picks the rank.
            if self.match_transcoder is not None and match_field in self.options:
                raise ValueError(
                    f"layer: layer.match_transcoder chooses {match_field} for layer.kind={self.kind!r}; remove "
                    f"layer.options.{match_field} or layer.match_transcoder"
                )
            if self._missing_unit_count():
                raise ValueError(f"{self._unit_count_reason()}; set it, e.g. --set layer.{units}=256")
        if self.match_convention not in spec_cls.match_conventions:
            kinds = [kind for kind, (cls, _) in LAYER_KINDS.items() if self.match_convention in cls.match_conventions]
            raise ValueError(
                f"layer.match_convention={self.match_convention!r} applies to {', '.join(kinds)} only; remove it for "
                f"layer.kind={self.kind!r}"
            )

    def _check_options(self) -> None:
        reserved = set(SPEC_FIELDS_FROM_RECIPE) | set(SPEC_FIELDS_FROM_MODEL) | {"kind"}
        allowed = sorted(spec_field_names(self.kind) - reserved)
        for name in self.options:
            if name in SPEC_FIELDS_FROM_RECIPE or name == "kind":
                raise ValueError(f"layer.options.{name}: not an option; set layer.{name} instead")
            if name in SPEC_FIELDS_FROM_MODEL:
                raise ValueError(f"layer.options.{name}: not an option; it is taken from the base model's MLP")
            if name not in allowed:
                raise ValueError(
                    f"layer.options.{name}: unknown option for layer.kind={self.kind!r}"
                    f"{did_you_mean(name, allowed)}; valid options: {', '.join(allowed) or '(none)'}"
                )

    @property
    def units_field(self) -> str:
        """The spec field that counts this kind's units: "num_experts" (mxd) or "num_latents" (transcoders)."""
        return spec_class(self.kind).units_field
