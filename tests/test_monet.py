"""Monet-HD / Monet-VD: factorized forward == materialized experts (outputs and gradients, float64), exact product-
expert masking, quantile routing, auxiliary losses, the paper's counts, and the recipe's hidden-width error. What
every kind keeps (round trips, a distillation, generic errors, dtypes, ...) is tests/test_kind_contract.py's battery."""

import dataclasses
import math

import pytest
import torch

from expertize.conversion.recipe.param_match import match_parameter_count
from expertize.conversion.recipe import RecipeError, recipe_from_dict
from expertize.conversion.upcycle import upcycle
from expertize.modeling import MonetHDSpec, MonetRouting, MonetVDSpec, build_sparse_layer
from tests import reference_monet as ref
from tests.conftest import tiny_base_model, tiny_tokenizer, write_corpus
from tests.kinds import assert_same_with_grads, check_spec
from tests.kinds import randomized as random_parameters

I, O, S, R = 6, 8, 4, 3  # d_in, d_out, sub-experts per side (N = 16), heads
N = S * S
SPECS = {"hd": MonetHDSpec, "vd": MonetVDSpec}


def make(kind: str = "hd", **fields):
    spec = SPECS[kind](**{"d_in": I, "d_out": O, "d_hidden": 16, "num_experts": N, "k": 2, "num_heads": R, **fields})
    return build_sparse_layer(spec)


def randomized(layer, seed: int = 0):
    """float64, every parameter random (the init's zero biases would hide bugs), running statistics off (0, 1)."""
    random_parameters(layer, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in layer.named_buffers():
            if name.startswith("running_mean"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen, dtype=buffer.dtype))
            else:
                buffer.copy_(torch.rand(buffer.shape, generator=gen, dtype=buffer.dtype) * 5 + 1)
    return layer


def tokens(n: int = 12, d: int = I, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


VARIANTS = [
    ("hd", dict(routing="quantile"), True),
    ("hd", dict(routing="quantile"), False),
    ("hd", dict(routing="topk", activation="gelu_new"), True),
    ("vd", dict(routing="quantile"), True),
    ("vd", dict(routing="quantile", activation="silu"), False),
    ("vd", dict(routing="topk", k=3), True),
]
VARIANT_IDS = [f"{kind}-{fields['routing']}-{'train' if train else 'eval'}" for kind, fields, train in VARIANTS]


# -- the factorized forward equals the explicit experts ----------------------------------------------------------


@pytest.mark.parametrize("kind, fields, training", VARIANTS, ids=VARIANT_IDS)
def test_factorized_forward_equals_materialized_experts_with_gradients(kind, fields, training):
    layer = randomized(make(kind, **fields)).train(training)
    x = tokens()
    assert_same_with_grads(layer, layer, lambda x: ref.materialized(layer, x, training), x)


@pytest.mark.parametrize("kind, fields, training", VARIANTS, ids=VARIANT_IDS)
def test_code_lists_each_active_product_expert_once_with_its_head_summed_gate(kind, fields, training):
    layer = randomized(make(kind, **fields)).train(training)
    x = tokens(40)
    index, weights = layer.encode(x)
    G = ref.product_gates(*ref.gates(layer, x, training))  # (T, N)
    dense = torch.zeros_like(G).scatter_add(-1, index, weights)
    torch.testing.assert_close(dense, G, rtol=1e-12, atol=1e-12)
    active = weights > 0
    assert (active.sum(-1) == (G > 0).sum(-1)).all()  # each active expert listed once
    assert (weights[:, :-1] >= weights[:, 1:]).all()  # by weight, zero padding last
    assert index.shape[-1] == int((G > 0).sum(-1).max())  # as wide as the widest token
    assert torch.allclose(weights.sum(-1), torch.full((40,), float(R), dtype=weights.dtype))  # Σ_ij G_ij = R heads
    if fields["routing"] == "topk":
        assert active.sum(-1).max() <= R * layer.spec.k**2


def test_code_keeps_leading_dimensions():
    layer = make("vd", routing="topk").eval()
    index, weights = layer.encode(torch.randn(2, 5, I))
    assert index.shape[:2] == weights.shape[:2] == (2, 5) and index.dtype == torch.int64


# -- masking, steering, code edits -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hd", "vd"])
def test_ablating_product_experts_removes_exactly_those_experts(kind):
    layer = randomized(make(kind)).eval()
    x = tokens(20)
    index, weights = layer.encode(x)
    e0, e1 = int(index[0, 0]), int(index[1, 1])  # experts some tokens route to
    i0, j0 = layer.split_expert_id(e0)
    assert (i0, j0) == divmod(e0, S)
    removed = {e0, e1}
    layer.ablate(removed)
    assert_same_with_grads(layer, layer, lambda x: ref.materialized(layer, x, False, removed=removed), x)
    # ... which is not the same as dropping sub-expert i0 (all (i0, j)) or j0 (all (i, j0)).
    masked = layer(x).detach()
    for whole in ([i0 * S + j for j in range(S)], [i * S + j0 for i in range(S)]):
        assert not torch.allclose(masked, ref.materialized(layer, x, False, removed=set(whole) | removed).detach())
    layer.clear_interventions()
    torch.testing.assert_close(layer(x), ref.materialized(layer, x, False), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["hd", "vd"])
def test_ablation_leaves_other_experts_and_tokens_untouched(kind):
    layer = randomized(make(kind, num_experts=64, k=1)).eval()  # sparser: 8 sub-experts per side
    x = tokens(20)
    index, weights = layer.encode(x)
    base = layer(x).detach()
    G = ref.product_gates(*ref.gates(layer, x, False))
    idle = int((G[0] == 0).nonzero()[0])  # an expert token 0 does not use (eval routing is per token)
    with layer.intervene(ablate=[idle]):
        torch.testing.assert_close(layer(x[:1]), base[:1], rtol=1e-10, atol=1e-10)
    e = int(index[0, 0])
    untouched = G[:, e] == 0  # tokens that do not route to e
    with layer.intervene(ablate=[e]):
        out = layer(x).detach()
    torch.testing.assert_close(out[untouched], base[untouched], rtol=1e-10, atol=1e-10)
    expected = base - G[:, e, None] * ref.expert_outputs(layer, x)[:, e].detach()  # y minus G_e E_e(x)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    with layer.intervene(ablate=index[3][weights[3] > 0].tolist()):  # every expert of token 3: only b_dec is left
        torch.testing.assert_close(layer(x)[3], layer.b_dec)


@pytest.mark.parametrize("kind", ["hd", "vd"])
def test_steering_adds_lambda_times_the_product_expert(kind):
    layer = randomized(make(kind)).eval()
    x = tokens(10)
    base = layer(x).detach()
    E = ref.expert_outputs(layer, x).detach()  # (T, N, O)
    used = int(layer.encode(x).top_k_index[0, 0])
    for unit in (used, N - 1):
        with layer.intervene(steer={unit: 2.5}):
            torch.testing.assert_close(layer(x), base + 2.5 * E[:, unit], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer(x), base)


# -- routing ------------------------------------------------------------------------------------------------------


def test_quantile_selection_uses_batch_statistics_in_training_and_running_ones_in_eval():
    layer = randomized(make("hd", num_experts=64, k=2))  # S = 8 sub-experts per side: Φ⁻¹(1 - 2/8) ≈ 0.674
    S8 = 8
    bn = torch.nn.BatchNorm1d(R, affine=False, momentum=layer.spec.bn_momentum, eps=layer.spec.bn_eps).double()
    bn.running_mean.copy_(layer.running_mean1)
    bn.running_var.copy_(layer.running_var1)
    x = tokens(30)
    z = ref.router_logits(layer, x, 1).detach()
    routing = layer.train().route(x)
    normalized = bn.train()(z.transpose(1, 2).reshape(-1, R)).view(30, S8, R).transpose(1, 2)  # (T, R, S)
    sigma = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - 2 / S8)).item()
    assert layer.quantile_threshold == pytest.approx(sigma, abs=1e-6)
    threshold = torch.minimum(normalized.max(-1, keepdim=True).values, torch.tensor(sigma, dtype=z.dtype))
    assert torch.equal(routing.gates1 > 0, normalized >= threshold)
    assert ((routing.gates1 > 0).sum(-1) >= 1).all()  # the row max is always kept
    # The running statistics moved exactly like torch's BatchNorm1d on the same (T·S, R) logits.
    torch.testing.assert_close(layer.running_mean1, bn.running_mean)
    torch.testing.assert_close(layer.running_var1, bn.running_var)

    # Eval: the running statistics, so a token's gates do not depend on the rest of its batch, and nothing moves.
    layer.eval()
    before = layer.running_mean1.clone()
    full = layer.route(x).gates1
    torch.testing.assert_close(layer.route(x[:3]).gates1, full[:3])
    assert torch.equal(layer.running_mean1, before)
    # Training: the batch decides; other tokens ten times larger shrink token t's normalized logits below Φ⁻¹.
    layer.train()
    counts = (layer.route(x).gates1 > 0).sum(-1)  # (T, R)
    t = int(counts.sum(-1).argmax())
    assert counts[t].sum() > R  # token t has more than one sub-expert in some head...
    crowd = 10 * x
    crowd[t] = x[t]
    assert ((layer.route(crowd).gates1[t] > 0).sum(-1) == 1).all()  # ...and only its row max in this batch


def test_quantile_routing_selects_about_k_per_head_on_gaussian_logits():
    spec = MonetHDSpec(d_in=64, d_out=8, d_hidden=32, num_experts=32 * 32, k=4, num_heads=4)
    layer = build_sparse_layer(spec).train()
    with torch.no_grad():  # unit-norm router rows: each logit of x ~ N(0, I) is N(0, 1)
        layer.W_router1.div_(layer.W_router1.norm(dim=-1, keepdim=True))
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(0))
    counts = (layer.route(x).gates1 > 0).sum(-1).double()  # (T, R)
    # E[count] = 32·P(Z ≥ Φ⁻¹(1 - 4/32)) = 4, plus the rare rows that keep only their max (P ≈ (7/8)^32 = 1.4%).
    assert counts.mean().item() == pytest.approx(4.0, abs=0.15)
    assert counts.min() >= 1 and counts.max() > 4  # adaptive, not a fixed k


def test_topk_routing_selects_exactly_k_and_needs_no_statistics():
    layer = make("vd", routing="topk", k=3)
    assert not dict(layer.named_buffers())
    routing = layer.train().route(torch.randn(20, I))
    assert ((routing.gates1 > 0).sum(-1) == 3).all() and ((routing.gates2 > 0).sum(-1) == 3).all()
    torch.testing.assert_close(routing.gates1.sum(-1), torch.ones(20, R))


def test_k_equal_to_sub_experts_selects_all():
    layer = make("hd", k=S).eval()
    assert layer.quantile_threshold == -math.inf
    assert (layer.route(torch.randn(7, I)).gates1 > 0).all()


# -- auxiliary losses ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hd", "vd"])
def test_aux_loss_is_the_weighted_paper_losses(kind):
    layer = randomized(make(kind, uniformity_coef=1e-3, ambiguity_coef=5e-3)).train()
    x = tokens(25)
    g1, g2 = ref.gates(layer, x, training=True)
    layer(x)
    eps = 1e-6
    # Eq. 16, with ĝ averaged over the batch (log of a per-token ĝ would be -inf).
    uniformity = sum(
        -1 / (2 * R * S) * torch.log(g.mean(0)[r, s] + eps) for g in (g1, g2) for r in range(R) for s in range(S)
    )
    # Eq. 17, averaged over tokens.
    ambiguity = torch.stack(
        [sum(1 / (2 * R) * (1 - g[t, r].max()) for g in (g1, g2) for r in range(R)) for t in range(25)]
    ).mean()
    torch.testing.assert_close(layer.aux_loss, 1e-3 * uniformity + 5e-3 * ambiguity, rtol=1e-10, atol=1e-12)
    logits = torch.cat([ref.router_logits(layer, x, 1).flatten(1), ref.router_logits(layer, x, 2).flatten(1)], -1)
    torch.testing.assert_close(layer.router_logits, logits)  # (T, 2·R·S): [router 1 | router 2], head-major
    layer.aux_loss.backward()
    assert layer.W_router1.grad.abs().sum() > 0 and layer.W_router2.grad.abs().sum() > 0


def test_uniformity_is_log_s_for_uniform_routing_and_larger_otherwise():
    layer = make("hd")
    uniform = torch.full((5, R, S), 1 / S)
    uniformity, ambiguity = layer.router_losses(MonetRouting(uniform, uniform, uniform, uniform))
    assert uniformity.item() == pytest.approx(math.log(S), abs=1e-4)
    assert ambiguity.item() == pytest.approx(1 - 1 / S)
    one_hot = torch.zeros(5, R, S)
    one_hot[..., 0] = 1
    uniformity, ambiguity = layer.router_losses(MonetRouting(one_hot, one_hot, one_hot, one_hot))
    assert uniformity.item() > math.log(S) + 5 and ambiguity.item() == 0


def test_aux_loss_only_when_training_or_asked():
    layer = make("hd").eval()
    layer(torch.randn(4, I))
    assert layer.aux_loss is None and layer.router_logits is None
    layer.record_router_outputs = True
    layer(torch.randn(4, I))
    assert layer.aux_loss is not None and layer.router_logits.shape == (4, 2 * R * S)


# -- spec, counts, init, dtype ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hd", "vd"])
@pytest.mark.parametrize("routing", ["quantile", "topk"])
def test_spec_counts_sub_experts_and_the_parameters_heads_reach(kind, routing):
    spec = SPECS[kind](d_in=I, d_out=O, d_hidden=24, num_experts=36, k=2, num_heads=2, routing=routing)
    check_spec(spec)
    layer = build_sparse_layer(spec)
    assert spec.num_sub_experts == 6 and spec.expert_dim == 4
    assert spec.active_parameters() < spec.num_parameters() and spec.flops_per_token() > 0  # heads reach 4 of 6
    every = dataclasses.replace(spec, num_heads=3)  # 3 heads x k = 2 can reach all 6 sub-experts per side
    assert every.active_parameters() == every.num_parameters()
    assert layer.num_units == 36


@pytest.mark.parametrize("spec_cls", [MonetHDSpec, MonetVDSpec])
def test_parameter_count_matches_the_paper_model(spec_cls):
    """Monet-1.4B: d = 2048, m = 16, √N = 512, 8 heads: 34,611,200 expert parameters per layer for HD and VD alike
    (App. A.2), plus 2·d·H·√N = 4d² router parameters (shared by 4 layers in the paper, per layer here)."""
    spec = spec_cls(d_in=2048, d_out=2048, d_hidden=512 * 16, num_experts=512**2, k=8, num_heads=8)
    router, b_dec = 2 * 2048 * 8 * 512, 2048
    assert router == 4 * 2048**2
    assert spec.num_parameters() - router - b_dec == 34_611_200


@pytest.mark.parametrize("spec_cls", [MonetHDSpec, MonetVDSpec])
def test_parameter_matching_searches_the_hidden_width(spec_cls):
    assert spec_cls.match_field == "d_hidden"
    fields = dict(d_in=32, d_out=32, num_experts=16, k=2, num_heads=2)
    target = 20_000
    d_hidden = match_parameter_count(spec_cls, fields, "d_hidden", target)
    spec = spec_cls(**fields, d_hidden=d_hidden)  # a valid width (a multiple of 4, or of 8 for VD)
    step = spec.hidden_step
    assert spec.num_parameters() <= target < spec_cls(**fields, d_hidden=d_hidden + step).num_parameters()


@pytest.mark.parametrize("kind", ["hd", "vd"])
def test_initialization(kind):
    layer = make(kind)
    assert layer.b_dec.abs().sum() == 0
    zero = ("b_up", "b_experts", "W_down")  # zero down projections: the layer starts as its output bias b_dec
    assert all(p.abs().sum() == 0 for n, p in layer.named_parameters() if n.startswith(zero))
    assert all(p.abs().sum() > 0 for n, p in layer.named_parameters() if n.startswith(("W_router", "W_up")))
    x = torch.randn(5, I)
    torch.testing.assert_close(layer(x), layer.b_dec.expand(5, O))
    layer.train()(torch.randn(16, I) * 3 + 1)
    assert not torch.equal(layer.running_mean1, torch.zeros(R))
    layer.reset_parameters()
    assert torch.equal(layer.running_mean1, torch.zeros(R)) and torch.equal(layer.running_var2, torch.ones(R))


def test_spec_normalizes_activation_alias_and_integer_coefficients():
    spec = MonetHDSpec(d_in=8, d_out=8, d_hidden=16, num_experts=16, k=2, activation="swish", uniformity_coef=0)
    assert spec.activation == "silu" and spec.uniformity_coef == 0.0 and isinstance(spec.uniformity_coef, float)


# -- the recipe -------------------------------------------------------------------------------------------------------


def _recipe(tmp_path, layer: dict) -> dict:
    base = tmp_path / "base"
    if not base.exists():
        tiny_base_model("llama").save_pretrained(base)
        tiny_tokenizer().save_pretrained(base)
    return {
        "base_model": str(base),
        "layers": [0, 1],
        "layer": layer,
        "data": {"source": "text", "paths": [str(write_corpus(tmp_path / "corpus.txt", 600))], "context_length": 16,
                 "train_tokens": 8192, "eval_tokens": 512, "eval_fraction": 0.1},
        "train": {"lr": 3e-3, "warmup_steps": 4, "tokens_per_step": 256, "shuffle_buffer_tokens": 1024,
                  "capture_batch_sequences": 16, "checkpoint_every": 0, "log_every": 4, "seed": 3, "device": "cpu"},
        "eval": {"batch_sequences": 8, "generation_prompts": 2, "prompt_tokens": 3, "continuation_tokens": 4},
        "output_dir": str(tmp_path / "run"),
    }


def test_recipe_names_the_hidden_width_it_cannot_split(tmp_path):
    layer = {"kind": "monet_vd", "num_experts": 16, "k": 2}  # d_hidden defaults to the base MLP's 37
    with pytest.raises(RecipeError, match=r"layer.d_hidden=37 must be a multiple of 8"):
        upcycle(recipe_from_dict(_recipe(tmp_path, layer)), progress=False)
