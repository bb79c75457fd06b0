"""Evaluation: metric definitions on hand-computed values, streaming == concatenated, MLP capture per family,
CE / KL / ablations with stand-in layers whose answers are known, the generation match curve, and the plots."""

import math

import pytest
import torch
from torch import nn

from expertize.conversion.data.mlp_pairs import MlpCapture, decoder_blocks
from expertize.conversion.evaluation.evaluate import evaluate_sparse_layers, generation_match_curve
from expertize.conversion.evaluation.metrics import ReconstructionStats
from expertize.conversion.training.losses import (
    LOSSES,
    fvu,
    kl_base_to_other,
    mse,
    next_token_ce,
    nmse_paper,
    relative_mse,
)
from expertize.conversion.recipe import EvalConfig
from expertize.modeling import SparseCode, SparseLayer, SparseSpec
from tests.conftest import D_MODEL, FAMILY_NAMES, VOCAB, tiny_base_model
from tests.families import ROWS

FAMILIES = FAMILY_NAMES


# ----------------------------------------------------------------------------------------------------------------
# Metrics


# y has token norms 5 and 1; the squared errors are [[0, 1], [1, 0]].
Y = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
Y_HAT = torch.tensor([[3.0, 5.0], [1.0, 1.0]])


def test_metrics_hand_computed():
    assert mse(Y_HAT, Y).item() == pytest.approx(2 / 4)
    # (0/5 + 1/5 + 1/1 + 0/1) / (2 tokens * 2 dims)
    assert nmse_paper(Y_HAT, Y).item() == pytest.approx(1.2 / 4)
    assert relative_mse(Y_HAT, Y).item() == pytest.approx(2 / 26)
    # mean y = [1.5, 2.5]; Σ‖y − ȳ‖² = 4 * 1.5²
    assert fvu(Y_HAT, Y).item() == pytest.approx(2 / 9)
    assert set(LOSSES) == {"nmse", "fvu", "mse"} and LOSSES["nmse"] is nmse_paper


def test_metrics_flatten_leading_dims_and_are_differentiable():
    y, y_hat = torch.randn(2, 3, 5), torch.randn(2, 3, 5, requires_grad=True)
    for loss in (*LOSSES.values(), relative_mse):
        value = loss(y_hat, y)
        assert value.item() == pytest.approx(loss(y_hat.reshape(6, 5), y.reshape(6, 5)).item())
        (grad,) = torch.autograd.grad(value, y_hat)
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_nmse_paper_eps_guards_zero_targets():
    assert nmse_paper(torch.ones(1, 2), torch.zeros(1, 2), eps=0.5).item() == pytest.approx(2 / 0.5 / 2)


def test_reconstruction_stats_over_batches_equal_concatenation():
    torch.manual_seed(0)
    y = torch.randn(50, 7, dtype=torch.float64) * 3 + 10  # a large mean: FVU needs the global mean
    y_hat = y + torch.randn(50, 7, dtype=torch.float64)
    stats = ReconstructionStats()
    for start, stop in [(0, 3), (3, 20), (20, 21), (21, 50)]:
        stats.update(y_hat[start:stop].float(), y[start:stop].float())
    y, y_hat = y.float().double(), y_hat.float().double()
    got = stats.as_dict()
    for name, fn in [("nmse_paper", nmse_paper), ("relative_mse", relative_mse), ("fvu", fvu), ("mse", mse)]:
        assert got[name] == pytest.approx(fn(y_hat, y).item(), rel=1e-12), name
    assert stats.count == 50
    torch.testing.assert_close(stats.mean_output(), y.mean(0), rtol=1e-12, atol=1e-12)


def test_next_token_ce_and_kl_hand_computed():
    # Position 0 predicts token 1 under p = softmax([0, ln 3]) = (1/4, 3/4); position 1 predicts nothing.
    logits = torch.tensor([[[0.0, math.log(3)], [5.0, -5.0]]])  # (B=1, L=2, V=2)
    ids = torch.tensor([[0, 1]])
    ce = next_token_ce(logits, ids)
    assert ce.shape == (1, 1)
    assert ce.item() == pytest.approx(math.log(4 / 3))
    uniform = torch.zeros(1, 2, 2)
    # KL((1/2, 1/2) ‖ (1/4, 3/4)) = 1/2 ln 2 + 1/2 ln(2/3)
    assert kl_base_to_other(uniform, logits).item() == pytest.approx(0.5 * math.log(4 / 3))
    assert kl_base_to_other(logits, logits).abs().max().item() == 0.0
    assert next_token_ce(torch.zeros(2, 4, VOCAB), torch.zeros(2, 4, dtype=torch.long)).mean().item() == (
        pytest.approx(math.log(VOCAB))
    )


# ----------------------------------------------------------------------------------------------------------------
# Capture: exactly what the MLP reads and writes, and nothing above the last target MLP runs


def _randomized_norms(model):
    """Norm weights away from their init (ones, or Gemma's zeros), so that a norm skipped or applied twice shows."""
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_is_mlp_input_and_output(family):
    """What capture records is what the family's block feeds its MLP and what the MLP returns before any norm of its
    output, rebuilt here from the native block's modules (tests/families.py): GPT-2 / Llama-likes norm the stream
    after attention, GPT-NeoX norms the block input (parallel residual), Gemma norms the attention output, adds it
    and norms again (`pre_feedforward_layernorm`), OLMo-2 feeds the stream itself; Gemma and OLMo-2 norm the MLP's
    output (`post_feedforward_layernorm`) before the residual add, which the block output must show."""
    row = ROWS[family]
    model = _randomized_norms(tiny_base_model(family))
    blocks = decoder_blocks(model)
    ids = torch.randint(0, VOCAB, (2, 9))
    seen = {}

    def keep(name):
        def hook(module, args, kwargs, output):
            hidden_in = args[0] if args else kwargs["hidden_states"]
            seen[name] = (hidden_in.detach(), (output[0] if isinstance(output, tuple) else output).detach())

        return hook

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_hook(keep(("block", i)), with_kwargs=True))
        handles.append(block.get_submodule(row.attention).register_forward_hook(keep(("attn", i)), with_kwargs=True))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for handle in handles:
        handle.remove()

    def norm(name, h):
        return h if name is None else blocks[i].get_submodule(name)(h)

    captured = MlpCapture(model, [0, 1])(ids)
    with torch.no_grad():
        for i, block in enumerate(blocks):
            x, y = captured[i]
            assert x.shape == y.shape == (2 * 9, D_MODEL)
            block_in, block_out = seen[("block", i)]
            attn_out = seen[("attn", i)][1]
            if row.parallel:  # the MLP reads the norm of the block input itself
                mid, expected_x = block_in + attn_out, norm(row.mlp_norm, block_in)
            else:  # sequential: the stream after attention (its output normed first, where the family does)
                mid = block_in + norm(row.attention_out_norm, attn_out)
                expected_x = norm(row.mlp_norm, mid)
            torch.testing.assert_close(x, expected_x.reshape(-1, D_MODEL))
            torch.testing.assert_close(y, block.mlp(x))
            expected_out = mid + norm(row.mlp_out_norm, y.reshape(block_out.shape))
            torch.testing.assert_close(block_out, expected_out)


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_stops_after_last_target_mlp(family):
    model = tiny_base_model(family)
    final_norm = model.get_submodule(ROWS[family].final_norm)
    ran = []
    handles = [
        decoder_blocks(model)[1].register_forward_pre_hook(lambda *_: ran.append("block 1")),
        final_norm.register_forward_pre_hook(lambda *_: ran.append("final norm")),
    ]
    ids = torch.randint(0, VOCAB, (1, 5))
    capture = MlpCapture(model, [0], stop_early=True)
    assert set(capture(ids)) == {0} and capture.last_logits is None
    assert ran == []
    assert set(MlpCapture(model, [1], stop_early=True)(ids)) == {1}
    assert ran == ["block 1"]
    full = MlpCapture(model, [0], stop_early=False)
    full(ids)
    assert full.last_logits.shape == (1, 5, VOCAB) and ran[-1] == "final norm"
    for handle in handles:
        handle.remove()


# ----------------------------------------------------------------------------------------------------------------
# End to end with stand-in sparse layers whose answers are known


class _StandIn(SparseLayer):
    """One-unit "sparse layer": `fn(hidden_states)` as its output, code = unit 0 with weight `weight`."""

    def __init__(self, fn, weight: float = 1.0) -> None:
        super().__init__(SparseSpec(d_in=D_MODEL, d_out=D_MODEL))
        self.fn, self.weight = fn, weight

    @property
    def num_units(self) -> int:
        return 1

    def encode(self, x: torch.Tensor) -> SparseCode:
        index = torch.zeros(*x.shape[:-1], 1, dtype=torch.long)
        return SparseCode(index, torch.full(index.shape, self.weight, dtype=x.dtype))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fn(hidden_states)


class _ExactMlp(_StandIn):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__(mlp)
        self.mlp = mlp  # registered, so it follows .eval() / dtype like a real layer


CFG = EvalConfig(batch_sequences=3, generation_prompts=4, prompt_tokens=3, continuation_tokens=6, histogram=True)


def _eval_sequences(seed: int = 0, num: int = 7, length: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (num, length), generator=torch.Generator().manual_seed(seed))


def _mean_mlp_outputs(model, layers, sequences) -> dict[int, torch.Tensor]:
    ys = [MlpCapture(model, layers)(sequences[i : i + 1]) for i in range(len(sequences))]
    return {i: torch.cat([y[i][1] for y in ys]).double().mean(0).float() for i in layers}


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_mlp_is_perfect(family, tmp_path):
    model = tiny_base_model(family)
    blocks = decoder_blocks(model)
    layers = {0: _ExactMlp(blocks[0].mlp), 1: _ExactMlp(blocks[1].mlp)}
    sequences = _eval_sequences()
    report = evaluate_sparse_layers(model, layers, sequences, CFG, plots_dir=tmp_path / "plots", progress=False)

    assert report["eval_tokens"] == sequences.numel()
    ce = report["ce"]
    assert ce["predicted_tokens"] == 7 * 11
    assert ce["delta"] == 0.0 and ce["spliced"] == ce["base"]
    assert abs(ce["kl_base_spliced"]) < 1e-7
    assert ce["ce_recovered_zero"] == 1.0 and ce["ce_recovered_mean"] == 1.0
    assert ce["zero_ablation"] != ce["base"] and ce["mean_ablation"] != ce["base"]
    for i in ("0", "1"):
        rec = report["layers"][i]
        assert rec["relative_mse"] < 1e-12 and rec["fvu"] < 1e-12 and rec["nmse_paper"] < 1e-12 and rec["mse"] < 1e-12
        assert rec["l0"] == 1.0 and rec["dead_units"] == 0 and rec["dead_fraction"] == 0.0 and rec["num_units"] == 1
    gen = report["generation"]
    assert gen["n_prompts"] == 4 and gen["match_curve"] == [1.0] * 6 and gen["match_at_end"] == 1.0
    # the model is left as it was: original MLPs back in place
    assert blocks[0].mlp is layers[0].mlp and not model.training


def test_base_ce_matches_a_plain_forward():
    model = tiny_base_model("gpt2")
    sequences = _eval_sequences(num=5)
    report = evaluate_sparse_layers(
        model, {1: _ExactMlp(decoder_blocks(model)[1].mlp)}, sequences, CFG, progress=False
    )
    with torch.no_grad():
        expected = next_token_ce(model(input_ids=sequences).logits, sequences).double().mean().item()
    assert report["ce"]["base"] == pytest.approx(expected, rel=1e-6)


def test_zero_layer_recovers_nothing_over_zero_ablation():
    model = tiny_base_model("llama")
    layers = {0: _StandIn(torch.zeros_like, weight=0.0)}
    report = evaluate_sparse_layers(model, layers, _eval_sequences(), CFG, progress=False)
    ce = report["ce"]
    assert ce["spliced"] == ce["zero_ablation"]
    assert ce["ce_recovered_zero"] == 0.0
    rec = report["layers"]["0"]
    assert rec["relative_mse"] == pytest.approx(1.0)  # predicting 0: Σ‖y‖² / Σ‖y‖²
    assert rec["l0"] == 0.0 and rec["dead_units"] == 1 and rec["dead_fraction"] == 1.0


@pytest.mark.parametrize("given", [True, False], ids=["mean_outputs given", "mean over eval tokens"])
def test_mean_layer_recovers_nothing_over_mean_ablation(given):
    model = tiny_base_model("gpt_neox")
    sequences = _eval_sequences()
    means = _mean_mlp_outputs(model, [0, 1], sequences)
    layers = {i: _StandIn(lambda h, m=means[i]: m.expand_as(h)) for i in (0, 1)}
    report = evaluate_sparse_layers(
        model, layers, sequences, CFG, mean_outputs=means if given else None, progress=False
    )
    ce = report["ce"]
    if given:
        assert ce["spliced"] == ce["mean_ablation"] and ce["ce_recovered_mean"] == 0.0
    else:
        assert ce["ce_recovered_mean"] == pytest.approx(0.0, abs=1e-5)
    for i in ("0", "1"):
        assert report["layers"][i]["fvu"] == pytest.approx(1.0, rel=1e-5)  # predicting the mean explains nothing


def test_mean_outputs_must_cover_every_layer():
    model = tiny_base_model("gpt2")
    layers = {i: _ExactMlp(decoder_blocks(model)[i].mlp) for i in (0, 1)}
    with pytest.raises(ValueError, match=r"layer\(s\) \[1\]"):
        evaluate_sparse_layers(model, layers, _eval_sequences(), CFG, mean_outputs={0: torch.zeros(D_MODEL)})


def test_no_generation_when_no_prompts():
    model = tiny_base_model("gpt2")
    cfg = EvalConfig(batch_sequences=4, generation_prompts=0)
    report = evaluate_sparse_layers(
        model, {0: _ExactMlp(decoder_blocks(model)[0].mlp)}, _eval_sequences(), cfg, progress=False
    )
    assert report["generation"] is None


def test_firing_counts_and_plots(tmp_path):
    """A two-unit layer whose unit 1 never fires: one dead unit, both PNGs written, JSON-able report."""
    import json

    class TwoUnits(_ExactMlp):
        num_units = 2

    model = tiny_base_model("gpt2")
    report = evaluate_sparse_layers(
        model, {1: TwoUnits(decoder_blocks(model)[1].mlp)}, _eval_sequences(), CFG, plots_dir=tmp_path, progress=False
    )
    rec = report["layers"]["1"]
    assert rec["dead_units"] == 1 and rec["dead_fraction"] == 0.5 and rec["num_units"] == 2
    histogram = rec["firing_frequency_histogram"]
    assert histogram == str(tmp_path / "firing_frequency_layer1.png")
    match_plot = report["generation"]["match_curve_plot"]
    for path in (histogram, match_plot):
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    json.dumps(report, allow_nan=False)

    no_hist = EvalConfig(batch_sequences=4, generation_prompts=2, continuation_tokens=2, histogram=False)
    report = evaluate_sparse_layers(
        model, {1: TwoUnits(decoder_blocks(model)[1].mlp)}, _eval_sequences(), no_hist, progress=False
    )
    assert report["layers"]["1"]["firing_frequency_histogram"] is None
    assert report["generation"]["match_curve_plot"] is None


# ----------------------------------------------------------------------------------------------------------------
# Generation match curve


def test_generation_match_curve():
    base = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 5, 6]])
    other = torch.tensor(
        [
            [1, 2, 3],  # identical throughout
            [1, 9, 3],  # diverges at token 2 (the later match does not count)
            [7, 2, 3],  # diverges at token 1
            [4, 5, 0],  # diverges at token 3
        ]
    )
    assert generation_match_curve(base, other) == [3 / 4, 2 / 4, 1 / 4]
    assert generation_match_curve(base, base) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="same shape"):
        generation_match_curve(base, other[:, :2])


# ----------------------------------------------------------------------------------------------------------------
# The replay from the first sparse layer's block


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_from_the_sparse_layers_block_gives_the_full_forwards_report_bit_for_bit(family, monkeypatch):
    """The spliced and ablated forwards replay only the blocks from the first sparse layer's (suffix.py): the report
    must equal, float for float, the one every forward computed whole — on every family (masks, rotary embeddings,
    parallel residuals are what the replay must carry)."""
    from expertize.conversion.evaluation import shared_passes
    from expertize.conversion.specialization.suffix import SuffixRunner

    model = tiny_base_model(family)
    mlp = decoder_blocks(model)[1].mlp
    layers = {1: _StandIn(lambda h, mlp=mlp: 0.5 * mlp(h) + 0.1 * torch.tanh(h))}  # differs from the MLP
    sequences = _eval_sequences()
    cfg = EvalConfig(batch_sequences=3, generation_prompts=0, histogram=False)
    replays = []
    original = SuffixRunner.logits
    monkeypatch.setattr(SuffixRunner, "logits", lambda self, *a, **k: replays.append(self.layer) or original(self, *a,
                                                                                                                  **k))
    replayed = evaluate_sparse_layers(model, layers, sequences, cfg, progress=False)
    # 3 batches: the first batch's check, then per batch the spliced forward and the zero ablation; the mean
    # ablation's second pass (mean over the eval tokens) runs whole
    assert replays == [1] * (1 + 3 * 2)

    def full_forwards_only(self, *args):
        self.runner, self.prefix, self.checked = None, None, True

    monkeypatch.setattr(shared_passes.Replay, "__init__", full_forwards_only)
    replays.clear()
    whole = evaluate_sparse_layers(model, layers, sequences, cfg, progress=False)
    assert replays == [] and replayed == whole
    assert replayed["ce"]["delta"] != 0.0  # the layer is not the MLP: the comparison has something to compare


def test_a_replay_that_differs_from_the_full_forward_is_not_used(monkeypatch):
    """Where the replay does not reproduce the base forward's logits bit for bit on the first batch, the evaluation
    computes every forward whole: the report is the full forwards' and the replay is never asked again."""
    from expertize.conversion.specialization.suffix import SuffixRunner

    model = tiny_base_model("llama")
    layers = {1: _StandIn(lambda h: 0.5 * h)}
    sequences = _eval_sequences()
    cfg = EvalConfig(batch_sequences=3, generation_prompts=0, histogram=False)
    expected = evaluate_sparse_layers(model, layers, sequences, cfg, progress=False)
    replays = []
    original = SuffixRunner.logits
    monkeypatch.setattr(SuffixRunner, "logits", lambda self, *a, **k: replays.append(1) or original(self, *a, **k)
                        + 1e-3)  # a replay off by a little
    assert evaluate_sparse_layers(model, layers, sequences, cfg, progress=False) == expected
    assert replays == [1]  # the first batch's check only
