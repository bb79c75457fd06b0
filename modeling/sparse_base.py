"""The kind contract of the sparse layers: `SparseLayer`, the base class of every sparse MLP replacement (its
capabilities with safe defaults), `Coder`, and the activations the kinds share. The spec base class is in
sparse_spec.py, the sparse code and its interventions in sparse_code.py, the shared kernels in sparse_kernels.py.

Part of the Hub bundle: imports only torch, the standard library and sibling files.

Letters used in shape comments across the bundle:
    T tokens (any leading dims flattened), I d_in, O d_out, H hidden width, N experts / latents, K active (top-k).
"""

import math
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from .sparse_code import CodeHook, CodeInterventions, SparseCode
from .sparse_spec import SparseSpec


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


class Coder(NamedTuple):
    """A layer that is exactly a sparse coder, the shape sparse-coder tools (sparsify, circuit-tracer) hold:

        y = W_decᵀ act(W_enc x + b_enc) + b_dec  (+ W_skip x)

    with `activation` one of
        "topk"      TopK_k(ReLU(pre)): the K units are chosen among the positive pre-activations, by
                    `pre + b_select` where `b_select` is given (it chooses, never weights);
        "jumprelu"  pre · 1[pre > threshold], threshold (L,) > 0 (k is then the target L0 it was trained to);
        "relu"      ReLU(pre).
    Tensors are the layer's own, detached."""

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
    activation: str
    """"topk", "jumprelu" or "relu"."""
    k: int | None
    """TopK's K, the JumpReLU target L0, None for ReLU."""
    b_select: torch.Tensor | None = None
    """(L,) selection bias (topk only), or None."""
    threshold: torch.Tensor | None = None
    """(L,) JumpReLU thresholds, or None."""


class SparseLayer(CodeInterventions, nn.Module):
    """Base class of every sparse MLP replacement.

    `forward(hidden_states) -> hidden_states` with the MLP's shape and dtype; `encode(x)` returns the `SparseCode`
    after it has passed through `self.code_hook`. Interventions (`steer`, `ablate`) act on the code after TopK.
    """

    spec: SparseSpec

    def __init__(self, spec: SparseSpec) -> None:
        super().__init__()
        self.spec = spec
        self.code_hook = CodeHook()
        self.clear_interventions()  # steering and ablation (sparse_code.py)
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
        self.dead_for_preact: torch.Tensor | None = None
        """Set by the trainer on kinds with `supports_preact_loss`: (N,) bool, the units dead so far. A training
        forward then sets `preact_loss` from its own pre-activations (no second encoder pass)."""
        self.preact_loss: torch.Tensor | None = None
        """Scalar, unweighted: the last training forward's pre-activation loss on the dead units (see
        `supports_preact_loss`); the trainer weights it by train.preact_coef."""
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

    def sparse_coder(self) -> Coder | None:
        """The layer as a sparse coder when it is exactly one (`Coder`: TopK, JumpReLU or ReLU), else None; the spec's
        `not_sparse_coder` says why not. What `expertize export` writes for sparsify and circuit-tracer."""
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

    @torch.no_grad()
    def init_from_inputs(self, x: torch.Tensor) -> list[nn.Parameter]:
        """Called once by distillation with the first training batch's inputs x (T, I), before the first step (a
        fresh run, not a resumed one): a kind whose parameters start best from the data sets them here (JumpReLU:
        its thresholds) and returns them, which the trainer then averages over ranks. Default: nothing."""
        return []

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

    reads_other_layers = False
    """True where the output also reads other layers' codes of the same pass (a placed cross-layer transcoder,
    jumprelu_transcoders.py): such a layer runs only in its model's order, never alone on captured inputs."""

    supports_auxk = False
    """Whether dead units can model the residual error through `auxk_reconstruction` (AuxK, Gao et al. 2024;
    conversion/training/auxk.py): kinds whose units are chosen by a top-k over their own parameters."""

    supports_preact_loss = False
    """Whether a training forward with `dead_for_preact` set computes `preact_loss`: threshold kinds (JumpReLU, CLT),
    whose dead latents get no gradient from the distillation loss and need a push up to their threshold."""

    def threshold_parameters(self) -> list[nn.Parameter]:
        """The parameters that set a threshold kind's thresholds (`train.threshold_lr_scale` scales their learning
        rate); none for the other kinds."""
        return []

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

    l0_is_trained_target = False
    """Whether `spec.k` is the L0 training steers the code to without selecting K units (threshold kinds): then a
    mean L0 far from it means the thresholds drifted off (evaluation/health.py names which way)."""

    @property
    def target_l0(self) -> int | None:
        """The L0 a healthy code has (K for kinds that select the top K units, the trained target L0 of threshold
        kinds), or None where there is no such K."""
        return int(self.spec.k) if self.selects_top_k_units or self.l0_is_trained_target else None

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


def uniform_(param: nn.Parameter, bound: float) -> None:
    nn.init.uniform_(param, -bound, bound)


def linear_bound(fan_in: int) -> float:
    """nn.Linear's default init bound (kaiming_uniform with a=sqrt(5) reduces to 1/sqrt(fan_in))."""
    return 1.0 / math.sqrt(fan_in)
