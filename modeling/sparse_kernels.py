"""The shared kernels of the sparse layers: TopK selection over ReLU scores (with a selection bias), the sparse decode
of a code, and gathered dots whose backward touches only the K selected rows.

Part of the Hub bundle: imports only torch and sibling files. Shape letters as in sparse_base.py.
"""

import torch
from torch.nn import functional as F

from .sparse_code import SparseCode


def sparse_rows_sum(code: SparseCode, rows: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k · rows[idx_k] per token, touching only the selected rows (never densifying over N).

    code: (T, K) index and weights; rows: (N, O). Returns (T, O).
    """
    return F.embedding_bag(
        code.top_k_index, rows, per_sample_weights=code.top_k_weights.to(rows.dtype), mode="sum"
    )


def decode_rows(code: SparseCode, W_dec: torch.Tensor, b_dec: torch.Tensor, x: torch.Tensor,
                W_skip: torch.Tensor | None = None) -> torch.Tensor:
    """A coder's output: Σ_k w_k · W_dec[idx_k] + b_dec (+ W_skip x). code (..., K), W_dec (N, O), b_dec (O,),
    x (..., I) the input, W_skip (O, I) or None. Returns (..., O)."""
    lead = x.shape[:-1]
    out = sparse_rows_sum(code.flat(), W_dec) + b_dec  # (T, O)
    if W_skip is not None:
        out = out + F.linear(x.reshape(-1, x.shape[-1]), W_skip)
    return out.view(*lead, -1)


def relu_topk(
    pre: torch.Tensor, k: int, selection_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """TopK(ReLU(pre)) along the last dim: returns (values, indices), each (T, K).

    With `selection_bias` (N,) (balanced training, `SparseLayer.b_select`), the K are chosen among the *positive*
    entries by `pre + selection_bias`, and their values stay ReLU(pre): the bias only decides who competes on equal
    terms (DeepSeek-V3's auxiliary-loss-free balancing), never how much a unit contributes, and it cannot make a unit
    fire whose pre-activation is not positive (it would add a zero weight and take a slot).
    """
    if selection_bias is None:
        values, indices = pre.topk(k, dim=-1, sorted=False)
        # ReLU after TopK equals TopK after ReLU (ReLU is monotone) and touches K entries instead of N.
        return F.relu(values), indices
    score = torch.where(pre > 0, pre + selection_bias.to(pre.dtype), float("-inf"))  # (T, N)
    indices = score.topk(k, dim=-1, sorted=False).indices  # (T, K)
    return F.relu(pre.gather(-1, indices)), indices


def _gathered_rows_backward(
    x: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, grad: torch.Tensor, need_x: bool, need_rows: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The backward of out[t, k] = rows[index[t, k]] · x[t] for grad (T, K) in rows' dtype, as one embedding_bag:
    grad x_t = Σ_k g_tk rows[idx_tk] (T, I) and grad rows[n] = Σ_{idx_tk = n} g_tk x_t (N, I), the latter as that
    embedding_bag's own backward with grad_outputs x. Returns (grad_x or None, grad_rows or None)."""
    if not (need_x or need_rows):
        return None, None
    with torch.enable_grad():
        w = rows.detach().requires_grad_(need_rows)
        grad_x = F.embedding_bag(index, w, per_sample_weights=grad, mode="sum")  # (T, I)
    grad_rows = None
    if need_rows:
        (grad_rows,) = torch.autograd.grad(grad_x, w, grad_outputs=x.to(rows.dtype))  # (N, I)
    return (grad_x.detach().to(x.dtype) if need_x else None), grad_rows


def positive_topk_index(score: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """Index (T, K) of the top K of `score` (T, N) = pre + b among the entries with pre > 0 (i.e. score > b), as
    `relu_topk` with a selection bias chooses them. `score` may be overwritten.

    On the CPU, outside tracing: one unmasked top K, and the mask only for the rows where a non-positive entry took a
    slot (a raised bias outranked a positive score; rare in training, and every row with fewer than K positive
    entries). Where every chosen entry is positive, they are also the top K of the positive entries, so the choice is
    exactly the masked one's. Masking every column instead (a broadcast compare-and-fill over (T, N)) cost about 2x
    the top K itself on 2 CPU threads (9 ms vs 4.7 ms at T = 1,024, N = 3,584; docs/results/speed.md). A GPU or a
    traced graph masks every column (one pass, no host synchronization to find the rows)."""
    b = b.to(score.dtype)  # autocast may compute the scores in a lower precision
    if score.is_cuda or torch.compiler.is_compiling():
        score.masked_fill_(score <= b, float("-inf"))  # pre <= 0
        return score.topk(k, dim=-1, sorted=False).indices  # (T, K)
    index = score.topk(k, dim=-1, sorted=False).indices  # (T, K), unmasked
    rows = (score.gather(-1, index) <= b[index]).any(-1).nonzero().squeeze(-1)  # (R,) a non-positive entry chosen
    if rows.numel():
        redo = score.index_select(0, rows)  # (R, N)
        redo.masked_fill_(redo <= b, float("-inf"))
        index.index_copy_(0, rows, redo.topk(k, dim=-1, sorted=False).indices)
    return index


def biased_linear_relu_topk(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, selection_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`relu_topk(F.linear(x, weight, bias), k, selection_bias)` in fewer passes over the (T, N) scores: the bias is
    added inside the matmul (score = pre + b) and `positive_topk_index` chooses without a dense mask where it can.
    Same choice among the positive entries (up to the float rounding of the fused add), same values; where fewer
    than K entries are positive, the zero-weight fillers may be other units than `relu_topk`'s (they never fire).
    Returns (values, index), each (T, K).

    Why: `relu_topk`'s where(pre > 0, pre + b, -inf) is three elementwise passes over (T, N), which cost 1.2-1.6x a
    whole training step at small widths (benchmarks/dead_unit_overhead.py).
    """
    b = selection_bias.to(weight.dtype)
    score = F.linear(x, weight, b if bias is None else bias + b)  # (T, N) = pre + b
    index = positive_topk_index(score, b, k)  # (T, K)
    b = b.to(score.dtype)
    return F.relu(score.gather(-1, index) - b[index]), index  # ReLU(pre) at the chosen units


class LinearReluTopK(torch.autograd.Function):
    """`relu_topk(F.linear(x, weight, bias), k, selection_bias)` with a backward that touches only the K selected
    rows of `weight`; also returns the pre-activations (T, N), detached, for AuxK to reuse.

    The gradient of the (T, N) logits is zero outside the K selected entries per token (g_tk), so the dense backward
    (two T×N×I matmuls) reduces to gathers and scatters over T·K rows, which is exactly one `embedding_bag` and its
    backward: grad x_t = Σ_k g_tk W[idx_tk], grad W[n] = Σ_{idx_tk = n} g_tk x_t, grad b[n] = Σ_{idx_tk = n} g_tk.
    Same values as the plain ops; gradients equal theirs up to float summation order.

        values, index, pre = LinearReluTopK.apply(x, weight, bias, k, selection_bias, need_pre)

    `need_pre=False` (no AuxK this step) lets a biased choice skip the (T, N) pre-activations (`pre` is then empty).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, k, selection_bias=None, need_pre=True):
        # x (T, I), weight (N, I), bias / selection_bias (N,)
        if selection_bias is None:
            pre = F.linear(x, weight, bias)  # (T, N)
            values, index = relu_topk(pre, k)  # (T, K) each
        elif need_pre:  # AuxK reads the pre-activations this step: kept, and the choice made on pre + b
            pre = F.linear(x, weight, bias)  # (T, N)
            index = positive_topk_index(pre + selection_bias.to(pre.dtype), selection_bias, k)  # (T, K)
            values = F.relu(pre.gather(-1, index))
        else:  # nobody reads the pre-activations this step (AuxK is not running): the cheaper biased choice
            values, index = biased_linear_relu_topk(x, weight, bias, k, selection_bias)
            pre = x.new_empty(0)
        ctx.save_for_backward(x, weight, index, values)
        ctx.mark_non_differentiable(index, pre)
        # The outputs nobody differentiates (index, pre) would otherwise get a zero gradient materialized for the
        # backward: a dense (T, N) buffer, as large as the dense backward this kernel avoids.
        ctx.set_materialize_grads(False)
        return values, index, pre

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_values, _grad_index, _grad_pre):
        if grad_values is None:  # the values reached no loss
            return (None,) * len(ctx.needs_input_grad)
        x, weight, index, values = ctx.saved_tensors
        grad = torch.where(values > 0, grad_values, 0).to(weight.dtype)  # ReLU's backward, as F.relu's: (T, K)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x, grad_w = _gathered_rows_backward(x, weight, index, grad, need_x, need_w)
        grad_b = None
        if need_b:  # False when bias is None
            grad_b = weight.new_zeros(weight.shape[0]).index_add_(0, index.reshape(-1), grad.reshape(-1))  # (N,)
        return grad_x, grad_w, grad_b, None, None, None


GATHER_CHUNK_ELEMENTS = 1 << 24
"""The forward gathers at most this many weights (tokens × K × I) at once, to bound the (T, K, I) transient."""


class GatheredDot(torch.autograd.Function):
    """out[t, k] = rows[index[t, k]] · x[t] without keeping the (T, K, I) gather for backward.

    Backward, the same embedding_bag identities as `LinearReluTopK`: grad x_t = Σ_k g_tk rows[idx_tk]
    and grad rows[n] = Σ_{idx_tk = n} g_tk x_t (the backward of that embedding_bag with grad_outputs x).
    """

    @staticmethod
    def forward(ctx, x, rows, index):  # x (T, I), rows (N, I), index (T, K)
        T, K = index.shape
        chunk = max(1, GATHER_CHUNK_ELEMENTS // max(1, K * rows.shape[1]))
        out = [
            torch.bmm(F.embedding(index[i : i + chunk], rows), x[i : i + chunk, :, None]).squeeze(-1)  # (t, K)
            for i in range(0, T, chunk)
        ]
        ctx.save_for_backward(x, rows, index)
        return torch.cat(out) if out else x.new_zeros(0, K)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, rows, index = ctx.saved_tensors
        need_x, need_rows = ctx.needs_input_grad[:2]
        grad_x, grad_rows = _gathered_rows_backward(x, rows, index, grad.to(rows.dtype), need_x, need_rows)
        return grad_x, grad_rows, None


def dead_relu_topk(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    dead_mask: torch.Tensor,
    k_aux: int,
    pre: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AuxK's selection (Gao et al. 2024, §A.2): TopK_aux(ReLU(W x + b)) over the *dead* units only.

    x (T, I), weight (N, I), bias (N,), dead_mask (N,) bool -> (values, index), each (T, min(k_aux, N)).
    The ranking runs without autograd, on `pre` (T, N) = W x + b when the forward kept it (no second dense product);
    the selected pre-activations are recomputed from their rows only (`GatheredDot`), so gradients reach just the
    selected rows of `weight` / `bias`, never a dense (T, N) grad. Where fewer than k_aux units are dead, live units
    fill the remaining slots with value 0 (no host sync to count).
    """
    k_aux = min(int(k_aux), weight.shape[0])
    with torch.no_grad():
        if pre is None:
            pre = F.linear(x, weight, bias)  # (T, N)
        index = pre.masked_fill(~dead_mask, float("-inf")).topk(k_aux, dim=-1, sorted=False).indices  # (T, k_aux)
    # F.embedding, not bias[index]: its backward is deterministic (as routed_neurons' neuron_activations).
    values = GatheredDot.apply(x, weight, index) + F.embedding(index, bias.unsqueeze(-1)).squeeze(-1)  # (T, k_aux)
    return F.relu(values) * dead_mask[index], index  # live fillers -> 0


def _rectangle(u: torch.Tensor) -> torch.Tensor:
    """The rectangle kernel of the JumpReLU straight-through estimator: 1 on |u| < 1/2, else 0."""
    return ((u > -0.5) & (u < 0.5)).to(u.dtype)


class JumpReLU(torch.autograd.Function):
    """pre · 1[pre > θ] with the straight-through estimator of Rajamanoharan et al. 2024 (arXiv 2407.14435, eq. 11):

        ∂/∂pre = 1[pre > θ]                       (the exact derivative away from the jump)
        ∂/∂θ   = -(θ/ε) · rect((pre - θ)/ε)        (the jump's pseudo-derivative, nonzero within ε/2 of θ)

    pre (T, N), threshold θ (N,) > 0, bandwidth ε (N,) > 0. The forward is what circuit-tracer's JumpReLU computes."""

    @staticmethod
    def forward(ctx, pre: torch.Tensor, threshold: torch.Tensor, bandwidth: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(pre, threshold, bandwidth)
        return pre * (pre > threshold)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pre, threshold, bandwidth = ctx.saved_tensors
        grad_pre = grad * (pre > threshold)
        window = _rectangle((pre - threshold) / bandwidth)  # (T, N)
        grad_threshold = -(threshold / bandwidth) * (grad * window).sum(0)  # (N,)
        return grad_pre, grad_threshold, None


class JumpStep(torch.autograd.Function):
    """1[pre > θ], the per-entry L0, with the straight-through estimator for θ (Rajamanoharan et al. 2024, eq. 12):
    ∂/∂θ = -(1/ε) · rect((pre - θ)/ε); no gradient to pre (the L0 penalty moves thresholds, not the encoder).
    pre (T, N), threshold θ (N,), bandwidth ε (N,)."""

    @staticmethod
    def forward(ctx, pre: torch.Tensor, threshold: torch.Tensor, bandwidth: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(pre, threshold, bandwidth)
        return (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pre, threshold, bandwidth = ctx.saved_tensors
        window = _rectangle((pre - threshold) / bandwidth)  # (T, N)
        return None, -(grad * window).sum(0) / bandwidth, None
