"""μMoE (mumoe_cp, mumoe_tr): entmax15, the factorized forms against materialized experts (float64, outputs and
gradients), the paper's parameter counts and interventions against the reference. What every kind keeps (round
trips, a distillation, the reset guard, bf16, generic errors, ...) is tests/test_kind_contract.py's battery."""

import pytest
import torch

from expertize.conversion.recipe.param_match import match_parameter_count
from expertize.modeling import MuMoECPSpec, MuMoELayer, MuMoETRSpec, build_sparse_layer, entmax15, spec_from_dict
from tests.kinds import assert_same_with_grads, check_spec, randomized
from tests.reference_mumoe import entmax15_reference, entmax15_threshold_bisect, gate_reference, materialize
from tests.reference_mumoe import mumoe_reference

I, O, H, N = 6, 5, 7, 9
KINDS = ["mumoe_cp", "mumoe_tr"]


def _spec(kind: str, **fields):
    defaults = dict(kind=kind, d_in=I, d_out=O, d_hidden=H, num_experts=N, rank=3)
    return spec_from_dict({**defaults, **fields})


def _layer(kind: str, seed: int = 0, **fields) -> MuMoELayer:
    """float64, every parameter random (the paper's zero gate would make a uniform and hide gate bugs)."""
    return randomized(build_sparse_layer(_spec(kind, **fields)), seed)


# -- entmax15 ------------------------------------------------------------------------------------------------------


ENTMAX_INPUTS = {
    "normal": lambda g: torch.randn(64, 11, generator=g, dtype=torch.float64),
    "wide (very sparse)": lambda g: 20 * torch.randn(64, 11, generator=g, dtype=torch.float64),
    "narrow (dense)": lambda g: 0.05 * torch.randn(64, 11, generator=g, dtype=torch.float64),
    "ties": lambda g: torch.randint(-2, 3, (64, 11), generator=g).double(),
    "constant": lambda g: torch.full((3, 7), 4.0, dtype=torch.float64),
    "one expert": lambda g: torch.randn(5, 1, generator=g, dtype=torch.float64),
    "many experts": lambda g: 3 * torch.randn(8, 2000, generator=g, dtype=torch.float64),
}


@pytest.mark.parametrize("name", list(ENTMAX_INPUTS))
def test_entmax15_matches_bisection(name):
    logits = ENTMAX_INPUTS[name](torch.Generator().manual_seed(0))
    p = entmax15(logits)
    tau = entmax15_threshold_bisect(logits)
    expected = (logits / 2 - tau).clamp_min(0) ** 2  # the definition, with τ from bisection
    torch.testing.assert_close(p, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(p.sum(-1), torch.ones(logits.shape[0], dtype=torch.float64), rtol=0, atol=1e-12)
    # Zeros are exact and on the reference's zeros; a value exactly at τ (ties) is 0 here and ~1e-32 by bisection.
    assert torch.equal(p == 0, expected < 1e-20)


def test_entmax15_is_sparse_and_shift_invariant():
    logits = 5 * torch.randn(32, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    p = entmax15(logits)
    assert (p == 0).any() and ((p > 0).sum(-1) >= 1).all()
    torch.testing.assert_close(entmax15(logits + 123.0), p, rtol=0, atol=1e-12)
    # float32 inputs agree with the float64 reference to float32 precision
    torch.testing.assert_close(entmax15(logits.float()), p.float(), rtol=0, atol=1e-6)


def test_entmax15_gradcheck():
    logits = 2 * torch.randn(6, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    logits.requires_grad_(True)
    assert (entmax15(logits) == 0).any(), "the check should cover a sparse output"
    assert torch.autograd.gradcheck(entmax15, (logits,))


def test_entmax15_backward_equals_autograd_of_the_closed_form():
    logits = 3 * torch.randn(40, 13, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    weights = torch.randn(40, 13, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grads = []
    for fn in (entmax15, entmax15_reference):
        x = logits.clone().requires_grad_(True)
        (fn(x) * weights).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)


# -- factorized == materialized experts -------------------------------------------------------------------------


VARIANTS = [
    dict(),
    dict(encoder="glu", activation="silu"),
    dict(form="block"),
    dict(form="block", encoder="glu", activation="silu"),
    dict(form="block", encoder_bias=False, expert_bias=False, activation="relu"),
    dict(encoder_bias=False, expert_bias=False, activation="gelu_new"),
    dict(gate_activation="softmax"),
    dict(gate_norm="none", form="block"),
]


def _variant_id(variant: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in variant.items()) or "default"


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("kind", KINDS)
def test_factorized_equals_materialized_experts_with_gradients(kind, variant):
    layer = _layer(kind, **variant, **({"rank_1": 2, "rank_2": 3} if kind == "mumoe_tr" else {}))
    x = torch.randn(4, 3, I, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    reference = lambda v: mumoe_reference(layer, v.view(-1, I)).view(4, 3, O)  # noqa: E731
    assert_same_with_grads(layer, layer, reference, x, grad_rtol=1e-9)
    if variant.get("gate_activation", "entmax15") == "entmax15":
        a = gate_reference(layer, x.view(-1, I))
        assert (a == 0).any() and (a > 0).sum() > a.shape[0], "the test should mix several experts, with zeros"


@pytest.mark.parametrize("kind", KINDS)
def test_expert_weight_and_bias_are_the_materialized_experts(kind):
    layer = _layer(kind)
    W, beta = materialize(layer.mumoe_out)
    assert W.shape == (N, H, O)
    for n in (0, N - 1):
        torch.testing.assert_close(layer.expert_weight(n), W[n])
        torch.testing.assert_close(layer.mumoe_out.expert_bias(n), beta[n])


# -- interventions and the code ---------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["encoder", "block"])
@pytest.mark.parametrize("kind", KINDS)
def test_ablation_equals_the_layer_without_those_experts(kind, form):
    layer = _layer(kind, form=form)
    x = torch.randn(12, I, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    a = gate_reference(layer, x)
    active = [int(n) for n in a.sum(0).argsort(descending=True)[:2]]  # the two busiest experts
    with torch.no_grad():
        full = layer(x)
        with layer.intervene(ablate=active):
            ablated = layer(x)
        expected = mumoe_reference(layer, x, removed=tuple(active))
    torch.testing.assert_close(ablated, expected, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(ablated, full), "ablating busy experts must change the output"
    torch.testing.assert_close(layer(x), full)  # the context manager restored the layer


@pytest.mark.parametrize("form", ["encoder", "block"])
@pytest.mark.parametrize("kind", KINDS)
def test_steering_adds_lambda_to_the_expert_coefficient(kind, form):
    layer = _layer(kind, form=form)
    x = torch.randn(8, I, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    idle = int(gate_reference(layer, x).sum(0).argmin())
    with torch.no_grad(), layer.intervene(steer={idle: 2.5, 0: -1.0}):
        steered = layer(x)
    torch.testing.assert_close(steered, mumoe_reference(layer, x, steer={idle: 2.5, 0: -1.0}), rtol=1e-10, atol=1e-10)
    if form == "encoder":  # z does not depend on a: the change is λ (W_nᵀ z + β_n) exactly
        layer.clear_interventions()
        z = layer.hidden(x, None)
        W, beta = materialize(layer.mumoe_out)
        with layer.intervene(steer={idle: 2.5}), torch.no_grad():
            expected = mumoe_reference(layer, x) + 2.5 * (z @ W[idle] + beta[idle])
            torch.testing.assert_close(layer(x), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_code_covers_every_expert_with_exact_zeros(kind):
    layer = _layer(kind)
    x = torch.randn(2, 5, I, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    code = layer.encode(x)
    assert code.top_k_index.shape == code.top_k_weights.shape == (2, 5, N)
    assert torch.equal(code.top_k_index, torch.arange(N).expand(2, 5, N))
    torch.testing.assert_close(code.top_k_weights, gate_reference(layer, x.view(-1, I)).view(2, 5, N))
    l0 = (code.top_k_weights > 0).sum(-1).double().mean()  # the trainer's and evaluator's L0
    assert 1 <= l0 < N


@pytest.mark.parametrize("form", ["encoder", "block"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_zero_code_switches_every_expert_off(kind, form):
    layer = _layer(kind, form=form)
    x = torch.randn(2, 5, I, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    zero = layer.code_hook.register_forward_hook(
        lambda mod, args, out: out._replace(top_k_weights=out.top_k_weights * 0)
    )
    with torch.no_grad():  # a = 0 switches every expert off (in both maps of a block): only b_dec is left
        torch.testing.assert_close(layer(x), layer.b_dec.expand(2, 5, O))
    zero.remove()
    assert not torch.allclose(layer(x), layer.b_dec.expand(2, 5, O))


@pytest.mark.parametrize("kind", KINDS)
def test_router_logits_side_channel(kind):
    layer = _layer(kind).eval()
    x = torch.randn(7, I, dtype=torch.float64)
    layer(x)
    assert layer.router_logits is None and layer.aux_loss is None
    layer.record_router_outputs = True
    layer(x)
    assert layer.router_logits.shape == (7, N) and layer.aux_loss is None
    logits = x @ layer.W_gate.T
    variance = logits.var(-1, unbiased=False, keepdim=True)
    normalized = (logits - logits.mean(-1, keepdim=True)) / (variance + 1e-5).sqrt()
    torch.testing.assert_close(layer.router_logits, normalized)  # what entmax sees


# -- init, dtypes ------------------------------------------------------------------------------------------------


def test_paper_initialization():
    torch.manual_seed(0)
    cp = build_sparse_layer(_spec("mumoe_cp", rank=50))
    tr = build_sparse_layer(_spec("mumoe_tr", rank=5, rank_1=4, rank_2=3, form="block"))
    for layer in (cp, tr):
        assert layer.W_gate.abs().sum() == 0 and layer.b_dec.abs().sum() == 0
        code = layer.encode(torch.randn(3, I))  # zero gate: a uniform over the experts
        torch.testing.assert_close(code.top_k_weights, torch.full((3, N), 1 / N))
        x = torch.randn(3, I)
        torch.testing.assert_close(layer(x), layer.b_dec.expand(3, O))  # output map's U_out = 0: starts as b_dec
        assert layer.mumoe_out.U_out.abs().sum() == 0
    assert 0 < cp.mumoe_out.U_in.abs().max() <= 1 / H**0.5 and 0 < cp.mumoe_out.b_in.abs().max() <= 1 / H**0.5
    assert abs(cp.mumoe_out.U_experts.mean().item() - 1) < 0.1  # N(1, 1) over 450 entries
    assert 0 < cp.W_enc.abs().max() <= 1 / I**0.5 and cp.b_enc.abs().sum() == 0
    experts = tr.mumoe_out.U_experts  # (N, R1, R2): rectangular diagonal slices, ones plus noise
    off_diagonal = ~torch.eye(4, 3, dtype=torch.bool)
    assert (experts[:, off_diagonal] == 0).all() and (experts.diagonal(dim1=1, dim2=2) != 0).all()
    assert experts.diagonal(dim1=1, dim2=2).std() > 0.3  # σ = 1 noise: the experts differ
    assert 0 < tr.mumoe_in.U_out.abs().max() <= 1 / (5 * 4) ** 0.5  # the first map keeps the paper's init
    assert 0 < tr.mumoe_in.U_in.abs().max() <= 1 / I**0.5
    paper = build_sparse_layer(_spec("mumoe_tr", rank=5, decoder_init="paper"))  # the from-scratch init
    assert 0 < paper.mumoe_out.U_out.abs().max() <= 1 / (5 * 4) ** 0.5
    same = build_sparse_layer(_spec("mumoe_cp", expert_init_std=0.0))  # σ = 0: one shared map across experts
    torch.testing.assert_close(same.expert_weight(0), same.expert_weight(N - 1))


@pytest.mark.parametrize("kind", KINDS)
def test_the_gate_runs_in_float32_for_bf16_inputs(kind):
    layer = build_sparse_layer(_spec(kind, form="block", encoder="glu")).to(torch.bfloat16)
    assert layer.encode(torch.randn(2, 4, I, dtype=torch.bfloat16)).top_k_weights.dtype == torch.float32


# -- specs -------------------------------------------------------------------------------------------------------


SPECS = [
    _spec("mumoe_cp"),
    _spec("mumoe_cp", form="block", encoder="glu"),
    _spec("mumoe_cp", encoder="glu", encoder_bias=False, expert_bias=False),
    _spec("mumoe_tr"),
    _spec("mumoe_tr", form="block", rank_1=1, rank_2=5),
    _spec("mumoe_tr", form="block", encoder="glu", expert_bias=False, encoder_bias=False),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.form}-{s.encoder}")
def test_spec_counts_every_parameter_as_active_and_grows_with_the_rank(spec):
    check_spec(spec)
    assert spec.active_parameters() == spec.num_parameters()  # dense compute
    counts = [spec_from_dict({**spec.to_dict(), "rank": r}).num_parameters() for r in range(1, 30)]
    assert all(a < b for a, b in zip(counts, counts[1:])), "num_parameters must grow with the rank (matching)"


def test_paper_parameter_counts():
    """GPT-2 blocks (digest §1.9, Table 4: 12 blocks = 57,048,096 CP / 57,417,696 TR, counting a 768+768 input LN
    that we do not have and no output bias, which we have) and the CLIP heads of Table 3."""
    gpt2 = dict(d_in=768, d_out=768, d_hidden=3072, num_experts=256, form="block")
    cp = MuMoECPSpec(rank=556, **gpt2)
    tr = MuMoETRSpec(rank=149, **gpt2)
    assert 12 * (cp.num_parameters() - 768 + 2 * 768) == 57_048_096
    assert 12 * (tr.num_parameters() - 768 + 2 * 768) == 57_417_696
    gate = 64 * 768
    assert MuMoECPSpec(d_in=8, d_out=8, d_hidden=8, num_experts=64, rank=393).map_parameters(768, 1000, True) + gate \
        == 769_521
    assert MuMoETRSpec(d_in=8, d_out=8, d_hidden=8, num_experts=64, rank=102).map_parameters(768, 1000, True) + gate \
        == 771_928
    # Table 5 FLOPs (multiply-accumulates) of one map
    assert cp.map_macs(768, 3072) == 556 * (256 + 768 + 3072)
    assert tr.map_macs(768, 3072) == 4 * 768 * 149 + 4 * 256 * 4 + 4 * 4 * 149 + 4 * 3072 * 149
    assert cp.flops_per_token() == 2 * (768 * 256 + cp.map_macs(768, 3072) + cp.map_macs(3072, 768)) + 768


@pytest.mark.parametrize("kind", KINDS)
def test_rank_matching_is_tight(kind):
    spec_cls = type(_spec(kind))
    assert spec_cls.match_field == "rank"
    fields = dict(d_in=64, d_out=64, d_hidden=172, num_experts=16, encoder="glu")
    target = 40_000
    rank = match_parameter_count(spec_cls, fields, "rank", target)
    count = lambda r: spec_cls(rank=r, **fields).num_parameters()  # noqa: E731
    assert count(rank) <= target < count(rank + 1)


def test_model_card_names_both_kinds_and_cites_the_paper_once(tmp_path):
    from expertize.conversion.publishing.card import CardInputs, write_model_card

    layers = {i: _spec(kind, d_in=32, d_out=32).to_dict() for i, kind in enumerate(KINDS)}
    path = write_model_card(
        tmp_path, CardInputs(base_model="openai-community/gpt2", layers=layers, recipe_summary={}, metrics=None)
    )
    text = path.read_text(encoding="utf-8")
    assert "CPμMoE" in text and "TRμMoE" in text
    assert MuMoECPSpec.citation == MuMoETRSpec.citation and text.count(MuMoECPSpec.citation) == 1
    assert "arXiv:2402.12550" in text
