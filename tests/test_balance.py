"""Keeping every unit in use: the selection bias (training/balance.py), resampling (training/resample.py), AuxK's
reuse of the forward's pre-activations, and the health warnings of collapsed or dead codes (evaluation/health.py).
"""

import tempfile
from pathlib import Path

import pytest
import torch

from expertize.conversion.evaluation.evaluate import evaluate_sparse_layers
from expertize.conversion.evaluation.health import code_health
from expertize.conversion.recipe import EvalConfig, TrainConfig
from expertize.conversion.training.auxk import fired_units
from expertize.conversion.training.balance import SelectionBalancer
from expertize.conversion.training.distill_plan import plan_distillation
from expertize.conversion.training.resample import Resampler
from expertize.modeling import build_sparse_layer
from expertize.modeling.sparse_kernels import LinearReluTopK, relu_topk
from tests.conftest import D_MODEL, check_remote_roundtrip, tiny_base_model
from tests.kinds import tiny_spec
from tests.test_dead_units import TOKENS, _cfg, _train

BALANCED_KINDS = ["mxd", "transcoder", "skip_transcoder", "routed_neurons", "moe_x"]


class Clustered:
    """ActivationBatches' interface over inputs drawn around 6 centers (so that plain TopK leaves many units dead)
    and targets tanh(W x)."""

    def __init__(self, layers, steps, seed=0):
        gen = torch.Generator().manual_seed(seed)
        centers = torch.randn(6, D_MODEL, generator=gen) * 2
        W = torch.randn(D_MODEL, D_MODEL, generator=gen) / D_MODEL**0.5
        self.local_tokens = TOKENS

        def batch():
            x = centers[torch.randint(0, 6, (TOKENS,), generator=gen)] + 0.3 * torch.randn(TOKENS, D_MODEL,
                                                                                           generator=gen)
            return x, torch.tanh(x @ W)

        self.data = [{i: batch() for i in layers} for _ in range(steps)]
        self.stop_at = None

    def batches(self, start_step=0):
        for step in range(start_step, len(self.data)):
            if step == self.stop_at:
                raise KeyboardInterrupt
            yield self.data[step]


def _dead_after_training(spec: dict, steps: int, **train) -> float:
    torch.manual_seed(0)
    layers = {0: build_sparse_layer(spec)}
    batches = Clustered(layers, steps)
    with tempfile.TemporaryDirectory() as folder:
        _train(layers, batches, _cfg(dead_window_tokens=10 * TOKENS, **train), Path(folder), steps)
    x = torch.cat([b[0][0] for b in batches.data[-10:]])
    with torch.no_grad():
        code = layers[0].encode(x)
    fired = fired_units(code.top_k_index, layers[0].active_entries(code.top_k_weights), layers[0].num_units)
    return 1 - fired.float().mean().item()


def test_the_selection_bias_chooses_among_positive_scores_and_never_weights():
    pre = torch.tensor([[3.0, 2.0, 1.0, -1.0, 0.5], [-2.0, -1.0, 4.0, 0.2, -0.1]])
    bias = torch.tensor([0.0, 0.0, 5.0, 10.0, 0.0])
    values, index = relu_topk(pre, 2, bias)
    chosen = [set(row) for row in index.tolist()]
    assert chosen == [{2, 0}, {2, 3}]  # unit 3 (bias 10) is never chosen where its score is not positive
    torch.testing.assert_close(values, torch.relu(pre.gather(-1, index)))  # unbiased weights
    plain = relu_topk(pre, 2)
    assert [set(r) for r in plain[1].tolist()] == [{0, 1}, {2, 3}]


def test_linear_relu_topk_with_a_selection_bias_has_the_gathered_gradients():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(11, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, generator=gen, requires_grad=True)
    sel = torch.randn(11, dtype=torch.float64, generator=gen)
    values, index, pre = LinearReluTopK.apply(x, w, b, 3, sel)
    ref_values, ref_index = relu_topk(torch.nn.functional.linear(x, w, b), 3, sel)
    assert torch.equal(index, ref_index) and torch.equal(values, ref_values) and not pre.requires_grad
    weights = torch.linspace(-1, 1, values.numel(), dtype=torch.float64).view_as(values)
    grads = torch.autograd.grad((values * weights).sum(), (x, w, b))
    ref = torch.autograd.grad((ref_values * weights).sum(), (x, w, b))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_the_balancer_moves_each_bias_toward_the_target_rate():
    layer = build_sparse_layer({**tiny_spec("transcoder"), "selection_bias": True}).train()  # 64 latents, K = 4
    balancer = SelectionBalancer(layer, rate=0.1)  # DeepSeek-V3's symmetric rule
    assert balancer.target == 4 / 64
    index = torch.tensor([[0, 1, 2, 3]] * 16)  # units 0-3 fire on every token, the others never
    layer(torch.randn(16, D_MODEL))  # a training forward measures the score scale
    scale = layer.selection_scale
    load, measured = balancer.step_stats(index, torch.ones(16, 4))
    assert load[:4].tolist() == [1.0] * 4 and load[4:].sum() == 0 and measured == scale
    balancer.update(load, measured, lr=0.5, step_tokens=16)
    torch.testing.assert_close(layer.b_select[:4], -0.05 * scale.expand(4))
    torch.testing.assert_close(layer.b_select[4:], 0.05 * scale.expand(60))


def test_the_floor_rule_lifts_only_the_units_below_the_floor_and_never_goes_negative():
    layer = build_sparse_layer({**tiny_spec("transcoder"), "selection_bias": True}).train()  # 64 latents, K = 4
    balancer = SelectionBalancer(layer, rate=1.0, floor=0.5)  # floor: half the fair share 4 / 64
    assert balancer.horizon_tokens == 10 / (0.5 * 4 / 64)  # 10 expected firings at the floor: 320 tokens
    load = torch.full((64,), 4 / 64)  # every unit at its fair share ...
    load[:8] = 0.0  # ... but units 0-7, which never fire
    for _ in range(3):
        balancer.update(load, torch.tensor(2.0), lr=0.1, step_tokens=32)
    # The averaged share starts at the first step's and moves 32 / 320 of the way per step.
    torch.testing.assert_close(balancer.average, load)
    torch.testing.assert_close(layer.b_select[:8], torch.full((8,), 3 * 0.2))  # 3 steps of rate · lr · scale up
    assert bool((layer.b_select[8:] == 0).all())  # above the floor: clamped at 0, never pushed below
    load[:8] = 1.0
    for _ in range(40):
        balancer.update(load, torch.tensor(2.0), lr=0.1, step_tokens=32)
    assert bool((layer.b_select == 0).all())  # once they fire, the bias decays back to 0


@pytest.mark.slow  # a subprocess per kind (~8 s each)
@pytest.mark.parametrize("kind", BALANCED_KINDS)
def test_the_selection_bias_is_saved_and_routes_at_inference_through_remote_code(kind, tmp_path):
    from expertize.conversion.surgery.splice import splice

    spec = {**tiny_spec(kind), "selection_bias": True}
    layer = build_sparse_layer(spec)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.b_select.copy_(torch.randn(layer.b_select.shape, generator=torch.Generator().manual_seed(1)))
    model = splice(tiny_base_model("llama"), {1: layer})
    x = torch.randn(3, 5, D_MODEL)
    with torch.no_grad():
        biased = model.model.layers[1].mlp(x)
        model.model.layers[1].mlp.b_select.zero_()
        assert not torch.allclose(model.model.layers[1].mlp(x), biased)  # the bias changes the routing
        model.model.layers[1].mlp.b_select.copy_(layer.b_select)
    check_remote_roundtrip(model, tmp_path, "model.layers")  # same logits and greedy tokens through remote code


def test_balancing_keeps_units_alive_where_plain_topk_lets_them_die():
    spec = dict(kind="mxd", d_in=D_MODEL, d_out=D_MODEL, d_hidden=24, num_experts=96, k=2)
    plain = _dead_after_training(spec, 60, balance="none")
    balanced = _dead_after_training({**spec, "selection_bias": True}, 60, balance="bias")
    assert plain > 0.2 and balanced < 0.1, (plain, balanced)


def test_resampling_revives_units_that_can_never_fire_and_resets_their_moments():
    torch.manual_seed(0)
    spec = dict(kind="transcoder", d_in=D_MODEL, d_out=D_MODEL, num_latents=48, k=2)
    layer = build_sparse_layer(spec).train()
    dead = torch.arange(0, 48, 2)
    with torch.no_grad():
        layer.b_enc[dead] = -1e3  # these latents cannot win the top K on any input
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    batches = Clustered({0: layer}, 3)
    x, y = batches.data[0][0]
    layer(x).sub(y).square().mean().backward()
    optimizer.step()
    for key in ("exp_avg", "exp_avg_sq"):  # moments the resampled rows must not keep
        optimizer.state[layer.W_enc][key][dead] = 1.0
    resampler = Resampler(layer, every_tokens=TOKENS, until_tokens=10 * TOKENS)
    with torch.no_grad():
        code = layer.encode(x)
        resampler.update_fired(fired_units(code.top_k_index, layer.active_entries(code.top_k_weights), 48), TOKENS)
        assert resampler.due and bool(resampler.tracker.dead_mask()[dead].all())
        n = resampler.resample(x, y - layer(x), optimizer)
    assert n >= len(dead) and resampler.resampled == n
    state = optimizer.state[layer.W_enc]
    assert state["exp_avg"][dead].abs().sum() == 0 and state["exp_avg_sq"][dead].abs().sum() == 0
    assert layer.b_enc[dead].abs().sum() == 0 and layer.W_dec[dead].abs().sum() == 0
    cosine = torch.nn.functional.cosine_similarity(layer.W_enc[dead].unsqueeze(1), x.unsqueeze(0), dim=-1)
    assert bool((cosine.max(dim=1).values > 0.999).all())  # each re-pointed at one of the step's inputs
    with torch.no_grad():
        code = layer.encode(torch.cat([b[0][0] for b in batches.data]))
        revived = fired_units(code.top_k_index, layer.active_entries(code.top_k_weights), 48)[dead]
    assert revived.float().mean() > 0.5


def test_a_run_that_resamples_resumes_exactly(tmp_path):
    from tests.test_dead_units import _assert_same_weights, _copy

    spec = dict(kind="mxd", d_in=D_MODEL, d_out=D_MODEL, d_hidden=24, num_experts=96, k=2)
    torch.manual_seed(0)
    layers = {0: build_sparse_layer(spec)}
    cfg = _cfg(balance="none", resample_every_tokens=3 * TOKENS)
    whole, resumed = _copy(layers), _copy(layers)
    batches = Clustered(layers, 12)
    trainer = _train(whole, batches, cfg, tmp_path / "whole", 12)
    assert trainer.resamplers[0].resampled > 0
    batches.stop_at = 7
    from expertize.conversion.training.errors import RunInterrupted

    with pytest.raises(RunInterrupted):
        _train(resumed, batches, cfg, tmp_path / "resumed", 12)
    batches.stop_at = None
    again = _copy(layers)
    _train(again, batches, cfg, tmp_path / "resumed", 12)
    _assert_same_weights(again, whole)


@pytest.mark.parametrize("kind", ["mxd", "transcoder", "routed_neurons"])
def test_auxk_reuses_the_forwards_pre_activations_with_the_same_result(kind):
    layer = build_sparse_layer(tiny_spec(kind)).train()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(20, D_MODEL, generator=torch.Generator().manual_seed(3))
    dead = torch.zeros(layer.num_units, dtype=torch.bool)
    dead[::3] = True
    recomputed = layer.auxk_reconstruction(x, dead, 5)
    layer.keep_for_auxk = True
    layer(x)
    assert "pre" in layer._kept or "logits" in layer._kept
    reused = layer.auxk_reconstruction(x, dead, 5)
    assert layer._kept == {}  # taken: the memory is released
    torch.testing.assert_close(reused, recomputed, rtol=0, atol=0)


def test_health_warnings_name_dead_collapsed_and_concentrated_codes():
    assert code_health(dead_fraction=0.02, l0=31.5, k=32, effective_units=900, num_units=1024) == []
    warnings = code_health(dead_fraction=0.88, l0=2.4, k=32, effective_units=3, num_units=1024)
    assert [w.split(":")[0] for w in warnings] == ["dead", "collapsed", "concentrated"]
    assert "L0 2.4 of K=32" in warnings[1] and "train.lr" in warnings[1]
    assert code_health(dead_fraction=0.0, l0=0.1, k=None, effective_units=500, num_units=512) == []


def test_a_threshold_kinds_l0_far_from_its_target_is_named_so():
    """Issue 47: a JumpReLU layer's k is the L0 training steers to, not a top K; an L0 far below it (or above) is
    flagged in its own words, and the layer declares the target (it had none, so nothing was flagged)."""
    healthy = dict(dead_fraction=0.02, effective_units=900, num_units=1024, k=16, thresholded=True)
    assert code_health(**{**healthy, "l0": 9.0}) == [] and code_health(**{**healthy, "l0": 31.0}) == []
    low, high = code_health(**{**healthy, "l0": 4.2}), code_health(**{**healthy, "l0": 40.0})
    assert [w.split(":")[0] for w in low + high] == ["off target", "off target"]
    assert "mean L0 4.2 against the target L0 16" in low[0] and "above most pre-activations" in low[0]
    assert "less sparse than asked" in high[0] and "collapsed" not in " ".join(low + high)
    from expertize.modeling import build_sparse_layer
    from tests.kinds import tiny_spec

    assert build_sparse_layer(tiny_spec("jumprelu_transcoder")).target_l0 == tiny_spec("jumprelu_transcoder")["k"]
    assert build_sparse_layer(tiny_spec("mumoe_cp")).target_l0 is None


def test_health_advice_leaves_out_what_the_run_already_used():
    from expertize.conversion.evaluation.health import InEffect

    sick = dict(dead_fraction=0.5, l0=1.0, k=4, effective_units=2.0, num_units=64)
    general = code_health(**sick)
    assert "Fix: train.balance: floor (the default" in general[0] and "train.balance: bias" in general[2]
    floor = code_health(**sick, in_effect=InEffect(balance="floor", balance_floor=0.3, resampling=False))
    assert "train.balance: floor" not in floor[0]
    assert floor[0].endswith("Fix: a higher train.balance_floor (this run: 0.3), train.resample_every_tokens: auto "
                             "(re-points units already dead), more data.train_tokens")
    everything = code_health(**sick, in_effect=InEffect(balance="bias", balance_floor=0.3, resampling=True))
    assert [w.split(". Fix: ")[1] for w in everything] == ["more data.train_tokens", "a lower train.lr",
                                                           "more data.train_tokens"]
    # A kind without a selection bias or resampling (mumoe) is not sent to train.balance or resampling.
    mumoe = InEffect(balance="none", balance_floor=0.3, resampling=False, can_balance=False, can_resample=False)
    assert "train.balance" not in " ".join(code_health(**sick, in_effect=mumoe))


def test_a_layer_trained_with_the_floor_rule_is_not_told_to_use_it():
    """The evaluation of a layer trained with `train.balance: floor` (its selection bias exists) and half its units
    dead: the dead-unit warning in metrics.json names what is left to try, not the rule in effect."""
    torch.manual_seed(0)
    layer = build_sparse_layer({**tiny_spec("mxd"), "selection_bias": True}).eval()
    with torch.no_grad():
        layer.b_gate[: layer.num_units // 2] = -1e4  # these units never fire
    input_ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    metrics = evaluate_sparse_layers(
        tiny_base_model("llama"), {1: layer}, input_ids,
        EvalConfig(batch_sequences=4, generation_prompts=0, histogram=False), progress=False,
        plan=plan_distillation(TrainConfig(balance="floor", balance_floor=0.25), layer, steps=100),
    )
    dead = [w for w in metrics["layers"]["1"]["health"] if w.startswith("dead:")]
    assert len(dead) == 1 and "train.balance: floor" not in dead[0]  # the plan's rule in effect, not the general advice
    assert "a higher train.balance_floor (this run: 0.25)" in dead[0] and "resample_every_tokens: auto" in dead[0]


@pytest.mark.slow  # a whole upcycle with variants (~4 s): in CI's opt-in run, off the fast suite's 8 minutes
def test_a_run_built_to_collapse_warns_in_the_summary_metrics_variants_and_card(tiny_run, capsys):
    """lr 0.1 without balancing: the MxD gate scores go negative on almost every token (mean L0 far below K). The
    run still finishes (exit 0), and every place that reports its fidelity says the code collapsed."""
    import json

    import yaml

    from expertize.conversion.cli import main

    tmp_path, tree = tiny_run
    tree["layers"] = [1]
    tree["layer"] = {"kind": "mxd", "k": 8, "num_experts": 64}
    tree["data"]["train_tokens"] = 16_384
    tree["train"].update(checkpoint_every=0, grad_clip=None)
    tree["eval"].update(generation_prompts=0)
    tree["variants"] = [{"name": "collapsed", "train": {"lr": 0.1, "balance": "none", "warmup_steps": 2}}]
    recipe = tmp_path / "collapse.yaml"
    recipe.write_text(yaml.safe_dump(tree))
    assert main(["upcycle", str(recipe), "--no-progress"]) == 0
    out = capsys.readouterr().out
    run = Path(tree["output_dir"])
    health = json.loads((run / "collapsed" / "metrics.json").read_text())["layers"]["1"]["health"]
    assert any(w.startswith("collapsed: mean L0") for w in health), health
    assert "⚠" in out and "collapsed" in out  # the variants table printed at the end of the run
    assert "collapsed: mean L0" in (run / "variants.md").read_text()
    assert "Code health" in (run / "collapsed" / "README.md").read_text()
    from expertize.conversion.upcycle import upcycle_summary

    assert "WARNING layer 1 code collapsed: mean L0" in upcycle_summary(run / "collapsed")


@pytest.mark.parametrize("case", ["floor", "signed", "few_positive"])
def test_biased_choice_without_pre_equals_relu_topk(case):
    # The cheaper path (`need_pre=False`: no AuxK this step) chooses the same positive units with the same values as
    # relu_topk over the materialized pre-activations, and its gradients are the same.
    from expertize.modeling.sparse_kernels import LinearReluTopK, relu_topk

    torch.manual_seed(0)
    T, I, N, K = 64, 16, 96, 8
    x = torch.randn(T, I, dtype=torch.float64)
    weight = torch.randn(N, I, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(N, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(N, dtype=torch.float64)
    b[::7] = torch.rand(len(b[::7]), dtype=torch.float64) * 3  # a few raised units (the floor rule: b >= 0)
    if case == "signed":
        b = torch.randn(N, dtype=torch.float64)  # the symmetric rule moves biases both ways
    if case == "few_positive":
        with torch.no_grad():
            bias -= 6.0  # most rows have fewer than K positive pre-activations
    pre = torch.nn.functional.linear(x, weight, bias).detach()
    ref_values, ref_index = relu_topk(pre, K, b)
    assert case != "few_positive" or ((pre > 0).sum(-1) < K).float().mean() > 0.5
    outputs = {}
    for need_pre in (True, False):
        weight.grad = bias.grad = None
        values, index, kept = LinearReluTopK.apply(x, weight, bias, K, b, need_pre)
        (values.square() + values).sum().backward()  # order-free: the K slots may come in another order
        outputs[need_pre] = (values.detach(), index, weight.grad.clone(), bias.grad.clone())
        assert kept.numel() == (T * N if need_pre else 0)
    values, index, grad_w, grad_b = outputs[False]
    fired = values > 0
    ref_fired = ref_values > 0
    for t in range(T):  # the same positive units chosen, with the same values
        mine = dict(zip(index[t][fired[t]].tolist(), values[t][fired[t]].tolist()))
        ref = dict(zip(ref_index[t][ref_fired[t]].tolist(), ref_values[t][ref_fired[t]].tolist()))
        assert mine.keys() == ref.keys()
        assert all(abs(mine[u] - ref[u]) < 1e-9 for u in mine)
    torch.testing.assert_close(values.sort(-1).values, ref_values.sort(-1).values)
    if case != "few_positive":  # with K positives everywhere, even the order-free choice is identical
        assert torch.equal(index.sort(-1).values, ref_index.sort(-1).values)
        torch.testing.assert_close(grad_w, outputs[True][2])
        torch.testing.assert_close(grad_b, outputs[True][3])


# -- the annealed floor (train.balance_anneal, the default since issue 28) ------------------------------------------


def _floor_run(tmp_path, steps=40, stop_at=None, **train):
    spec = dict(kind="transcoder", d_in=D_MODEL, d_out=D_MODEL, num_latents=96, k=2, selection_bias=True)
    torch.manual_seed(0)
    layers = {0: build_sparse_layer(spec)}
    batches = Clustered(layers, steps)
    batches.stop_at = stop_at
    trainer = _train(layers, batches, _cfg(**{"balance": "floor", **train}), tmp_path, steps)
    return layers[0], trainer


def test_the_floor_bias_decays_to_exactly_zero_by_the_anneals_end_and_is_held_without_it(tmp_path):
    """Default [0.5, 0.8]: the floor raises units' biases in the first half, then the bias decays linearly from its
    value at 50 % to 0 at 80 % of the steps, so the saved layer routes by plain top-K; `balance_anneal: null` keeps it."""
    layer, trainer = _floor_run(tmp_path / "annealed")
    balancer = trainer.balancers[0]
    assert balancer.anneal == (0.5, 0.8) and balancer.frozen is not None
    assert float(balancer.frozen.max()) > 0 and int(balancer.raised.sum()) > 0  # it did raise units first
    assert bool((layer.b_select == 0).all())  # exactly 0: plain top-K from 80 % of the run on
    summary = trainer.balance_summaries()[0][0]
    assert summary["bias_at_end"] is False and summary["units_raised"] == int(balancer.raised.sum()) > 0
    held, trainer = _floor_run(tmp_path / "held", balance_anneal=None)
    assert float(held.b_select.max()) > 0 and trainer.balance_summaries()[0][0]["bias_at_end"] is True


def test_the_anneal_follows_the_step_linearly():
    layer = build_sparse_layer({**tiny_spec("transcoder"), "selection_bias": True}).train()
    balancer = SelectionBalancer(layer, rate=1.0, floor=0.5, anneal=(0.5, 0.75))
    load = torch.zeros(64)
    balancer.update(load, torch.tensor(1.0), lr=0.1, step_tokens=32, progress=0.25)  # the rule: +0.1 for every unit
    start = layer.b_select.clone()
    assert float(start.min()) == pytest.approx(0.1)
    for progress, factor in ((0.5, 1.0), (0.625, 0.5), (0.7, 0.2), (0.75, 0.0), (1.0, 0.0)):
        balancer.update(load, torch.tensor(1.0), lr=0.1, step_tokens=32, progress=progress)
        torch.testing.assert_close(layer.b_select, start * factor)


def test_the_symmetric_rule_is_never_annealed(tmp_path):
    """`balance: bias` is part of the routing (DeepSeek-V3 keeps it at inference): the default anneal leaves it be."""
    _, trainer = _floor_run(tmp_path, balance="bias")
    assert trainer.balancers[0].anneal is None and trainer.balance_summaries()[0][0]["bias_at_end"] is True


def test_an_annealing_run_interrupted_after_the_anneal_began_resumes_exactly(tmp_path):
    from expertize.conversion.training.errors import RunInterrupted
    from tests.test_dead_units import _assert_same_weights

    whole, _ = _floor_run(tmp_path / "whole")
    with pytest.raises(RunInterrupted):
        _floor_run(tmp_path / "resumed", stop_at=27)  # between the anneal's start (20) and its end (32)
    resumed, trainer = _floor_run(tmp_path / "resumed")
    assert trainer.balancers[0].frozen is not None
    _assert_same_weights({0: resumed}, {0: whole})  # b_select included (a buffer of the state dict)
