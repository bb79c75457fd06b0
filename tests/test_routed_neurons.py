"""routed_neurons (Secret MoEs): the gathered top-k path against a dense all-neurons reference (float64, outputs and
gradients), k = m equals a dense softmax-gated MLP, interventions against the reference, the paper's counts. What
every kind keeps (round trips, a distillation, the reset guard, bf16, generic errors, ...) is
tests/test_kind_contract.py's battery."""

import pytest
import torch

from expertize.modeling import (
    RoutedNeuronsLayer,
    RoutedNeuronsSpec,
    build_sparse_layer,
    sparse_kernels,
    spec_from_dict,
)
from tests.kinds import assert_same_with_grads, check_spec, randomized
from tests.reference_mumoe import ACTIVATIONS

I, O, M, K = 6, 5, 13, 3


def _spec(**fields) -> RoutedNeuronsSpec:
    return spec_from_dict({"kind": "routed_neurons", "d_in": I, "d_out": O, "num_experts": M, "k": K, **fields})


def _layer(seed: int = 0, **fields) -> RoutedNeuronsLayer:
    """float64, every parameter random (the default init zeroes the output rows, which would hide bugs)."""
    return randomized(build_sparse_layer(_spec(**fields)), seed)


def router_reference(layer: RoutedNeuronsLayer, x: torch.Tensor) -> torch.Tensor:
    """s = W_gate (W_gate_proj x) + b_gate (low rank) or W_gate x + b_gate: (T, I) -> (T, M)."""
    h = x @ layer.W_gate_proj.T if layer.W_gate_proj is not None else x
    return h @ layer.W_gate.T + layer.b_gate


def dense_gates(layer: RoutedNeuronsLayer, x: torch.Tensor) -> torch.Tensor:
    """softmax over the top-k router scores, scattered into a dense (T, M) gate."""
    top, index = router_reference(layer, x).topk(layer.spec.k, dim=-1)
    e = (top - top.amax(-1, keepdim=True)).exp()
    gates = torch.zeros(x.shape[0], layer.spec.num_experts, dtype=x.dtype)
    return gates.scatter(-1, index, e / e.sum(-1, keepdim=True))


def dense_reference(layer: RoutedNeuronsLayer, x: torch.Tensor, gates: torch.Tensor | None = None) -> torch.Tensor:
    """Every one of the M neurons computed densely and weighted by its gate (zero off the top-k): (T, I) -> (T, O)."""
    act = ACTIVATIONS[layer.spec.activation]
    gates = dense_gates(layer, x) if gates is None else gates
    out = (gates * act(x @ layer.W_enc.T + layer.b_enc)) @ layer.W_dec + layer.b_dec
    if layer.W_shared_enc is not None:
        out = out + act(x @ layer.W_shared_enc.T + layer.b_shared_enc) @ layer.W_shared_dec
    return out


VARIANTS = [
    dict(),
    dict(num_shared=4, router_rank=2),
    dict(router_rank=0, activation="silu"),
    dict(router_rank=None, num_shared=2, activation="relu"),
]


def _variant_id(variant: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in variant.items()) or "default"


@pytest.mark.parametrize("chunk", [None, 7], ids=["one-chunk", "chunked"])
@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_gathered_path_equals_dense_reference_with_gradients(variant, chunk, monkeypatch):
    if chunk is not None:  # the forward gathers 7 weights at a time: one token per chunk here
        monkeypatch.setattr(sparse_kernels, "GATHER_CHUNK_ELEMENTS", chunk)
    layer = _layer(**variant)
    x = torch.randn(3, 4, I, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert_same_with_grads(layer, layer, lambda v: dense_reference(layer, v.view(-1, I)).view(3, 4, O), x)


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_k_equal_to_m_is_a_dense_softmax_gated_mlp(variant):
    layer = _layer(k=M, **variant)
    x = torch.randn(10, I, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    gates = router_reference(layer, x).softmax(-1)  # every neuron, softmax over all M scores
    torch.testing.assert_close(layer(x), dense_reference(layer, x, gates), rtol=1e-10, atol=1e-10)


def test_encode_is_topk_ids_and_softmax_weights():
    layer = _layer(num_shared=2)
    x = torch.randn(2, 5, I, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    code = layer.encode(x)
    assert code.top_k_index.shape == code.top_k_weights.shape == (2, 5, K)
    gates = dense_gates(layer, x.view(-1, I))
    dense = torch.zeros(10, M, dtype=torch.float64)
    dense.scatter_(-1, code.top_k_index.view(10, K), code.top_k_weights.view(10, K))
    torch.testing.assert_close(dense, gates)
    torch.testing.assert_close(code.top_k_weights.sum(-1), torch.ones(2, 5, dtype=torch.float64))


def test_ablation_zeroes_the_gate_without_renormalizing():
    layer = _layer(num_shared=2)
    x = torch.randn(8, I, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    index = layer.encode(x).top_k_index
    ablated = sorted({int(index[0, 0]), int(index[1, 1])})
    gates = dense_gates(layer, x)
    gates[:, ablated] = 0
    with torch.no_grad(), layer.intervene(ablate=ablated):
        out = layer(x)
    torch.testing.assert_close(out, dense_reference(layer, x, gates), rtol=1e-10, atol=1e-10)
    assert not torch.allclose(out, layer(x))


def test_steering_adds_lambda_times_the_neuron_output():
    """a_n += λ gives y + λ φ(w_n · x + b_n) u_n, for a selected and an unselected neuron."""
    layer = _layer()
    x = torch.randn(8, I, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    index = layer.encode(x).top_k_index
    unselected = next(n for n in range(M) if not (index == n).any())
    with torch.no_grad():
        base = layer(x)
        for unit in (int(index[0, 0]), unselected):
            with layer.intervene(steer={unit: 2.5}):
                steered = layer(x)
            h = ACTIVATIONS["gelu"](x @ layer.W_enc[unit] + layer.b_enc[unit])  # (T,)
            torch.testing.assert_close(steered, base + 2.5 * h[:, None] * layer.W_dec[unit], rtol=1e-10, atol=1e-10)


def test_code_hook_edits_the_code():
    layer = _layer(num_shared=3)
    x = torch.randn(4, I, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    handle = layer.code_hook.register_forward_hook(
        lambda mod, args, out: out._replace(top_k_weights=out.top_k_weights * 0)
    )
    with torch.no_grad():  # no routed neuron: only the shared neurons and b_dec are left
        shared = ACTIVATIONS["gelu"](x @ layer.W_shared_enc.T + layer.b_shared_enc) @ layer.W_shared_dec
        torch.testing.assert_close(layer(x), shared + layer.b_dec)
    handle.remove()


def test_router_logits_side_channel():
    layer = _layer(router_rank=3).eval()
    x = torch.randn(7, I, dtype=torch.float64)
    layer(x)
    assert layer.router_logits is None and layer.aux_loss is None
    layer.record_router_outputs = True
    layer(x)
    torch.testing.assert_close(layer.router_logits, router_reference(layer, x))
    assert layer.aux_loss is None


def test_initialization():
    layer = build_sparse_layer(_spec(num_shared=4, router_rank=2, k=4))
    assert layer.W_gate_proj.shape == (2, I) and layer.W_gate.shape == (M, 2)
    assert layer.W_dec.abs().sum() == 0 and layer.W_shared_dec.abs().sum() == 0 and layer.b_dec.abs().sum() == 0
    torch.testing.assert_close(layer(torch.randn(3, I)), layer.b_dec.expand(3, O))  # starts as the mean output
    assert 0 < layer.W_enc.abs().max() <= 1 / I**0.5 and 0 < layer.b_enc.abs().max() <= 1 / I**0.5
    assert 0 < layer.W_gate.abs().max() <= 1 / 2**0.5
    paper = build_sparse_layer(_spec(num_shared=4, k=4, decoder_init="paper"))
    assert 0 < paper.W_dec.abs().max() <= 1 / 4**0.5 and 0 < paper.W_shared_dec.abs().max() <= 1 / 4**0.5
    full = build_sparse_layer(_spec(router_rank=0))
    assert full.W_gate_proj is None and full.W_gate.shape == (M, I) and full.W_shared_enc is None


# -- specs -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [_spec(), _spec(num_shared=4), _spec(router_rank=0), _spec(router_rank=None, num_shared=1), _spec(router_rank=20)],
    ids=lambda s: f"r={s.router_rank}-S={s.num_shared}",
)
def test_spec_counts_parameters_in_every_variant(spec):
    check_spec(spec)
    assert spec.active_parameters() < spec.num_parameters()


def test_parameter_and_flop_formulas():
    spec = _spec(num_shared=4, router_rank=2)
    router = I * 2 + 2 * M + M
    assert spec.num_parameters() == router + M * (I + 1 + O) + 4 * (I + 1 + O) + O
    assert spec.active_parameters() == router + K * (I + 1 + O) + 4 * (I + 1 + O) + O
    assert spec.flops_per_token() == 2 * (I * 2 + 2 * M + (K + 4) * (I + O)) + O
    # The paper's Pythia-410m setting: the low-rank router alone costs ~25.9M MACs per token (digest §4).
    big = RoutedNeuronsSpec(d_in=1024, d_out=1024, num_experts=100_000, k=64, num_shared=64, router_rank=256)
    assert (big.flops_per_token() - 1024) // 2 - 128 * 2048 == 25_862_144
