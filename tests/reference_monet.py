"""Slow explicit Monet: every product expert E_ij materialized as its own matrices, gates recomputed independently.

Used only by tests to prove the factorized layers. Letters as in modeling/monet.py: T tokens, I d_in, O d_out,
R heads, S sub-experts per side, M expert_dim, N = S² product experts.
"""

import math

import torch
from torch.nn import functional as F

from expertize.modeling import MonetHDLayer, MonetLayer, MonetVDLayer

ACTIVATIONS = {
    "relu2": lambda v: v.clamp_min(0) ** 2,
    "relu": lambda v: v.clamp_min(0),
    "gelu": lambda v: 0.5 * v * (1 + torch.erf(v / 2**0.5)),
    "gelu_new": lambda v: 0.5 * v * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (v + 0.044715 * v**3))),
    "silu": lambda v: v * torch.sigmoid(v),
}


def router_logits(layer: MonetLayer, x: torch.Tensor, side: int) -> torch.Tensor:
    R, S = layer.spec.num_heads, layer.spec.num_sub_experts
    return (x @ getattr(layer, f"W_router{side}").T).view(-1, R, S)  # (T, R, S)


def selection(layer: MonetLayer, z: torch.Tensor, side: int, training: bool) -> torch.Tensor:
    """Selected sub-experts (T, R, S): the released MonetRouter's BatchNorm1d(R) + Φ⁻¹ threshold, or plain top-k."""
    spec = layer.spec
    T, R, S = z.shape
    if spec.routing == "topk":
        kth = z.sort(dim=-1, descending=True).values[..., spec.k - 1 : spec.k]  # (T, R, 1)
        return z >= kth
    flat = z.detach().transpose(1, 2).reshape(-1, R)  # (T·S, R), the released code's layout
    mean = getattr(layer, f"running_mean{side}").clone()  # never touch the layer's statistics
    var = getattr(layer, f"running_var{side}").clone()
    normalized = F.batch_norm(flat, mean, var, training=training, momentum=spec.bn_momentum, eps=spec.bn_eps)
    normalized = normalized.view(T, S, R).transpose(1, 2)  # (T, R, S)
    sigma = torch.special.ndtri(torch.tensor(1 - spec.k / S, dtype=z.dtype))
    return normalized >= torch.minimum(normalized.max(dim=-1, keepdim=True).values, sigma)


def gates(layer: MonetLayer, x: torch.Tensor, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ĝ¹, ĝ²), each (T, R, S): softmax of the raw logits over the selected sub-experts."""
    out = []
    for side in (1, 2):
        z = router_logits(layer, x, side)
        out.append(torch.where(selection(layer, z, side, training), z, -math.inf).softmax(dim=-1))
    return out[0], out[1]


def product_gates(g1: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
    """G_e = Σ_r ĝ¹_ri ĝ²_rj with e = i·S + j: (T, N)."""
    return torch.einsum("tri,trj->tij", g1, g2).flatten(1)


def experts(layer: MonetLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every product expert written out: E_e(x) = V_e σ(U_e x + c_e) + d_e with U (N, M, I), c (N, M), V (N, O, M),
    d (N, O), built expert by expert from the layer's parameters (Eq. 6 / Eq. 13)."""
    spec = layer.spec
    I, O, S, M = spec.d_in, spec.d_out, spec.num_sub_experts, spec.expert_dim
    U, c, V, d = [], [], [], []
    for e in range(spec.num_experts):
        i, j = divmod(e, S)
        if isinstance(layer, MonetHDLayer):
            U.append(layer.W_up.view(S, M, I)[i])
            c.append(layer.b_up.view(S, M)[i])
            V.append(layer.W_down.view(S, M, O)[j].T)
            d.append(layer.b_experts[j])
        else:
            assert isinstance(layer, MonetVDLayer)
            half, out_half = M // 2, O // 2
            U.append(torch.cat([layer.W_up1.view(S, half, I)[i], layer.W_up2.view(S, half, I)[j]]))
            c.append(torch.cat([layer.b_up1.view(S, half)[i], layer.b_up2.view(S, half)[j]]))

            def block(name: str, index: int) -> torch.Tensor:  # (O/2, M/2)
                return getattr(layer, name).view(S, half, out_half)[index].T

            top = torch.cat([block("W_down11", i), block("W_down12", i)], dim=1)  # [V¹¹_i, V¹²_i]
            bottom = torch.cat([block("W_down21", j), block("W_down22", j)], dim=1)  # [V²¹_j, V²²_j]
            V.append(torch.cat([top, bottom]))
            d.append(torch.cat([layer.b_experts1[i], layer.b_experts2[j]]))
    return torch.stack(U), torch.stack(c), torch.stack(V), torch.stack(d)


def expert_outputs(layer: MonetLayer, x: torch.Tensor) -> torch.Tensor:
    """E_e(x) for every expert: (T, N, O)."""
    U, c, V, d = experts(layer)
    hidden = ACTIVATIONS[layer.spec.activation](torch.einsum("nmi,ti->tnm", U, x) + c)  # (T, N, M)
    return torch.einsum("nom,tnm->tno", V, hidden) + d


def materialized(layer: MonetLayer, x: torch.Tensor, training: bool, removed=()) -> torch.Tensor:
    """Σ_e G_e E_e(x) + b_dec over all N explicit experts, experts in `removed` left out: (T, I) -> (T, O)."""
    G = product_gates(*gates(layer, x, training))  # (T, N)
    keep = torch.ones(layer.spec.num_experts, dtype=G.dtype)
    keep[list(removed)] = 0
    return torch.einsum("tn,tno->to", G * keep, expert_outputs(layer, x)) + layer.b_dec
