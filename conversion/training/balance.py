"""Auxiliary-loss-free balancing of top-K selections (after DeepSeek-V3, arXiv 2412.19437, §2.1.2), for every kind
that chooses K of its units by a score: MxD's and the transcoders' gates (among the positive pre-activations), routed
neurons' router, MoE-X's router.

The layer adds a per-unit bias `b_select` (S,) to its scores *only to choose* the top K (`SparseLayer._select`,
`relu_topk`); the chosen units are weighted by their unbiased scores, so the bias never changes what a unit
contributes, only whether it competes. After every optimizer step the balancer moves each unit's bias by

    step = rate · lr_t · scale          lr_t: the step's learning rate (warm-up, decay); scale: mean |selected score|

Two rules (`train.balance`):

    floor (default)  keep every unit chosen on at least `floor` x its fair share K / S of the tokens:
                     b_i += step · sign(floor · K/S − rate_i), then b_i = max(b_i, 0)
                     rate_i: an exponential average of unit i's share over about 10 expected firings at the floor, so
                     the rule does not depend on how many tokens one step holds. A unit above the floor has no bias
                     (it competes on its own score) and frequent units keep their natural rates.
    bias             DeepSeek-V3's rule: b_i += step · sign(K/S − load_i), every unit toward the fair share on every
                     step (uniform usage; it also keeps MxD's code from collapsing at a high learning rate, at a cost
                     in fidelity: benchmarks/dead_units.py)

The step follows the optimizer's: the scores drift by about one learning rate per step under AdamW, so a bias that
must keep up with them moves in proportion to it, and settles as the schedule decays; it is measured in the layer's
own score scale (MoE-X's sparsity scores lie in (−1, 1), a transcoder's pre-activations anywhere), taken by the layer
on each training forward. Device-side throughout (no host synchronization).

The anneal (`train.balance_anneal: [start, end]`, default [0.5, 0.8] of the run's steps): at `start` the rule stops
and the bias decays linearly to exactly 0 at `end`; the rest of the run trains plain top-K, and the saved model routes
without a bias. Why: a held bias keeps choosing rarely-positive units at inference, displacing better ones on every
token where they are positive at all — the floor's bias grew to 10-20x the mean selected score for 20-60 % of the
units at lr 1e-2 (tiny-gpt2-shakespeare), and zeroing it after training alone cut the transcoder's FVU from 1.15x
to 1.04x that of no handling. Units the bias revived in the first half have learned a job by then and keep firing on
their own scores (docs/results/dead_units.md: fewer dead units than no handling at no cost in FVU or KL). `null`:
the bias is held to the end and saved (routing at inference uses it), as DeepSeek-V3 does.
"""

import torch

from expertize.modeling import SparseLayer

FLOOR_HORIZON_FIRINGS = 10
"""The floor rule averages a unit's share over the tokens in which a unit at the floor fires this many times."""


def balanced(layer: SparseLayer) -> bool:
    """Whether `layer` has a selection bias to balance (its spec's `selection_bias`)."""
    return getattr(layer, "b_select", None) is not None


class SelectionBalancer:
    """Moves one layer's `b_select` after each step (see the module docstring)."""

    def __init__(
        self, layer: SparseLayer, rate: float, floor: float | None = None, anneal: tuple[float, float] | None = None
    ) -> None:
        if not balanced(layer):
            raise ValueError(f"{layer.spec.kind} layer has no selection bias (spec.selection_bias is false)")
        self.layer, self.rate, self.floor = layer, float(rate), floor
        self.anneal = anneal
        """[start, end] fractions of the run: the bias holds its rule until start, then decays linearly to 0 at end;
        None: held to the end."""
        self.frozen: torch.Tensor | None = None
        """The bias when the anneal started (S,): it decays from this value."""
        self.raised = torch.zeros_like(layer.b_select, dtype=torch.bool)
        """(S,) the units whose bias the rule ever raised above 0 (metrics.json: what the balancing changed)."""
        self.target = layer.spec.k / layer.b_select.numel()
        """The share of tokens on which each unit would be chosen under perfect balance, K / S."""
        self.average: torch.Tensor | None = None
        """Floor rule: each unit's averaged share of the tokens (S,), from the first step on."""

    @property
    def horizon_tokens(self) -> float:
        """Floor rule: tokens over which a unit's share is averaged."""
        return FLOOR_HORIZON_FIRINGS / (self.floor * self.target)

    def step_stats(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's (load (S,): share of the code's tokens on which each unit was chosen and fired, scale: the
        layer's mean |selected score|), from one step's code (..., K). Data parallel: average both over ranks."""
        tokens = max(1, top_k_index[..., 0].numel())
        load = self.layer.selection_load(top_k_index, top_k_weights) / tokens  # (S,)
        scale = self.layer.selection_scale
        return load, (scale if scale is not None else load.new_ones(())).float()

    @torch.no_grad()
    def update(
        self, load: torch.Tensor, scale: torch.Tensor, lr: float, step_tokens: int, progress: float = 0.0
    ) -> None:
        """Move the bias after one step of `step_tokens` tokens (global) whose load and scale are `step_stats`';
        `progress`: the fraction of the run's steps done after this step (the anneal's clock)."""
        b = self.layer.b_select
        if self.anneal is not None and progress >= self.anneal[0]:
            if self.frozen is None:
                self.frozen = b.clone()
            start, end = self.anneal
            b.copy_(self.frozen * max(0.0, (end - progress) / (end - start) if end > start else 0.0))
            return
        load = load.to(b.device, torch.float32)
        step = self.rate * lr * scale.to(b.device, b.dtype)
        if self.floor is None:
            b.add_(step * torch.sign(self.target - load).to(b.dtype))
            self.raised |= b > 0
            return
        alpha = min(1.0, step_tokens / self.horizon_tokens)
        self.average = load.clone() if self.average is None else self.average.lerp_(load, alpha)
        b.add_(step * torch.sign(self.floor * self.target - self.average).to(b.dtype)).clamp_(min=0)
        self.raised |= b > 0

    def summary(self) -> dict:
        """What the balancing did to this layer, for metrics.json: the rule, the units whose bias it raised, and
        whether a bias is left in the saved model."""
        return {
            "rule": "floor" if self.floor is not None else "bias",
            "floor": self.floor,
            "anneal": None if self.anneal is None else list(self.anneal),
            "units_raised": int(self.raised.sum()),
            "bias_at_end": bool((self.layer.b_select != 0).any()),
        }

    def state_dict(self) -> dict:
        return {
            "average": None if self.average is None else self.average.cpu(),
            "frozen": None if self.frozen is None else self.frozen.cpu(),
            "raised": self.raised.cpu(),
        }

    def load_state_dict(self, state: dict) -> None:
        average = state.get("average")
        self.average = None if average is None else average.to(self.layer.b_select.device)
        frozen = state.get("frozen")
        self.frozen = None if frozen is None else frozen.to(self.layer.b_select.device)
        if state.get("raised") is not None:
            self.raised = state["raised"].to(self.layer.b_select.device)
