"""Domain masking (Monet §5.1): assign units to domains by firing probability, ablate a domain's units, compare the
rise of CE on that domain's held-out text with the rise on the other domains, beside a random-units control.

The CEs come from conditions.py (the suffix replay, exact) as per-document sums, so every figure carries its bootstrap
interval over eval documents (bootstrap.py); a specificity whose interval holds its control's value is "n.s.".
"""

import dataclasses
import math

import torch

from .bootstrap import Estimate, Replicates, mean_change, ratio, significant
from .conditions import Condition, DomainCE

__all__ = [
    "MaskingPlan", "MaskingRow", "assign_units", "masking_rows", "masking_summary", "plan_masking",
    "random_live_units", "specificity",
]


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
    """One domain's ablation, every figure with its bootstrap interval over eval documents (bootstrap.py)."""

    domain: str
    units: int
    """Units assigned to the domain (and ablated)."""
    delta_target: Estimate
    """CE rise on the domain's held-out text, nats."""
    delta_others: Estimate
    """Mean CE rise on the other domains' held-out text."""
    specificity: Estimate
    """delta_target / delta_others."""
    random_delta_target: Estimate
    random_delta_others: Estimate
    random_specificity: Estimate

    @property
    def significant(self) -> bool:
        """Whether the specificity's interval excludes the random control's value."""
        return significant(self.specificity, self.random_specificity)


@dataclasses.dataclass
class MaskingPlan:
    """Per domain with assigned units: its index, its units and as many random live units (the control)."""

    domains: list[int]
    units: list[torch.Tensor]
    controls: list[torch.Tensor]

    def conditions(self) -> list[Condition]:
        """[ablate domain 0's units, ablate its control, ablate domain 1's units, …] in plan order."""
        return [Condition(ablate=tuple(ids.tolist())) for pair in zip(self.units, self.controls) for ids in pair]


def plan_masking(rates: torch.Tensor, live: torch.Tensor, ratio: float = 2.0, seed: int = 0) -> MaskingPlan:
    """rates (D, U) on the fit split, live (U,) bool: Monet's assignment, and per domain a control of as many random
    live units (seed + domain index)."""
    plan = MaskingPlan([], [], [])
    for d, units in enumerate(assign_units(rates, ratio)):
        if units.numel():
            plan.domains.append(d)
            plan.units.append(units)
            plan.controls.append(random_live_units(live, units.numel(), seed + d))
    return plan


def changes(ce: list[DomainCE], weights: list[torch.Tensor], condition: int) -> list[Replicates]:
    """Per eval domain the mean CE change under `condition` (its index in the DomainCE rows): (R + 1,) each."""
    return [mean_change(c.conditions[condition], c.base, c.tokens, w) for c, w in zip(ce, weights)]


def target_and_others(per_domain: list[Replicates], d: int) -> tuple[Replicates, Replicates]:
    """(domain d's figure, the mean of the other domains' figures)."""
    others = [v for e, v in enumerate(per_domain) if e != d]
    return per_domain[d], torch.stack(others).mean(0)


def _figures(plan: MaskingPlan, ce: list[DomainCE], weights: list[torch.Tensor], first: int) -> list[dict]:
    """Per planned domain the replicate vectors of ΔCE on its text ("target") and on the others' ("others"), for its
    units and ("random_…") its control; the plan's conditions start at row `first` of the DomainCEs."""
    out = []
    for i, d in enumerate(plan.domains):
        figures = {}
        for prefix, condition in (("", first + 2 * i), ("random_", first + 2 * i + 1)):
            figures[prefix + "target"], figures[prefix + "others"] = target_and_others(
                changes(ce, weights, condition), d)
        out.append(figures)
    return out


def masking_rows(names: list[str], plan: MaskingPlan, ce: list[DomainCE], weights: list[torch.Tensor],
                 first: int = 0) -> list[MaskingRow]:
    """One row per planned domain, from each eval domain's condition CEs (`ce`, domains in `names` order), the plan's
    conditions starting at row `first`, and each domain's document weights (R + 1, n)."""
    rows = []
    for d, units, f in zip(plan.domains, plan.units, _figures(plan, ce, weights, first)):
        rows.append(MaskingRow(
            names[d], int(units.numel()), Estimate.of(f["target"]), Estimate.of(f["others"]),
            Estimate.of(ratio(f["target"], f["others"])), Estimate.of(f["random_target"]),
            Estimate.of(f["random_others"]), Estimate.of(ratio(f["random_target"], f["random_others"])),
        ))
    return rows


def masking_summary(plan: MaskingPlan, ce: list[DomainCE], weights: list[torch.Tensor], first: int = 0) -> dict:
    """The table's figures over the planned domains: mean ΔCE(target), mean ΔCE(others) and their ratio, the
    specificity (a ratio of means: per-domain ratios explode where ΔCE(others) ≈ 0), and the same for the random
    controls. Empty without a planned domain."""
    figures = _figures(plan, ce, weights, first)
    if not figures:
        return {}
    mean = {key: torch.stack([f[key] for f in figures]).mean(0) for key in figures[0]}
    return {
        "mask_delta_target": Estimate.of(mean["target"]), "mask_delta_others": Estimate.of(mean["others"]),
        "specificity": Estimate.of(ratio(mean["target"], mean["others"])),
        "random_mask_delta_target": Estimate.of(mean["random_target"]),
        "random_mask_delta_others": Estimate.of(mean["random_others"]),
        "random_specificity": Estimate.of(ratio(mean["random_target"], mean["random_others"])),
    }
