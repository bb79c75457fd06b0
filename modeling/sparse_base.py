"""Pieces shared by every sparse layer: the spec base class, the sparse code, its hook point and interventions.

Part of the Hub bundle: imports only torch, the standard library and sibling files.

Letters used in shape comments across the bundle:
    T tokens (any leading dims flattened), I d_in, O d_out, H hidden width, N experts / latents, K active (top-k).
"""

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F


class SparseCode(NamedTuple):
    """The sparse part of a layer's computation for each token."""

    top_k_index: torch.Tensor
    """(..., K) int64 ids of the active experts / latents."""
    top_k_weights: torch.Tensor
    """(..., K) their coefficients (post-activation, post-TopK)."""

    def flat(self) -> "SparseCode":
        """The same code with the leading dims flattened: (..., K) -> (T, K)."""
        return SparseCode(
            self.top_k_index.reshape(-1, self.top_k_index.shape[-1]),
            self.top_k_weights.reshape(-1, self.top_k_weights.shape[-1]),
        )


class CodeHook(nn.Module):
    """Identity on the `SparseCode`.

    A stable module path (`...mlp.code_hook`) whose forward output hooks, nnsight and SAE tooling can read and replace.
    The code it sees has the layer input's leading shape, e.g. (batch, seq, K) inside a model, like the module's own
    output (batch, seq, d_out).
    """

    def forward(self, code: SparseCode) -> SparseCode:
        return code


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # squared ReLU (Monet, Primer)
}
# Activation names used by transformers configs -> ours (same function, other spelling).
ACTIVATION_ALIASES = {"gelu_pytorch_tanh": "gelu_new", "swish": "silu", "gelu_fast": "gelu_new"}


def canonical_activation(name: str) -> str:
    name = ACTIVATION_ALIASES.get(name, name)
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; choose one of {sorted(ACTIVATIONS)}")
    return name


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
    not_topk_coder: ClassVar[str] = (
        "its output is not a sum of fixed decoder rows weighted by TopK(ReLU(W_enc x + b_enc))"
    )
    """Why this kind's layer is not a TopK sparse coder (`SparseLayer.topk_coder` gives None), the one shape that
    sparsify and circuit-tracer hold: `expertize export` refuses such a layer with this reason."""

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

    def num_parameters(self) -> int:
        raise NotImplementedError

    def active_parameters(self) -> int:
        """Parameters touched per token (dense parts + the K selected rows)."""
        raise NotImplementedError

    def flops_per_token(self) -> int:
        """Forward FLOPs per token (2 x multiply-accumulates), counting only the K selected rows of sparse parts."""
        raise NotImplementedError


class TopKCoder(NamedTuple):
    """A layer that is exactly a TopK sparse coder, the one shape sparse-coder tools (sparsify, circuit-tracer) hold:

        y = W_decᵀ TopK_k(ReLU(W_enc x + b_enc)) + b_dec  (+ W_skip x)

    The K units are chosen among the positive pre-activations, by `pre + b_select` where `b_select` is given (it
    chooses, never weights). Tensors are the layer's own, detached."""

    W_enc: torch.Tensor
    """(L, I) encoder rows."""
    b_enc: torch.Tensor
    """(L,)"""
    W_dec: torch.Tensor
    """(L, O) decoder rows: unit l adds W_dec[l] per unit of its value."""
    b_dec: torch.Tensor
    """(O,)"""
    W_skip: torch.Tensor | None
    """(O, I) linear skip path, or None."""
    k: int
    b_select: torch.Tensor | None
    """(L,) selection bias, or None."""


class SparseLayer(nn.Module):
    """Base class of every sparse MLP replacement.

    `forward(hidden_states) -> hidden_states` with the MLP's shape and dtype; `encode(x)` returns the `SparseCode`
    after it has passed through `self.code_hook`. Interventions (`steer`, `ablate`) act on the code after TopK.
    """

    spec: SparseSpec

    def __init__(self, spec: SparseSpec) -> None:
        super().__init__()
        self.spec = spec
        self.code_hook = CodeHook()
        # Interventions are run-time state, never saved: plain attributes, not buffers.
        self._steering: dict[int, float] = {}
        self._ablated: frozenset[int] = frozenset()
        # The same at chosen positions only: {(unit, positions): value} and {positions: units}.
        self._steering_at: dict[tuple[int, tuple[int, ...]], float] = {}
        self._ablated_at: dict[tuple[int, ...], frozenset[int]] = {}
        # Side channel for routed layers (transformers' MoEs record router logits from their router module; a
        # swapped `.mlp` is invisible to that machinery, so the model collects these after the forward instead).
        self.router_logits: torch.Tensor | None = None
        """(T, E) router scores of the last forward, set by routed layers while `record_router_outputs` is on."""
        self.aux_loss: torch.Tensor | None = None
        """Scalar auxiliary loss of the last forward, *already weighted* by the spec's own coefficient(s); set by
        layers that have one, while training or while `record_router_outputs` is on."""
        self.record_router_outputs = False
        self.keep_for_auxk = False
        """Set by the trainer for a step in which AuxK runs: the training forward keeps what `auxk_reconstruction`
        would otherwise recompute (the dense pre-activations), and AuxK takes it."""
        self._kept: dict[str, Any] = {}
        self.selection_scale: torch.Tensor | None = None
        """Training forwards of layers with a selection bias: the mean |score| of the selected units (a scalar
        tensor), the scale in which the balancer moves `b_select`."""

    @property
    def activation_hook(self) -> CodeHook:
        """The module whose output is each unit's activation as a reader sees it: what inspection's statistics and
        top contexts and specialization's rates and probes read. `code_hook` for kinds whose code weight is the unit's
        contribution scale; a kind whose code weight is something else (routed neurons: a router gate) adds its own,
        read-only hook. Interventions always edit `code_hook`."""
        return self.code_hook

    def _init_selection_bias(self, num_selectable: int) -> None:
        """`b_select` (num_selectable,), a persistent buffer, when the spec asks for a selection bias; else None."""
        if getattr(self.spec, "selection_bias", False):
            self.register_buffer("b_select", torch.zeros(num_selectable))
        else:
            self.b_select = None

    def _select(self, scores: torch.Tensor, k: int, *, sorted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """TopK over `scores` (T, S) with the selection bias if there is one: (selected scores, index), each (T, K);
        the scores returned are the unbiased ones (the bias chooses, it never weights)."""
        if self.b_select is None:
            selected, index = scores.topk(k, dim=-1, sorted=sorted)
        else:
            index = (scores + self.b_select.to(scores.dtype)).topk(k, dim=-1, sorted=sorted).indices
            selected = scores.gather(-1, index)
        self._note_selection_scale(selected)
        return selected, index

    def _note_selection_scale(self, selected: torch.Tensor) -> None:
        if self.b_select is not None and self.training:
            self.selection_scale = selected.detach().abs().float().mean()

    def active_entries(self, weights: torch.Tensor) -> torch.Tensor:
        """Which entries of a code are active: weights (..., K) -> (..., K) bool.

        The one definition of an active unit, read by every count of the code: L0 and dead units (evaluation, the
        training and healing logs, the dead-unit trackers of AuxK and resampling, the balancer's load), firing in
        inspection, specialization and the per-prompt view. Default: nonzero. A unit whose weight is not 0 adds
        weight x its output direction to the layer's output, whatever the sign, so it is in use; this is the
        code's ℓ0 as the papers count it (MoE-X with GELU experts: ~4,091 of 4,096 hidden units active, Yang et
        al. 2025). For the kinds' codes of ReLU / TopK / entmax / softmax / |g·h| weights (>= 0) it equals "> 0";
        it differs for a code with negative entries, e.g. MoE-X split from a GELU MLP, where "> 0" would count the
        ~5 % of entries above 0 and hide the other ~95 % the output depends on. A kind whose zero weight is not
        its "off" (or whose "off" is not zero) overrides this."""
        return weights != 0

    def selection_load(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Tokens on which each selectable unit (`b_select`'s entries) was chosen and fired, from a code of
        (..., K) index and weights: (S,) float32. Default: the code's units are the selectable ones."""
        index = top_k_index.reshape(-1)
        fired = self.active_entries(top_k_weights.reshape(-1)).float()
        return torch.zeros(self.b_select.shape[0], device=index.device).index_add_(0, index, fired)

    # -- what inspection asks (conversion/inspection/ reads these; it never switches on the kind) -------------------

    def topk_coder(self) -> TopKCoder | None:
        """The layer as a TopK sparse coder when it is exactly one (`TopKCoder`), else None; the spec's
        `not_topk_coder` says why not. What `expertize export` writes for sparsify and circuit-tracer."""
        return None

    router_distribution: str | None = None
    """How a token's routing is a distribution over the routed experts, if the kind has a router: "scores" (a
    softmax over router scores the layer records in `router_logits`: moe_x, routed neurons) or "gates" (the code's
    own weights, normalized per token: μMoE's entmax gate, Monet's head-summed G); None (TopK over ReLU scores:
    mxd, transcoders) means the per-unit firing frequency is the load."""

    @property
    def num_routed_experts(self) -> int:
        """How many experts the router chooses among (the code's units, unless they are finer: MoE-X)."""
        return self.num_units

    def routed_experts(self, top_k_index: torch.Tensor) -> torch.Tensor:
        """The routed expert of each code entry, (..., K) -> (..., K') (identity unless code units are finer)."""
        return top_k_index

    def output_directions(self) -> torch.Tensor | None:
        """(U, O): what one unit adds to the output per unit of activation, when that is a fixed vector (a decoder
        row); None where it depends on the token (see `token_directions`) or does not exist (Monet)."""
        return None

    token_directions = False
    """True when a unit's output direction depends on the token through the layer's hidden code z (`hidden(x)`):
    inspection averages `direction_terms(z)` over each unit's firing tokens and `directions_from_means` maps the
    means to (U, O) directions (mxd: c_n ⊙ mean Dᵀz; μMoE: W_nᵀ mean z + β_n)."""

    def direction_terms(self, z: torch.Tensor) -> torch.Tensor:
        """(T, H) hidden code -> (T, F), the per-token quantity whose mean over a unit's firing tokens gives its
        direction."""
        raise NotImplementedError

    def directions_from_means(self, means: torch.Tensor) -> torch.Tensor:
        """(U, F) per-unit means of `direction_terms` -> (U, O) output directions."""
        raise NotImplementedError

    def hidden(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The layer's hidden code z (T, H), for kinds with `token_directions`: their forward computes z by calling
        this method once per forward (inspection reads z by wrapping it, never recomputing it; `direction_terms`
        takes it). Kinds without token directions need not have it."""
        raise NotImplementedError(
            f"{self.spec.kind} layers have no hidden code: a kind with token_directions = True defines hidden() and "
            "calls it in its forward"
        )

    # -- what training asks (conversion/training/ reads these; it never switches on the kind) ----------------------

    @property
    def output_bias(self) -> nn.Parameter | None:
        """The (O,) bias every token's output adds (`y = ... + b`), which distillation starts at the mean MLP output
        of the first batch (the MxD paper's init of b_dec; `DistillTask.first_batch`), or None where the kind has
        none (the trainer then leaves the layer's init as it is). A kind with such a bias returns its parameter."""
        return None

    def average_code_output(self, x: torch.Tensor, mean_weights: torch.Tensor) -> torch.Tensor:
        """The layer's output on x (..., I) with every token's code replaced by the average code `mean_weights` (N,)
        (each unit at its mean weight over some tokens): (..., O). What the code probe measures the code share with
        (conversion/evaluation/code_probe.py) and what `train.code_share_floor` trains against, so it stays
        differentiable in the layer's parameters. This default replaces the code at `code_hook` by a dense (..., N)
        one — exact for every kind, but N-wide per token; kinds whose output is linear in the code override it."""
        n = mean_weights.shape[0]

        def average_code(module, args, code: SparseCode) -> SparseCode:
            lead = code.top_k_index.shape[:-1]
            index = torch.arange(n, device=mean_weights.device).expand(*lead, n)  # (..., N)
            return SparseCode(index, mean_weights.to(code.top_k_weights.dtype).expand(*lead, n))

        handle = self.code_hook.register_forward_hook(average_code)
        try:
            return self(x)
        finally:
            handle.remove()

    supports_auxk = False
    """Whether dead units can model the residual error through `auxk_reconstruction` (AuxK, Gao et al. 2024;
    conversion/training/auxk.py): kinds whose units are chosen by a top-k over their own parameters."""

    def auxk_reconstruction(self, x: torch.Tensor, dead_mask: torch.Tensor, k_aux: int) -> torch.Tensor:
        """AuxK's ê: what the `k_aux` highest-ranked *dead* units (`dead_mask` (N,) bool) would add to the output for
        input x, without the output bias: (..., I) -> (..., O). Gradients reach only those units' parameters. The
        training forward may keep its dense pre-activations for it (`keep_for_auxk`, `_keep` / `_take_kept`). Kinds
        that set `supports_auxk` define it."""
        raise NotImplementedError(f"{self.spec.kind} layers have no AuxK (supports_auxk is False)")

    # -- starting from a dense MLP (the spec's init_modes besides "default"; conversion/surgery/dense_init.py) ------

    @property
    def dense_init_groups(self) -> int:
        """How many groups of the dense MLP's hidden neurons the layer takes (one per expert): "split" partitions the
        neurons into this many groups, "copy" gives each group all of them."""
        raise NotImplementedError(f"{self.spec.kind} layers do not start from a dense MLP")

    def dense_fit_problems(self, dense: Any, method: str) -> list[str]:
        """What keeps this layer's spec from holding the dense MLP `dense` (d_in, d_hidden, d_out, glu, bias) by
        `method`, one message per mismatch (each naming the field and the value it needs); [] when it fits."""
        raise NotImplementedError(f"{self.spec.kind} layers do not start from a dense MLP")

    @torch.no_grad()
    def init_from_dense(
        self, dense: Any, groups: list[torch.Tensor], *, noise_std: float = 0.0, seed: int = 0
    ) -> None:
        """Overwrite the weights with a dense MLP's: group j of units takes the hidden neurons `groups[j]` (sorted
        ids) of `dense` (w_in (H, I), b_in, w_up, b_up (None unless GLU), w_out (O, H), b_out; a missing bias gives
        zeros), plus Gaussian noise of `noise_std` x std(w_in) where the kind needs ties broken (drawn from `seed`).
        Called after `dense_fit_problems` returned []."""
        raise NotImplementedError(f"{self.spec.kind} layers do not start from a dense MLP")

    supports_resampling = False
    """Whether `resample_units` can re-point dead units at given inputs (conversion/training/resample.py)."""

    @torch.no_grad()
    def resample_units(self, units: torch.Tensor, x: torch.Tensor, error: torch.Tensor) -> dict[str, torch.Tensor]:
        """Re-initialize dead `units` (n,) toward inputs `x` (n, I) on which the layer's error is large (`error`
        (n, O), y - ŷ): each unit's input row points at its x (its score on that input is then high), its output
        row starts so that the layer's output is unchanged until training moves it. Returns {parameter name: the
        rows it re-initialized} so that the trainer resets those rows' optimizer moments. Anthropic's resampling
        (Bricken et al. 2023), per kind; kinds without it leave `supports_resampling` False."""
        raise NotImplementedError(f"{self.spec.kind} layers do not resample dead units")

    @staticmethod
    def _point_rows(rows: torch.Tensor, units: torch.Tensor, directions: torch.Tensor, live: torch.Tensor) -> None:
        """rows[units] = unit `directions` (n, I) scaled to the mean norm of the rows of `live` units (N,) bool."""
        norms = rows.norm(dim=-1)  # (N,)
        scale = (norms * live).sum() / live.sum().clamp_min(1)
        scale = torch.where(live.any(), scale, norms.mean())
        rows[units] = (directions / directions.norm(dim=-1, keepdim=True).clamp_min(1e-12) * scale).to(rows.dtype)

    def _keep(self, source: torch.Tensor, **tensors: torch.Tensor) -> None:
        """During a training forward with `keep_for_auxk`: remember `tensors` (detached) as computed from input
        `source` (the tensor object the caller passed in)."""
        if self._wants_pre():
            if self._kept.get("source") is not source:
                self._kept = {"source": source}
            self._kept.update({name: t.detach() for name, t in tensors.items()})

    def _wants_pre(self) -> bool:
        """Whether this forward must produce the dense pre-activations (to keep them for AuxK)."""
        return self.training and self.keep_for_auxk

    def _take_kept(self, source: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the last training forward kept for input `source` (emptied: memory is released), or {}."""
        kept, self._kept = self._kept, {}
        return kept if kept.get("source") is source else {}

    @property
    def num_units(self) -> int:
        """Number of units (experts / latents) the code indexes."""
        raise NotImplementedError

    selects_top_k_units = False
    """Whether the code lists the top `spec.k` units per token (mxd, transcoders, routed neurons): then every token
    should have K firing units, and a mean L0 far below K means the code collapsed."""

    @property
    def target_l0(self) -> int | None:
        """The L0 a healthy code has (K for kinds that select the top K units), or None where there is no such K."""
        return int(self.spec.k) if self.selects_top_k_units else None

    def reset_parameters(self) -> None:
        raise NotImplementedError

    # -- router side channel and optimizer hooks ------------------------------------------------------------------

    @property
    def wants_router_outputs(self) -> bool:
        """Whether this forward should compute `aux_loss` / keep `router_logits` (training, or asked by the model)."""
        return self.training or self.record_router_outputs

    def _set_router_outputs(self, router_logits: torch.Tensor | None, aux_loss: torch.Tensor | None) -> None:
        if self.wants_router_outputs:
            self.router_logits, self.aux_loss = router_logits, aux_loss

    def clear_router_outputs(self) -> None:
        self.router_logits = self.aux_loss = None

    def before_optimizer_step(self) -> None:
        """Called by trainers after backward, before the optimizer step (e.g. project gradients)."""

    def after_optimizer_step(self) -> None:
        """Called by trainers after the optimizer step (e.g. renormalize constrained weights)."""

    # -- interventions --------------------------------------------------------------------------------------------

    def _check_units(self, units: Iterable[int]) -> list[int]:
        units = [int(u) for u in units]
        bad = [u for u in units if not 0 <= u < self.num_units]
        if bad:
            raise ValueError(f"unit id(s) {bad} out of range: this layer has {self.num_units} units (0..{self.num_units - 1})")
        return units

    @staticmethod
    def _check_positions(positions: Iterable[int] | None) -> tuple[int, ...] | None:
        if positions is None:
            return None
        if isinstance(positions, int):
            positions = [positions]
        checked = tuple(sorted({int(p) for p in positions}))
        if not checked:
            raise ValueError("positions is empty; give token positions (e.g. [0, -1]) or None for every position")
        return checked

    def steer(self, unit: int, value: float, positions: Iterable[int] | None = None) -> None:
        """Add `value` to unit `unit`'s coefficient after TopK (the MxD paper's `a_n += λ`) at every position, or at
        `positions`: indices along the sequence of each forward call (negative ones count from its end; one that a
        call does not have is skipped). With `generate` and a KV cache the prompt is the first call and every new
        token a call of its own, so `positions=[-1]` steers the prompt's last token and every generated one."""
        (unit,) = self._check_units([unit])
        where = self._check_positions(positions)
        if where is None:
            self._steering[unit] = self._steering.get(unit, 0.0) + float(value)
        else:
            self._steering_at[unit, where] = self._steering_at.get((unit, where), 0.0) + float(value)

    def ablate(self, units: Iterable[int], positions: Iterable[int] | None = None) -> None:
        """Zero the coefficients of `units` after TopK (the other selected units keep theirs), at every position or
        at `positions` (as `steer`'s)."""
        units = frozenset(self._check_units(units))
        where = self._check_positions(positions)
        if where is None:
            self._ablated = self._ablated | units
        else:
            self._ablated_at[where] = self._ablated_at.get(where, frozenset()) | units

    def clear_interventions(self) -> None:
        self._steering, self._steering_at = {}, {}
        self._ablated, self._ablated_at = frozenset(), {}

    @contextlib.contextmanager
    def intervene(
        self, steer: dict[int, float] | None = None, ablate: Iterable[int] = (),
        positions: Iterable[int] | None = None,
    ) -> Iterator["SparseLayer"]:
        """Context manager: `with layer.intervene(steer={5: 100.0}, ablate=[3]): model.generate(...)`; with
        `positions` (e.g. [-1]) only there (see `steer`)."""
        saved = (dict(self._steering), self._ablated, dict(self._steering_at), dict(self._ablated_at))
        try:
            for unit, value in (steer or {}).items():
                self.steer(unit, value, positions)
            ablate = list(ablate)
            if ablate:
                self.ablate(ablate, positions)
            yield self
        finally:
            self._steering, self._ablated, self._steering_at, self._ablated_at = saved

    def _hook_code(self, index: torch.Tensor, weights: torch.Tensor, lead: tuple[int, ...]) -> SparseCode:
        """Interventions, then `code_hook` at the input's leading shape: (T, K) each -> the code (*lead, K')."""
        code = self._intervene_on_code(index, weights, lead)
        return self.code_hook(SparseCode(code.top_k_index.reshape(*lead, -1), code.top_k_weights.reshape(*lead, -1)))

    def _hook_code_tracked(
        self, index: torch.Tensor, weights: torch.Tensor, lead: tuple[int, ...]
    ) -> tuple[SparseCode, bool, bool]:
        """`_hook_code` for layers that decode faster from their own internal form while the code is untouched.

        Returns (the code flattened to (T, K'), same_units, same_values): whether the code's units / values are still
        `index` / `weights` — no intervention and no hook replaced or edited them (in place too: nnsight's setitem
        bumps the version counter). Where edits cannot be seen — under torch.compile / torch.export, or for
        inference-mode tensors, which carry no version counter — both are False, so the caller decodes whatever the
        code holds (its general path, which is also free of host synchronizations).
        """
        code = self._intervene_on_code(index, weights, lead)
        shown = SparseCode(code.top_k_index.reshape(*lead, -1), code.top_k_weights.reshape(*lead, -1))
        trackable = not (
            torch.compiler.is_compiling() or shown.top_k_index.is_inference() or shown.top_k_weights.is_inference()
        )
        stamp = (shown.top_k_index._version, shown.top_k_weights._version) if trackable else None
        out = self.code_hook(shown)
        if not trackable:
            return out.flat(), False, False
        same_units = (
            code.top_k_index is index and out.top_k_index is shown.top_k_index and out.top_k_index._version == stamp[0]
        )
        same_values = (
            code.top_k_weights is weights
            and out.top_k_weights is shown.top_k_weights
            and out.top_k_weights._version == stamp[1]
        )
        return out.flat(), same_units, same_values

    def _intervene_on_code(
        self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, lead: tuple[int, ...] = ()
    ) -> SparseCode:
        # top_k_index, top_k_weights: (T, K), T = prod(lead) tokens; the last of `lead` is the sequence
        if self._ablated:
            ablated = torch.tensor(sorted(self._ablated), device=top_k_index.device)
            top_k_weights = top_k_weights.masked_fill(torch.isin(top_k_index, ablated), 0.0)
        for where, units in self._ablated_at.items():
            at = self._at_positions(where, top_k_index, lead)  # (T, 1)
            hit = torch.isin(top_k_index, torch.tensor(sorted(units), device=top_k_index.device)) & at  # (T, K)
            top_k_weights = top_k_weights.masked_fill(hit, 0.0)
        if self._steering or self._steering_at:
            # Steered units ride along as extra (index, value) pairs: the sum over the code then adds λ·row_n exactly,
            # also when n is already among the top K (embedding_bag sums duplicate ids). At chosen positions the
            # pair is there at every position with the value 0 elsewhere (adds nothing, and fires nowhere else).
            n_tokens = top_k_index.shape[0]
            units = list(self._steering) + [unit for unit, _ in self._steering_at]
            values = torch.tensor(
                list(self._steering.values()) + list(self._steering_at.values()),
                device=top_k_weights.device, dtype=top_k_weights.dtype,
            ).expand(n_tokens, len(units))  # (T, S)
            if self._steering_at:
                at = torch.cat([self._at_positions(where, top_k_index, lead) for _, where in self._steering_at], -1)
                values = torch.cat([values[:, : len(self._steering)], values[:, len(self._steering):] * at], -1)
            extra_index = torch.tensor(units, device=top_k_index.device).expand(n_tokens, len(units))  # (T, S)
            top_k_index = torch.cat([top_k_index, extra_index], dim=-1)  # (T, K + S)
            top_k_weights = torch.cat([top_k_weights, values], dim=-1)  # (T, K + S)
        return SparseCode(top_k_index, top_k_weights)

    @staticmethod
    def _at_positions(positions: tuple[int, ...], top_k_index: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
        """(T, 1) bool: whether each of the T = prod(lead) tokens stands at one of `positions` of its sequence (the
        last dim of `lead`; negative positions from its end)."""
        length = lead[-1] if lead else 1
        wanted = sorted({p + length if p < 0 else p for p in positions if -length <= p < length})
        position = torch.arange(top_k_index.shape[0], device=top_k_index.device) % max(length, 1)  # (T,)
        return torch.isin(position, torch.tensor(wanted, dtype=torch.long, device=position.device))[:, None]


def sparse_rows_sum(code: SparseCode, rows: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k · rows[idx_k] per token, touching only the selected rows (never densifying over N).

    code: (T, K) index and weights; rows: (N, O). Returns (T, O).
    """
    return F.embedding_bag(
        code.top_k_index, rows, per_sample_weights=code.top_k_weights.to(rows.dtype), mode="sum"
    )


def relu_topk(
    pre: torch.Tensor, k: int, selection_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """TopK(ReLU(pre)) along the last dim: returns (values, indices), each (T, K).

    With `selection_bias` (N,) (balanced training, `SparseLayer.b_select`), the K are chosen among the *positive*
    entries by `pre + selection_bias`, and their values stay ReLU(pre): the bias only decides who competes on equal
    terms (DeepSeek-V3's auxiliary-loss-free balancing), never how much a unit contributes, and it cannot make a unit
    fire whose pre-activation is not positive (it would add a zero weight and take a slot).
    """
    if selection_bias is None:
        values, indices = pre.topk(k, dim=-1, sorted=False)
        # ReLU after TopK equals TopK after ReLU (ReLU is monotone) and touches K entries instead of N.
        return F.relu(values), indices
    score = torch.where(pre > 0, pre + selection_bias.to(pre.dtype), float("-inf"))  # (T, N)
    indices = score.topk(k, dim=-1, sorted=False).indices  # (T, K)
    return F.relu(pre.gather(-1, indices)), indices


def _gathered_rows_backward(
    x: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, grad: torch.Tensor, need_x: bool, need_rows: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The backward of out[t, k] = rows[index[t, k]] · x[t] for grad (T, K) in rows' dtype, as one embedding_bag:
    grad x_t = Σ_k g_tk rows[idx_tk] (T, I) and grad rows[n] = Σ_{idx_tk = n} g_tk x_t (N, I), the latter as that
    embedding_bag's own backward with grad_outputs x. Returns (grad_x or None, grad_rows or None)."""
    if not (need_x or need_rows):
        return None, None
    with torch.enable_grad():
        w = rows.detach().requires_grad_(need_rows)
        grad_x = F.embedding_bag(index, w, per_sample_weights=grad, mode="sum")  # (T, I)
    grad_rows = None
    if need_rows:
        (grad_rows,) = torch.autograd.grad(grad_x, w, grad_outputs=x.to(rows.dtype))  # (N, I)
    return (grad_x.detach().to(x.dtype) if need_x else None), grad_rows


def positive_topk_index(score: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """Index (T, K) of the top K of `score` (T, N) = pre + b among the entries with pre > 0 (i.e. score > b), as
    `relu_topk` with a selection bias chooses them. `score` may be overwritten.

    On the CPU, outside tracing: one unmasked top K, and the mask only for the rows where a non-positive entry took a
    slot (a raised bias outranked a positive score; rare in training, and every row with fewer than K positive
    entries). Where every chosen entry is positive, they are also the top K of the positive entries, so the choice is
    exactly the masked one's. Masking every column instead (a broadcast compare-and-fill over (T, N)) cost about 2x
    the top K itself on 2 CPU threads (9 ms vs 4.7 ms at T = 1,024, N = 3,584; docs/results/speed.md). A GPU or a
    traced graph masks every column (one pass, no host synchronization to find the rows)."""
    b = b.to(score.dtype)  # autocast may compute the scores in a lower precision
    if score.is_cuda or torch.compiler.is_compiling():
        score.masked_fill_(score <= b, float("-inf"))  # pre <= 0
        return score.topk(k, dim=-1, sorted=False).indices  # (T, K)
    index = score.topk(k, dim=-1, sorted=False).indices  # (T, K), unmasked
    rows = (score.gather(-1, index) <= b[index]).any(-1).nonzero().squeeze(-1)  # (R,) a non-positive entry chosen
    if rows.numel():
        redo = score.index_select(0, rows)  # (R, N)
        redo.masked_fill_(redo <= b, float("-inf"))
        index.index_copy_(0, rows, redo.topk(k, dim=-1, sorted=False).indices)
    return index


def biased_linear_relu_topk(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, selection_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`relu_topk(F.linear(x, weight, bias), k, selection_bias)` in fewer passes over the (T, N) scores: the bias is
    added inside the matmul (score = pre + b) and `positive_topk_index` chooses without a dense mask where it can.
    Same choice among the positive entries (up to the float rounding of the fused add), same values; where fewer
    than K entries are positive, the zero-weight fillers may be other units than `relu_topk`'s (they never fire).
    Returns (values, index), each (T, K).

    Why: `relu_topk`'s where(pre > 0, pre + b, -inf) is three elementwise passes over (T, N), which cost 1.2-1.6x a
    whole training step at small widths (benchmarks/dead_unit_overhead.py).
    """
    b = selection_bias.to(weight.dtype)
    score = F.linear(x, weight, b if bias is None else bias + b)  # (T, N) = pre + b
    index = positive_topk_index(score, b, k)  # (T, K)
    b = b.to(score.dtype)
    return F.relu(score.gather(-1, index) - b[index]), index  # ReLU(pre) at the chosen units


class LinearReluTopK(torch.autograd.Function):
    """`relu_topk(F.linear(x, weight, bias), k, selection_bias)` with a backward that touches only the K selected
    rows of `weight`; also returns the pre-activations (T, N), detached, for AuxK to reuse.

    The gradient of the (T, N) logits is zero outside the K selected entries per token (g_tk), so the dense backward
    (two T×N×I matmuls) reduces to gathers and scatters over T·K rows, which is exactly one `embedding_bag` and its
    backward: grad x_t = Σ_k g_tk W[idx_tk], grad W[n] = Σ_{idx_tk = n} g_tk x_t, grad b[n] = Σ_{idx_tk = n} g_tk.
    Same values as the plain ops; gradients equal theirs up to float summation order.

        values, index, pre = LinearReluTopK.apply(x, weight, bias, k, selection_bias, need_pre)

    `need_pre=False` (no AuxK this step) lets a biased choice skip the (T, N) pre-activations (`pre` is then empty).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, k, selection_bias=None, need_pre=True):
        # x (T, I), weight (N, I), bias / selection_bias (N,)
        if selection_bias is None:
            pre = F.linear(x, weight, bias)  # (T, N)
            values, index = relu_topk(pre, k)  # (T, K) each
        elif need_pre:  # AuxK reads the pre-activations this step: kept, and the choice made on pre + b
            pre = F.linear(x, weight, bias)  # (T, N)
            index = positive_topk_index(pre + selection_bias.to(pre.dtype), selection_bias, k)  # (T, K)
            values = F.relu(pre.gather(-1, index))
        else:  # nobody reads the pre-activations this step (AuxK is not running): the cheaper biased choice
            values, index = biased_linear_relu_topk(x, weight, bias, k, selection_bias)
            pre = x.new_empty(0)
        ctx.save_for_backward(x, weight, index, values)
        ctx.mark_non_differentiable(index, pre)
        # The outputs nobody differentiates (index, pre) would otherwise get a zero gradient materialized for the
        # backward: a dense (T, N) buffer, as large as the dense backward this kernel avoids.
        ctx.set_materialize_grads(False)
        return values, index, pre

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_values, _grad_index, _grad_pre):
        if grad_values is None:  # the values reached no loss
            return (None,) * len(ctx.needs_input_grad)
        x, weight, index, values = ctx.saved_tensors
        grad = torch.where(values > 0, grad_values, 0).to(weight.dtype)  # ReLU's backward, as F.relu's: (T, K)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x, grad_w = _gathered_rows_backward(x, weight, index, grad, need_x, need_w)
        grad_b = None
        if need_b:  # False when bias is None
            grad_b = weight.new_zeros(weight.shape[0]).index_add_(0, index.reshape(-1), grad.reshape(-1))  # (N,)
        return grad_x, grad_w, grad_b, None, None, None


GATHER_CHUNK_ELEMENTS = 1 << 24
"""The forward gathers at most this many weights (tokens × K × I) at once, to bound the (T, K, I) transient."""


class GatheredDot(torch.autograd.Function):
    """out[t, k] = rows[index[t, k]] · x[t] without keeping the (T, K, I) gather for backward.

    Backward, the same embedding_bag identities as `LinearReluTopK`: grad x_t = Σ_k g_tk rows[idx_tk]
    and grad rows[n] = Σ_{idx_tk = n} g_tk x_t (the backward of that embedding_bag with grad_outputs x).
    """

    @staticmethod
    def forward(ctx, x, rows, index):  # x (T, I), rows (N, I), index (T, K)
        T, K = index.shape
        chunk = max(1, GATHER_CHUNK_ELEMENTS // max(1, K * rows.shape[1]))
        out = [
            torch.bmm(F.embedding(index[i : i + chunk], rows), x[i : i + chunk, :, None]).squeeze(-1)  # (t, K)
            for i in range(0, T, chunk)
        ]
        ctx.save_for_backward(x, rows, index)
        return torch.cat(out) if out else x.new_zeros(0, K)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, rows, index = ctx.saved_tensors
        need_x, need_rows = ctx.needs_input_grad[:2]
        grad_x, grad_rows = _gathered_rows_backward(x, rows, index, grad.to(rows.dtype), need_x, need_rows)
        return grad_x, grad_rows, None


def dead_relu_topk(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    dead_mask: torch.Tensor,
    k_aux: int,
    pre: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AuxK's selection (Gao et al. 2024, §A.2): TopK_aux(ReLU(W x + b)) over the *dead* units only.

    x (T, I), weight (N, I), bias (N,), dead_mask (N,) bool -> (values, index), each (T, min(k_aux, N)).
    The ranking runs without autograd, on `pre` (T, N) = W x + b when the forward kept it (no second dense product);
    the selected pre-activations are recomputed from their rows only (`GatheredDot`), so gradients reach just the
    selected rows of `weight` / `bias`, never a dense (T, N) grad. Where fewer than k_aux units are dead, live units
    fill the remaining slots with value 0 (no host sync to count).
    """
    k_aux = min(int(k_aux), weight.shape[0])
    with torch.no_grad():
        if pre is None:
            pre = F.linear(x, weight, bias)  # (T, N)
        index = pre.masked_fill(~dead_mask, float("-inf")).topk(k_aux, dim=-1, sorted=False).indices  # (T, k_aux)
    # F.embedding, not bias[index]: its backward is deterministic (as routed_neurons' neuron_activations).
    values = GatheredDot.apply(x, weight, index) + F.embedding(index, bias.unsqueeze(-1)).squeeze(-1)  # (T, k_aux)
    return F.relu(values) * dead_mask[index], index  # live fillers -> 0


def uniform_(param: nn.Parameter, bound: float) -> None:
    nn.init.uniform_(param, -bound, bound)


def linear_bound(fan_in: int) -> float:
    """nn.Linear's default init bound (kaiming_uniform with a=sqrt(5) reduces to 1/sqrt(fan_in))."""
    return 1.0 / math.sqrt(fan_in)
