"""`train.lr: auto`: the distillation's peak learning rate, from measurements rather than a paper's long-run setting.

    lr = LR_BEST · factor(kind) · min(1, sqrt(FULL_RATE_STEPS / steps))

- LR_BEST = 1e-2: the best rate (lowest held-out KL among codes that did not collapse) of MxD and the TopK transcoder
  at K = 8 and 32 on tiny-gpt2-shakespeare at 80 to 320 steps of 1,024 to 4,096 tokens (lr 3e-3 / 1e-2 / 3e-2;
  benchmarks/dead_units.py, docs/results/dead_units.md#the-learning-rate-rule). On stories260k the best was 3e-2 and
  1e-2 cost 1-19 % more KL; on tiny-gpt2-shakespeare 3e-2 collapsed MxD's code (L0 below K / 2) or left 41-83 % of
  the units dead, and 3e-3 cost 14-170 % more KL everywhere.
- FULL_RATE_STEPS = 320: at 1,280 steps (256 tokens per step, the same tokens) tiny-gpt2-shakespeare's best fell to 3e-3
  (1e-2 collapsed MxD and left the transcoder's K = 8 at 41 % dead) while stories260k's stayed 1e-2; the rule gives
  5e-3 there. The fall as 1/sqrt(steps) is AdamW's usual dependence on the horizon, fitted to these two points.
- factor(kind): the kind's `auto_lr_factor` (modeling/sparse_spec.py): 1, or MoE-X's 0.3 (its best rate was 3e-3).
- Beyond MEASURED_STEPS = 1,280 steps the rule is an extrapolation, and the run says so — the MxD paper's 1e-4 at
  117,000 steps is 5x below it; sweep long runs (recipe `variants:`).
"""

import math

LR_BEST = 1e-2
FULL_RATE_STEPS = 320
MEASURED_STEPS = 1280


def rule_lr(steps: int, factor: float = 1.0) -> float:
    """The rule's peak learning rate for a run of `steps` optimizer steps for a kind of `auto_lr_factor` `factor`
    (the tokens per step act through the number of steps only: at 80 steps the best rate was the same at 1,024 and
    4,096 tokens per step)."""
    return LR_BEST * factor * min(1.0, math.sqrt(FULL_RATE_STEPS / max(int(steps), 1)))


def beyond_measured(steps: int) -> bool:
    """Whether the rule extrapolates for this many steps (see the module docstring)."""
    return steps > MEASURED_STEPS
