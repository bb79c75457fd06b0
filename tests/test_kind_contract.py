"""The contract every sparse layer kind keeps: one battery driven by tests/kinds.py, so a new kind is one row there.

In process, for every row and for the toy kind of tests/toy_kind.py (registered for the test only: the proof that a
kind outside the table's authors' minds passes the same battery): the spec round trip and its parameter count, the
errors that name the field, shapes and dtypes (float32, float64, bfloat16), gradients to every parameter, the code at
`code_hook` and edits made there, steering and ablation, the unit-range error, the reset guard used while loading,
inference mode and torch.compile, an inspection pass, AuxK and resampling where the layer declares them.
Across all kinds at once: one remote-code round trip (one subprocess for every kind's folder) and one distillation
through the real pipeline (every kind a variant on one activation stream). The per-kind files keep only their math.
"""

import dataclasses
import json
import re

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from expertize.conversion.errors import ExpertizeError
from expertize.conversion.training.auxk import auxk_loss, supports_auxk
from expertize.modeling import FAMILIES, LAYER_KINDS, ExpertizeLlamaConfig, build_sparse_layer, spec_from_dict
from tests.common_testers import FamilyTester
from tests.conftest import FAMILY_NAMES, run_isolated, tiny_base_model, tiny_tokenizer
from tests.kinds import D_MODEL, KINDS, ROWS, KindRow, check_spec, randomized, tiny_spec
from tests.toy_kind import TOY_KIND, TOY_TINY_FIELDS, toy_kind_registered


@pytest.fixture(params=[*KINDS, TOY_KIND])
def row(request):
    """Each row of tests/kinds.py, and the toy kind registered for the test (a new kind is one row)."""
    if request.param != TOY_KIND:
        yield ROWS[request.param]
        return
    with toy_kind_registered():
        yield KindRow(TOY_KIND, TOY_TINY_FIELDS[TOY_KIND])


def _spec(row: KindRow, variant: bool = False) -> dict:
    return tiny_spec(row.kind, fields={**row.fields, **(row.variant if variant else {})})


def _layer(row: KindRow, variant: bool = False, seed: int = 0, dtype=torch.float64):
    return randomized(build_sparse_layer(_spec(row, variant)), seed, dtype, std=0.3).eval()


def _x(*shape, seed: int = 1, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_the_table_has_a_row_for_every_registered_kind():
    assert sorted(LAYER_KINDS) == KINDS, f"tests/kinds.py lacks a row for {sorted(set(LAYER_KINDS) - set(KINDS))}"
    for row in ROWS.values():
        assert set(row.variant) <= {f for f in spec_from_dict(_spec(row)).to_dict()}, row.kind
        assert supports_auxk(build_sparse_layer(_spec(row))) == row.has_auxk


# -- the spec ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_declares_its_facts_on_its_spec_class(kind):
    """What the recipe and the card know about a kind is read from its spec class, so each registered kind has it."""
    from expertize.modeling import MlpShape

    spec_cls = ROWS[kind].spec_class
    fields = {f.name for f in dataclasses.fields(spec_cls)}
    assert spec_cls.kind == kind and spec_cls.title and spec_cls.title != kind
    assert spec_cls.unit_name in ("expert", "latent")
    assert spec_cls.units_field in fields and spec_cls.size_field() in fields
    assert spec_cls.citation.startswith("@article{") and "url           = {https://arxiv.org/abs/" in spec_cls.citation
    assert spec_cls.init_modes[0] == "default" and spec_cls.match_conventions[0] == "exact"
    defaults = spec_cls.mlp_defaults(MlpShape(16, 64, "gelu_new", False), init="default", num_units=None)
    assert set(defaults) <= fields


@pytest.mark.parametrize("variant", [False, True], ids=["tiny", "variant"])
def test_spec_round_trips_and_counts_its_parameters(row, variant):
    spec = spec_from_dict(_spec(row, variant))
    assert spec.kind == row.kind and spec.to_dict()["kind"] == row.kind
    check_spec(spec)
    if row.selects_top_k:  # K of the units' rows per token
        assert spec.active_parameters() < spec.num_parameters()


def test_spec_errors_name_the_field_and_the_kind(row):
    data = _spec(row)
    with pytest.raises(ValueError, match=rf"unknown field\(s\) \['bogus'\] for sparse layer kind '{row.kind}'"):
        spec_from_dict({**data, "bogus": 1})
    required = [f.name for f in dataclasses.fields(row.spec_class) if f.name not in ("d_in", "d_out")
                and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    needs = rf"sparse layer kind '{row.kind}' needs field\(s\) {re.escape(str(required))}"
    with pytest.raises(ValueError, match=needs):
        spec_from_dict({k: v for k, v in data.items() if k not in required})
    units = row.spec_class.units_field
    with pytest.raises(ValueError, match=rf"{row.kind}.{units} must be an integer"):
        spec_from_dict({**data, units: data[units] + 0.5})
    if row.has_field("activation"):
        with pytest.raises(ValueError, match=r"activation 'tanh' is not supported"):
            spec_from_dict({**data, "activation": "tanh"})
    if row.has_field("k"):
        with pytest.raises(ValueError, match=rf"{row.kind}.k=\d+ exceeds"):
            spec_from_dict({**data, "k": 10**6})
    with pytest.raises(ValueError, match=r"unknown sparse layer kind 'moe_magic'; known kinds: \["):
        spec_from_dict({**data, "kind": "moe_magic"})


@pytest.mark.parametrize("kind, fields, message", [(kind, *case) for kind in KINDS for case in ROWS[kind].errors],
                         ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else None)
def test_spec_errors_of_each_kind_name_the_field(kind, fields, message):
    with pytest.raises(ValueError, match=message):
        spec_from_dict({**tiny_spec(kind), **fields})


# -- forward, code, gradients -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_forward_and_code_keep_the_inputs_leading_shape_and_dtype(row, dtype):
    layer = _layer(row, dtype=dtype)
    x = _x(2, 3, 5, dtype=dtype)
    with torch.no_grad():
        out = layer(x)
        code = layer.encode(x)
    assert out.shape == x.shape and out.dtype == dtype and torch.isfinite(out).all()
    assert code.top_k_index.shape == code.top_k_weights.shape and code.top_k_index.shape[:3] == (2, 3, 5)
    assert code.top_k_index.dtype == torch.int64 and code.top_k_weights.is_floating_point()
    assert 0 <= int(code.top_k_index.min()) and int(code.top_k_index.max()) < layer.num_units
    if row.selects_top_k:
        assert code.top_k_index.shape[-1] == layer.spec.k == layer.target_l0


@pytest.mark.parametrize("variant", [False, True], ids=["tiny", "variant"])
def test_every_parameter_gets_a_finite_nonzero_gradient(row, variant):
    """A training step in float64 and one under bfloat16 autocast reach every parameter (the aux loss included)."""
    layer = _layer(row, variant).train()
    for autocast in (False, True):
        layer.zero_grad(set_to_none=True)
        layer.to(torch.float32 if autocast else torch.float64)
        x = _x(4, 6, dtype=torch.float32 if autocast else torch.float64)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = layer(x).float().square().mean()
            if layer.aux_loss is not None:
                loss = loss + layer.aux_loss.float()
        loss.backward()
        for name, p in layer.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, (autocast, name)


def test_code_hook_sees_the_code_and_its_edits_reach_the_output(row):
    """What a hook returns, or writes in place (nnsight's way), is the code the layer decodes: halving by either
    route gives one output, and a zeroed code equals ablating every unit."""
    layer = _layer(row)
    x = _x(3, 4)
    seen = []

    def halve_in_place(module, args, code):  # returns None: the layer keeps the (edited) code
        code.top_k_weights.mul_(0.5)

    with torch.no_grad():
        handle = layer.code_hook.register_forward_hook(lambda m, a, code: seen.append(code))
        base = layer(x)
        handle.remove()
        assert len(seen) == 1 and seen[0].top_k_index.shape[:2] == (3, 4)
        handle = layer.code_hook.register_forward_hook(lambda m, a, c: c._replace(top_k_weights=c.top_k_weights / 2))
        halved = layer(x)
        handle.remove()
        handle = layer.code_hook.register_forward_hook(halve_in_place)
        torch.testing.assert_close(layer(x), halved)
        handle.remove()
        handle = layer.code_hook.register_forward_hook(lambda m, a, c: c._replace(top_k_weights=c.top_k_weights * 0))
        zeroed = layer(x)
        handle.remove()
        with layer.intervene(ablate=range(layer.num_units)):
            torch.testing.assert_close(layer(x), zeroed)
    assert not torch.allclose(halved, base) and not torch.allclose(zeroed, base)


def test_steering_is_linear_and_ablation_removes_only_the_units_that_fire(row):
    layer = _layer(row)
    x = _x(12)
    with torch.no_grad():
        base = layer(x)
        code = layer.encode(x)
        fired = sorted(set(code.top_k_index[code.top_k_weights != 0].tolist()))
        unit = fired[0]
        with layer.intervene(steer={unit: 1.5}):
            once = layer(x)
        with layer.intervene(steer={unit: 3.0}):
            twice = layer(x)
        assert not torch.allclose(once, base)
        torch.testing.assert_close(twice - base, 2 * (once - base))  # adds λ times the unit's contribution
        with layer.intervene(ablate=[u for u in range(layer.num_units) if u not in fired]):
            torch.testing.assert_close(layer(x), base)
        with layer.intervene(ablate=fired[:2]):
            assert not torch.allclose(layer(x), base)
        torch.testing.assert_close(layer(x), base)  # the context manager restored the layer


def test_steering_and_ablation_at_chosen_positions(row):
    """`positions` index the sequence (the input's last leading dim; negative from its end): the steered / ablated
    output there equals the every-position intervention's, and elsewhere the plain output."""
    layer = _layer(row)
    x = _x(2, 6)  # (batch, seq, d): position p of both sequences
    with torch.no_grad():
        base = layer(x)
        code = layer.encode(x)
        unit = sorted(set(code.top_k_index[code.top_k_weights != 0].tolist()))[0]
        for steer, ablate in (({unit: 2.0}, ()), ({}, [unit])):
            with layer.intervene(steer=steer, ablate=ablate):
                everywhere = layer(x)
            assert not torch.allclose(everywhere, base)
            with layer.intervene(steer=steer, ablate=ablate, positions=[1, -1]):
                chosen = layer(x)
            at = torch.tensor([False, True, False, False, False, True])
            torch.testing.assert_close(chosen[:, at], everywhere[:, at])
            torch.testing.assert_close(chosen[:, ~at], base[:, ~at])
            with layer.intervene(steer=steer, ablate=ablate, positions=[9]):  # beyond this call's sequence: skipped
                torch.testing.assert_close(layer(x), base)
        with layer.intervene(steer={unit: 4.0}):
            twice = layer(x)
        layer.steer(unit, 2.0, positions=0)
        layer.steer(unit, 2.0, positions=[0])  # adds up, as at every position
        steered = layer(x)
        torch.testing.assert_close(steered[:, 0], twice[:, 0])
        torch.testing.assert_close(steered[:, 1:], base[:, 1:])
        layer.clear_interventions()
        torch.testing.assert_close(layer(x), base)
    with pytest.raises(ValueError, match="positions is empty"):
        layer.steer(unit, 1.0, positions=[])


def test_interventions_name_the_valid_range(row):
    layer = _layer(row)
    n = layer.num_units
    with pytest.raises(ValueError, match=rf"unit id\(s\) \[{n}\] out of range: this layer has {n} units"):
        layer.steer(n, 1.0)
    with pytest.raises(ValueError, match=r"unit id\(s\) \[-1\] out of range"):
        layer.ablate([-1])


@pytest.mark.parametrize("variant", [False, True], ids=["tiny", "variant"])
def test_reset_parameters_never_touches_loaded_weights(row, variant):
    """Under transformers' guard (as while loading), parameters flagged as loaded keep their values."""
    from transformers.initialization import guard_torch_init_functions

    layer = _layer(row, variant)
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    for p in layer.parameters():
        p._is_hf_initialized = True
    with guard_torch_init_functions():
        layer.reset_parameters()
    for name, p in layer.named_parameters():
        assert torch.equal(p, before[name]), name


def test_inference_mode_and_hooked_edits_agree_with_no_grad(row):
    """Every kind runs under torch.inference_mode() with the same output as under no_grad, and an edit of the code
    made by a hook reaches the output there too (inference tensors carry no version counter to detect it)."""
    layer = _layer(row, dtype=torch.float32)
    x = _x(2, 4, dtype=torch.float32)

    def zero_in_place(module, args, code):  # what nnsight's `code_hook.output.top_k_weights[:] = 0` does
        code.top_k_weights.mul_(0)

    with torch.no_grad():
        reference = layer(x)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), reference)
        handle = layer.code_hook.register_forward_hook(zero_in_place)
        zeroed = layer(x)
        handle.remove()
    with torch.no_grad():
        handle = layer.code_hook.register_forward_hook(zero_in_place)
        torch.testing.assert_close(zeroed, layer(x))
        handle.remove()
    assert not torch.allclose(zeroed, reference)


# aot_eager traces exactly what inductor is given (dynamo's graph, AOTAutograd's decomposition) without generating
# C++: the fast suite's check that nothing breaks the graph. Inductor's code generation cost 5-18 s a kind with a cold
# compile cache (a fresh venv, as in CI), so its row is in the opt-in run.
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_layer_compiles_fullgraph_with_the_eager_output(row, backend):
    """No host synchronization or data-dependent shape: torch.compile(fullgraph=True) traces the layer."""
    import torch._dynamo

    layer = _layer(row, dtype=torch.float32)
    x = _x(2, 4, seed=2, dtype=torch.float32)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(layer, fullgraph=True, backend=backend)
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)


# -- what generic code asks of a kind: inspection, AuxK, resampling ---------------------------------------------------


def test_inspection_reads_routing_effects_and_meaning_from_the_kind(row):
    from expertize.conversion.inspection import LAYER_SCHEMA, InspectionSettings, collect_stats, validate
    from expertize.conversion.surgery.splice import splice

    layer = _layer(row, dtype=torch.float32)
    model = splice(tiny_base_model("gpt2"), {1: layer}).eval()
    corpora = {"a": torch.randint(4, 99, (4, 12), generator=torch.Generator().manual_seed(0))}
    settings = InspectionSettings(top_n=2, left=2, right=1, batch_size=2, vocab_top=3)
    stats = collect_stats(model, corpora, settings, token_text=lambda t: f"t{t}", model_name="tiny")
    report = stats.to_json(1)
    validate(report, LAYER_SCHEMA)
    spec = layer.spec
    assert (report["kind"], report["activation"], report["unit_name"]) == (
        row.kind, spec.activation_meaning, spec.code_unit())
    assert report["num_units"] == layer.num_units and stats.frequency(1).sum() > 0
    if row.has_router:
        assert report["routing"]["experts"] == layer.num_routed_experts
        assert sum(report["routing"]["load"]) == pytest.approx(1.0)
    else:
        assert report.get("routing") is None
    has_effects = layer.output_directions() is not None or layer.token_directions
    assert any(u["promoted_tokens"] for u in report["units"]) == has_effects


def test_auxk_where_the_kind_declares_it(row):
    layer = _layer(row).train()
    x, y = _x(9), _x(9, seed=2)
    dead = torch.zeros(layer.num_units, dtype=torch.bool)
    dead[::2] = True
    with torch.no_grad():
        y_hat = layer(x)
    if not row.has_auxk:
        refusal = rf"AuxK is not defined for sparse layer kind '{row.kind}'.*auxk_coef: 0"
        with pytest.raises(ExpertizeError, match=refusal):
            auxk_loss(layer, x, y, y_hat, dead, 2)
        return
    loss = auxk_loss(layer, x, y, y_hat, dead, 2)
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    assert any(p.grad is not None and p.grad.any() for p in layer.parameters())
    assert auxk_loss(layer, x, y, y_hat, torch.zeros_like(dead), 2) == 0  # no dead unit: no term


def test_resampling_where_the_kind_declares_it(row):
    layer = _layer(row, dtype=torch.float32)
    x, units = _x(3, dtype=torch.float32), torch.tensor([1, 5, 9])
    if not row.supports_resampling:
        with pytest.raises(NotImplementedError, match=rf"{row.kind} layers do not resample dead units"):
            layer.resample_units(units, x, torch.randn(3, D_MODEL))
        return
    rows = layer.resample_units(units, x, torch.randn(3, D_MODEL))
    names = dict(layer.named_parameters())
    assert rows and set(rows) <= set(names)
    for name, index in rows.items():
        assert torch.equal(torch.as_tensor(index).sort().values, units), name
    with torch.no_grad():
        code = layer.encode(x)
    for i, unit in enumerate(units.tolist()):  # each unit now fires on the input it was pointed at
        assert bool(((code.top_k_index[i] == unit) & (code.top_k_weights[i] > 0)).any()), unit


# -- what training asks: the output bias, one real step through the trainer -----------------------------------------


def test_the_declared_output_bias_is_added_to_every_token(row):
    """`output_bias` (the contract's name for what the trainer starts at the mean MLP output) is a parameter of the
    layer of shape (O,), and moving it by δ moves every token's output by exactly δ."""
    layer = _layer(row)
    bias = layer.output_bias
    if bias is None:  # the kind has no such bias: the trainer leaves the layer as it is
        return
    assert any(bias is p for p in layer.parameters()) and bias.shape == (layer.spec.d_out,)
    x = _x(3, 5)
    delta = torch.linspace(-1, 1, layer.spec.d_out, dtype=bias.dtype)
    with torch.no_grad():
        before = layer(x)
        bias.add_(delta)
        torch.testing.assert_close(layer(x), before + delta, rtol=1e-12, atol=1e-12)


class _Activations:
    """ActivationBatches' interface over seeded in-memory (x, y) pairs for one layer."""

    def __init__(self, layer_index: int, tokens: int, steps: int) -> None:
        gen = torch.Generator().manual_seed(3)
        self.local_tokens = tokens
        self.data = [{layer_index: (torch.randn(tokens, D_MODEL, generator=gen),
                                    torch.randn(tokens, D_MODEL, generator=gen) + 2.0)} for _ in range(steps)]

    def batches(self, start_step: int = 0):
        yield from self.data[start_step:]


@pytest.mark.parametrize("variant", [False, True], ids=["tiny", "variant"])
def test_a_real_training_step_runs_for_every_kind(row, variant, tmp_path):
    """The distillation trainer itself (conversion/training/distill.py) on in-memory activations, with the train
    defaults plus AuxK from the second step: whatever it asks of a layer, the kind declares. (A bias the trainer
    wrote by the name `b_dec`, which the contract never declared, once crashed a new kind's first run here.)"""
    from expertize.conversion.recipe import TrainConfig
    from expertize.conversion.device import make_accelerator
    from expertize.conversion.training.distill import Trainer

    tokens, steps = 32, 3
    layer = build_sparse_layer(_spec(row, variant))
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    activations = _Activations(1, tokens, steps)
    cfg = TrainConfig(lr=1e-2, warmup_steps=0, tokens_per_step=tokens, checkpoint_every=0, log_every=1,
                      device="cpu", auxk_coef=1 / 32, dead_window_tokens=tokens)
    trainer = Trainer({1: layer}, activations, cfg, total_steps=steps,
                      accelerator=make_accelerator(torch.device("cpu")), run_dir=tmp_path, progress=False,
                      log=lambda message: None)
    trainer.first_batch(activations.data[0])  # what the engine calls first: the output bias starts at the mean output
    mean = activations.data[0][1][1].mean(0)
    torch.testing.assert_close(trainer.mean_outputs[1], mean)
    if layer.output_bias is not None:
        torch.testing.assert_close(layer.output_bias.detach(), mean)
    trainer.fit()
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, steps + 1)) and all(r["loss"] == r["loss"] for r in log)
    assert ("auxk" in log[-1]) == row.has_auxk  # AuxK ran where the kind declares it
    assert any(not torch.equal(p, before[name]) for name, p in layer.named_parameters())
    assert not layer.training  # released in eval mode


@pytest.mark.slow  # 5-25 s (subprocesses or a whole upcycle): in CI's opt-in run, off the fast suite's 8 minutes
def test_a_kind_registered_only_here_runs_the_quickstart_end_to_end(tmp_path, capsys):
    """The contributor's first run of a new kind: `expertize upcycle quickstart --set layer.kind=<kind>` with a kind
    that only this test registers (tests/toy_kind.py, its output bias named its own way) runs to a published folder
    (capture, distillation with the default dead-unit handling, evaluation, card) that loads back with its layer. A
    tiny budget (8 steps, ~2 s): how well a kind learns is its benchmark's business."""
    from expertize.conversion.cli import main
    from expertize.conversion.surgery.splice import load_expertize_model

    out = tmp_path / "run"
    overrides = [f"layer.kind={TOY_KIND}", "layer.k=4", "layer.match_transcoder=2", f"output_dir={out}",
                 "data.train_tokens=8192", "data.eval_tokens=2048", "train.warmup_steps=2", "train.auxk_coef=0.03",
                 "train.log_every=2",  # steps 2, 4, 6, 8 in train_log.jsonl (the quickstart logs every 10)
                 "eval.generation_prompts=2"]
    with toy_kind_registered():
        code = main(["upcycle", "quickstart", "--no-progress", *[a for o in overrides for a in ("--set", o)]])
        err = capsys.readouterr().err
        assert code == 0, err[-3000:]
        assert "Traceback" not in err
        model = load_expertize_model(out)
        (index, layer), = model.sparse_layers().items()
        assert (index, layer.spec.kind, layer.num_units) == (2, TOY_KIND, 256)  # 2 x d_model 128 latents
    metrics = json.loads((out / "metrics.json").read_text())["layers"]["2"]
    assert 0 <= metrics["fvu"] < float("inf") and 0 < metrics["l0"] <= 4, metrics
    assert TOY_KIND in (out / "README.md").read_text()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"]


def test_a_units_field_outside_the_recipe_settings_is_refused_where_the_kind_is_written():
    from expertize.modeling.sparse_spec import SparseSpec

    with pytest.raises(TypeError, match=r"BadSpec.units_field='num_codes': a kind's units_field must be one of "
                                        r"\['num_experts', 'num_latents'\]"):
        @dataclasses.dataclass
        class BadSpec(SparseSpec):
            kind = "bad"
            units_field = "num_codes"
            num_codes: int = 4


def test_a_token_direction_kind_computes_its_hidden_code_once_per_forward(row):
    """Inspection reads the hidden code z by wrapping `hidden` for a pass (conversion/inspection/effects.py), so a
    kind with `token_directions` computes z through it, once per forward; the others need no `hidden`."""
    layer = _layer(row)
    if not layer.token_directions:
        return
    calls, original = [], layer.hidden

    def hidden(*args, **kwargs):
        z = original(*args, **kwargs)
        calls.append(z.shape)
        return z

    layer.hidden = hidden
    with torch.no_grad():
        layer(_x(2, 3))
    del layer.hidden
    assert len(calls) == 1 and calls[0][0] == 6


# -- inside a model ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_code_hook_sees_the_inputs_leading_shape_inside_a_model(kind):
    """Inside a model the code at `mlp.code_hook` is (batch, seq, K), like the module's own output (batch, seq, O)."""
    model = AutoModelForCausalLM.from_config(FamilyTester(None, "llama", kind).get_config()).eval()
    seen = []
    model.model.layers[1].mlp.code_hook.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        model(torch.randint(3, 99, (3, 5)))
    (code,) = seen
    assert code.top_k_index.shape[:2] == code.top_k_weights.shape[:2] == (3, 5)
    assert code.top_k_index.shape == code.top_k_weights.shape


def test_auto_classes_know_the_expertize_configs_in_process():
    for family in FAMILIES:
        config = FamilyTester(None, family, "mxd").get_config()
        assert type(AutoModelForCausalLM.from_config(config)) is FAMILIES[family].causal_lm_class
        assert type(AutoModel.from_config(config)) is FAMILIES[family].base_model_class
    assert isinstance(ExpertizeLlamaConfig(), ExpertizeLlamaConfig)


# -- every kind at once: remote code, distillation --------------------------------------------------------------------

REMOTE_EVERY_KIND = """
import json, sys, torch
from transformers import AutoModelForCausalLM
report = {}
for family, (folder, reference, blocks_path) in json.loads(sys.argv[1]).items():
    ref = torch.load(reference)
    model, info = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state = model.state_dict()  # buffers too (Monet's running statistics)
    for key, value in ref["state"].items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    blocks = eval("model." + blocks_path)
    with torch.no_grad():
        torch.testing.assert_close(model(ref["input_ids"]).logits, ref["logits"], rtol=1e-5, atol=1e-5)
        for index, units in ref["ablated"].items():
            blocks[index].mlp.ablate(units)
        torch.testing.assert_close(model(ref["input_ids"]).logits, ref["ablated_logits"], rtol=1e-5, atol=1e-5)
        for index in ref["ablated"]:
            blocks[index].mlp.clear_interventions()
    greedy = model.generate(ref["input_ids"][:1, :3], max_new_tokens=4, do_sample=False)[0].tolist()
    assert greedy == ref["greedy"], (greedy, ref["greedy"])
    report[family] = [type(block.mlp).__name__ for block in blocks]
print(json.dumps(report))
"""


def _trained_like(kind: str, shape, variant: bool, seed: int):
    """A layer for an MLP of `shape` with random weights and running statistics moved away from their init."""
    spec = tiny_spec(kind, shape.d_model, shape.d_hidden, shape.activation, shape.glu, variant=variant)
    layer = randomized(build_sparse_layer(spec), seed, torch.float32, std=0.3)
    with torch.no_grad():
        layer.train()(torch.randn(64, D_MODEL) * 2 + 0.5)
    return layer.eval()


def _base_with_layers(family: str, num_layers: int):
    from tests.conftest import tiny_base_config

    config = tiny_base_config(family, num_layers=num_layers)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _family_kinds(f: int) -> list[str]:
    """The kinds family number f holds: every kind once over the families, and one kind again for a family beyond
    the number of kinds, so that every family loads through remote code here (an empty share built a model with no
    layers)."""
    return KINDS[f :: len(FAMILY_NAMES)] or [KINDS[f % len(KINDS)]]


def test_every_kind_round_trips_through_remote_code_in_one_process(tmp_path):
    """One folder per family holding its share of the kinds (each kind's variant, then its tiny spec, on consecutive
    layers), all loaded through remote code by one fresh interpreter that cannot import expertize: the same
    parameters and buffers (no missing or stray keys), logits, greedy tokens and logits under ablations in every
    sparse layer; and the same in process. (The headless model and the refusal without trust_remote_code are the
    family's, tests/test_splice_roundtrip.py.)"""
    from expertize.conversion.surgery.splice import load_expertize_model, save_model, splice

    plan, expected, tokenizer = {}, {}, tiny_tokenizer()
    input_ids = torch.randint(4, 99, (2, 6), generator=torch.Generator().manual_seed(0))
    for f, family in enumerate(FAMILY_NAMES):
        kinds = _family_kinds(f)
        base = _base_with_layers(family, 2 * len(kinds))
        shape = FAMILIES[family].config_class(**base.config.to_dict()).mlp_shape()
        layers = {2 * j + tiny: _trained_like(kind, shape, not tiny, 10 * f + 2 * j + tiny)
                  for j, kind in enumerate(kinds) for tiny in (0, 1)}
        model = splice(base, layers)
        model.generation_config.eos_token_id = None  # random weights may say EOS early; the check counts 4 new tokens
        ablated, codes, mlps = {}, {}, model.sparse_layers()
        handles = [mlp.code_hook.register_forward_hook(lambda m, a, code, i=i: codes.setdefault(i, code))
                   for i, mlp in mlps.items()]
        with torch.no_grad():
            logits = model(input_ids).logits
            for handle in handles:
                handle.remove()
            for index, mlp in mlps.items():  # in every sparse layer two units the first token uses
                units, weights = codes[index].top_k_index[0, 0], codes[index].top_k_weights[0, 0]
                ablated[index] = units[weights != 0][:2].tolist()
                mlp.ablate(ablated[index])
            ablated_logits = model(input_ids).logits
            for mlp in mlps.values():
                mlp.clear_interventions()
        assert not torch.allclose(ablated_logits, logits), family
        greedy = model.generate(input_ids[:1, :3], max_new_tokens=4, do_sample=False)[0].tolist()
        folder = tmp_path / f"model_{family}"
        save_model(model, folder, tokenizer=tokenizer)
        for kind in kinds:  # the kind's own file travels with the model
            assert (folder / f"{ROWS[kind].layer_class.__module__.rsplit('.', 1)[-1]}.py").is_file(), kind
        torch.save({"input_ids": input_ids, "logits": logits, "greedy": greedy, "ablated": ablated,
                    "ablated_logits": ablated_logits, "state": model.state_dict()}, tmp_path / f"{family}.pt")
        plan[family] = (str(folder), str(tmp_path / f"{family}.pt"), FAMILIES[family].blocks_path)
        expected[family] = [type(layers[i]).__name__ for i in sorted(layers)]
        reloaded = load_expertize_model(folder)
        for key, value in model.state_dict().items():  # loaded buffers are not re-initialized either
            torch.testing.assert_close(reloaded.state_dict()[key], value, rtol=0, atol=0, msg=key)
        with torch.no_grad():
            torch.testing.assert_close(reloaded(input_ids).logits, logits)
    assert {k for f in range(len(FAMILY_NAMES)) for k in _family_kinds(f)} == set(KINDS)
    out = run_isolated(REMOTE_EVERY_KIND, tmp_path, timeout=600, args=(json.dumps(plan),))
    assert json.loads(out.strip().splitlines()[-1]) == expected


def _recipe_layer(row: KindRow) -> dict:
    """The row's tiny layer as a recipe `layer:` section, sized by parameter matching (its `size_field`)."""
    from expertize.conversion.recipe.layer_config import SPEC_FIELDS_FROM_RECIPE

    size = row.spec_class.size_field()
    fields = {k: v for k, v in row.fields.items() if k not in (size, "decoder_init")}  # the kind's own init
    top = {k: v for k, v in fields.items() if k in SPEC_FIELDS_FROM_RECIPE}
    options = {k: v for k, v in fields.items() if k not in SPEC_FIELDS_FROM_RECIPE}
    return {"kind": row.kind, "match_transcoder": 4, **top, **({"options": options} if options else {})}


def _next_valid(spec, field: str):
    """The spec with the smallest valid `field` value above its own (Monet's widths come in steps)."""
    for value in range(getattr(spec, field) + 1, getattr(spec, field) + 65):
        try:
            return spec_from_dict({**spec.to_dict(), field: value})
        except ValueError:
            continue
    raise AssertionError(f"no valid {field} above {getattr(spec, field)}")


@pytest.mark.slow  # a whole upcycle run of every kind (tests/test_kind_contract.py's training step is in the default)
def test_every_kind_distils_through_the_pipeline(tiny_run):
    """One upcycle run, every kind a variant on one activation stream: each sized by parameter matching to a 4x
    transcoder, its MLP-derived fields from the base model, trained (the loss falls), spliced and evaluated (finite
    FVU, L0 within the code). How well a kind learns is its benchmark's business (benchmarks/), not this budget's."""
    from expertize.conversion.recipe import recipe_from_dict
    from expertize.conversion.upcycle import upcycle
    from expertize.modeling import MlpShape
    from expertize.modeling.sparse_base import canonical_activation

    tmp_path, tree = tiny_run
    tree["layers"] = [1]
    tree["data"].update(train_tokens=4096, eval_tokens=256)
    tree["train"].update(checkpoint_every=0)
    tree["eval"].update(generation_prompts=0)
    tree["layer"] = _recipe_layer(ROWS[KINDS[0]])  # a variant of the same kind is merged over it
    tree["variants"] = [{"name": kind, "layer": _recipe_layer(ROWS[kind])} for kind in KINDS]
    out = upcycle(recipe_from_dict(tree), progress=False)
    budget = 128 * (32 + 1) + 128 * 32 + 32  # a transcoder of 4 x 32 latents: 8,352 parameters
    llama = MlpShape(32, 37, "silu", True)  # the tiny Llama's MLP
    for kind in KINDS:
        folder, row = out / kind, ROWS[kind]
        spec = spec_from_dict(json.loads((folder / "config.json").read_text())["sparse_layers"]["1"])
        size = row.spec_class.size_field()
        assert spec.kind == kind
        own_rule = row.spec_class.matched_size(spec.to_dict(), 128, "exact")
        if own_rule is not None:  # the kind's own matching rule (transcoders: exactly 4 x d_in = 128 latents)
            assert getattr(spec, size) == own_rule
        else:  # the largest size within the transcoder's parameter count
            assert spec.num_parameters() <= budget < _next_valid(spec, size).num_parameters()
        derived = row.spec_class.mlp_defaults(llama)
        derived = {k: canonical_activation(v) if k == "activation" else v for k, v in derived.items()
                   if k not in row.fields and k != size}
        assert derived.items() <= spec.to_dict().items(), (kind, derived)
        metrics = json.loads((folder / "metrics.json").read_text())["layers"]["1"]
        assert 0 <= metrics["fvu"] < float("inf"), (kind, metrics)
        assert 0 < metrics["l0"] <= (spec.k if row.selects_top_k else build_sparse_layer(spec).num_units), kind
        log = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]
        assert log[-1]["loss"] < log[0]["loss"], kind
