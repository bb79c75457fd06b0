"""`train.warmup_steps: auto` and the schedule's defaults: the warm-up and the decay follow the run's length, as
`train.lr: auto` does (lr_rule.py), and together they are the schedule that rule was measured under.

    warm-up = round(WARMUP_FRACTION · steps), at least 1 step on a run of 2 steps or more (0 on a run of 1 step)
    then SCHEDULE decay to MIN_LR_RATIO · lr                  (a tenth of the steps, then cosine to 0.1 lr)

- Every rate of the lr rule's sweep (benchmarks/dead_units.py, docs/results/dead_units.md#the-learning-rate-rule,
  and the dead-unit benchmark around it) trained with a warm-up of a tenth of the steps and a cosine decay to 0.1 lr:
  `lr: auto` is the best rate *under this schedule*. The schema's defaults before issue 40 were the MxD paper's
  5,000 warm-up steps then constant, set for a 117,000-step run; on a real GPT-NeoX layer (320 steps, lr auto in both
  columns) they gave a KL 6x (TopK transcoder K = 32: 0.303 against 0.047) to 29x (MxD K = 32: 0.253 against 0.0087)
  that of a warm-up of 50 steps with a cosine decay to 0.1 lr (issue 40). `recipes/paper/*` keep the paper's
  settings, written out, for the paper's budget.
- The constants are the measured schedule's, not yet a sweep of the schedule itself (issue 40 asks for one:
  benchmarks of the lr-rule style, several models, two budgets, seeds); change them here, in one place.
- Healing (`heal:`) uses the same rule on its own steps (HEAL_WARMUP_FRACTION, HEAL_MIN_LR_RATIO, the same values).
  Its schedule was not swept either; its defaults before were warm-up 100 and cosine to 0.1 lr: at the default
  budget (1,000,000 tokens, context 128, 8 sequences per step: 976 steps) 100 steps is a tenth, so the rule keeps
  that run's schedule and scales it with the budget (benchmarks/moe_x_routers.py heals with warm-up 16 of 128 steps,
  cosine to 0.1 lr). The floor stays 0.1, as before and as in distillation, so one shape serves both stages.

`resolve_schedule` is the one place `auto` becomes numbers (the lr and the warm-up together); the recipe's
`TrainConfig.resolved` / `HealConfig.resolved` and the trainers call it, and metrics.json records what it returned
beside the rules' values.
"""

import dataclasses
import math
from typing import Any

from .coerce import RecipeError
from .lr_rule import rule_lr

WARMUP_FRACTION = 0.1
"""The warm-up's share of the run's optimizer steps (`train.warmup_steps: auto`)."""
SCHEDULE = "cosine"
"""The decay after the warm-up (`train.schedule`'s default)."""
MIN_LR_RATIO = 0.1
"""The decay's floor as a fraction of the peak rate (`train.min_lr_ratio`'s default)."""

HEAL_WARMUP_FRACTION = WARMUP_FRACTION
"""`heal.warmup_steps: auto`: the same share of the healing steps (see the module docstring)."""
HEAL_SCHEDULE = SCHEDULE
"""`heal.schedule`'s default."""
HEAL_MIN_LR_RATIO = MIN_LR_RATIO
"""`heal.min_lr_ratio`'s default."""

AUTO = "auto"


def rule_warmup(steps: int, fraction: float = WARMUP_FRACTION) -> int:
    """The rule's warm-up for a run of `steps` optimizer steps: `fraction` of them rounded to the nearest step (halves
    up), at least 1 on a run of 2 steps or more, 0 on a run of 0 or 1 step; always below `steps` for a run of 2 steps
    or more."""
    steps = int(steps)
    if steps < 2:
        return 0
    return min(steps - 1, max(1, math.floor(fraction * steps + 0.5)))


@dataclasses.dataclass(frozen=True)
class ResolvedSchedule:
    """A stage's learning-rate schedule with `auto` resolved, and the rules' values for its steps."""

    steps: int
    lr: float
    warmup_steps: int
    schedule: str
    min_lr_ratio: float
    lr_rule: float | None
    """The `train.lr: auto` rule's rate for these steps (None for a stage without the rule: healing)."""
    warmup_rule: int
    """The `warmup_steps: auto` rule's warm-up for these steps."""
    lr_auto: bool
    warmup_auto: bool

    def note(self, section: str) -> str | None:
        """One line saying what `auto` resolved to (None when nothing was `auto`), e.g. "train.lr auto: 0.01,
        train.warmup_steps auto: 20, then cosine to 0.1 lr, for 195 steps (conversion/recipe/lr_rule.py,
        schedule_rule.py)"."""
        if not (self.lr_auto or self.warmup_auto):
            return None
        lr = f"{section}.lr auto: {self.lr:.3g}" if self.lr_auto else f"{section}.lr {self.lr:.3g}"
        warmup = (f"{section}.warmup_steps auto: {self.warmup_steps:,}" if self.warmup_auto
                  else f"{section}.warmup_steps {self.warmup_steps:,}")
        rules = ", ".join(name for name, auto in (("lr_rule.py", self.lr_auto), ("schedule_rule.py", self.warmup_auto))
                          if auto)
        return (f"{lr}, {warmup}, then {self.decay()}, for {self.steps:,} steps (the rules of "
                f"conversion/recipe/{rules})")

    def decay(self) -> str:
        """The schedule after the warm-up in words: "constant", "cosine to 0.1 lr"."""
        return self.schedule if self.schedule == "constant" else f"{self.schedule} to {self.min_lr_ratio:g} lr"


def resolve_schedule(
    cfg: Any, steps: int, *, lr_factor: float | None = 1.0, warmup_fraction: float = WARMUP_FRACTION
) -> ResolvedSchedule:
    """The schedule of a stage of `steps` optimizer steps configured by `cfg` (a TrainConfig or HealConfig: `lr`,
    `warmup_steps`, `schedule`, `min_lr_ratio`): `auto` values resolved by the rules. `lr_factor`: the kind's
    `auto_lr_factor` for the lr rule; None for a stage that has no lr rule (its `lr` must be a number)."""
    steps = int(steps)
    lr_rule = None if lr_factor is None else rule_lr(steps, lr_factor)
    lr_auto = cfg.lr == AUTO
    if lr_auto and lr_rule is None:
        raise ValueError("lr: auto needs the lr rule (a distillation); give a number")
    warmup_rule = rule_warmup(steps, warmup_fraction)
    warmup_auto = cfg.warmup_steps == AUTO
    return ResolvedSchedule(
        steps=steps,
        lr=lr_rule if lr_auto else float(cfg.lr),
        warmup_steps=warmup_rule if warmup_auto else int(cfg.warmup_steps),
        schedule=cfg.schedule,
        min_lr_ratio=float(cfg.min_lr_ratio),
        lr_rule=lr_rule,
        warmup_rule=warmup_rule,
        lr_auto=lr_auto,
        warmup_auto=warmup_auto,
    )


def check_warmup(section: str, warmup_steps: int | str, steps: int, how: str = "") -> None:
    """Refuse an explicit warm-up that is not shorter than its stage of `steps` steps (the learning rate would never
    reach its peak); `auto` always fits. `how`: how the steps were counted, for the message. Stages of no step are
    left to their own check (preflight's "less than one step")."""
    if warmup_steps == AUTO or steps < 1 or warmup_steps < steps:
        return
    counted = f" ({how})" if how else ""
    fraction = warmup_fraction_of(section)
    raise RecipeError(
        f"{section}.warmup_steps={warmup_steps:,} is not below the {steps:,} steps of the run{counted}, so the "
        f"learning rate would never reach its peak; write {section}.warmup_steps: auto ({fraction:.0%} of the steps: "
        f"{rule_warmup(steps, fraction):,}) or a number below {steps}"
    )


def warmup_fraction_of(section: str) -> float:
    """The warm-up share of a recipe section ("train", "heal")."""
    return HEAL_WARMUP_FRACTION if section == "heal" else WARMUP_FRACTION
