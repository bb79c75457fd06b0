"""Resampling dead units (Bricken et al. 2023, "Towards Monosemanticity", the "neuron resampling" appendix): every
`every_tokens` training tokens, each unit that has not fired since the last check is re-pointed at an input on
which the layer's error is large, and its optimizer moments are reset.

    dead  = units with no firing in the last `every_tokens` tokens            (a `DeadUnitTracker` of that window)
    t_u   ~ P(t) ∝ ||y_t − ŷ_t||²  over the step's tokens, one draw per dead unit u
    layer.resample_units(dead, x[t], (y − ŷ)[t])                               kind-specific (mxd, transcoders,
                                                                               routed_neurons); see each layer
    AdamW's exp_avg / exp_avg_sq of the re-initialized rows -> 0

Checks run until `until_tokens` (by default 60 % of the run), so that a resampled unit has time to learn. A unit
re-pointed at x scores high on inputs like x and so wins the top K there; its output row starts at zero, so the
layer's output does not jump. Data parallel: every rank agrees on the dead set (the fired mask is OR-reduced) and
the proposals (x, error) are averaged over ranks, so the re-initialized rows are identical everywhere.
"""

import math

import torch

from expertize.modeling import SparseLayer

from .auxk import DeadUnitTracker

UNTIL_FRACTION = 0.6
"""Resampling stops after this fraction of the run's tokens (resampled units need steps to learn)."""
MIN_EXPECTED_FIRINGS = 50
"""`every_tokens` "auto": the window in which a unit firing at its fair share K / N would fire this many times, so
that even a unit at a tenth of its share fires in it with probability 1 - e^-5 > 99 % (Poisson): only units that
really stopped are resampled."""


def supports_resampling(layer: SparseLayer) -> bool:
    return bool(getattr(layer, "supports_resampling", False))


def auto_every_tokens(num_units: int, k: int, tokens_per_step: int) -> int:
    """MIN_EXPECTED_FIRINGS · N / K tokens, in whole steps."""
    window = MIN_EXPECTED_FIRINGS * num_units / max(k, 1)
    return max(1, math.ceil(window / tokens_per_step)) * tokens_per_step


class Resampler:
    """Resampling for one layer (see the module docstring)."""

    def __init__(self, layer: SparseLayer, every_tokens: int, until_tokens: int, seed: int = 0) -> None:
        self.layer, self.every_tokens, self.until_tokens = layer, int(every_tokens), int(until_tokens)
        device = next(layer.parameters()).device
        self.tracker = DeadUnitTracker(layer.num_units, self.every_tokens, device=device)
        self.next_check = self.every_tokens
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.resampled = 0
        """Units resampled so far (the log reports it)."""

    def update_fired(self, fired: torch.Tensor, num_tokens: int) -> None:
        self.tracker.update_fired(fired, num_tokens)

    @property
    def due(self) -> bool:
        seen = self.tracker.tokens_seen
        return seen >= self.next_check and seen <= self.until_tokens

    @torch.no_grad()
    def resample(self, x: torch.Tensor, error: torch.Tensor, optimizer, reduce=None) -> int:
        """Resample the dead units with the step's inputs `x` (T, I) and errors `error` (T, O); reset their moments
        in `optimizer` (AdamW). `reduce(tensor)` averages over ranks (data parallel). Returns how many."""
        self.next_check = self.tracker.tokens_seen + self.every_tokens
        dead = self.tracker.dead_mask()
        units = dead.nonzero().squeeze(-1)  # (n,): one host sync per check
        if units.numel() == 0:
            return 0
        weights = error.float().square().sum(-1)  # (T,)
        if not bool(weights.sum() > 0):
            return 0
        picks = torch.multinomial(weights, units.numel(), replacement=True, generator=self.generator)  # (n,)
        xs, es = x[picks].float(), error[picks].float()  # (n, I), (n, O)
        if reduce is not None:
            xs, es = reduce(xs), reduce(es)
        rows = self.layer.resample_units(units, xs, es)
        _reset_moments(optimizer, self.layer, rows)
        self.tracker.last_fired[units] = self.tracker.tokens_seen  # a fresh window for the resampled units
        self.resampled += units.numel()
        return units.numel()

    def state_dict(self) -> dict:
        return {"tracker": self.tracker.state_dict(), "next_check": self.next_check, "resampled": self.resampled,
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.tracker.load_state_dict(state["tracker"])
        self.next_check, self.resampled = int(state["next_check"]), int(state["resampled"])
        self.generator.set_state(state["generator"])


def _reset_moments(optimizer, layer: SparseLayer, rows: dict[str, torch.Tensor]) -> None:
    """Zero AdamW's first and second moments of `rows` of each named parameter of `layer`."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # 🤗 Accelerate wraps the torch optimizer
    for name, index in rows.items():
        state = optimizer.state.get(getattr(layer, name), {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key][index] = 0
