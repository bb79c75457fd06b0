"""Slow, explicit reference forms of the sparse layers, used only to prove the fast factorized ones.

Letters: T tokens, I d_in, O d_out, H hidden, N experts / latents.
"""

import torch
from torch.nn import functional as F

from expertize.modeling import MxdLayer, TranscoderLayer


def dense_code(pre: torch.Tensor, k: int) -> torch.Tensor:
    """TopK(ReLU(pre)) scattered into a dense (T, N) tensor: the paper code's path."""
    values, index = F.relu(pre).topk(k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, index, values)


def mxd_dense(layer: MxdLayer, x: torch.Tensor) -> torch.Tensor:
    """MxD with a dense coefficient vector and `a @ C` over all N experts."""
    a = dense_code(F.linear(x, layer.W_gate, layer.b_gate), layer.spec.k)  # (T, N)
    return (a @ layer.W_experts) * (layer.hidden(x) @ layer.W_dec) + layer.b_dec  # (T, O)


def mxd_materialized(layer: MxdLayer, x: torch.Tensor) -> torch.Tensor:
    """Eq. 3 literally: Σ_n a_n W_nᵀ z with every expert materialized, W_n = D diag(c_n) (Lemma 1)."""
    a = dense_code(F.linear(x, layer.W_gate, layer.b_gate), layer.spec.k)  # (T, N)
    experts = layer.W_dec[None, :, :] * layer.W_experts[:, None, :]  # (N, H, O)
    z = layer.hidden(x)  # (T, H)
    return torch.einsum("tn,nho,th->to", a, experts, z) + layer.b_dec


def mxd_hidden_reference(layer: MxdLayer, x: torch.Tensor) -> torch.Tensor:
    """z written out with the activation named in the spec, independently of the layer's `act` attribute."""
    acts = {
        "gelu": lambda v: 0.5 * v * (1 + torch.erf(v / 2**0.5)),
        "gelu_new": lambda v: 0.5 * v * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (v + 0.044715 * v**3))),
        "silu": lambda v: v * torch.sigmoid(v),
        "relu": lambda v: v.clamp_min(0),
    }
    z = acts[layer.spec.activation](x @ layer.W_enc.T + (layer.b_enc if layer.b_enc is not None else 0))
    if layer.W_glu is not None:
        z = z * (x @ layer.W_glu.T + (layer.b_glu if layer.b_glu is not None else 0))
    return z


def transcoder_dense(layer: TranscoderLayer, x: torch.Tensor) -> torch.Tensor:
    z = dense_code(F.linear(x, layer.W_enc, layer.b_enc), layer.spec.k)  # (T, L)
    out = z @ layer.W_dec + layer.b_dec
    if layer.W_skip is not None:
        out = out + x @ layer.W_skip.T
    return out
