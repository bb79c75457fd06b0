"""Experiment tracking (training/tracking.py, `train.log_with`): TensorBoard event files written by distillation and
healing hold loss, L0, dead fraction, lr and throughput at every log interval, read back with TensorBoard's own
EventAccumulator; a tracker whose package is missing fails before any step, naming the fix."""

import pytest
import torch

from expertize.conversion.recipe.data import DataConfig
from expertize.conversion.errors import ExpertizeError
from expertize.conversion.recipe import HealConfig, TrainConfig
from expertize.conversion.surgery.splice import splice
from expertize.conversion.training import tracking
from expertize.conversion.device import make_accelerator
from expertize.conversion.training.distill import Trainer
from expertize.conversion.training.heal import Healer
from expertize.conversion.training.log import read_log
from expertize.modeling import MxdSpec, build_sparse_layer
from tests.conftest import D_HIDDEN, D_MODEL, tiny_base_model, tiny_tokenizer, write_corpus

REQUIRED = {"loss", "l0", "dead_fraction", "lr", "tokens_per_second"}


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(folder.glob("events.out.tfevents.*"))
    assert events, f"no event file in {folder}"
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class Batches:
    def __init__(self, steps: int):
        gen = torch.Generator().manual_seed(0)
        self.local_tokens = 64
        self.data = [{0: (torch.randn(64, D_MODEL, generator=gen), torch.randn(64, D_MODEL, generator=gen))}
                     for _ in range(steps)]

    def batches(self, start_step=0):
        yield from self.data[start_step:]


def _trainer(tmp_path, log_with: str, steps: int = 6) -> Trainer:
    torch.manual_seed(0)
    layers = {0: build_sparse_layer(MxdSpec(d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=16, k=4))}
    cfg = TrainConfig(lr=1e-2, warmup_steps=0, tokens_per_step=64, checkpoint_every=0, log_every=2, device="cpu",
                      auxk_coef=1 / 32, dead_window_tokens=128, log_with=log_with)
    return Trainer(layers, Batches(steps), cfg, total_steps=steps, accelerator=make_accelerator(torch.device("cpu")),
                   run_dir=tmp_path, progress=False)


def test_distillation_writes_tensorboard_scalars(tmp_path):
    _trainer(tmp_path, "tensorboard").fit()
    scalars = _scalars(tmp_path / "tracking" / "distil")
    assert REQUIRED | {"auxk", "layers/0/loss", "layers/0/dead"} <= set(scalars)
    log = read_log(tmp_path / "train_log.jsonl")
    assert [step for step, _ in scalars["loss"]] == [r["step"] for r in log] == [2, 4, 6]
    for key in ("loss", "l0", "dead_fraction", "lr"):
        assert [v for _, v in scalars[key]] == pytest.approx([r[key] for r in log], rel=1e-6), key
    assert all(v > 0 for _, v in scalars["tokens_per_second"])


def test_healing_writes_tensorboard_scalars(tmp_path):
    torch.manual_seed(0)
    layer = build_sparse_layer(MxdSpec(d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=16, k=4))
    torch.nn.init.normal_(layer.W_dec, std=0.1)
    model = splice(tiny_base_model("llama"), {1: layer})
    data = DataConfig(paths=[str(write_corpus(tmp_path / "corpus.txt", n_docs=200))], context_length=16)
    cfg = HealConfig(tokens=16 * 8 * 4, batch_sequences=8, lr=3e-3, warmup_steps=0, log_every=2, checkpoint_every=0)
    healer = Healer(model, tiny_base_model("llama"), tiny_tokenizer(), data, cfg, family="llama",
                    device=torch.device("cpu"), run_dir=tmp_path, progress=False, log_with="tensorboard")
    healer.fit()
    scalars = _scalars(tmp_path / "tracking" / "heal")
    assert REQUIRED | {"kl", "aux"} <= set(scalars)
    log = read_log(tmp_path / "heal_log.jsonl")
    assert [step for step, _ in scalars["loss"]] == [r["step"] for r in log] == [2, 4]
    assert [v for _, v in scalars["l0"]] == pytest.approx([r["l0"] for r in log]) and 0 < log[-1]["l0"] <= 4
    assert 0.0 <= log[-1]["dead_fraction"] <= 1.0


def test_no_tracker_writes_nothing(tmp_path):
    _trainer(tmp_path, "none").fit()
    assert not (tmp_path / "tracking").exists() and read_log(tmp_path / "train_log.jsonl")


def test_a_missing_tracker_package_fails_before_training(tmp_path, monkeypatch):
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [])
    trainer = _trainer(tmp_path, "tensorboard")
    with pytest.raises(ExpertizeError, match=r"train.log_with='tensorboard' needs the 'tensorboard' package.*"
                                             r"expertize\[tracking\].*--set train.log_with=none"):
        trainer.fit()
    assert trainer.step == 0 and not (tmp_path / "train_log.jsonl").exists()


def test_scalars_flattens_records():
    record = {"step": 4, "loss": 0.5, "layers": {"8": {"dead": 3, "l0": 2.0}}, "note": "x", "flag": True,
              "bad": float("nan")}
    assert tracking.scalars(record) == {"loss": 0.5, "layers/8/dead": 3, "layers/8/l0": 2.0}
