"""The pre-activation loss on dead latents (issue 47): the threshold kinds' default against dead JumpReLU latents.

- `dead_preact_gap` equals the formula written out latent by latent, is exactly 0 with no dead latent, and its
  gradient reaches only the dead latents' encoder rows, biases and thresholds;
- a training forward with `dead_for_preact` set computes it from its own pre-activations (JumpReLU and CLT);
- through the trainer it revives latents pushed far below their thresholds, which stay dead without it, and the
  log records it per layer; with preact_coef 0 the run is the plain one bit for bit;
- an interrupted run resumes exactly (the dead mask comes from the checkpointed trackers);
- kinds without thresholds ignore it; bad settings are refused with the field's name.
"""

import pytest
import torch
from torch.nn import functional as F

from expertize.conversion.device import make_accelerator
from expertize.conversion.recipe import TrainConfig
from expertize.conversion.training.distill import Trainer
from expertize.conversion.training.errors import RunInterrupted
from expertize.conversion.training.log import read_log
from expertize.modeling import build_sparse_layer
from expertize.modeling.jumprelu_transcoders import dead_preact_gap
from tests.conftest import D_MODEL
from tests.kinds import tiny_spec
from tests.test_dead_units import TOKENS, FixedBatches

CPU = torch.device("cpu")
LATENTS = 64
KILLED = torch.arange(LATENTS) % 4 == 0  # every fourth latent pushed far below its threshold


def _jumprelu(kind: str = "jumprelu_transcoder", seed: int = 0):
    torch.manual_seed(seed)
    return build_sparse_layer({**tiny_spec(kind), "num_latents": LATENTS, "k": 8})


def _cfg(**overrides) -> TrainConfig:
    settings = dict(lr=0.1, warmup_steps=0, schedule="constant", tokens_per_step=TOKENS, checkpoint_every=0,
                    log_every=1, grad_clip=0.5, device="cpu", dead_window_tokens=2 * TOKENS, balance="none")
    return TrainConfig(**{**settings, **overrides})


def _train(layers, batches, cfg, run_dir, steps, log=None) -> Trainer:
    trainer = Trainer(layers, batches, cfg, total_steps=steps, accelerator=make_accelerator(CPU), run_dir=run_dir,
                      progress=False, log=log)
    trainer.fit()
    return trainer


def _killed_layers(seed: int = 0):
    """One JumpReLU layer whose KILLED latents have a bias of -3: on inputs ~ N(0, 1) their pre-activations sit ~5
    standard deviations below 0, so the first batch's thresholds (> 0) leave them silent, out of every window."""
    layer = _jumprelu(seed=seed)
    with torch.no_grad():
        layer.b_enc[KILLED] = -3.0
    return {0: layer}


def test_gap_is_the_formula_and_reaches_only_dead_latents():
    layer = _jumprelu()
    x = torch.randn(40, D_MODEL)
    dead = torch.zeros(LATENTS, dtype=torch.bool)
    dead[[1, 5, 9, 33]] = True
    with torch.no_grad():
        layer.b_enc[dead] = -3.0  # below their thresholds on every token, as a dead latent is
    pre = F.linear(x, layer.W_enc, layer.b_enc)  # (T, L)
    threshold = layer.threshold
    p, th = pre.detach(), threshold.detach()
    loss = dead_preact_gap(pre, threshold, dead, k=8)
    n = 5  # ⌈40 tokens x 8 / 64 latents⌉: each latent's fair share of the batch
    rms = float(p.square().mean().sqrt())
    expected = sum(
        sum(max(0.0, float(th[l]) - v) for v in sorted(p[:, l].tolist(), reverse=True)[:n]) / n / rms
        for l in range(LATENTS) if dead[l]
    ) / LATENTS
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    for name in ("W_enc", "b_enc", "threshold_exponent"):
        grad = getattr(layer, name).grad
        assert grad[~dead].abs().max() == 0, name  # live latents: untouched
        assert (grad[dead].reshape(dead.sum(), -1).abs().amax(-1) > 0).all(), name
    assert layer.b_enc.grad[dead].lt(0).all()  # gradient descent raises the dead latents' biases
    assert layer.threshold_exponent.grad[dead].gt(0).all()  # ... and lowers their thresholds
    none = dead_preact_gap(pre.detach(), threshold.detach(), torch.zeros(LATENTS, dtype=torch.bool), k=8)
    assert none.item() == 0.0


@pytest.mark.parametrize("kind", ["jumprelu_transcoder", "clt"])
def test_training_forward_computes_it_from_its_own_preactivations(kind):
    layer = _jumprelu(kind)
    assert layer.supports_preact_loss
    x = torch.randn(3, 7, D_MODEL)
    dead = torch.arange(LATENTS) % 3 == 0
    layer.train()
    layer(x)
    assert layer.preact_loss is None  # no dead mask set: nothing computed
    layer.dead_for_preact = dead
    layer(x)
    expected = dead_preact_gap(F.linear(x.reshape(-1, D_MODEL), layer.W_enc, layer.b_enc), layer.threshold, dead, 8)
    torch.testing.assert_close(layer.preact_loss, expected)
    layer.eval()
    layer.preact_loss = None
    layer(x)
    assert layer.preact_loss is None  # evaluation computes none
    assert not build_sparse_layer(tiny_spec("transcoder")).supports_preact_loss


def test_it_revives_latents_that_stay_dead_without_it(tmp_path):
    steps = 60
    plain = _killed_layers()
    unhandled = _train(plain, FixedBatches(plain, steps), _cfg(preact_coef=0.0), tmp_path / "plain", steps)
    revived = _killed_layers()
    messages = []
    default = TrainConfig().preact_coef
    trainer = _train(revived, FixedBatches(revived, steps), _cfg(preact_coef=default), tmp_path / "preact", steps,
                     log=messages.append)
    # Token count at which each latent last fired (0: never). Without the loss no pushed-down latent ever fires;
    # with it, at the default weight, every one fires again, and in the second half of the run.
    assert unhandled.dead_units[0].last_fired[KILLED].eq(0).all()
    assert trainer.dead_units[0].last_fired[KILLED].gt(steps // 2 * TOKENS).all()
    plain_log = read_log(tmp_path / "plain" / "train_log.jsonl")
    log = read_log(tmp_path / "preact" / "train_log.jsonl")
    assert all("preact" not in r["layers"]["0"] for r in plain_log)
    assert log[2]["layers"]["0"]["preact"] > 0  # once a window has passed, it acts and the log shows it
    assert "preact" not in log[0]["layers"]["0"]  # not before: no latent can be dead yet
    assert any(f"pre-activation loss on dead latents (train.preact_coef={default:g}, dead after 128 tokens) for "
               "layer(s) [0]" in m for m in messages)


def test_coefficient_zero_is_the_plain_run_bit_for_bit(tmp_path):
    a, b = _killed_layers(), _killed_layers()
    _train(a, FixedBatches(a, 6), _cfg(preact_coef=0.0), tmp_path / "a", 6)
    trainer = _train(b, FixedBatches(b, 6), _cfg(preact_coef=0.0, dead_window_tokens=TOKENS), tmp_path / "b", 6)
    assert trainer.preact_layers == set()
    for name, value in a[0].state_dict().items():
        assert torch.equal(value, b[0].state_dict()[name]), name  # a different window changes nothing at 0


def test_preact_run_resumes_exactly(tmp_path):
    cfg = _cfg(preact_coef=1.0, checkpoint_every=2)
    straight = _killed_layers()
    _train(straight, FixedBatches(straight, 9), cfg, tmp_path / "straight", 9)
    first = _killed_layers()
    interrupted = FixedBatches(first, 9)
    interrupted.stop_at = 5
    with pytest.raises(RunInterrupted, match="saved a checkpoint of step 5"):
        _train(first, interrupted, cfg, tmp_path / "resumed", 9)
    resumed = _killed_layers()
    _train(resumed, FixedBatches(resumed, 9), cfg, tmp_path / "resumed", 9)
    for name, value in straight[0].state_dict().items():
        assert torch.equal(value, resumed[0].state_dict()[name]), name
    strip = lambda path: [{k: v for k, v in r.items() if k != "seconds"} for r in read_log(path)]  # noqa: E731
    assert strip(tmp_path / "resumed" / "train_log.jsonl") == strip(tmp_path / "straight" / "train_log.jsonl")


def test_kinds_without_thresholds_ignore_it(tmp_path):
    torch.manual_seed(0)
    layers = {0: build_sparse_layer(tiny_spec("transcoder")), 1: build_sparse_layer(tiny_spec("mxd"))}
    trainer = _train(layers, FixedBatches(layers, 3), _cfg(preact_coef=1.0), tmp_path, 3)
    assert trainer.preact_layers == set()
    assert all("preact" not in entry for r in read_log(tmp_path / "train_log.jsonl") for entry in r["layers"].values())


def test_setting_is_checked():
    with pytest.raises(ValueError, match=r"train.preact_coef: must be >= 0 \(0 disables the pre-activation loss\), "
                                         r"got -1"):
        TrainConfig(preact_coef=-1)


def test_the_variants_table_names_it_where_it_acts():
    from expertize.conversion.publishing.variants_table import handling

    train = {"balance": "floor", "balance_floor": 0.3, "preact_coef": 1.0}
    assert handling(train, "clt") == "no balancing (no selection bias), pre-activation loss 1"
    assert handling(train, "jumprelu_transcoder") == "no balancing (no selection bias), pre-activation loss 1"
    assert handling(train, "transcoder") == "floor 0.3"  # a top-K kind: the setting does not reach it
    assert handling({**train, "preact_coef": 0.0}, "clt") == "no balancing (no selection bias)"


def test_runs_from_before_the_setting_keep_their_identity():
    """A finished run whose recipe predates train.preact_coef: an MxD run is still the run of today's recipe (the
    setting does nothing for MxD); a JumpReLU run trained without the loss, so it is not today's default run."""
    from expertize.conversion.publishing.run_folder import run_identity

    def recipe(kind, **train):
        return {"base_model": "gpt2", "layer": {"kind": kind, "k": 8}, "train": {"lr": 0.01, **train}}

    assert run_identity(recipe("mxd")) == run_identity(recipe("mxd", preact_coef=1.0))
    assert run_identity(recipe("jumprelu_transcoder")) == run_identity(recipe("jumprelu_transcoder", preact_coef=0.0))
    assert run_identity(recipe("jumprelu_transcoder")) != run_identity(recipe("jumprelu_transcoder", preact_coef=1.0))
    assert run_identity(recipe("clt", preact_coef=1.0))["train"]["preact_coef"] == 1.0


def test_health_sends_dead_jumprelu_latents_to_the_preactivation_loss():
    """A threshold kind's dead-latent warning names its remedy (not balancing, not resampling, which left more
    JumpReLU latents dead at 2.5-4.8x the KL) and says why its latents died."""
    from expertize.conversion.evaluation.health import InEffect, code_health
    from expertize.conversion.recipe import TrainConfig as Train
    from expertize.conversion.training.distill_plan import plan_distillation

    layer = _jumprelu()
    sick = dict(dead_fraction=0.4, l0=8.0, k=8, effective_units=40.0, num_units=LATENTS, thresholded=True)
    with_loss = code_health(**sick, in_effect=InEffect.of(plan_distillation(Train(), layer, 100), layer))[0]
    assert "their pre-activations sit under their thresholds, where no gradient reaches them" in with_loss
    assert with_loss.endswith("Fix: a higher train.preact_coef (this run: 0.001), more data.train_tokens")
    without = code_health(**sick, in_effect=InEffect.of(plan_distillation(Train(preact_coef=0), layer, 100), layer))
    assert without[0].endswith("Fix: train.preact_coef: 0.001 (the default: pushes dead latents back over their "
                               "thresholds), more data.train_tokens")
    topk = build_sparse_layer(tiny_spec("transcoder"))
    plan = plan_distillation(Train(), topk, 100)
    assert plan.preact_coef == 0.0  # the kind computes none
    assert "preact" not in code_health(**{**sick, "thresholded": False}, in_effect=InEffect.of(plan, topk))[0]
