"""μMoE (mumoe_cp, mumoe_tr): entmax15, the factorized forms against materialized experts (float64, outputs and
gradients), the paper's parameter counts, interventions, remote-code round trip and a short distillation."""

import json

import pytest
import torch

from expertize.conversion.recipe.param_match import match_parameter_count
from expertize.conversion.recipe import recipe_from_dict
from expertize.conversion.surgery.splice import splice
from expertize.conversion.upcycle import upcycle
from expertize.modeling import MuMoECPSpec, MuMoELayer, MuMoETRSpec, build_sparse_layer, entmax15, spec_from_dict
from tests.conftest import D_HIDDEN, D_MODEL, check_remote_roundtrip, tiny_base_model
from tests.reference_mumoe import entmax15_reference, entmax15_threshold_bisect, gate_reference, materialize
from tests.reference_mumoe import mumoe_reference

I, O, H, N = 6, 5, 7, 9
KINDS = ["mumoe_cp", "mumoe_tr"]


def _spec(kind: str, **fields):
    defaults = dict(kind=kind, d_in=I, d_out=O, d_hidden=H, num_experts=N, rank=3)
    return spec_from_dict({**defaults, **fields})


def _randomize(layer: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """float64, every parameter random (the paper's zero gate would make a uniform and hide gate bugs)."""
    gen = torch.Generator().manual_seed(seed)
    layer.double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return layer


def _layer(kind: str, seed: int = 0, **fields) -> MuMoELayer:
    return _randomize(build_sparse_layer(_spec(kind, **fields)), seed)


def _outputs_and_grads(layer, fn, x):
    x = x.clone().requires_grad_(True)
    layer.zero_grad()
    out = fn(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


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
    fast = _outputs_and_grads(layer, layer, x)
    slow = _outputs_and_grads(layer, lambda v: mumoe_reference(layer, v.view(-1, I)).view(4, 3, O), x)
    torch.testing.assert_close(fast[0], slow[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fast[1], slow[1], rtol=1e-10, atol=1e-10)
    for name in fast[2]:
        torch.testing.assert_close(fast[2][name], slow[2][name], rtol=1e-9, atol=1e-10, msg=f"grad of {name}")
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
def test_code_hook_exposes_and_edits_the_code(kind, form):
    layer = _layer(kind, form=form)
    x = torch.randn(2, 5, I, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    seen = []
    handle = layer.code_hook.register_forward_hook(lambda mod, args, out: seen.append(out))
    layer(x)
    handle.remove()
    assert len(seen) == 1 and seen[0].top_k_weights.shape == (2, 5, N)  # the input's leading shape
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


@pytest.mark.parametrize("form", ["encoder", "block"])
@pytest.mark.parametrize("kind", KINDS)
def test_reset_parameters_never_touches_loaded_weights(kind, form):
    """Under transformers' guard (as while loading), parameters flagged as loaded keep their values."""
    from transformers.initialization import guard_torch_init_functions

    layer = _layer(kind, form=form, encoder="glu")
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    for p in layer.parameters():
        p._is_hf_initialized = True
    with guard_torch_init_functions():
        layer.reset_parameters()
    for name, p in layer.named_parameters():
        assert torch.equal(p, before[name]), name


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_in_bf16_out_and_autocast_training_step(kind):
    torch.manual_seed(0)
    layer = build_sparse_layer(_spec(kind, form="block", encoder="glu", decoder_init="paper"))
    torch.nn.init.normal_(layer.W_gate)
    x = torch.randn(2, 4, I)
    with torch.no_grad():
        out = layer.to(torch.bfloat16)(x.bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == (2, 4, O) and torch.isfinite(out).all()
    code = layer.encode(x.bfloat16())
    assert code.top_k_weights.dtype == torch.float32  # the gate runs in float32
    layer.float().train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = layer(x).float().pow(2).mean()
    loss.backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


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
def test_spec_counts_parameters_and_round_trips(spec):
    layer = build_sparse_layer(spec)
    assert spec.num_parameters() == sum(p.numel() for p in layer.parameters())
    assert spec_from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.active_parameters() == spec.num_parameters()  # dense compute
    assert spec.flops_per_token() > 0
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


@pytest.mark.parametrize(
    "data, message",
    [
        (dict(gate_norm="batchnorm"), r"mumoe_cp.gate_norm='batchnorm' is not supported: BatchNorm makes the gate"),
        (dict(gate_norm="rms"), r"mumoe_cp.gate_norm must be one of \['layernorm', 'none'\]"),
        (dict(form="sandwich"), r"mumoe_cp.form must be one of \['block', 'encoder'\]"),
        (dict(rank=0), r"mumoe_cp.rank must be >= 1, got 0"),
        (dict(rank=2.5), r"mumoe_cp.rank must be an integer"),
        (dict(gate_activation="sparsemax"), r"mumoe_cp.gate_activation must be one of"),
        (dict(expert_init_std=-1.0), r"mumoe_cp.expert_init_std must be a finite number >= 0"),
        (dict(encoder_bias="yes"), r"mumoe_cp.encoder_bias must be true or false"),
        (dict(k=4), r"unknown field\(s\) \['k'\] for sparse layer kind 'mumoe_cp'"),
        (dict(rank_1=4), r"unknown field\(s\) \['rank_1'\] for sparse layer kind 'mumoe_cp'"),
        (dict(activation="tanh"), r"activation 'tanh'"),
        (dict(decoder_init="xavier"), r"mumoe_cp.decoder_init must be one of \['paper', 'zeros'\]"),
    ],
)
def test_spec_errors(data, message):
    with pytest.raises(ValueError, match=message):
        _spec("mumoe_cp", **data)


def test_spec_errors_tr_and_missing_rank():
    with pytest.raises(ValueError, match=r"mumoe_tr.rank_2 must be >= 1, got 0"):
        _spec("mumoe_tr", rank_2=0)
    with pytest.raises(ValueError, match=r"sparse layer kind 'mumoe_tr' needs field\(s\) \['rank'\]"):
        spec_from_dict(dict(kind="mumoe_tr", d_in=I, d_out=O, d_hidden=H, num_experts=N))


def test_model_card_names_both_kinds_and_cites_the_paper_once(tmp_path):
    from expertize.conversion.publishing.card import CITATIONS, write_model_card

    layers = {i: _spec(kind, d_in=32, d_out=32).to_dict() for i, kind in enumerate(KINDS)}
    path = write_model_card(
        tmp_path, base_model="openai-community/gpt2", layers=layers, recipe_summary={}, metrics=None
    )
    text = path.read_text(encoding="utf-8")
    assert "CPμMoE" in text and "TRμMoE" in text
    assert CITATIONS["mumoe_cp"] == CITATIONS["mumoe_tr"] and text.count(CITATIONS["mumoe_cp"]) == 1
    assert "arXiv:2402.12550" in text


# -- save -> remote code, distillation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, glu, blocks", [("gpt2", False, "transformer.h"), ("llama", True, "model.layers")]
)
def test_roundtrip_through_remote_code(family, glu, blocks, tmp_path):
    """Layer 0 in the encoder form, layer 1 in the block form; CP and TR swap places between the families."""
    kinds = KINDS if family == "gpt2" else KINDS[::-1]
    activation = "silu" if glu else "gelu_new"
    layers = {}
    for index, (kind, form) in enumerate(zip(kinds, ["encoder", "block"])):
        spec = spec_from_dict(dict(kind=kind, d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=6, rank=5,
                                   form=form, encoder="glu" if glu else "mlp", activation=activation))
        layer = build_sparse_layer(spec)
        torch.manual_seed(index)
        with torch.no_grad():  # trained-like: a non-uniform gate, a non-zero decoder and output bias
            layer.W_gate.normal_(0, 1)
            layer.mumoe_out.U_out.normal_(0, 0.3)
            layer.b_dec.normal_(0, 0.1)
        layers[index] = layer
    model = splice(tiny_base_model(family), layers)
    report, input_ids, logits = check_remote_roundtrip(model, tmp_path, blocks)
    assert (tmp_path / "model" / "mumoe.py").is_file()
    assert report["sparse"] == ["MuMoELayer", "MuMoELayer"]


def test_short_distillation_on_a_tiny_llama(tiny_run):
    """mumoe_tr sized by parameter matching (its rank), then trained, spliced and evaluated by the real pipeline."""
    tmp_path, tree = tiny_run
    tree["layers"] = [1]
    tree["layer"] = {"kind": "mumoe_tr", "num_experts": 8, "match_transcoder": 4}
    tree["train"].update(lr=1e-3, checkpoint_every=0)
    tree["eval"].update(generation_prompts=2, continuation_tokens=3)
    out = upcycle(recipe_from_dict(tree), progress=False)
    config = json.loads((out / "config.json").read_text())
    spec = spec_from_dict(config["sparse_layers"]["1"])
    # 4x transcoder on d = 32: 128 (32 + 1) + 128 * 32 + 32 = 8,352 parameters; the rank is the largest that fits
    assert spec.kind == "mumoe_tr" and spec.encoder == "glu" and spec.activation == "silu"
    assert spec.num_parameters() <= 8_352 < spec_from_dict({**spec.to_dict(), "rank": spec.rank + 1}).num_parameters()
    metrics = json.loads((out / "metrics.json").read_text())
    layer = metrics["layers"]["1"]
    assert 0 <= layer["fvu"] < 1.0, layer  # better than predicting the mean
    assert 1 <= layer["l0"] <= 8
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"]
