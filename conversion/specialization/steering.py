"""Steering (the MxD paper's a_n += λ at every position, §6), measured without a judge: does adding λ to a domain's
unit make the model predict that domain's held-out text better, more than the other domains' text?

    unit of domain d     the live unit with the largest rate_d − max_{d'≠d} rate_d' (firing rates on the fit split)
    λ                    scale x the unit's mean activation over its firing tokens (fit split), so kinds whose codes
                         live on different scales (softmax gates vs ReLU values) are steered comparably
    drop(text)           CE(text) − CE_steered(text), nats; > 0: the text became more likely
    effect               drop(domain d's held-out text) − mean drop(the other domains' held-out text)
    control              the same for a random live unit (seed + d) steered by scale x its own mean activation

The cost to fluency on the other domains is reported beside it (−drop on the others). Every figure carries its
bootstrap interval over eval documents (bootstrap.py); an effect whose interval holds the control's is "n.s.".
"""

import dataclasses

import torch

from .bootstrap import Estimate, significant
from .conditions import Condition, DomainCE
from .masking import changes, random_live_units, target_and_others

__all__ = ["SteeringPlan", "SteeringRow", "domain_units", "plan_steering", "steering_rows", "steering_summary"]


def domain_units(rates: torch.Tensor, live: torch.Tensor) -> list[int]:
    """rates (D, U), live (U,) bool -> per domain the live unit with the largest rate_d − max other rate."""
    rows = []
    for d in range(rates.shape[0]):
        others = torch.cat([rates[:d], rates[d + 1 :]]).max(0).values  # (U,)
        contrast = (rates[d] - others).masked_fill(~live, -float("inf"))  # (U,)
        rows.append(int(contrast.argmax()))
    return rows


@dataclasses.dataclass
class SteeringRow:
    """One domain's steering, every figure with its bootstrap interval over eval documents (bootstrap.py)."""

    domain: str
    unit: int
    lam: float
    drop_target: Estimate
    drop_others: Estimate
    effect: Estimate
    """drop_target − drop_others."""
    random_unit: int
    random_lam: float
    random_drop_target: Estimate
    random_drop_others: Estimate
    random_effect: Estimate

    @property
    def significant(self) -> bool:
        """Whether the effect's interval excludes the random unit's effect."""
        return significant(self.effect, self.random_effect)


@dataclasses.dataclass
class SteeringPlan:
    """Per domain: its unit and λ, and a random live unit with its λ (the control)."""

    units: list[tuple[int, float]]
    controls: list[tuple[int, float]]

    def conditions(self) -> list[Condition]:
        """[steer domain 0's unit, steer its control, steer domain 1's unit, …]."""
        return [Condition(steer=(pair,)) for both in zip(self.units, self.controls) for pair in both]


def plan_steering(rates: torch.Tensor, live: torch.Tensor, mean_activation: torch.Tensor, scale: float = 4.0,
                  seed: int = 0) -> SteeringPlan:
    """rates (D, U) and mean_activation (U,) on the fit split, live (U,) bool."""
    plan = SteeringPlan([], [])
    for d, unit in enumerate(domain_units(rates, live)):
        control = int(random_live_units(live, 1, seed + d)[0])
        plan.units.append((unit, scale * float(mean_activation[unit])))
        plan.controls.append((control, scale * float(mean_activation[control])))
    return plan


def _figures(plan: SteeringPlan, ce: list[DomainCE], weights: list[torch.Tensor], first: int) -> list[dict]:
    """Per domain the replicate vectors of the CE drop on its text and on the others' and the effect, for its unit
    and ("random_…") its control; the plan's conditions start at row `first` of the DomainCEs."""
    out = []
    for d in range(len(plan.units)):
        figures = {}
        for prefix, condition in (("", first + 2 * d), ("random_", first + 2 * d + 1)):
            rise_target, rise_others = target_and_others(changes(ce, weights, condition), d)
            figures[prefix + "target"], figures[prefix + "others"] = -rise_target, -rise_others
            figures[prefix + "effect"] = rise_others - rise_target
        out.append(figures)
    return out


def steering_rows(names: list[str], plan: SteeringPlan, ce: list[DomainCE], weights: list[torch.Tensor],
                  first: int = 0) -> list[SteeringRow]:
    """One row per domain, from each eval domain's condition CEs (domains in `names` order), the plan's conditions
    starting at row `first`, and each domain's document weights (R + 1, n)."""
    rows = []
    for d, f in enumerate(_figures(plan, ce, weights, first)):
        (u, lam), (ru, rlam) = plan.units[d], plan.controls[d]
        e = {key: Estimate.of(v) for key, v in f.items()}
        rows.append(SteeringRow(names[d], u, lam, e["target"], e["others"], e["effect"], ru, rlam,
                                e["random_target"], e["random_others"], e["random_effect"]))
    return rows


def steering_summary(plan: SteeringPlan, ce: list[DomainCE], weights: list[torch.Tensor], first: int = 0) -> dict:
    """The table's figures: the mean effect over the domains, the mean drop on the other domains (its fluency cost,
    negated), and the same for the random units."""
    figures = _figures(plan, ce, weights, first)
    mean = {key: torch.stack([f[key] for f in figures]).mean(0) for key in figures[0]}
    return {"steering_effect": Estimate.of(mean["effect"]), "steering_drop_others": Estimate.of(mean["others"]),
            "random_steering_effect": Estimate.of(mean["random_effect"]),
            "random_steering_drop_others": Estimate.of(mean["random_others"])}
