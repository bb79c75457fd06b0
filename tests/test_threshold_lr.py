"""train.threshold_lr_scale (issue 47): the threshold kinds' thresholds in an AdamW group of their own.

- the thresholds step at that multiple of the learning rate and every other parameter exactly as without it;
- at 1 (the default), and for kinds without thresholds, the optimizer is the one-group optimizer of before;
- a run with a scaled group resumes exactly; bad values are refused with the field's name; a run recorded before the
  setting existed keeps its identity (its thresholds trained at the learning rate).
"""

import pytest
import torch

from expertize.conversion.recipe import TrainConfig
from expertize.conversion.training.errors import RunInterrupted
from expertize.conversion.training.log import read_log
from expertize.modeling import build_sparse_layer
from tests.kinds import tiny_spec
from tests.test_dead_units import FixedBatches
from tests.test_preact import _cfg, _jumprelu, _train


def _one_step(tmp_path, name: str, scale: float, kind: str):
    """The layer's parameters after one step (a constant schedule, no dead latent yet: plain AdamW, whose first step
    is about lr x sign(grad) per entry; the first batch sets the thresholds before it, `init_from_inputs`)."""
    layers = {0: _jumprelu(kind)}
    trainer = _train(layers, FixedBatches(layers, 1), _cfg(threshold_lr_scale=scale, preact_coef=0.0),
                     tmp_path / name, 1)
    return trainer, {k: v.clone() for k, v in layers[0].state_dict().items()}


@pytest.mark.parametrize("kind", ["jumprelu_transcoder", "clt"])
def test_the_thresholds_step_at_the_scaled_rate_and_the_rest_as_before(tmp_path, kind):
    plain, after = _one_step(tmp_path, "plain", 1.0, kind)
    scaled, after_scaled = _one_step(tmp_path, "scaled", 0.25, kind)
    _, start = _one_step(tmp_path, "still", 1e-9, kind)  # the thresholds as the first batch set them
    assert len(plain.optimizer.param_groups) == 1
    assert [g["lr"] for g in scaled.optimizer.param_groups] == pytest.approx([0.1, 0.025])
    step = after["threshold_exponent"] - start["threshold_exponent"]
    step_scaled = after_scaled["threshold_exponent"] - start["threshold_exponent"]
    assert step.abs().min() > 0.01  # every threshold moved
    torch.testing.assert_close(step_scaled, 0.25 * step, rtol=1e-4, atol=1e-6)
    for name in after:
        if name != "threshold_exponent":
            assert torch.equal(after[name], after_scaled[name]), name


def test_kinds_without_thresholds_keep_one_group(tmp_path):
    torch.manual_seed(0)
    layers = {0: build_sparse_layer(tiny_spec("transcoder")), 1: build_sparse_layer(tiny_spec("mxd"))}
    trainer = _train(layers, FixedBatches(layers, 1), _cfg(threshold_lr_scale=0.1), tmp_path, 1)
    assert len(trainer.optimizer.param_groups) == 1


def test_a_scaled_run_resumes_exactly(tmp_path):
    cfg = _cfg(threshold_lr_scale=0.3, checkpoint_every=2, schedule="cosine", warmup_steps=2)
    straight = {0: _jumprelu()}
    _train(straight, FixedBatches(straight, 7), cfg, tmp_path / "straight", 7)
    first = {0: _jumprelu()}
    interrupted = FixedBatches(first, 7)
    interrupted.stop_at = 5
    with pytest.raises(RunInterrupted, match="saved a checkpoint of step 5"):
        _train(first, interrupted, cfg, tmp_path / "resumed", 7)
    resumed = {0: _jumprelu()}
    _train(resumed, FixedBatches(resumed, 7), cfg, tmp_path / "resumed", 7)
    for name, value in straight[0].state_dict().items():
        assert torch.equal(value, resumed[0].state_dict()[name]), name
    strip = lambda path: [{k: v for k, v in r.items() if k != "seconds"} for r in read_log(path)]  # noqa: E731
    assert strip(tmp_path / "resumed" / "train_log.jsonl") == strip(tmp_path / "straight" / "train_log.jsonl")


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_setting_is_checked(value):
    with pytest.raises(ValueError, match=rf"train.threshold_lr_scale: must be > 0, got {value}"):
        TrainConfig(threshold_lr_scale=value)


def test_runs_from_before_the_setting_keep_their_identity():
    from expertize.conversion.publishing.run_folder import run_identity

    def recipe(kind, **train):
        return {"base_model": "gpt2", "layer": {"kind": kind, "k": 8}, "train": {"lr": 0.01, **train}}

    assert run_identity(recipe("jumprelu_transcoder")) == run_identity(recipe("jumprelu_transcoder",
                                                                               threshold_lr_scale=1.0))
    assert run_identity(recipe("clt")) != run_identity(recipe("clt", threshold_lr_scale=0.3))
    assert run_identity(recipe("mxd")) == run_identity(recipe("mxd", threshold_lr_scale=0.3))  # nothing it acts on
