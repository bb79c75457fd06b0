"""Domain masking (Monet §5.1): assign units to domains by firing probability, ablate a domain's units, compare the
rise of CE on that domain's held-out text with the rise on the other domains, beside a random-units control."""

import dataclasses
import math

import torch
from torch import nn

from .passes import mean_ce

__all__ = ["MaskingRow", "assign_units", "domain_masking", "random_live_units", "specificity"]


def assign_units(rates: torch.Tensor, ratio: float = 2.0) -> list[torch.Tensor]:
    """Monet's rule. rates (D, U): firing probability of each unit on each domain. Unit u belongs to domain d when d
    is its most frequent domain and rates[d, u] >= ratio x its rate on the second most frequent domain (and > 0).
    Returns, per domain, the sorted (n_d,) int64 ids of its units; a unit belongs to at most one domain (ratio >= 1).
    """
    if ratio < 1:
        raise ValueError(f"the assignment ratio must be >= 1 (Monet uses 2), got {ratio}")
    D, U = rates.shape
    if D < 2:
        raise ValueError("assigning units to domains needs at least two domains")
    top2 = rates.double().topk(2, dim=0)  # values, indices: (2, U)
    first, second = top2.values[0], top2.values[1]  # (U,)
    owner = top2.indices[0]  # (U,)
    assigned = (first > 0) & (first >= ratio * second)  # (U,)
    return [torch.nonzero(assigned & (owner == d)).flatten() for d in range(D)]


def random_live_units(live: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """n distinct units drawn uniformly (seeded) from the live ones (live: (U,) bool), sorted; all if fewer."""
    ids = torch.nonzero(live).flatten()
    gen = torch.Generator().manual_seed(seed)
    return ids[torch.randperm(ids.numel(), generator=gen)[:n]].sort().values


def specificity(target: float, others: float) -> float:
    """ΔCE(target) / ΔCE(others); +inf when the others do not move (or improve) while the target gets worse."""
    if others > 0:
        return target / others
    return math.inf if target > 0 else math.nan


@dataclasses.dataclass
class MaskingRow:
    domain: str
    units: int
    """Units assigned to the domain (and ablated)."""
    delta_target: float
    """CE rise on the domain's held-out text, nats."""
    delta_others: float
    """Mean CE rise on the other domains' held-out text."""
    random_delta_target: float
    random_delta_others: float

    @property
    def specificity(self) -> float:
        return specificity(self.delta_target, self.delta_others)

    @property
    def random_specificity(self) -> float:
        return specificity(self.random_delta_target, self.random_delta_others)


def domain_masking(
    model: nn.Module, layer: nn.Module, rates: torch.Tensor, live: torch.Tensor,
    eval_sequences: dict[str, torch.Tensor],
    ratio: float = 2.0, seed: int = 0, batch_size: int = 8, base_ce: dict[str, float] | None = None,
) -> list[MaskingRow]:
    """One row per domain with at least one assigned unit. rates (D, U) from the fit split (domains in the order of
    `eval_sequences`); live (U,) bool; eval_sequences {domain: (S, T)} held-out text. The control ablates as many
    units drawn from the live ones (seed + domain index)."""
    names = list(eval_sequences)
    base_ce = base_ce or {n: mean_ce(model, s, batch_size) for n, s in eval_sequences.items()}
    rows = []
    for d, units in enumerate(assign_units(rates, ratio)):
        if units.numel() == 0:
            continue
        control = random_live_units(live, units.numel(), seed + d)
        deltas = []
        for ablated in (units, control):
            ce = {n: mean_ce(model, s, batch_size, layer, ablate=ablated.tolist()) for n, s in eval_sequences.items()}
            delta = {n: ce[n] - base_ce[n] for n in names}
            others = [delta[n] for n in names if n != names[d]]
            deltas += [delta[names[d]], sum(others) / len(others)]
        rows.append(MaskingRow(names[d], int(units.numel()), *deltas))
    return rows
