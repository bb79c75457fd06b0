"""AuxK, an auxiliary loss that revives dead units (Gao et al. 2024, "Scaling and evaluating sparse autoencoders",
§A.2).

A unit (expert / latent) is *dead* when it has not fired for `window_tokens` tokens. Each step, the k_aux dead units
with the highest pre-activations (router scores for routed neurons) reconstruct the main path's residual error:

    e = y - ŷ  (detached)        ê = layer.auxk_reconstruction(x, dead_mask, k_aux)   (no output bias)
    loss_aux = mean_t ||e_t - ê_t||² / ||e_t||²                                         (per-token normalized MSE)

and the trainer adds `coef · loss_aux` (the paper: coef 1/32, k_aux 512, dead after 10M tokens). Normalizing by the
error's own norm per token (the paper's released code) keeps the term's scale fixed as the main loss falls. Gradients
reach only the selected dead units' parameters (each kind's `auxk_reconstruction` says which).

Which kinds: `supports_auxk(layer)` (`SparseLayer.supports_auxk`, False unless a kind sets it and defines
`auxk_reconstruction`). MxD, transcoder, skip transcoder and routed neurons have it; MoE-X and Monet do not (their
layer classes say why).

Nothing here syncs with the host: the tracker's counters and masks stay on the layer's device, and "no unit is dead"
gives an exact 0 by a device-side factor instead of a Python branch. `DeadUnitTracker.may_have_dead` (host-side) lets
the trainer skip the auxiliary forward while no unit can be dead yet (before the first window has passed).

Data parallel: pass the *global* token count of a step and a `fired` mask reduced over ranks (any rank), e.g.
`fired = accelerator.reduce(fired_units(...).int(), "sum") > 0`, to `update_fired`, so that every rank agrees on
the dead mask.
"""

import math

import torch

from expertize.modeling import SparseLayer

from ..errors import ExpertizeError

PAPER_K_AUX = 512
"""k_aux of the paper ("typically 512")."""
PAPER_COEF = 1 / 32
"""α of the paper."""
PAPER_DEAD_WINDOW_TOKENS = 10_000_000
"""The paper's window: a latent is dead after 10M tokens without firing."""
WINDOW_BUDGET_FRACTION = 1 / 40
"""`dead_window_tokens` caps the window at this fraction of the run's training tokens. Measured
(benchmarks/dead_units.py, MxD K=8 on tiny-gpt2-shakespeare, 327,680 tokens): a tenth of the budget left 30.9% of the
experts dead, 1/40 (8,192 tokens) 13.5%, at equal FVU: most experts die early, so AuxK must start early."""


def supports_auxk(layer: SparseLayer) -> bool:
    """Whether `layer`'s kind implements `auxk_reconstruction` (`SparseLayer.supports_auxk`, the contract's)."""
    return bool(layer.supports_auxk)


def dead_window_tokens(
    train_tokens: int, tokens_per_step: int = 1, paper_window: int = PAPER_DEAD_WINDOW_TOKENS
) -> int:
    """The dead window for a run of `train_tokens` tokens: min(10M, train_tokens / 40), rounded up to whole steps,
    at least one step.

    Why: the paper's 10M tokens is a small fraction of its multi-billion-token runs. A unit can only be called dead
    (and AuxK can only act) once a window has passed, so on a small budget the full 10M would leave AuxK nothing to
    do; 1/40 of the budget lets it act over at least 97% of the run, before most dying units are past recovery
    (measured: see WINDOW_BUDGET_FRACTION). Whole steps, because firing is recorded once per step."""
    if train_tokens < 1 or tokens_per_step < 1:
        raise ValueError(f"train_tokens ({train_tokens}) and tokens_per_step ({tokens_per_step}) must be >= 1")
    window = min(paper_window, math.ceil(train_tokens * WINDOW_BUDGET_FRACTION))
    return max(1, math.ceil(window / tokens_per_step)) * tokens_per_step


def auto_k_aux(d_out: int) -> int:
    """k_aux when the recipe says "auto": min(512, d_out / 2). The paper's 512 is for wide models; ê lives in d_out
    dimensions, and EleutherAI's sparsify uses d/2 (rounded down, at least 1), which this follows below d = 1024."""
    return max(1, min(PAPER_K_AUX, d_out // 2))


def fired_units(top_k_index: torch.Tensor, active: torch.Tensor, num_units: int) -> torch.Tensor:
    """Units active somewhere in a code: (..., K) index and its active mask (the layer's rule,
    `SparseLayer.active_entries(weights)`, bool) -> (N,) bool, on the code's device.

    The mask, not the weights: which entries count is the kind's one definition, shared with the evaluation's dead
    units and the inspection's firing (e.g. a selected unit whose weight is 0 did not fire). `index_add_` instead of
    boolean indexing: no host sync."""
    if active.dtype != torch.bool:
        raise TypeError(f"active must be a bool mask (layer.active_entries(weights)), got {active.dtype}")
    index = top_k_index.reshape(-1)  # (T·K,)
    fired = active.reshape(-1).to(torch.float32)  # (T·K,)
    counts = torch.zeros(num_units, dtype=torch.float32, device=index.device).index_add_(0, index, fired)  # (N,)
    return counts > 0


def code_l0(layer, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> float:
    """Mean active units per token of one step's code ((..., K) each) by the layer's rule (`active_entries`): the
    L0 of the training and healing logs, counted as the evaluation counts it. One host sync (a logged number)."""
    tokens = top_k_index[..., 0].numel() if top_k_index.shape[-1] else top_k_index.numel()
    return layer.active_entries(top_k_weights).sum().item() / max(tokens, 1)


class DeadUnitTracker:
    """Tokens since each unit of one layer last fired, kept on the layer's device.

    `last_fired[n]` is the token count (`tokens_seen`) at the end of the last step in which unit n fired, 0 if it
    has not fired since tracking began (so no unit is dead before the first window has passed). A unit is dead when
    `tokens_seen - last_fired[n] >= window_tokens`.
    """

    def __init__(self, num_units: int, window_tokens: int, device: torch.device | str | None = None) -> None:
        if window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
        self.num_units = int(num_units)
        self.window_tokens = int(window_tokens)
        self.tokens_seen = 0  # host int: token counts are known to the host without a sync
        self.last_fired = torch.zeros(self.num_units, dtype=torch.long, device=device)  # (N,)

    @property
    def may_have_dead(self) -> bool:
        """False while no unit can be dead yet (fewer than `window_tokens` tokens seen): the trainer may skip AuxK."""
        return self.tokens_seen >= self.window_tokens

    def update(self, top_k_index: torch.Tensor, active: torch.Tensor, num_tokens: int | None = None) -> None:
        """Record one step's code ((..., K) index and its active mask, `fired_units`'); `num_tokens` defaults to the
        code's token count."""
        if num_tokens is None:
            num_tokens = top_k_index[..., 0].numel() if top_k_index.shape[-1] else top_k_index.numel()
        self.update_fired(fired_units(top_k_index, active, self.num_units), num_tokens)

    def update_fired(self, fired: torch.Tensor, num_tokens: int) -> None:
        """Record one step of `num_tokens` tokens in which the units of `fired` ((N,) bool) fired."""
        self.tokens_seen += int(num_tokens)
        self.last_fired.masked_fill_(fired.to(self.last_fired.device), self.tokens_seen)

    def tokens_since_fired(self) -> torch.Tensor:
        """(N,) int64: tokens since each unit last fired (since tracking began, for units that never fired)."""
        return self.tokens_seen - self.last_fired

    def dead_mask(self) -> torch.Tensor:
        """(N,) bool: units that have not fired for `window_tokens` tokens."""
        return self.tokens_since_fired() >= self.window_tokens

    def state_dict(self) -> dict:
        return {
            "num_units": self.num_units,
            "window_tokens": self.window_tokens,
            "tokens_seen": self.tokens_seen,
            "last_fired": self.last_fired.cpu(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore exactly (the window too: a resumed run keeps the dead mask it had)."""
        if int(state["num_units"]) != self.num_units:
            raise ValueError(f"tracker state has {state['num_units']} units, this layer has {self.num_units}")
        self.window_tokens = int(state["window_tokens"])
        self.tokens_seen = int(state["tokens_seen"])
        self.last_fired = state["last_fired"].to(device=self.last_fired.device, dtype=torch.long).clone()


def auxk_loss(
    layer: SparseLayer,
    x: torch.Tensor,
    y: torch.Tensor,
    y_hat: torch.Tensor,
    dead_mask: torch.Tensor,
    k_aux: int,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unweighted AuxK loss of one layer: mean over tokens of ||e - ê||² / ||e||², e = (y - ŷ) detached.

    x (..., I) the layer's input, y (..., O) the target, y_hat (..., O) the layer's output on x, dead_mask (N,) bool,
    token_mask (...,) bool or None: tokens to average over (e.g. excluding special positions; default all).
    Returns a scalar (float32, or float64 for float64 inputs): exactly 0 (with zero gradients) when no unit is dead;
    a token whose error is exactly 0 contributes 0 (no NaN). Multiply by the coefficient (paper: 1/32) before adding
    it to the main loss. Cost: one more dense (T, N) score matmul without autograd, plus gathers over T·k_aux rows.
    """
    if not supports_auxk(layer):
        kind = layer.spec.kind
        raise ExpertizeError(
            f"AuxK is not defined for sparse layer kind {kind!r} (its units are not chosen by a top-k over their own "
            "parameters); set train.auxk_coef: 0 for this kind"
        )
    dead_mask = dead_mask.to(device=x.device, dtype=torch.bool)
    dtype = torch.promote_types(y.dtype, torch.float32)  # at least float32, as the main loss (float64 stays)
    e = (y - y_hat).detach().to(dtype).reshape(-1, y.shape[-1])  # (T, O)
    e_hat = layer.auxk_reconstruction(x, dead_mask, k_aux).to(dtype).reshape(-1, y.shape[-1])  # (T, O)
    err_sq = e.square().sum(-1)  # (T,)
    nonzero = err_sq > 0
    per_token = (e - e_hat).square().sum(-1) / torch.where(nonzero, err_sq, torch.ones_like(err_sq))  # (T,)
    per_token = torch.where(nonzero, per_token, torch.zeros_like(per_token))
    if token_mask is None:
        loss = per_token.mean() if per_token.numel() else per_token.sum()
    else:
        weight = token_mask.reshape(-1).to(per_token)  # (T,)
        loss = (per_token * weight).sum() / weight.sum().clamp_min(1)
    # No dead unit: ê = 0 and the ratio would be 1; the factor makes it an exact 0 without a host sync.
    return loss * dead_mask.any().to(loss.dtype)
