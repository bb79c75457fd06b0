"""`train.code_share_floor`: train a layer so that its per-token code carries at least a given share of what it
explains (issue 35).

A layer with a dense path (MxD's hidden code Dᵀz, a skip connection) can reconstruct the MLP while its code says
little: MxD with d_hidden equal to the MLP's width contains the MLP itself (Cᵀa a constant vector), and plain
distillation drifts there — on a held-out GPT-NeoX its experts carried 5 % of what the layer explained. The code probe
(evaluation/code_probe.py) measures this on held-out tokens as the code share, (FVU_avg − FVU) / (1 − FVU), where
FVU_avg is the FVU with every token given the average code. This term measures the same on each training batch and
adds

    coef · max(0, floor − share_batch),   share_batch = (FVU_avg − sg(FVU)) / (1 − sg(FVU))

to the loss, sg = stop-gradient: it pushes only the *average-code* output away from the target (the dense path may
not explain more than 1 − floor of the variance by itself) and never the layer's own reconstruction; the average code
is the batch's (detached), so the gradient reaches the dense path and the expert decoders, not the selection. Zero
once the batch's share is above the floor: a constraint, not a trade-off pursued forever.

    T tokens, I d_in, O d_out, N units, K slots per token.
"""

import torch
from torch.nn import functional as F

from expertize.modeling import SparseLayer

__all__ = ["code_share_penalty"]


def code_share_penalty(
    layer: SparseLayer, x: torch.Tensor, y: torch.Tensor, y_hat: torch.Tensor,
    code: tuple[torch.Tensor, torch.Tensor], floor: float,
) -> tuple[torch.Tensor, float]:
    """(max(0, floor − share_batch), share_batch) for one layer's batch: x (T, I) its input, y (T, O) the MLP's
    output, y_hat (T, O) the layer's output, `code` the (index, weights) (T, K) the layer chose for x."""
    index, weights = code
    mean = torch.zeros(layer.num_units, dtype=torch.float32, device=weights.device)  # (N,) mean weight per unit
    mean.index_add_(0, index.reshape(-1), weights.detach().float().reshape(-1))
    mean = mean / index.shape[0]
    y = y.float()
    variance = ((y - y.mean(0)) ** 2).sum().clamp_min(1e-30)
    fvu = (((y - y_hat.detach().float()) ** 2).sum() / variance).clamp_max(1 - 1e-6)
    y_average = layer.average_code_output(x, mean).float()  # (T, O), differentiable in the layer's parameters
    fvu_average = ((y - y_average) ** 2).sum() / variance
    share = (fvu_average - fvu) / (1 - fvu)
    return F.relu(floor - share), float(share.detach())
