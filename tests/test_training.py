"""The one training engine: layer hooks in healing, non-finite detection, Ctrl-C, resume, device choice, loss curve.

Fast: tiny layers and in-memory batches built here (the end-to-end runs are in test_upcycle.py / test_heal.py).
"""

import json
import math

import pytest
import torch
from torch import nn

from expertize.conversion.recipe.data import DataConfig
from expertize.conversion.errors import ExpertizeError, RunFailed
from expertize.conversion.recipe import HealConfig, TrainConfig
from expertize.conversion.surgery.splice import splice
from expertize.conversion.training.compute import make_adamw
from expertize.conversion import device as device_mod
from expertize.conversion.device import make_accelerator, resolve_device
from expertize.conversion.training.distill import Trainer
from expertize.conversion.training.engine import Engine, OptimConfig, lr_lambda
from expertize.conversion.training.errors import RunInterrupted, TrainingDiverged
from expertize.conversion.training.heal import Healer
from expertize.conversion.training.together import train_together
from expertize.conversion.training.log import plot_loss_curve, read_log, truncate_log
from expertize.modeling import MxdSpec, build_sparse_layer
from tests.conftest import D_HIDDEN, D_MODEL, tiny_base_model, tiny_tokenizer, write_corpus

# -- a toy task: y = W x on fixed batches; `poison` / `interrupt` inject failures at chosen steps ---------------------


class HookSpy(nn.Module):
    """A layer-like module counting the engine's optimizer hooks (and optionally corrupting the weight)."""

    def __init__(self, weight: nn.Parameter, corrupt_at: int | None = None) -> None:
        super().__init__()
        self.weight, self.corrupt_at, self.calls = weight, corrupt_at, []

    def before_optimizer_step(self) -> None:
        self.calls.append("before")

    def after_optimizer_step(self) -> None:
        self.calls.append("after")
        if self.corrupt_at is not None and len(self.calls) == 2 * self.corrupt_at:
            with torch.no_grad():
                self.weight[0, 0] = math.inf  # non-finite weights under a finite loss


class Toy(Engine):
    name, section = "toy", "train"

    def __init__(self, tmp_path, *, steps=6, poison=None, interrupt_fetch=None, interrupt_loss=None, corrupt_at=None,
                 log=None, **optim):
        torch.manual_seed(0)
        self.net = nn.Linear(4, 4)
        self.spy = HookSpy(self.net.weight, corrupt_at)
        self.poison, self.interrupt_fetch, self.interrupt_loss = poison, interrupt_fetch, interrupt_loss
        optim = {"lr": 1e-2, "log_every": 1, "checkpoint_every": 2, "grad_clip": 1.0, **optim}
        super().__init__(self.net, self.net.parameters(), OptimConfig(**optim), total_steps=steps, tokens_per_step=8,
                         checkpoint_path=tmp_path / "ckpt" / "state.pt", log_path=tmp_path / "log.jsonl",
                         hook_layers=[self.spy], progress=False, log=log)

    def batches(self, start_step):
        gen = torch.Generator().manual_seed(1)
        xs = [torch.randn(8, 4, generator=gen) for _ in range(self.total_steps)]
        for step in range(start_step, self.total_steps):
            if step == self.interrupt_fetch:
                raise KeyboardInterrupt
            x = xs[step] * (math.nan if step + 1 == self.poison else 1.0)
            yield x, x.flip(-1)

    def compute_loss(self, batch):
        if self.step + 1 == self.interrupt_loss:
            raise KeyboardInterrupt
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean()
        return loss, loss.detach()

    def record(self, parts):
        return {"loss": parts.item()}

    def model_state(self):
        return self.net.state_dict()

    def load_model_state(self, state):
        self.net.load_state_dict(state)


def _saved(tmp_path):
    return torch.load(tmp_path / "ckpt" / "state.pt", weights_only=False)


def test_engine_calls_the_layer_hooks_around_every_optimizer_step(tmp_path):
    toy = Toy(tmp_path)
    train_together([toy])
    assert toy.spy.calls == ["before", "after"] * 6
    assert [r["step"] for r in read_log(tmp_path / "log.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_healing_keeps_mxd_unit_norm_experts(tmp_path):
    """Healing goes through the engine, so MxD's unit_norm_experts hooks run (healing skipped them before)."""
    torch.manual_seed(0)
    spec = MxdSpec(d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=16, k=4, unit_norm_experts=True)
    layer = build_sparse_layer(spec)
    torch.nn.init.normal_(layer.W_dec, std=0.1)
    base = tiny_base_model("llama")
    model = splice(tiny_base_model("llama"), {1: layer})
    data = DataConfig(paths=[str(write_corpus(tmp_path / "corpus.txt", n_docs=200))], context_length=16)
    cfg = HealConfig(tokens=16 * 8 * 4, batch_sequences=8, lr=3e-2, warmup_steps=0, log_every=1, checkpoint_every=0)
    healer = Healer(model, base, tiny_tokenizer(), data, cfg, family="llama", device=torch.device("cpu"),
                    run_dir=tmp_path / "run", progress=False)
    initial = layer.W_experts.detach().clone()
    healed = healer.fit()
    experts = healed.model.layers[1].mlp.W_experts
    assert healer.step == 4 and (experts - initial).abs().max() > 1e-3  # trained, and stayed on the unit sphere
    torch.testing.assert_close(experts.norm(dim=-1), torch.ones(16), rtol=0, atol=1e-5)


def test_non_finite_loss_raises_and_keeps_the_last_good_checkpoint(tmp_path):
    toy = Toy(tmp_path, poison=5)
    with pytest.raises(TrainingDiverged) as caught:
        train_together([toy])
    message = str(caught.value)
    assert isinstance(caught.value, RunFailed)
    assert "non-finite" in message and "step 5 of 6" in message and "train.lr=0.01" in message
    assert "checkpoint of step 4" in message and "expertize upcycle RECIPE --restart" in message
    saved = _saved(tmp_path)
    assert saved["step"] == 4 and all(torch.isfinite(v).all() for v in saved["model"].values())
    # Same weights as a clean run after 4 steps: the poisoned step never reached the disk.
    clean = Toy(tmp_path / "clean", steps=4)
    train_together([clean])
    for key, value in clean.net.state_dict().items():
        torch.testing.assert_close(saved["model"][key], value, rtol=0, atol=0)
    assert [r["step"] for r in read_log(tmp_path / "log.jsonl")] == [1, 2, 3, 4]  # no NaN record logged


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    toy = Toy(tmp_path, corrupt_at=1, checkpoint_every=1)
    with pytest.raises(TrainingDiverged, match=r"the weights became non-finite .*no checkpoint was written"):
        train_together([toy])
    assert not (tmp_path / "ckpt" / "state.pt").exists()


def test_a_huge_learning_rate_diverges_instead_of_finishing(tmp_path):
    """lr=1e4 with an MxD layer: the run stops with TrainingDiverged, never finishes with NaN weights."""
    layers, batches = _distill_setup(unit_norm_experts=False)
    cfg = TrainConfig(lr=1e4, warmup_steps=0, tokens_per_step=64, checkpoint_every=0, log_every=1, device="cpu")
    trainer = Trainer(layers, batches, cfg, total_steps=200, accelerator=make_accelerator(torch.device("cpu")),
                      run_dir=tmp_path, progress=False)
    with pytest.raises(TrainingDiverged, match=r"Lower train.lr .*--restart"):
        trainer.fit()
    assert all(math.isfinite(r["loss"]) for r in read_log(tmp_path / "train_log.jsonl"))


def test_ctrl_c_between_steps_saves_and_resumes_exactly(tmp_path):
    messages = []
    with pytest.raises(RunInterrupted) as caught:
        train_together([Toy(tmp_path, interrupt_fetch=3)])
    assert isinstance(caught.value, KeyboardInterrupt) and isinstance(caught.value, RunFailed)
    assert str(caught.value).startswith("toy interrupted at step 3 of 6; saved a checkpoint of step 3")
    assert "Run the same command again to resume" in str(caught.value)
    assert _saved(tmp_path)["step"] == 3

    resumed = Toy(tmp_path, log=messages.append)
    train_together([resumed])
    assert messages == [f"resuming toy from step 3 of 6 ({tmp_path / 'ckpt' / 'state.pt'})"]
    straight = Toy(tmp_path / "straight")
    train_together([straight])
    for key, value in straight.net.state_dict().items():
        torch.testing.assert_close(resumed.net.state_dict()[key], value, rtol=0, atol=0)
    strip = lambda path: [{k: v for k, v in r.items() if k != "seconds"} for r in read_log(path)]  # noqa: E731
    assert strip(tmp_path / "log.jsonl") == strip(tmp_path / "straight" / "log.jsonl")


def test_ctrl_c_inside_a_step_keeps_the_last_checkpoint(tmp_path):
    with pytest.raises(RunInterrupted, match=r"interrupted at step 2 of 6; the last checkpoint is of step 2"):
        train_together([Toy(tmp_path, interrupt_loss=3)])
    with pytest.raises(RunInterrupted, match=r"at step 0 of 6; no checkpoint was written yet"):
        train_together([Toy(tmp_path / "early", interrupt_loss=1)])


# -- distillation: the engine reproduces today's loop exactly ---------------------------------------------------------


class FixedBatches:
    """ActivationBatches' interface over seeded in-memory (x, y) pairs per layer."""

    def __init__(self, layers, tokens, steps, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.local_tokens = tokens
        self.data = [{i: (torch.randn(tokens, D_MODEL, generator=gen), torch.randn(tokens, D_MODEL, generator=gen))
                      for i in layers} for _ in range(steps)]

    def batches(self, start_step=0):
        yield from self.data[start_step:]


def _distill_setup(steps=200, unit_norm_experts=True):
    torch.manual_seed(0)
    spec = MxdSpec(d_in=D_MODEL, d_out=D_MODEL, d_hidden=D_HIDDEN, num_experts=16, k=4,
                   unit_norm_experts=unit_norm_experts)
    layers = {0: build_sparse_layer(spec), 2: build_sparse_layer(spec)}
    return layers, FixedBatches(layers, 64, steps)


def test_distillation_matches_the_reference_loop_bit_for_bit(tmp_path):
    cfg = TrainConfig(lr=3e-3, warmup_steps=2, schedule="cosine", tokens_per_step=64, checkpoint_every=3,
                      log_every=2, grad_clip=0.5, device="cpu")
    layers, batches = _distill_setup(steps=6)
    reference = {i: build_sparse_layer(layer.spec) for i, layer in layers.items()}
    for i, layer in reference.items():
        layer.load_state_dict(layers[i].state_dict())
    Trainer(layers, batches, cfg, total_steps=6, accelerator=make_accelerator(torch.device("cpu")),
            run_dir=tmp_path, progress=False).fit()

    # The loop as it stood before the engine (conversion/train.py): b_dec from the first batch, then per step
    # forward -> nmse -> backward -> before hooks -> clip -> AdamW -> schedule -> zero grads -> after hooks.
    from expertize.conversion.training.losses import LOSSES

    params = [p for _, layer in sorted(reference.items()) for p in layer.parameters()]
    # the engine's AdamW kernel (fused on a CPU, training/compute.py; tests/test_compute.py bounds it against
    # the per-parameter loop): this reference checks the loop around it, bit for bit
    optimizer = make_adamw(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                           device=torch.device("cpu"))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, 6))
    with torch.no_grad():
        for i, (_, y) in batches.data[0].items():
            reference[i].b_dec.copy_(y.mean(0))
    for batch in batches.data:
        for layer in reference.values():
            layer.train()
        sum(LOSSES[cfg.loss](reference[i](x), y) for i, (x, y) in batch.items()).backward()
        for layer in reference.values():
            layer.before_optimizer_step()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        for layer in reference.values():
            layer.after_optimizer_step()
    for i, layer in layers.items():
        for key, value in reference[i].state_dict().items():
            torch.testing.assert_close(layer.state_dict()[key], value, rtol=0, atol=0, msg=f"{i}.{key}")
    assert [r["step"] for r in read_log(tmp_path / "train_log.jsonl")] == [2, 4, 6]


def test_optim_config_reads_train_and_heal_sections():
    heal = OptimConfig.from_config(HealConfig(lr=2e-3, warmup_steps=3), precision="bf16")
    assert (heal.lr, heal.warmup_steps, heal.schedule, heal.precision, heal.betas) == (2e-3, 3, "cosine", "bf16",
                                                                                       (0.9, 0.999))
    train = OptimConfig.from_config(TrainConfig(betas=[0.8, 0.9], grad_clip=None))
    assert train.betas == (0.8, 0.9) and train.grad_clip is None
    assert [round(lr_lambda(heal, 13)(s), 4) for s in (0, 2, 3, 13)] == [0.3333, 1.0, 1.0, 0.1]


# -- logs -----------------------------------------------------------------------------------------------------------


def test_truncate_log_drops_later_records_and_a_torn_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (2, 4, 6)) + '{"step": 8, "lo',
                    encoding="utf-8")
    truncate_log(path, 4)
    assert [r["step"] for r in read_log(path)] == [2, 4]


def test_loss_curve_png_from_the_distillation_and_healing_logs(tmp_path):
    assert plot_loss_curve([tmp_path / "train_log.jsonl"], tmp_path / "plots" / "loss.png") is None
    (tmp_path / "train_log.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 1 / s, "layers": {"0": {"loss": 1 / s}, "1": {"loss": 2 / s}}}) + "\n"
        for s in (1, 2, 3)), encoding="utf-8")
    (tmp_path / "heal_log.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n", encoding="utf-8")
    png = plot_loss_curve([tmp_path / "train_log.jsonl", tmp_path / "heal_log.jsonl"], tmp_path / "plots" / "l.png")
    assert png == tmp_path / "plots" / "l.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- devices --------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_accelerators(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device_mod, "_mps_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_auto_and_cpu_resolve_to_the_cpu_without_accelerators(no_accelerators):
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    accelerator = make_accelerator(resolve_device("auto"))
    assert accelerator.device == torch.device("cpu") and accelerator.num_processes == 1


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "mps"])
def test_unavailable_devices_are_refused_with_the_fix(no_accelerators, name):
    with pytest.raises(ExpertizeError) as caught:
        resolve_device(name)
    message = str(caught.value)
    assert f"train.device='{name}' is not available" in message and "this machine offers cpu" in message
    assert "--set train.device=" in message


def test_a_gpu_index_beyond_the_machine_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ExpertizeError, match=r"'cuda:5' is not available: this machine has 2 visible GPUs"):
        resolve_device("cuda:5")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_multi_process_launches_use_the_local_gpu_and_refuse_an_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("cuda") == resolve_device("auto") == torch.device("cuda", 1)
    with pytest.raises(ExpertizeError, match=r"'cuda:3' names one GPU, but this launch has 2 processes"):
        resolve_device("cuda:3")


def test_unknown_device_names_are_refused():
    for name in ("tpu", "cpu:1", "cuda:x"):
        with pytest.raises(ExpertizeError, match="use one of auto, cpu, cuda, cuda:N or mps"):
            resolve_device(name)


def test_a_warmup_longer_than_the_run_is_reported(tmp_path):
    messages = []
    train_together([Toy(tmp_path, warmup_steps=10, log=messages.append)])
    assert messages == ["warning: train.warmup_steps=10 is more than the 6 steps of toy, so the learning rate never "
                        "reaches train.lr; lower warmup_steps"]
