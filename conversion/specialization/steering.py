"""Steering (the MxD paper's a_n += λ at every position, §6), measured without a judge: does adding λ to a domain's
unit make the model predict that domain's held-out text better, more than the other domains' text?

    unit of domain d     the live unit with the largest rate_d − max_{d'≠d} rate_d' (firing rates on the fit split)
    λ                    scale x the unit's mean activation over its firing tokens (fit split), so kinds whose codes
                         live on different scales (softmax gates vs ReLU values) are steered comparably
    drop(text)           CE(text) − CE_steered(text), nats; > 0: the text became more likely
    effect               drop(domain d's held-out text) − mean drop(the other domains' held-out text)
    control              the same for a random live unit (seed + d) steered by scale x its own mean activation

The cost to fluency on the other domains is reported beside it (−drop on the others).
"""

import dataclasses

import torch
from torch import nn

from .masking import random_live_units
from .passes import mean_ce

__all__ = ["SteeringRow", "domain_units", "steer_domains"]


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
    domain: str
    unit: int
    lam: float
    drop_target: float
    drop_others: float
    random_unit: int
    random_lam: float
    random_drop_target: float
    random_drop_others: float

    @property
    def effect(self) -> float:
        return self.drop_target - self.drop_others

    @property
    def random_effect(self) -> float:
        return self.random_drop_target - self.random_drop_others


def steer_domains(
    model: nn.Module, layer: nn.Module, rates: torch.Tensor, live: torch.Tensor, mean_activation: torch.Tensor,
    eval_sequences: dict[str, torch.Tensor], scale: float = 4.0, seed: int = 0, batch_size: int = 8,
    base_ce: dict[str, float] | None = None,
) -> list[SteeringRow]:
    """One row per domain. rates (D, U) and mean_activation (U,) from the fit split; eval_sequences
    {domain: (S, T)}."""
    names = list(eval_sequences)
    base_ce = base_ce or {n: mean_ce(model, s, batch_size) for n, s in eval_sequences.items()}
    rows = []
    for d, unit in enumerate(domain_units(rates, live)):
        control = int(random_live_units(live, 1, seed + d)[0])
        values = []
        for u in (unit, control):
            lam = scale * float(mean_activation[u])
            drop = {n: base_ce[n] - mean_ce(model, s, batch_size, layer, steer={u: lam})
                    for n, s in eval_sequences.items()}
            others = [drop[n] for n in names if n != names[d]]
            values.append((u, lam, drop[names[d]], sum(others) / len(others)))
        (u, lam, t, o), (ru, rlam, rt, ro) = values
        rows.append(SteeringRow(names[d], u, lam, t, o, ru, rlam, rt, ro))
    return rows
