"""The transcoder's sparse gate backward (issue 20): its encoder runs `LinearReluTopK`, whose backward builds grad x,
grad W_enc and grad b_enc from the K selected rows only. A training step's gradients equal those of the same layer
under plain dense autograd, with and without the selection bias, on rows with fewer than K positive
pre-activations and on tied zeros; gradcheck passes in float64; and a wrong backward fails these checks.
(benchmarks/transcoder_backward.py times the two paths at GPT-2 shapes.)"""

import pytest
import torch
from torch.nn import functional as F

from expertize.modeling import SkipTranscoderSpec, TranscoderLayer, TranscoderSpec
from expertize.modeling.sparse_kernels import LinearReluTopK

I, O, L, K = 6, 5, 16, 4
TOL = 1e-5


def make_layer(*, skip: bool = False, selection_bias: bool = False, dtype=torch.float32, seed: int = 0):
    """A tiny transcoder with every parameter (and `b_select`) random: the init zeroes biases and skip paths."""
    spec_cls = SkipTranscoderSpec if skip else TranscoderSpec
    layer = TranscoderLayer(spec_cls(d_in=I, d_out=O, num_latents=L, k=K, selection_bias=selection_bias)).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*layer.parameters(), *([layer.b_select] if selection_bias else [])]:
            t.copy_(torch.randn(t.shape, generator=gen, dtype=dtype))
    return layer.train()


def dense_reference(layer: TranscoderLayer, x: torch.Tensor) -> torch.Tensor:
    """The layer under plain autograd: the code scattered into a dense (T, L) tensor, decoded by a dense product, so
    every gradient goes through dense (T, L) tensors. The K are the largest positive pre-activations (by pre +
    b_select with a selection bias, which only chooses); where fewer than K are positive, zeros fill the code."""
    pre = F.linear(x, layer.W_enc, layer.b_enc)  # (T, L)
    with torch.no_grad():
        bias = layer.b_select if layer.b_select is not None else torch.zeros_like(layer.b_enc)
        index = torch.where(pre > 0, pre + bias, float("-inf")).topk(layer.spec.k, dim=-1).indices  # (T, K)
    z = torch.zeros_like(pre).scatter(-1, index, F.relu(pre).gather(-1, index))  # (T, L)
    out = z @ layer.W_dec + layer.b_dec  # (T, O)
    return out if layer.W_skip is None else out + x @ layer.W_skip.T


def step_grads(layer: TranscoderLayer, fn, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """A training step (MSE to `target`) through `fn`: the output, and the gradients of x and every parameter."""
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = fn(x)
    F.mse_loss(out, target).backward()
    return {"output": out.detach(), "x": x.grad, **{n: p.grad.clone() for n, p in layer.named_parameters()}}


def assert_same_training_gradients(layer: TranscoderLayer, x: torch.Tensor) -> None:
    target = torch.randn(x.shape[0], O, generator=torch.Generator().manual_seed(1), dtype=x.dtype)
    sparse = step_grads(layer, layer, x, target)
    dense = step_grads(layer, lambda v: dense_reference(layer, v), x, target)
    assert sparse.keys() == dense.keys() and {"x", "W_enc", "b_enc", "W_dec", "b_dec"} <= sparse.keys()
    for name in sparse:
        torch.testing.assert_close(sparse[name], dense[name], rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")


def edge_rows(layer: TranscoderLayer) -> torch.Tensor:
    """(5, I) inputs: x = 0 (pre = b_enc: 2 positive latents, tied zeros, the rest negative), a row with no positive
    pre-activation, and 3 random rows. Sets b_enc and W_enc's first column to make it so."""
    with torch.no_grad():
        layer.b_enc.copy_(torch.tensor([1.5, 0.5] + [0.0] * 6 + [-1.0] * (L - 8)))
        layer.W_enc[:, 0] = layer.W_enc[:, 0].abs() + 0.5  # every latent's pre falls as x_0 falls
    negative = torch.zeros(I)
    negative[0] = -100.0
    random = torch.randn(3, I, generator=torch.Generator().manual_seed(2))
    rows = torch.cat([torch.zeros(1, I), negative[None], random])
    return rows.to(layer.W_enc.dtype)


@pytest.mark.parametrize(
    "skip, selection_bias", [(False, False), (False, True), (True, True)], ids=["plain", "selection-bias", "skip"]
)
def test_training_gradients_equal_dense_autograd(skip, selection_bias):
    layer = make_layer(skip=skip, selection_bias=selection_bias)
    assert_same_training_gradients(layer, torch.randn(9, I, generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("selection_bias", [False, True], ids=["plain", "selection-bias"])
def test_rows_with_fewer_than_k_positive_pre_activations(selection_bias):
    layer = make_layer(selection_bias=selection_bias)
    x = edge_rows(layer)
    pre = F.linear(x, layer.W_enc, layer.b_enc).detach()
    assert (pre[:2] > 0).sum(-1).tolist() == [2, 0] and (pre[0] == 0).sum() == 6  # the cases the test claims
    with torch.no_grad():
        code = layer.encode(x)
    assert (code.top_k_weights[:2] > 0).sum(-1).tolist() == [2, 0]  # zeros fill the code, they do not fire
    assert_same_training_gradients(layer, x)


def test_gradcheck_in_float64():
    """Finite differences against the analytic backward, with the selection bias on and an edge row (fewer than K
    positive); the TopK boundary and the ReLU kink are kept farther than gradcheck's step from every input."""
    layer = make_layer(selection_bias=True, dtype=torch.float64, seed=4)
    x = torch.randn(5, I, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        layer.W_enc[:, 0] = layer.W_enc[:, 0].abs() + 0.5
        # Row 0 = (-a, 0, ...): latent l is positive iff a < b_l / W_enc[l, 0]; a between the 2nd and 3rd largest
        # of these thresholds leaves exactly 2 positive.
        thresholds = (layer.b_enc / layer.W_enc[:, 0]).sort(descending=True).values
        x[0] = 0.0
        x[0, 0] = -(thresholds[1] + thresholds[2]) / 2
        pre = F.linear(x, layer.W_enc, layer.b_enc)  # (T, L)
        score = torch.where(pre > 0, pre + layer.b_select, float("-inf")).sort(-1, descending=True).values
    assert (pre[0] > 0).sum() == 2 < K
    gaps = score[:, K - 1] - score[:, K]  # inf: the K-th is the last positive; nan: both are not positive
    assert (gaps.nan_to_num(nan=1.0, posinf=1.0) > 1e-3).all() and (pre.abs() > 1e-3).all()
    names = [n for n, _ in layer.named_parameters()]

    def step(x, *params):
        return torch.func.functional_call(layer, dict(zip(names, params)), (x,))

    params = [p.detach().clone().requires_grad_(True) for p in layer.parameters()]
    assert torch.autograd.gradcheck(step, (x.requires_grad_(True), *params))


def test_the_training_step_runs_the_sparse_kernel():
    """Equal gradients alone would not tell: the dense path has them too. The graph must hold the sparse backward and
    no dense TopK scatter."""
    layer = make_layer(selection_bias=True)
    out = layer(torch.randn(3, I))
    visited, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in visited:
            visited.add(node)
            stack.extend(next_fn for next_fn, _ in node.next_functions)
    seen = {node.name() for node in visited}
    assert any("LinearReluTopK" in name for name in seen), seen
    assert not any(name.startswith(("Topk", "Gather", "Addmm")) for name in seen), seen


def _unmasked_backward(ctx, grad_values, _grad_index, _grad_pre):
    """The kernel's backward without ReLU's mask: right wherever all K selected values are positive."""
    x, weight, index, _ = ctx.saved_tensors
    T, K_ = index.shape
    grad_x = F.embedding_bag(index, weight, per_sample_weights=grad_values, mode="sum")  # (T, I)
    rows = grad_values.reshape(-1, 1) * x.repeat_interleave(K_, 0)  # (T K, I)
    grad_w = torch.zeros_like(weight).index_add_(0, index.reshape(-1), rows)
    grad_b = torch.zeros(weight.shape[0], dtype=weight.dtype).index_add_(0, index.reshape(-1), grad_values.reshape(-1))
    return grad_x, grad_w, grad_b, *[None] * (len(ctx.needs_input_grad) - 3)  # k, selection bias, need_pre


def _scaled_backward(original):
    def backward(ctx, *grads):
        grad_x, grad_w, grad_b, *rest = original(ctx, *grads)
        return (grad_x, grad_w * 1.01, grad_b, *rest)

    return backward


def test_a_wrong_backward_fails_these_checks(monkeypatch):
    """The checks above can fail: a 1 % error in grad W_enc fails the equality and gradcheck; a backward that forgets
    ReLU's mask passes on rows where all K fire and fails on the edge rows."""
    layer = make_layer()
    random_rows = torch.randn(9, I, generator=torch.Generator().manual_seed(3))
    assert_same_training_gradients(layer, random_rows)  # the real kernel passes

    with monkeypatch.context() as patch:
        patch.setattr(LinearReluTopK, "backward", staticmethod(_scaled_backward(LinearReluTopK.backward)))
        with pytest.raises(AssertionError, match="W_enc"):
            assert_same_training_gradients(layer, random_rows)
        layer64 = make_layer(dtype=torch.float64, seed=4)
        x = torch.randn(3, I, dtype=torch.float64)
        params = dict(layer64.named_parameters())
        w = params["W_enc"].detach().clone().requires_grad_(True)
        fn = lambda w_enc: torch.func.functional_call(layer64, {**params, "W_enc": w_enc}, (x,))  # noqa: E731
        assert not torch.autograd.gradcheck(fn, (w,), raise_exception=False)

    with monkeypatch.context() as patch:
        patch.setattr(LinearReluTopK, "backward", staticmethod(_unmasked_backward))
        with torch.no_grad():
            layer.b_enc.add_(3.0)  # every token's K selected latents fire: ReLU's mask is moot
            assert (layer.encode(random_rows).top_k_weights > 0).all()
        assert_same_training_gradients(layer, random_rows)
        with pytest.raises(AssertionError):
            assert_same_training_gradients(layer, edge_rows(layer))
