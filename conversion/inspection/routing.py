"""Routing statistics of router kinds: load per expert and router entropy, accumulated over the inspection pass.

    kind             experts E              load (fraction of routing mass, sums to 1)    entropy of
    moe_x            the M routed experts   top-K assignments per expert                   softmax of router scores
    routed_neurons   the N neurons          top-K assignments per neuron                   softmax of router scores
    mumoe_cp / _tr   the N experts          Σ gate coefficient a_n (soft load)             the gate a itself (entmax)
    monet_hd / _vd   the N product experts  Σ head-summed gate G_ij                        G / Σ G per token

`router_entropy` is the mean over tokens, in nats; `max_entropy` = log E (uniform routing). mxd and the transcoders
have no router distribution (a TopK over ReLU scores): their load is the firing frequency already reported per unit.
"""

import math

import torch
from torch import nn

__all__ = ["ROUTER_KINDS", "RoutingAccumulator"]

ROUTER_KINDS = ("moe_x", "routed_neurons", "mumoe_cp", "mumoe_tr", "monet_hd", "monet_vd")
"""Kinds with routing statistics; a new router kind adds its name here and its case in `RoutingAccumulator`."""


class RoutingAccumulator:
    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.kind = layer.spec.kind
        self.num_experts = layer.spec.num_experts
        self.load = torch.zeros(self.num_experts, dtype=torch.float64)
        self.entropy_sum = 0.0
        self.tokens = 0
        self._recording = layer.record_router_outputs

    @property
    def uses_router_logits(self) -> bool:
        return self.kind in ("moe_x", "routed_neurons")

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
            assigned = index
            if self.kind == "moe_x":  # units j·D + h -> the K selected experts j
                assigned = index[:, :: self.layer.spec.d_expert] // self.layer.spec.d_expert
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
