"""MxD and transcoders: the fast factorized / gathered forms equal explicit references, in float64, outputs and
gradients; the papers' parameter matching; steering and ablation against the formulas; kind facts. What every kind
keeps (spec round trip, errors, code hook, ...) is tests/test_kind_contract.py's battery."""

import pytest
import torch

from expertize.conversion.recipe.param_match import match_parameter_count, mxd_experts_for_transcoder
from expertize.modeling import (
    LAYER_KINDS,
    MlpShape,
    MxdLayer,
    MxdSpec,
    SkipTranscoderSpec,
    TranscoderLayer,
    TranscoderSpec,
)
from tests.kinds import assert_same_with_grads, check_spec, randomized
from tests.reference import (
    mxd_dense,
    mxd_hidden_reference,
    mxd_materialized,
    transcoder_dense,
)

I, O, H, N, K = 6, 5, 7, 11, 3


MXD_VARIANTS = [
    dict(encoder="mlp", activation="gelu"),
    dict(encoder="mlp", activation="gelu_new"),
    dict(encoder="mlp", activation="relu"),
    dict(encoder="glu", activation="silu"),
    dict(encoder="glu", activation="gelu", encoder_bias=False),
]


@pytest.mark.parametrize("variant", MXD_VARIANTS, ids=lambda v: f"{v['encoder']}-{v['activation']}")
def test_mxd_factorized_equals_materialized_experts(variant):
    """Lemma 2: (Cᵀa) * (Dᵀz) + b == Σ_n a_n (D diag(c_n))ᵀ z + b."""
    layer = randomized(MxdLayer(MxdSpec(d_in=I, d_out=O, d_hidden=H, num_experts=N, k=K, **variant)))
    x = torch.randn(4, 5, I, dtype=torch.float64)
    torch.testing.assert_close(layer(x), mxd_materialized(layer, x.view(-1, I)).view(4, 5, O), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant", MXD_VARIANTS, ids=lambda v: f"{v['encoder']}-{v['activation']}")
def test_mxd_gather_path_equals_dense_reference_with_gradients(variant):
    layer = randomized(MxdLayer(MxdSpec(d_in=I, d_out=O, d_hidden=H, num_experts=N, k=K, **variant)))
    assert_same_with_grads(layer, layer, lambda x: mxd_dense(layer, x), torch.randn(9, I, dtype=torch.float64))


@pytest.mark.parametrize("variant", MXD_VARIANTS, ids=lambda v: f"{v['encoder']}-{v['activation']}")
def test_mxd_hidden_uses_the_named_activation(variant):
    layer = randomized(MxdLayer(MxdSpec(d_in=I, d_out=O, d_hidden=H, num_experts=N, k=K, **variant)))
    x = torch.randn(9, I, dtype=torch.float64)
    torch.testing.assert_close(layer.hidden(x), mxd_hidden_reference(layer, x), rtol=1e-10, atol=1e-10)


def test_mxd_expert_weight_is_d_diag_c():
    layer = randomized(MxdLayer(MxdSpec(d_in=I, d_out=O, d_hidden=H, num_experts=N, k=K)))
    torch.testing.assert_close(layer.expert_weight(3), layer.W_dec @ torch.diag(layer.W_experts[3]))


@pytest.mark.parametrize("skip", [False, True])
def test_transcoder_gather_path_equals_dense_reference_with_gradients(skip):
    spec_cls = SkipTranscoderSpec if skip else TranscoderSpec
    layer = randomized(TranscoderLayer(spec_cls(d_in=I, d_out=O, num_latents=N, k=K)))
    assert_same_with_grads(layer, layer, lambda x: transcoder_dense(layer, x), torch.randn(9, I, dtype=torch.float64))


def test_paper_initialization():
    mxd = MxdLayer(MxdSpec(d_in=I, d_out=O, d_hidden=H, num_experts=N, k=K))
    assert mxd.W_dec.abs().sum() == 0 and mxd.b_gate.abs().sum() == 0 and mxd.W_experts.abs().sum() > 0
    x = torch.randn(3, I)
    torch.testing.assert_close(mxd(x), mxd.b_dec.expand(3, O))  # D = 0: the layer starts as its output bias
    skip = TranscoderLayer(SkipTranscoderSpec(d_in=I, d_out=O, num_latents=N, k=K))
    assert skip.W_skip.abs().sum() == 0 and skip.W_dec.abs().sum() == 0
    plain = TranscoderLayer(TranscoderSpec(d_in=I, d_out=O, num_latents=N, k=K))
    assert plain.W_skip is None and plain.W_dec.abs().sum() > 0


@pytest.mark.parametrize("variant", MXD_VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_mxd_counts_parameters_in_every_variant(variant):
    spec = MxdSpec(d_in=I, d_out=O, d_hidden=H, num_experts=N, k=K, **variant)
    check_spec(spec)
    assert spec.active_parameters() < spec.num_parameters()


def test_parameter_matching_reproduces_mxd_paper_table_2():
    paper = dict(convention="paper")
    assert mxd_experts_for_transcoder(768, 768, 3072, 32, **paper) == 21_490  # GPT-2
    assert mxd_experts_for_transcoder(1024, 1024, 4096, 32, **paper) == 28_658  # Pythia-410m
    assert mxd_experts_for_transcoder(2048, 2048, 8192, 32, **paper) == 57_330  # Pythia-1.4b
    assert mxd_experts_for_transcoder(3072, 3072, 8192, 32, encoder="glu", **paper) == 86_015  # Llama-3.2-3B


@pytest.mark.parametrize("encoder", ["mlp", "glu"])
def test_exact_parameter_matching_is_tight(encoder):
    n = mxd_experts_for_transcoder(64, 64, 172, 8, encoder=encoder)
    budget = TranscoderSpec(d_in=64, d_out=64, num_latents=8 * 64, k=1).num_parameters()
    count = lambda n: MxdSpec(d_in=64, d_out=64, d_hidden=172, num_experts=n, k=1, encoder=encoder).num_parameters()
    assert count(n) <= budget < count(n + 1)


@pytest.mark.parametrize("encoder", ["mlp", "glu"])
def test_generic_parameter_matching_agrees_with_mxd_closed_form(encoder):
    budget = TranscoderSpec(d_in=64, d_out=64, num_latents=8 * 64, k=1).num_parameters()
    fields = dict(d_in=64, d_out=64, d_hidden=172, k=4, encoder=encoder)
    assert match_parameter_count(MxdSpec, fields, "num_experts", budget) == mxd_experts_for_transcoder(
        64, 64, 172, 8, encoder=encoder
    )


def test_generic_parameter_matching_steps_down_to_a_valid_value():
    """Values the spec rejects (here: N < K near a tiny budget) are skipped, and an impossible budget says so."""
    fields = dict(d_in=8, d_out=8, d_hidden=4, k=3)
    one = MxdSpec(num_experts=1, k=1, d_in=8, d_out=8, d_hidden=4).num_parameters()
    per_expert = 8 + 8 + 1
    with pytest.raises(ValueError, match="no valid num_experts"):
        match_parameter_count(MxdSpec, fields, "num_experts", one + per_expert)  # fits N = 2 < K = 3 only
    assert match_parameter_count(MxdSpec, fields, "num_experts", one + 5 * per_expert) == 6
    with pytest.raises(ValueError, match="raise the expansion factor"):
        match_parameter_count(MxdSpec, fields, "num_experts", one - 1)


def test_steering_adds_lambda_times_expert_output():
    """The paper's steering a_n += λ after TopK gives y + λ c_n * (Dᵀz), whether or not n was selected."""
    layer = randomized(MxdLayer(MxdSpec(d_in=I, d_out=O, d_hidden=H, num_experts=N, k=K)))
    x = torch.randn(8, I, dtype=torch.float64)
    base = layer(x)
    selected = layer.encode(x).top_k_index
    for unit in (int(selected[0, 0]), N - 1):
        with layer.intervene(steer={unit: 2.5}):
            steered = layer(x)
        expected = base + 2.5 * layer.W_experts[unit] * (layer.hidden(x) @ layer.W_dec)
        torch.testing.assert_close(steered, expected)
    torch.testing.assert_close(layer(x), base)  # the context manager restored the layer


def test_ablation_zeroes_selected_experts_only():
    layer = randomized(MxdLayer(MxdSpec(d_in=I, d_out=O, d_hidden=H, num_experts=N, k=K)))
    x = torch.randn(8, I, dtype=torch.float64)
    code = layer.encode(x)
    ablated = {int(code.top_k_index[0, 0]), int(code.top_k_index[1, 1])}
    layer.ablate(ablated)
    weights = torch.where(torch.isin(code.top_k_index, torch.tensor(sorted(ablated))), 0.0, code.top_k_weights)
    a = torch.zeros(8, N, dtype=torch.float64).scatter(-1, code.top_k_index, weights)
    torch.testing.assert_close(layer(x), (a @ layer.W_experts) * (layer.hidden(x) @ layer.W_dec) + layer.b_dec)
    layer.clear_interventions()
    torch.testing.assert_close(layer(x), mxd_dense(layer, x))


def test_transcoder_code_is_relu_topk_and_a_zero_code_leaves_the_bias():
    layer = randomized(TranscoderLayer(TranscoderSpec(d_in=I, d_out=O, num_latents=N, k=K)))
    x = torch.randn(4, I, dtype=torch.float64)
    code = layer.encode(x)
    assert code.top_k_index.shape == (4, K) and (code.top_k_weights >= 0).all()
    handle = layer.code_hook.register_forward_hook(lambda mod, args, out: out._replace(top_k_weights=out.top_k_weights * 0))
    torch.testing.assert_close(layer(x), layer.b_dec.expand(4, O))
    handle.remove()


def test_random_k_draws_k_in_paper_range_only_in_training():
    torch.manual_seed(0)
    layer = MxdLayer(MxdSpec(d_in=I, d_out=O, d_hidden=H, num_experts=40, k=8, random_k=True))
    x = torch.randn(2, I)
    assert layer.eval().encode(x).top_k_index.shape[-1] == 8
    layer.train()
    ks = {layer.encode(x).top_k_index.shape[-1] for _ in range(200)}
    assert ks == set(range(4, 13))


def test_unit_norm_experts():
    layer = MxdLayer(MxdSpec(d_in=I, d_out=O, d_hidden=H, num_experts=N, k=K, unit_norm_experts=True))
    torch.testing.assert_close(layer.W_experts.norm(dim=-1), torch.ones(N))
    layer.W_experts.grad = torch.randn(N, O)
    layer.project_expert_grads_()
    torch.testing.assert_close((layer.W_experts.grad * layer.W_experts).sum(-1), torch.zeros(N), atol=1e-6, rtol=0)


# -- kind facts (that every kind declares them: tests/test_kind_contract.py) ------------------------------------------


def test_kind_facts_that_differ_between_kinds():
    assert (TranscoderSpec.unit_name, TranscoderSpec.units_field) == ("latent", "num_latents")
    assert (MxdSpec.unit_name, MxdSpec.units_field, MxdSpec.size_field()) == ("expert", "num_experts", "num_experts")
    assert LAYER_KINDS["mumoe_cp"][0].size_field() == "rank" and LAYER_KINDS["monet_hd"][0].size_field() == "d_hidden"
    assert LAYER_KINDS["mumoe_cp"][0].citation == LAYER_KINDS["mumoe_tr"][0].citation  # one paper, two kinds
    assert [k for k, (s, _) in LAYER_KINDS.items() if "paper" in s.match_conventions] == ["mxd"]
    assert [k for k, (s, _) in LAYER_KINDS.items() if "split" in s.init_modes] == ["moe_x"]


def test_moe_x_experts_mirror_the_dense_mlp():
    moe_x = LAYER_KINDS["moe_x"][0]
    gelu, gated = MlpShape(16, 64, "gelu_new", False), MlpShape(16, 64, "silu", True)
    assert moe_x.mlp_defaults(gelu, init="split", num_units=8) == {
        "d_expert": 8, "expert_glu": False, "expert_bias": True, "gate_scaling": "k_softmax", "activation": "gelu_new"}
    assert moe_x.mlp_defaults(gated, init="copy", num_units=8)["d_expert"] == 64
    assert moe_x.mlp_defaults(gated, init="default")["d_expert"] == 8  # M: the spec's default 8 when not given
    assert moe_x.mlp_defaults(gated)["activation"] == "relu"  # MoE-X's own activation when not upcycled
    # MxD's dense hidden code: half the MLP's width (docs/results/code_share.md), not the paper's full width
    assert MxdSpec.mlp_defaults(gated) == {"d_hidden": 32, "encoder": "glu", "activation": "silu"}
