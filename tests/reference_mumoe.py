"""Slow, explicit references for μMoE, used only to prove the fast factorized layer.

entmax15 by bisection on its threshold; every expert W_n (P×Q) and bias β_n materialized from the paper's cores
(element formulas of Eqs. 6 and 8), and the layer as the literal sum Σ_n a_n (W_nᵀ z + β_n).
Letters: T tokens, I d_in, O d_out, H hidden, N experts, P/Q a map's input/output width.
"""

import torch

from expertize.modeling import MuMoELayer
from expertize.modeling.mumoe import MuMoECPMap

ACTIVATIONS = {
    "gelu": lambda v: 0.5 * v * (1 + torch.erf(v / 2**0.5)),
    "gelu_new": lambda v: 0.5 * v * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (v + 0.044715 * v**3))),
    "silu": lambda v: v * torch.sigmoid(v),
    "relu": lambda v: v.clamp_min(0),
}


def entmax15_threshold_bisect(logits: torch.Tensor, iters: int = 200) -> torch.Tensor:
    """τ with Σ_i [x_i - τ]₊² = 1 for x = logits / 2, by bisection on [max x - 1, max x]: (T, N) -> (T, 1)."""
    x = logits.detach() / 2
    hi = x.amax(-1, keepdim=True)  # mass 0 < 1
    lo = hi - 1  # mass >= 1 (the max alone contributes 1)
    for _ in range(iters):
        mid = (lo + hi) / 2
        too_low = (x - mid).clamp_min(0).pow(2).sum(-1, keepdim=True) > 1
        lo, hi = torch.where(too_low, mid, lo), torch.where(too_low, hi, mid)
    return (lo + hi) / 2


def entmax15_reference(logits: torch.Tensor) -> torch.Tensor:
    """entmax15 with the support found by bisection, then τ in closed form on that support (differentiable)."""
    x = logits / 2
    support = x > entmax15_threshold_bisect(logits)  # (T, N)
    n = support.sum(-1, keepdim=True)
    mean = torch.where(support, x, 0).sum(-1, keepdim=True) / n
    ss = torch.where(support, (x - mean) ** 2, 0).sum(-1, keepdim=True)
    tau = mean - ((1 - ss) / n).sqrt()
    return torch.where(support, (x - tau) ** 2, 0)


def gate_reference(layer: MuMoELayer, x: torch.Tensor) -> torch.Tensor:
    """a = φ(LN(G x)) with LayerNorm written out (biased variance, eps 1e-5): (T, I) -> (T, N)."""
    logits = x @ layer.W_gate.T
    if layer.spec.gate_norm == "layernorm":
        mean = logits.mean(-1, keepdim=True)
        var = ((logits - mean) ** 2).mean(-1, keepdim=True)
        logits = (logits - mean) / (var + 1e-5).sqrt()
    if layer.spec.gate_activation == "softmax":
        e = (logits - logits.amax(-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)
    return entmax15_reference(logits)


def paper_cores(mumoe) -> tuple[torch.Tensor, ...]:
    """The map's factors in the paper's layouts. CP: U¹ (R, N), U² (R, P), U³ (R, Q), bias row (R,).
    TR: U¹ (R1, N, R2), U² (R2, P, R3), U³ (R3, Q, R1), bias slice (R2, R3). A missing bias is zeros."""
    if isinstance(mumoe, MuMoECPMap):
        bias = mumoe.b_in if mumoe.b_in is not None else mumoe.U_in.new_zeros(mumoe.U_in.shape[0])
        return mumoe.U_experts.T, mumoe.U_in, mumoe.U_out, bias
    R2, R3 = mumoe.U_in.shape[:2]
    bias = mumoe.b_in if mumoe.b_in is not None else mumoe.U_in.new_zeros(R2, R3)
    return mumoe.U_experts.permute(1, 0, 2), mumoe.U_in.permute(0, 2, 1), mumoe.U_out.permute(1, 2, 0), bias


def materialize(mumoe) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert: W (N, P, Q) and β (N, Q).

    CP (Eq. 6): w_npq = Σ_r U¹_rn U²_rp U³_rq. TR (Eq. 8): w_npq = tr(U¹[:, n, :] U²[:, p, :] U³[:, q, :]).
    """
    U1, U2, U3, bias = paper_cores(mumoe)
    if isinstance(mumoe, MuMoECPMap):
        return torch.einsum("rn,rp,rq->npq", U1, U2, U3), torch.einsum("rn,r,rq->nq", U1, bias, U3)
    return torch.einsum("anb,bpc,cqa->npq", U1, U2, U3), torch.einsum("anb,bc,cqa->nq", U1, bias, U3)


def mix(a: torch.Tensor, experts: tuple[torch.Tensor, torch.Tensor], z: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """Σ_{n in keep} a_n (W_nᵀ z + β_n): (T, N), (T, P) -> (T, Q)."""
    W, beta = experts
    return torch.einsum("tn,npq,tp->tq", a[:, keep], W[keep], z) + a[:, keep] @ beta[keep]


def mumoe_reference(
    layer: MuMoELayer, x: torch.Tensor, removed: tuple[int, ...] = (), steer: dict[int, float] | None = None
) -> torch.Tensor:
    """The layer as a literal sum over materialized experts: (T, I) -> (T, O).

    `removed` experts are left out of every sum (the paper's W_n := 0); `steer` adds λ to a_n after the gate.
    """
    a = gate_reference(layer, x)  # (T, N)
    for n, value in (steer or {}).items():
        a = a + value * torch.nn.functional.one_hot(torch.tensor(n), a.shape[-1]).to(a.dtype)
    keep = [n for n in range(a.shape[-1]) if n not in removed]
    act = ACTIVATIONS[layer.spec.activation]
    if layer.spec.form == "block":
        z = act(mix(a, materialize(layer.mumoe_in), x, keep))
        if layer.mumoe_glu is not None:
            z = z * mix(a, materialize(layer.mumoe_glu), x, keep)
    else:
        z = act(x @ layer.W_enc.T + (layer.b_enc if layer.b_enc is not None else 0))
        if layer.W_glu is not None:
            z = z * (x @ layer.W_glu.T + (layer.b_glu if layer.b_glu is not None else 0))
    return mix(a, materialize(layer.mumoe_out), z, keep) + layer.b_dec
