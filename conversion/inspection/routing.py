"""Routing statistics of layers with a router: load per expert and router entropy, accumulated over inspection's pass.

What a layer's routing is comes from the layer itself (`SparseLayer.router_distribution` and friends in
modeling/sparse_base.py), never from its kind:

    router_distribution  experts E                load (fraction of routing mass, sums to 1)      entropy of
    "scores"             `num_routed_experts`     top-K assignments per expert (code entries     softmax of the
                                                  mapped by `routed_experts(index)`)             recorded router_logits
    "gates"              the code's units (the    Σ code weight per unit (soft load)             the code's weights
                         default of the above)                                                   per token, normalized
    None                 no router: its load is the per-unit firing frequency, reported per unit already

`router_entropy` is the mean over tokens, in nats; `max_entropy` = log E (uniform routing).
"""

import math

import torch
from torch import nn

__all__ = ["ROUTER_DISTRIBUTIONS", "RoutingAccumulator", "has_router"]

ROUTER_DISTRIBUTIONS = ("scores", "gates")
"""The values `SparseLayer.router_distribution` may take besides None (no router)."""


def has_router(layer: nn.Module) -> bool:
    """Whether `layer` declares a router, i.e. has routing statistics (an unknown declaration is an error)."""
    distribution = getattr(layer, "router_distribution", None)
    if distribution is not None and distribution not in ROUTER_DISTRIBUTIONS:
        raise ValueError(
            f"{type(layer).__name__}.router_distribution={distribution!r}: must be one of "
            f"{list(ROUTER_DISTRIBUTIONS)} or None (see SparseLayer.router_distribution in modeling/sparse_base.py)"
        )
    return distribution is not None


class RoutingAccumulator:
    def __init__(self, layer: nn.Module) -> None:
        if not has_router(layer):
            raise ValueError(f"{type(layer).__name__} declares no router (router_distribution is None)")
        self.layer = layer
        self.num_experts = int(layer.num_routed_experts)
        self.load = torch.zeros(self.num_experts, dtype=torch.float64)
        self.entropy_sum = 0.0
        self.tokens = 0
        self._recording = layer.record_router_outputs

    @property
    def uses_router_logits(self) -> bool:
        return self.layer.router_distribution == "scores"

    def attach(self) -> None:
        if self.uses_router_logits:
            self.layer.record_router_outputs = True  # the layer keeps its router scores of the last forward

    def detach(self) -> None:
        self.layer.record_router_outputs = self._recording
        if not self._recording:
            self.layer.clear_router_outputs()

    @torch.no_grad()
    def update(self, index: torch.Tensor, weights: torch.Tensor) -> None:
        """index, weights (T, K): the layer's code for one batch (router scores read from the layer)."""
        self.load = self.load.to(index.device)
        E = self.num_experts
        if self.uses_router_logits:
            assigned = self.layer.routed_experts(index)  # (T, K'): code units -> the routed experts they belong to
            self.load += torch.bincount(assigned.reshape(-1), minlength=E)[:E].double()
            p = self.layer.router_logits.double().softmax(-1)  # (T, E)
        else:
            w = weights.double().clamp_min(0)  # (T, K)
            self.load.index_add_(0, index.reshape(-1), w.reshape(-1))
            p = w / w.sum(-1, keepdim=True).clamp_min(1e-30)  # (T, K) per-token routing distribution
        self.entropy_sum += float(-(p * p.clamp_min(1e-30).log()).sum(-1).sum())
        self.tokens += index.shape[0]

    def summary(self) -> dict:
        total = float(self.load.sum())
        return {
            "experts": self.num_experts,
            "load": [float(x) / total if total else 0.0 for x in self.load.tolist()],
            "router_entropy": self.entropy_sum / self.tokens if self.tokens else 0.0,
            "max_entropy": math.log(self.num_experts),
            "entropy_of": "softmax of router scores" if self.uses_router_logits else "gate weights per token",
        }
