"""The speed settings (conversion/training/compute.py, data/mlp_pairs.py): fused AdamW and the compiled step give the
eager step's loss and gradients within stated bounds, TF32 is scoped and restored, a bf16 capture is a recorded and
refused-where-impossible choice, the capture batch rule, and provenance.json's "compute" record."""

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml

from expertize.conversion.data.mlp_pairs import (
    CPU_CAPTURE_SEQUENCES, MAX_CAPTURE_TOKENS, MlpCapture, capture_batch_size, forward_bytes_per_sequence,
)
from expertize.conversion.errors import ExpertizeError
from expertize.conversion.recipe import recipe_from_dict
from expertize.conversion.training import compute
from expertize.conversion.device import make_accelerator
from expertize.conversion.training.distill import Trainer
from expertize.modeling import build_sparse_layer
from tests.conftest import tiny_base_config, tiny_base_model
from tests.kinds import tiny_spec
from tests.test_dead_units import FixedBatches, _cfg

CPU = torch.device("cpu")
STEPS = 4


def _randomized_mxd() -> dict:
    torch.manual_seed(0)
    layers = {1: build_sparse_layer({**tiny_spec("mxd"), "selection_bias": True})}
    with torch.no_grad():  # a fresh MxD's zero decoder would leave the encoder and gate without gradients
        for p in layers[1].parameters():
            p.normal_(0, 0.2)
    return layers


def _steps(layers: dict, tmp_path: Path, *, fused: bool = True, backend: str | None = None) -> list:
    """(loss, gradients, parameters after the step) of STEPS distillation steps through the Trainer's own step code
    (compute_loss, backward, optimizer step, balancing), with its AdamW fused or not and its layers compiled or not."""
    batches = FixedBatches([1], STEPS)
    trainer = Trainer(layers, batches, _cfg(balance="floor"), total_steps=STEPS, accelerator=make_accelerator(CPU),
                      run_dir=tmp_path, progress=False)
    if not fused:  # the per-parameter loop torch uses on a CPU by default, with the same state
        trainer.optimizer = torch.optim.AdamW(trainer.params, lr=trainer.optim.lr, betas=trainer.optim.betas,
                                              weight_decay=trainer.optim.weight_decay)
        trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, trainer.scheduler.lr_lambdas[0])
    if backend is not None:
        compute.compile_layers(trainer.stack, True, backend=backend)
    trainer.model.train()
    out = []
    for step, batch in zip(range(STEPS), batches.batches()):
        if step == 0:
            trainer.first_batch(batch)
        loss, parts = trainer.compute_loss(batch)
        trainer._backward(loss)
        grads = [p.grad.detach().clone() for p in trainer.params]
        trainer._optimizer_step()
        trainer.track(parts)
        out.append((loss.detach(), grads, [p.detach().clone() for p in trainer.params]))
    trainer.release()
    return out


def _assert_steps_close(got: list, want: list, *, loss_rtol: float, grad_rtol: float, param_atol: float) -> None:
    """Per step: the loss within loss_rtol, every gradient within grad_rtol of its largest entry, every parameter
    within param_atol."""
    for step, ((loss, grads, params), (ref_loss, ref_grads, ref_params)) in enumerate(zip(got, want)):
        assert abs(loss - ref_loss) <= loss_rtol * abs(ref_loss), (step, loss, ref_loss)
        for g, r in zip(grads, ref_grads):
            assert (g - r).abs().max() <= grad_rtol * r.abs().max().clamp_min(1e-30), step
        for p, r in zip(params, ref_params):
            assert (p - r).abs().max() <= param_atol, step


def test_the_trainer_steps_adamw_fused_on_cpu_and_cuda_devices():
    layer = torch.nn.Linear(3, 3)
    assert compute.adamw_fused(layer.parameters(), CPU)
    assert not compute.adamw_fused(layer.parameters(), torch.device("mps"))  # parameters elsewhere: the loop
    assert not compute.adamw_fused([], CPU)
    with torch.no_grad():
        trainer = Trainer(_randomized_mxd(), FixedBatches([1], 1), _cfg(), total_steps=1,
                          accelerator=make_accelerator(CPU), checkpoint_path=Path("unused.pt"),
                          log_path=Path("unused.jsonl"), progress=False)
    assert trainer.optimizer.defaults["fused"] is True
    trainer.release()


def test_fused_adamw_gives_the_per_parameter_steps_within_float_rounding(tmp_path):
    # Bounds: the fused kernel computes the same update in another order; over 4 steps at lr 3e-2 the weights agree
    # to 1e-5 (a few float32 ulps of the update), the losses and gradients to 1e-4 relative.
    layers = _randomized_mxd()
    fused = _steps(copy.deepcopy(layers), tmp_path / "fused")
    loop = _steps(copy.deepcopy(layers), tmp_path / "loop", fused=False)
    _assert_steps_close(fused, loop, loss_rtol=1e-4, grad_rtol=1e-4, param_atol=1e-5)


@pytest.mark.slow  # torch.compile of the training step (~5 s)
def test_the_compiled_step_traces_the_sparse_kernels_and_gives_the_eager_step(tmp_path):
    # aot_eager: dynamo + AOTAutograd without code generation (fast); the traced graph runs the same aten ops, so the
    # step matches the eager one to float rounding of the traced choice (the masked top K: the same units).
    layers = _randomized_mxd()
    eager = _steps(copy.deepcopy(layers), tmp_path / "eager")
    traced = _steps(copy.deepcopy(layers), tmp_path / "traced", backend="aot_eager")
    _assert_steps_close(traced, eager, loss_rtol=1e-6, grad_rtol=1e-6, param_atol=1e-6)


@pytest.mark.slow
def test_the_inductor_compiled_step_gives_the_eager_step_within_bounds(tmp_path):
    # inductor fuses the elementwise work and reorders sums: measured 1.6e-7 relative on the losses and 5.2e-7 on
    # the gradients (CPU, float32); the bounds leave 10x room. Compiling takes ~10-30 s on 2 CPU threads.
    layers = _randomized_mxd()
    eager = _steps(copy.deepcopy(layers), tmp_path / "eager")
    compiled = _steps(copy.deepcopy(layers), tmp_path / "compiled", backend="inductor")
    _assert_steps_close(compiled, eager, loss_rtol=5e-6, grad_rtol=5e-6, param_atol=5e-6)


def test_tf32_is_scoped_to_the_block_and_restored(monkeypatch):
    matmul = torch.backends.cuda.matmul
    read = (lambda: matmul.fp32_precision) if hasattr(matmul, "fp32_precision") else (lambda: matmul.allow_tf32)
    before = read()
    with compute.matmul_precision(CPU, True) as on:  # a CPU has no TF32: nothing changes
        assert on is False and read() == before
    monkeypatch.setattr(compute, "tf32_supported", lambda device: True)  # as on an A100 / H100
    with compute.matmul_precision(CPU, True) as on:
        assert on is True and read() in ("tf32", True)
    assert read() == before
    with compute.matmul_precision(CPU, False) as on:  # train.tf32: false
        assert on is False and read() == before
    with pytest.raises(RuntimeError), compute.matmul_precision(CPU, True):
        raise RuntimeError("a failed step")
    assert read() == before


def test_bf16_capture_hands_on_float32_pairs_close_to_the_fp32_capture():
    model = tiny_base_model("gpt2")
    ids = torch.randint(0, 99, (3, 16), generator=torch.Generator().manual_seed(0))
    fp32 = MlpCapture(model, [0, 1])(ids)
    bf16 = MlpCapture(model, [0, 1], precision="bf16")(ids)
    for layer in (0, 1):
        for a, b in zip(bf16[layer], fp32[layer]):
            assert a.dtype == torch.float32 and a.shape == b.shape
            assert not torch.equal(a, b)  # the matmuls did run in bf16
            torch.testing.assert_close(a, b, rtol=0.05, atol=0.05 * b.abs().max().item())
    with pytest.raises(ValueError, match="'fp32' or 'bf16'"):
        MlpCapture(model, [0], precision="fp16")


def test_a_bf16_setting_the_device_cannot_run_is_refused_up_front(tiny_run):
    _, tree = tiny_run
    recipe = recipe_from_dict({**tree, "train": {**tree["train"], "capture_precision": "bf16"}}, source="test")
    compute.check_precision(recipe, CPU)  # a CPU runs bf16 autocast
    with pytest.raises(ExpertizeError, match=r"train.capture_precision=bf16 needs bf16 arithmetic.*fp32"):
        compute.check_precision(recipe, torch.device("mps"))
    with pytest.raises(ValueError, match="capture_precision: bf16 autocasts a float32 base model"):
        recipe_from_dict({**tree, "dtype": "bfloat16", "train": {**tree["train"], "capture_precision": "bf16"}},
                         source="test")


def test_the_capture_batch_rule():
    config = tiny_base_config("gpt2")
    gpu = torch.device("cuda")
    assert capture_batch_size(48, config, 16, gpu, free_bytes=1) == 48  # a number is used as given
    assert capture_batch_size("auto", config, 16, CPU) == CPU_CAPTURE_SEQUENCES
    per = forward_bytes_per_sequence(config, 16, 4)
    assert per == (16 * (8 * 32 + 2 * 37) + 2 * 16**2) * 4
    plenty = capture_batch_size("auto", config, 16, gpu, free_bytes=10**12)
    assert plenty == 2 ** 12 == MAX_CAPTURE_TOKENS // 16  # capped by tokens per forward
    assert capture_batch_size("auto", config, 16, gpu, free_bytes=10**12, max_sequences=100) == 64  # by the chunk
    tight = capture_batch_size("auto", config, 16, gpu, free_bytes=40 * per * 4)  # room for 40 sequences
    assert tight == 32
    assert capture_batch_size("auto", config, 16, gpu, free_bytes=0) == 1


def test_provenance_records_how_the_run_computed(tiny_run):
    from expertize.conversion.cli import main

    tmp_path, tree = tiny_run
    tree["train"].update(capture_precision="bf16", capture_batch_sequences="auto", checkpoint_every=0)
    tree["data"]["train_tokens"] = 2048
    tree["eval"].update(generation_prompts=0)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tree))
    assert main(["upcycle", str(recipe), "--no-progress"]) == 0
    record = json.loads((Path(tree["output_dir"]) / "provenance.json").read_text())["compute"]
    assert record == {
        "tf32": False, "tf32_requested": True, "base_dtype": "float32", "capture_precision": "bf16",
        "layer_precision": "fp32", "capture_batch_sequences": CPU_CAPTURE_SEQUENCES, "attention": "sdpa",
        "adamw": "fused", "compile": False,
    }
