"""Keeping experts alive in distillation (training/distill.py + training/auxk.py), and the tokens that matter.

- AuxK off (train.auxk_coef = 0) is bit-identical to the plain loop, even with a window that marks units dead;
- AuxK on equals a reference loop written here from the building blocks (DeadUnitTracker, auxk_loss), bit for
  bit, and the log's per-layer dead counts and AuxK losses are that loop's;
- a run interrupted and resumed continues exactly (the trackers are in the checkpoint);
- kinds without AuxK train without it and the log says so once;
- special-token positions (data.exclude_special_positions) leave the batches, and with them the loss: a spike of
  the MLP output on BOS positions only changes neither the training nor the reconstruction metrics.
"""

import itertools
import json

import pytest
import torch

from expertize.conversion.data.activations import ActivationBatches
from expertize.conversion.data.mlp_pairs import excluded_token_ids, kept_positions
from expertize.conversion.data.text import iter_sequences, load_eval_sequences
from expertize.conversion.recipe.data import DataConfig
from expertize.conversion.evaluation.evaluate import evaluate_sparse_layers
from expertize.conversion.training.compute import make_adamw
from expertize.conversion.training.losses import LOSSES
from expertize.conversion.recipe import EvalConfig, TrainConfig
from expertize.conversion.training.auxk import DeadUnitTracker, auto_k_aux, auxk_loss, fired_units
from expertize.conversion.device import make_accelerator
from expertize.conversion.training.distill import Trainer
from expertize.conversion.training.engine import lr_lambda
from expertize.conversion.training.errors import RunInterrupted
from expertize.conversion.training.log import read_log
from expertize.modeling import build_sparse_layer
from tests.conftest import D_MODEL, tiny_base_model, tiny_tokenizer, write_corpus
from tests.kinds import AUXK_KINDS, KINDS, ROWS, tiny_spec

CPU = torch.device("cpu")
TOKENS = 64
# Every kind with AuxK (tests/kinds.py reads it from the layer class), with many units and a small K: units die
# within the 2-step window, so AuxK has work to do.
SPECS = {kind: {**tiny_spec(kind), ROWS[kind].spec_class.units_field: 48, "k": 2} for kind in AUXK_KINDS}


class FixedBatches:
    """ActivationBatches' interface over seeded in-memory (x, y) pairs per layer."""

    def __init__(self, layers, steps, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.local_tokens = TOKENS
        self.data = [{i: (torch.randn(TOKENS, D_MODEL, generator=gen), torch.randn(TOKENS, D_MODEL, generator=gen))
                      for i in layers} for _ in range(steps)]
        self.stop_at = None  # a KeyboardInterrupt when the loop asks for this step's batch

    def batches(self, start_step=0):
        for step in range(start_step, len(self.data)):
            if step == self.stop_at:
                raise KeyboardInterrupt
            yield self.data[step]


def _layers(kinds=tuple(AUXK_KINDS), seed: int = 0):
    """One layer per kind (layer i: kinds[i]), trained together as the layers of one model are."""
    torch.manual_seed(seed)
    return {i: build_sparse_layer(SPECS[kind]) for i, kind in enumerate(kinds)}


def _copy(layers):
    out = {i: build_sparse_layer(layer.spec) for i, layer in layers.items()}
    for i, layer in out.items():
        layer.load_state_dict(layers[i].state_dict())
    return out


def _cfg(**overrides) -> TrainConfig:
    settings = dict(lr=3e-2, warmup_steps=2, schedule="cosine", min_lr_ratio=0.0, tokens_per_step=TOKENS, checkpoint_every=0,
                    log_every=1, grad_clip=0.5, device="cpu", dead_window_tokens=2 * TOKENS)
    return TrainConfig(**{**settings, **overrides})


def _train(layers, batches, cfg, tmp_path, steps, log=None):
    trainer = Trainer(layers, batches, cfg, total_steps=steps, accelerator=make_accelerator(CPU), run_dir=tmp_path,
                      progress=False, log=log)
    trainer.fit()
    return trainer


def _reference(layers, batches, cfg, steps, auxk_coef: float):
    """The loop before AuxK (tests/test_training.py's reference), plus, when auxk_coef > 0, the AuxK term computed
    from the building blocks: per layer a DeadUnitTracker fed with each step's code, and auxk_loss on its dead mask
    once a window has passed. Returns the per-step records {layer: (dead count, auxk loss or None)}."""
    params = [p for _, layer in sorted(layers.items()) for p in layer.parameters()]
    # the engine's AdamW kernel (fused on a CPU, training/compute.py; tests/test_compute.py bounds it against
    # the per-parameter loop): this reference checks the loop around it, bit for bit
    optimizer = make_adamw(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                           device=torch.device("cpu"))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, steps))
    trackers = {i: DeadUnitTracker(layer.num_units, cfg.dead_window_tokens) for i, layer in layers.items()}
    with torch.no_grad():
        for i, (_, y) in batches.data[0].items():
            layers[i].b_dec.copy_(y.mean(0))
    records = []
    for batch in batches.data[:steps]:
        codes, record = {}, {}
        for layer in layers.values():
            layer.train()
        loss = 0
        for i, (x, y) in sorted(batch.items()):
            out = layers[i](x)
            loss = loss + LOSSES[cfg.loss](out, y)
            codes[i] = layers[i].encode(x)
        aux = {}
        if auxk_coef > 0:
            for i, (x, y) in sorted(batch.items()):
                if trackers[i].may_have_dead:
                    k_aux = auto_k_aux(D_MODEL)
                    aux[i] = auxk_loss(layers[i], x, y, layers[i](x).detach(), trackers[i].dead_mask(), k_aux)
                    loss = loss + auxk_coef * aux[i]
        loss.backward()
        for layer in layers.values():
            layer.before_optimizer_step()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        for layer in layers.values():
            layer.after_optimizer_step()
        for i, code in codes.items():
            active = layers[i].active_entries(code[1])
            trackers[i].update_fired(fired_units(code[0], active, layers[i].num_units), TOKENS)
            record[str(i)] = (int(trackers[i].dead_mask().sum()), float(aux[i].detach()) if i in aux else None)
        records.append(record)
    return records


def _assert_same_weights(layers, reference):
    for i, layer in layers.items():
        for key, value in reference[i].state_dict().items():
            torch.testing.assert_close(layer.state_dict()[key], value, rtol=0, atol=0, msg=f"{i}.{key}")


def test_auxk_off_is_bit_identical_to_the_plain_loop(tmp_path):
    layers = _layers()
    reference = _copy(layers)
    batches = FixedBatches(layers, 8)
    cfg = _cfg(auxk_coef=0.0)
    _train(layers, batches, cfg, tmp_path, 8)
    records = _reference(reference, batches, cfg, 8, auxk_coef=0.0)
    _assert_same_weights(layers, reference)
    log = read_log(tmp_path / "train_log.jsonl")
    # Units do die within the 2-step window here, so the off switch is tested where AuxK would act.
    assert not any("auxk" in r for r in log)
    assert all(any(r["layers"][str(i)]["dead"] > 0 for r in log) for i in layers)
    assert [{i: v["dead"] for i, v in r["layers"].items()} for r in log] == [
        {i: dead for i, (dead, _) in rec.items()} for rec in records
    ]


def test_auxk_on_equals_the_reference_built_from_the_blocks(tmp_path):
    layers = _layers()
    reference = _copy(layers)
    batches = FixedBatches(layers, 8)
    cfg = _cfg(auxk_coef=0.5, auxk_k="auto")
    trainer = _train(layers, batches, cfg, tmp_path, 8)
    records = _reference(reference, batches, cfg, 8, auxk_coef=0.5)
    for i, layer in layers.items():  # float: the reference sums the same terms in the same order
        for key, value in reference[i].state_dict().items():
            torch.testing.assert_close(layer.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=f"{i}.{key}")
    log = read_log(tmp_path / "train_log.jsonl")
    assert trainer.auxk_layers == set(layers) and trainer.window_tokens == 2 * TOKENS
    for r, rec in zip(log, records, strict=True):
        for i, (dead, aux) in rec.items():
            assert r["layers"][i]["dead"] == dead
            if aux is None:  # no window has passed yet: no AuxK term (pytest >= 9.2 refuses approx(None, rel=...))
                assert r["layers"][i].get("auxk") is None
            else:
                assert r["layers"][i].get("auxk") == pytest.approx(aux, rel=1e-5)
    assert all(any(r["layers"][str(i)].get("auxk", 0) > 0 for r in log) for i in layers)  # AuxK acted
    assert all("auxk" not in r for r in log[:2])  # not before a whole window has passed
    # ... and it changed the trajectory (so the test above can fail).
    plain = _layers()
    _train(plain, batches, _cfg(auxk_coef=0.0), tmp_path / "plain", 8)
    for i in layers:
        assert any(not torch.equal(plain[i].state_dict()[k], v) for k, v in layers[i].state_dict().items()), i


def test_auxk_run_resumes_exactly(tmp_path):
    cfg = _cfg(auxk_coef=0.5, checkpoint_every=2)
    straight = _layers(("mxd", "mxd"))
    batches = FixedBatches(straight, 9)
    _train(straight, batches, cfg, tmp_path / "straight", 9)

    first = _layers(("mxd", "mxd"))
    interrupted = FixedBatches(first, 9)
    interrupted.stop_at = 5  # between steps 5 and 6: the engine saves step 5 and stops
    with pytest.raises(RunInterrupted, match="saved a checkpoint of step 5"):
        _train(first, interrupted, cfg, tmp_path / "resumed", 9)
    resumed_layers = _layers(("mxd", "mxd"))
    resumed = _train(resumed_layers, FixedBatches(resumed_layers, 9), cfg, tmp_path / "resumed", 9)
    _assert_same_weights(resumed_layers, straight)
    assert resumed.dead_units[0].tokens_seen == 9 * TOKENS
    strip = lambda path: [{k: v for k, v in r.items() if k != "seconds"} for r in read_log(path)]  # noqa: E731
    assert strip(tmp_path / "resumed" / "train_log.jsonl") == strip(tmp_path / "straight" / "train_log.jsonl")


def test_kinds_without_auxk_train_without_it_and_say_so(tmp_path):
    torch.manual_seed(0)
    without = [kind for kind in KINDS if kind not in AUXK_KINDS]
    layers = {i: build_sparse_layer(tiny_spec(kind)) for i, kind in enumerate(without)}
    messages = []
    trainer = _train(layers, FixedBatches(layers, 4), _cfg(auxk_coef=1 / 32, balance="none", preact_coef=0.0), tmp_path, 4,
                     log=messages.append)
    assert trainer.auxk_layers == set()
    assert messages == [
        f"kind(s) {', '.join(without)} have no AuxK (their units are not chosen by a top-k over their own "
        "parameters), so they train without it; set train.auxk_coef=0 to silence this note"
    ]
    assert all("auxk" not in r for r in read_log(tmp_path / "train_log.jsonl"))


def test_dead_unit_settings_are_checked():
    # The default handling is the selection-bias balance; AuxK is an option (benchmarks/dead_units.py says why).
    default = TrainConfig()
    assert (default.balance, default.balance_rate, default.auxk_coef, default.auxk_k) == ("floor", 10.0, 0.0, "auto")
    assert default.resample_every_tokens == 0
    with pytest.raises(ValueError, match=r"train.auxk_coef: must be >= 0 \(0 disables AuxK\), got -1"):
        TrainConfig(auxk_coef=-1)
    with pytest.raises(ValueError, match=r'train.dead_window_tokens: must be >= 1, "auto" or "interval", got 0'):
        TrainConfig(dead_window_tokens=0)
    with pytest.raises(ValueError, match=r"train.balance_rate: must be > 0, got 0"):
        TrainConfig(balance_rate=0)
    with pytest.raises(ValueError, match=r'train.resample_every_tokens: must be >= 0 \(0: off\) or "auto", got -1'):
        TrainConfig(resample_every_tokens=-1)


# -- tokens that matter -------------------------------------------------------------------------------------------


def test_special_positions_leave_the_batches_but_not_the_step_boundaries(tmp_path):
    tokenizer = tiny_tokenizer()
    cfg = DataConfig(paths=[str(write_corpus(tmp_path / "c.txt", n_docs=300))], context_length=16,
                     train_tokens=16 * 40)
    excluded = excluded_token_ids(cfg, tokenizer)
    assert excluded == [0, 1, 2, 3] and excluded_token_ids(DataConfig(**{**vars(cfg), "exclude_special_positions":
                                                                           False}), tokenizer) == []

    def make(exclude):
        return ActivationBatches(
            lambda ids: {0: (ids.reshape(-1, 1).float(), ids.reshape(-1, 1).float())},
            lambda start: iter_sequences(cfg, tokenizer, "train", start), context_length=16, tokens_per_step=40,
            shuffle_buffer_tokens=90, capture_batch_sequences=4, seed=1, device=CPU, exclude_token_ids=exclude)

    full = [b[0][0].flatten() for b in itertools.islice(make(()).batches(), 16)]
    kept = [b[0][0].flatten() for b in itertools.islice(make(excluded).batches(), 16)]
    for a, b in zip(full, kept, strict=True):  # step by step: the same positions, minus the special ones
        assert torch.equal(a[~torch.isin(a, torch.tensor(excluded).float())], b)
    assert sum(len(a) - len(b) for a, b in zip(full, kept)) >= 16  # every sequence starts with BOS
    resumed = [b[0][0].flatten() for b in itertools.islice(make(excluded).batches(5), 11)]
    assert all(torch.equal(a, b) for a, b in zip(resumed, kept[5:], strict=True))
    assert kept_positions(torch.tensor([[1, 5, 2]]), []) is None


def _spike_bos(model, layer: int, bos: int):
    """A forward hook adding 1e4 to one MLP's output at BOS positions only."""
    state = {}

    def pre(module, args, kwargs):
        state["ids"] = kwargs["input_ids"]

    def hook(module, args, output):
        return output + 1e4 * (state["ids"] == bos).unsqueeze(-1).to(output)

    mlp = model.model.layers[layer].mlp
    return [model.register_forward_pre_hook(pre, with_kwargs=True), mlp.register_forward_hook(hook)]


def test_a_bos_only_spike_changes_neither_the_training_nor_the_reconstruction_metrics(tmp_path):
    """The MLP output at BOS positions of the replaced layer is spiked by 1e4: with special positions excluded,
    the distilled weights (AuxK on) and the evaluation's FVU / NMSE / MSE / L0 / dead units stay exactly the same;
    without the exclusion the spike dominates the squared error."""
    tokenizer = tiny_tokenizer()
    cfg = DataConfig(paths=[str(write_corpus(tmp_path / "c.txt", n_docs=400))], context_length=16,
                     train_tokens=16 * 48, eval_tokens=16 * 8, eval_fraction=0.2)
    excluded = excluded_token_ids(cfg, tokenizer)
    base = tiny_base_model("llama")
    spec = dict(kind="mxd", d_in=D_MODEL, d_out=D_MODEL, d_hidden=24, num_experts=32, k=4)
    train = _cfg(auxk_coef=0.1, tokens_per_step=64, shuffle_buffer_tokens=256, capture_batch_sequences=8)
    eval_ids = load_eval_sequences(cfg, tokenizer)

    def run(spike: bool, exclude):
        from expertize.conversion.data.mlp_pairs import MlpCapture

        handles = _spike_bos(base, 1, tokenizer.bos_token_id) if spike else []
        try:
            batches = ActivationBatches(
                MlpCapture(base, [1]), lambda start: iter_sequences(cfg, tokenizer, "train", start),
                context_length=16, tokens_per_step=64, shuffle_buffer_tokens=256, capture_batch_sequences=8,
                seed=0, device=CPU, exclude_token_ids=exclude)
            torch.manual_seed(0)
            layers = {1: build_sparse_layer(spec)}
            run_dir = tmp_path / f"run-{spike}-{bool(exclude)}"
            Trainer(layers, batches, train, total_steps=12, accelerator=make_accelerator(CPU), run_dir=run_dir,
                    progress=False).fit()
            eval_cfg = EvalConfig(generation_prompts=0, histogram=False)
            metrics = evaluate_sparse_layers(base, layers, eval_ids, eval_cfg, progress=False,
                                             exclude_token_ids=exclude)
        finally:
            for handle in handles:
                handle.remove()
        return layers[1].state_dict(), metrics

    clean, clean_metrics = run(False, excluded)
    spiked, spiked_metrics = run(True, excluded)
    for key, value in clean.items():
        torch.testing.assert_close(spiked[key], value, rtol=0, atol=0, msg=key)
    assert spiked_metrics["layers"] == clean_metrics["layers"]
    positions = clean_metrics["reconstruction_positions"]
    assert positions["excluded_token_ids"] == [0, 1, 2, 3] and positions["exclude_special_positions"]
    assert positions["tokens"] + positions["excluded_tokens"] == eval_ids.numel() and positions["excluded_tokens"] >= 8
    assert spiked_metrics["ce"]["base"] != clean_metrics["ce"]["base"]  # CE does cover the BOS positions
    # Without the exclusion the same spike dominates the loss and the FVU.
    _, included_metrics = run(True, ())
    assert included_metrics["layers"]["1"]["mse"] > 1000 * clean_metrics["layers"]["1"]["mse"]
    assert included_metrics["reconstruction_positions"] == {
        "exclude_special_positions": False, "excluded_token_ids": [], "tokens": eval_ids.numel(),
        "excluded_tokens": 0}
    json.dumps(clean_metrics)  # JSON-able as it goes into metrics.json


def test_the_card_says_which_positions_the_fvu_covers(tmp_path):
    from expertize.conversion.publishing.card import CardInputs, render_model_card

    spec = build_sparse_layer(SPECS["mxd"]).spec.to_dict()
    metrics = {"layers": {"0": {"fvu": 0.1, "l0": 2.0}}, "eval_tokens": 4096,
               "reconstruction_positions": {"exclude_special_positions": True, "excluded_token_ids": [0, 50256],
                                            "tokens": 4064, "excluded_tokens": 32}}
    card = str(render_model_card(tmp_path, CardInputs(base_model="gpt2", layers={0: spec}, recipe_summary=None,
                                                      metrics=metrics)))
    assert ("- Positions: these metrics are computed over the 4,064 held-out positions that do not hold a special "
            "token; the 32 positions holding one (token ids 0, 50256") in card
    metrics["reconstruction_positions"] = {"exclude_special_positions": False, "excluded_token_ids": [],
                                           "tokens": 4096, "excluded_tokens": 0}
    card = str(render_model_card(tmp_path, CardInputs(base_model="gpt2", layers={0: spec}, recipe_summary=None,
                                                      metrics=metrics)))
    assert "- Positions: these metrics are computed over every held-out position (4,096), special tokens included." \
        in card
