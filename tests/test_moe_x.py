"""MoE-X layer: router formula, sorted dispatch vs a per-token reference (outputs and gradients), load-balance loss,
the scaled code and interventions, the spec's counts (the paper's) and its own errors, and LoRA on the 3-D experts.
What every kind keeps (round trips, generic errors, code hook edits, ...) is tests/test_kind_contract.py's battery."""

import math

import pytest
import torch
from torch import nn

from expertize.modeling import MoeXLayer, MoeXSpec
from expertize.modeling.moe_x import ROUTER_EPS
from expertize.modeling.sparse_base import ACTIVATIONS
from expertize.modeling.sparse_code import SparseCode
from expertize.modeling.sparse_kernels import sparse_rows_sum
from tests.kinds import assert_same_with_grads, check_spec, randomized

I, O, D, M, K = 6, 5, 7, 5, 2


def _layer(seed: int = 0, **fields) -> MoeXLayer:
    """float64, every parameter random (zero biases would hide bugs)."""
    fields = {"d_in": I, "d_out": O, "d_expert": D, "num_experts": M, "k": K, **fields}
    return randomized(MoeXLayer(MoeXSpec(**fields)), seed)


def _x(T: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randn(T, I, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# -- independent reference: one token at a time, one expert at a time ------------------------------------------------


def reference_score(layer: MoeXLayer, x_t: torch.Tensor, j: int) -> torch.Tensor:
    """Eq. 7 for one token and one expert, written from the paper's definitions."""
    spec = layer.spec
    if spec.router == "switch":
        return (layer.W_router[j] * x_t).sum()
    W = layer.W_enc[j]  # (D, I): D rows, column i holds D samples of N(μ_i, σ_i²)
    mu = W.sum(dim=0) / W.shape[0]
    var = ((W - mu) ** 2).sum(dim=0) / W.shape[0]
    mu_h = (mu * x_t).sum()
    var_h = (var * x_t * x_t).sum()
    if spec.bias_aware_router:
        b = layer.b_enc[j]
        mu_h = mu_h + b.sum() / b.numel()
        var_h = var_h + ((b - b.sum() / b.numel()) ** 2).sum() / b.numel()
    sigma_h = torch.sqrt(var_h + ROUTER_EPS) if spec.sigma_mode == "std" else var_h + ROUTER_EPS
    return -torch.erf(mu_h / (math.sqrt(2.0) * sigma_h))


def reference_expert(layer: MoeXLayer, x_t: torch.Tensor, j: int) -> torch.Tensor:
    """Expert j's hidden code zʲ (D,) for one token."""
    act = ACTIVATIONS[layer.spec.activation]
    h = layer.W_enc[j] @ x_t + (layer.b_enc[j] if layer.b_enc is not None else 0)
    z = act(h)
    if layer.W_up is not None:
        z = z * (layer.W_up[j] @ x_t + (layer.b_up[j] if layer.b_up is not None else 0))
    return z


def reference_forward(layer: MoeXLayer, x: torch.Tensor, ablated_experts=()) -> torch.Tensor:
    spec = layer.spec
    rows = []
    for x_t in x:
        scores = torch.stack([reference_score(layer, x_t, j) for j in range(spec.num_experts)])
        chosen = sorted(range(spec.num_experts), key=lambda j: -float(scores[j].detach()))[: spec.k]
        top = scores[chosen]
        if spec.gate_scaling == "none":
            gates = torch.ones_like(top)
        else:
            gates = torch.exp(top - top.max()) / torch.exp(top - top.max()).sum()
            gates = gates * (spec.k if spec.gate_scaling == "k_softmax" else 1)
        y = layer.b_dec.clone()
        for j, g in zip(chosen, gates):
            if j not in ablated_experts:
                y = y + layer.W_dec[j] @ (g * reference_expert(layer, x_t, j))  # W_dec[j] is (O, D)
        rows.append(y)
    return torch.stack(rows)


VARIANTS = [
    dict(),
    dict(sigma_mode="var_literal"),
    dict(router="switch"),
    dict(expert_bias=True, bias_aware_router=True),
    dict(expert_bias=True, activation="gelu_new"),
    dict(expert_glu=True, activation="silu"),
    dict(expert_glu=True, expert_bias=True, activation="silu", bias_aware_router=True, sigma_mode="var_literal"),
    dict(gate_scaling="none"),
    dict(gate_scaling="k_softmax", k=3),
    dict(k=M),
]
IDS = [
    "paper", "var_literal", "switch", "bias_aware", "gelu_bias", "glu", "glu_bias_all", "gate_none", "k_softmax", "k=M"
]


@pytest.mark.parametrize("sigma_mode", ["std", "var_literal"])
@pytest.mark.parametrize("bias_aware", [False, True])
def test_router_scores_equal_the_formula(sigma_mode, bias_aware):
    layer = _layer(sigma_mode=sigma_mode, expert_bias=bias_aware, bias_aware_router=bias_aware)
    x = _x()
    expected = torch.stack([torch.stack([reference_score(layer, x_t, j) for j in range(M)]) for x_t in x])
    scores = layer.router_scores(x)
    torch.testing.assert_close(scores, expected, rtol=1e-12, atol=1e-12)
    assert scores.abs().max() < 1  # −erf lies in (−1, 1)


def test_sigma_modes_differ_and_router_is_differentiable_in_w_enc():
    layer = _layer()
    x = _x()
    std = layer.router_scores(x)
    layer.spec.sigma_mode = "var_literal"
    assert not torch.allclose(std, layer.router_scores(x))
    layer.spec.sigma_mode = "std"
    std.sum().backward()  # the statistics are not detached (paper §4.3.2)
    assert layer.W_enc.grad.abs().sum() > 0


def test_zero_input_gives_finite_scores():
    layer = _layer()
    scores = layer.router_scores(torch.zeros(3, I, dtype=torch.float64))
    assert torch.isfinite(scores).all() and scores.abs().max() == 0


def test_router_statistics_run_in_float32_for_bf16_inputs():
    layer = _layer().to(torch.bfloat16)
    x = _x().to(torch.bfloat16)
    assert layer.router_scores(x).dtype == torch.float32
    assert layer(x).dtype == torch.bfloat16


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_sorted_dispatch_equals_per_token_reference_with_gradients(variant):
    layer = _layer(**variant)
    assert_same_with_grads(layer, layer, lambda x: reference_forward(layer, x), _x(T=17))
    if variant.get("gate_scaling") != "none":  # softmax gates carry the task gradient into the router
        router_param = "W_router" if variant.get("router") == "switch" else "W_enc"
        assert getattr(layer, router_param).grad.abs().sum() > 0


def test_leading_dims_and_dtype_are_kept():
    layer = _layer()
    x = torch.randn(2, 3, 4, I, dtype=torch.float64)
    out = layer(x)
    assert out.shape == (2, 3, 4, O) and out.dtype == x.dtype
    torch.testing.assert_close(out.view(-1, O), reference_forward(layer, x.view(-1, I)))
    assert layer.encode(x).top_k_index.shape == (2, 3, 4, K * D)


# -- load balance --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("counting", ["top1", "topk"])
@pytest.mark.parametrize("router", ["sparsity", "switch"])
def test_load_balance_loss_matches_hand_computation(counting, router):
    coef = 0.01
    layer = _layer(load_balance_counting=counting, router=router, load_balance_coef=coef, k=3).train()
    x = _x(T=40)
    layer(x)
    scores = layer.router_scores(x).detach()
    T = x.shape[0]
    counts = [0.0] * M
    for t in range(T):
        ranked = sorted(range(M), key=lambda j: -float(scores[t, j]))
        for j in ranked[:1] if counting == "top1" else ranked[:3]:
            counts[j] += 1
    total = sum(counts)  # T (top1) or T·K (topk)
    exp = [[math.exp(scores[t, i]) for i in range(M)] for t in range(T)]
    probs = [[e / sum(row) for e in row] for row in exp]
    P = [sum(probs[t][i] for t in range(T)) / T for i in range(M)]
    expected = coef * M * sum(c / total * p for c, p in zip(counts, P))
    assert layer.aux_loss.item() == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(layer.router_logits.detach(), scores)
    layer.aux_loss.backward()
    grad_param = layer.W_router if router == "switch" else layer.W_enc
    assert grad_param.grad.abs().sum() > 0  # P is differentiable


def test_router_outputs_only_when_wanted():
    layer = _layer().eval()
    layer(_x())
    assert layer.router_logits is None and layer.aux_loss is None
    layer.record_router_outputs = True
    layer(_x())
    assert layer.router_logits.shape == (13, M) and layer.aux_loss.ndim == 0


# -- code, mega-decoder and interventions -----------------------------------------------------------------------


def test_code_is_the_scaled_hidden_code_and_mega_decoder_reproduces_the_output():
    layer = _layer()
    x = _x()
    code = layer.encode(x)
    assert code.top_k_index.shape == code.top_k_weights.shape == (13, K * D)
    routing = layer.route(x)
    for t in range(13):
        for slot in range(K):
            j = int(routing.top_k_index[t, slot])
            block = slice(slot * D, (slot + 1) * D)
            assert code.top_k_index[t, block].tolist() == [layer.unit_index(j, h) for h in range(D)]
            expected = routing.top_k_weights[t, slot] * reference_expert(layer, x[t], j)
            torch.testing.assert_close(code.top_k_weights[t, block], expected)
    assert (code.top_k_weights == 0).any()  # ReLU zeros inside the active blocks
    # y = W_dec_mega z + b_dec (§4.2), through the generic gather path
    torch.testing.assert_close(sparse_rows_sum(code, layer.decoder_rows()) + layer.b_dec, layer(x))
    assert layer.decoder_rows().shape == (M * D, O)
    torch.testing.assert_close(layer.decoder_rows()[layer.unit_index(3, 4)], layer.W_dec[3, :, 4])


def test_steering_a_hidden_unit_adds_its_decoder_column():
    layer = _layer()
    x = _x()
    base = layer(x)
    unit = layer.unit_index(2, 5)
    with layer.intervene(steer={unit: 3.0}):
        steered = layer(x)
    torch.testing.assert_close(steered, base + 3.0 * layer.W_dec[2, :, 5])
    torch.testing.assert_close(layer(x), base)


def test_ablating_experts_drops_their_contribution_without_renormalizing():
    layer = _layer()
    x = _x()
    layer.ablate_experts([1, 3])
    torch.testing.assert_close(layer(x), reference_forward(layer, x, ablated_experts={1, 3}))
    assert not torch.allclose(layer(x), reference_forward(layer, x))
    layer.clear_interventions()
    torch.testing.assert_close(layer(x), reference_forward(layer, x))
    with pytest.raises(ValueError, match=r"expert id\(s\) \[5\] out of range: this layer has 5 experts"):
        layer.ablate_experts([5])
    with pytest.raises(ValueError, match=r"out of range: this layer has 35 units"):
        layer.steer(M * D, 1.0)


def test_code_hook_edits_take_the_dispatched_or_the_gather_path():
    """(In place and by replacement alike for every kind: tests/test_kind_contract.py.)"""
    layer = _layer()
    x = _x()
    # Halving the values (same units) stays on the dispatched path and halves the expert part.
    handle = layer.code_hook.register_forward_hook(lambda m, a, out: out._replace(top_k_weights=out.top_k_weights / 2))
    halved = layer(x)
    handle.remove()
    torch.testing.assert_close(halved, (layer(x) + layer.b_dec) / 2)
    # Rewriting which units fire, in place, takes the generic gather path.
    edited = []

    def move_first_block_to_last_expert(module, args, out):
        out.top_k_index[:, :D] = torch.arange(D) + (M - 1) * D
        edited.append(SparseCode(out.top_k_index.clone(), out.top_k_weights.detach().clone()))

    handle = layer.code_hook.register_forward_hook(move_first_block_to_last_expert)
    moved = layer(x)
    handle.remove()
    torch.testing.assert_close(moved, sparse_rows_sum(edited[0], layer.decoder_rows()) + layer.b_dec)
    assert not torch.allclose(moved, layer(x))


# -- spec ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_spec_counts_parameters_in_every_variant(variant):
    check_spec(MoeXSpec(**{"d_in": I, "d_out": O, "d_expert": D, "num_experts": M, "k": K, **variant}))


def test_counts_match_the_paper_gpt2_small():
    """8 copies of GPT-2 small's MLP (with biases), 2 active: the paper's 180M active parameters (digest §1.7)."""
    spec = MoeXSpec(d_in=768, d_out=768, d_expert=3072, num_experts=8, k=2, expert_bias=True)
    mlp = 768 * 3072 + 3072 + 3072 * 768 + 768
    assert spec.num_parameters() == 8 * (mlp - 768) + 768
    assert spec.active_parameters() == 2 * (mlp - 768) + 768
    assert 124_439_808 + 12 * (spec.active_parameters() - mlp) == pytest.approx(180e6, rel=0.01)  # all 12 layers
    assert spec.flops_per_token() == 2 * 2 * (768 * 3072 + 3072 * 768) + 2 * 2 * 768 * 8 + 768


def test_reset_parameters_gives_a_working_layer():
    """Default: W_dec = 0, so the layer starts as b_dec (distillation starts at FVU 1); 'paper': nn.Linear init."""
    torch.manual_seed(0)
    layer = MoeXLayer(MoeXSpec(d_in=I, d_out=O, d_expert=D, num_experts=M, k=K, expert_bias=True))
    assert layer.b_enc.abs().sum() == 0 and layer.b_dec.abs().sum() == 0 and layer.W_dec.abs().sum() == 0
    assert layer.W_enc.abs().sum() > 0
    x = torch.randn(4, I)
    torch.testing.assert_close(layer(x), layer.b_dec.expand(4, O))
    paper = MoeXLayer(MoeXSpec(d_in=I, d_out=O, d_expert=D, num_experts=M, k=K, decoder_init="paper"))
    assert paper.W_dec.abs().max() <= 1 / D**0.5 and paper.W_dec.abs().sum() > 0
    assert torch.isfinite(paper(x)).all() and paper(x).abs().sum() > 0


# -- PEFT LoRA on the 3-D expert weights ------------------------------------------------------------------------


def test_lora_on_3d_expert_parameters_trains_and_merges():
    peft = pytest.importorskip("peft")

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = _layer(expert_glu=True, activation="silu")

        def forward(self, x):
            return self.mlp(x)

    model = Block()
    x = _x()
    before = model(x).detach()
    config = peft.LoraConfig(r=2, lora_alpha=4, target_parameters=["mlp.W_enc", "mlp.W_up", "mlp.W_dec"])
    lora = peft.get_peft_model(model, config)
    trainable = {n: p for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # (experts, out, in) layout read correctly: A reads the input side, B writes the output side, rank r per expert.
    shapes = sorted((tuple(p.shape) for n, p in trainable.items()))
    assert shapes == sorted([(2 * M, I), (D, 2 * M), (2 * M, I), (D, 2 * M), (2 * M, D), (O, 2 * M)])
    torch.testing.assert_close(lora(x), before)  # B = 0 at init

    optimizer = torch.optim.SGD(trainable.values(), lr=0.1)
    loss = (lora(x) - 1.0).square().mean()
    loss.backward()
    optimizer.step()
    adapted = lora(x).detach()
    assert (adapted - before).abs().max() > 1e-4
    assert isinstance(lora.base_model.model.mlp.get_base_layer(), MoeXLayer)

    merged = lora.merge_and_unload()
    assert isinstance(merged.mlp, MoeXLayer)
    torch.testing.assert_close(merged(x), adapted, rtol=1e-10, atol=1e-10)
