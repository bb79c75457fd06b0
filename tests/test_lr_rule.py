"""`train.lr: auto`: the rule's values, the kind's factor, and the rate a run actually trains with and records."""

import json

import pytest
from expertize.conversion.recipe import recipe_from_dict
from expertize.conversion.recipe.lr_rule import FULL_RATE_STEPS, LR_BEST, MEASURED_STEPS, beyond_measured, rule_lr
from expertize.conversion.training.distill_plan import recipe_schedule
from expertize.conversion.upcycle import upcycle


def test_the_rule_is_the_measured_rate_then_falls_as_one_over_sqrt_steps():
    assert rule_lr(80) == rule_lr(FULL_RATE_STEPS) == LR_BEST == 1e-2  # measured best at 80-320 steps
    assert rule_lr(4 * FULL_RATE_STEPS) == pytest.approx(LR_BEST / 2)  # 1,280 steps: 5e-3 (measured 3e-3 / 1e-2)
    assert rule_lr(100 * FULL_RATE_STEPS) == pytest.approx(LR_BEST / 10)
    assert rule_lr(200, factor=0.3) == pytest.approx(3e-3)
    assert rule_lr(0) == LR_BEST  # no division by zero on a run without steps
    assert not beyond_measured(MEASURED_STEPS) and beyond_measured(MEASURED_STEPS + 1)


@pytest.mark.parametrize("kind, fields, factor", [
    ("mxd", {"k": 4, "num_experts": 64}, 1.0),
    ("moe_x", {"num_experts": 8, "k": 2}, 0.3),  # MoE-X's best rate was 3x lower (docs/results/all_kinds.md)
])
def test_a_recipe_resolves_auto_for_its_kind_and_steps(tiny_run, kind, fields, factor):
    _, tree = tiny_run
    tree["layer"] = {"kind": kind, **fields}
    tree["train"]["lr"] = "auto"
    for tokens in (12_288, 1_310_720):  # 48 steps (full rate) and 5,120 steps of 256 tokens (extrapolated)
        tree["data"]["train_tokens"] = tokens
        recipe = recipe_from_dict(tree)
        steps = recipe.distill_steps()
        assert recipe_schedule(recipe).lr == pytest.approx(LR_BEST * factor * min(1.0, (FULL_RATE_STEPS / steps) ** 0.5))
    tree["train"]["lr"] = 3e-4
    assert recipe_schedule(recipe_from_dict(tree)).lr == 3e-4  # a number is used as given


@pytest.mark.slow  # a whole upcycle (~4 s; the rule itself is tested above): in CI's opt-in run, off the fast suite's 8 minutes
def test_a_run_trains_with_the_auto_rate_and_records_it(tiny_run):
    """The optimizer's peak rate is the rule's (train_log.jsonl), and metrics.json records it beside the rule."""
    _, tree = tiny_run
    tree["train"].update(lr="auto", schedule="constant", warmup_steps=0)
    out = upcycle(recipe_from_dict(tree), progress=False)
    metrics = json.loads((out / "metrics.json").read_text())
    steps = metrics["train"]["steps"]
    assert steps == 48 and metrics["train"]["lr"] == metrics["train"]["lr_rule"] == rule_lr(steps) == 1e-2
    rates = [json.loads(line)["lr"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert rates and rates == pytest.approx([1e-2] * len(rates)), rates
