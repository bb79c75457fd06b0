"""`train.lr: auto`: the distillation's peak learning rate, from measurements rather than a paper's long-run setting.

    lr = LR_BEST · factor(kind) · min(1, sqrt(MEASURED_STEPS / steps))

- LR_BEST = 1e-2: the best rate (lowest held-out KL among codes that did not collapse) of MxD and the TopK transcoder
  at K = 8 and 32 on tiny-gpt2-shakespeare and stories260k at 80, 320 and 1,280 steps of 256 to 4,096 tokens, and on
  SmolLM2-135M layer 15 (benchmarks/dead_units.py --lrs 1e-3,3e-3,1e-2,3e-2; docs/results/dead_units.md). Where it
  was not the best (stories260k at 1,024 tokens per step: 3e-2), its KL was within 10 % of the best; 3x lower cost
  15-60 % more KL everywhere, 3x higher collapsed MxD's code (L0 below K / 2) or killed most units on
  tiny-gpt2-shakespeare.
- factor(kind): the kind's `auto_lr_factor` (modeling/sparse_base.py): 1, or MoE-X's 0.3 (its best rate was 3e-3).
- Longer runs: at most MEASURED_STEPS steps were measured, and the best rate did not move between 80 and 1,280 steps.
  Beyond, the rate falls as 1/sqrt(steps): an extrapolation (AdamW's best rate falls with the training horizon), not
  a measurement — the MxD paper's 1e-4 at 117,000 steps is 10x below it; sweep long runs (recipe `variants:`).
"""

import math

LR_BEST = 1e-2
MEASURED_STEPS = 1280


def rule_lr(steps: int, tokens_per_step: int = 4096, factor: float = 1.0) -> float:
    """The rule's peak learning rate for a run of `steps` optimizer steps (`tokens_per_step` did not change the best
    rate between 256 and 4,096; kept in the signature for the record) for a kind of `auto_lr_factor` `factor`."""
    return LR_BEST * factor * min(1.0, math.sqrt(MEASURED_STEPS / max(int(steps), 1)))


def beyond_measured(steps: int) -> bool:
    """Whether the rule extrapolates for this many steps (see the module docstring)."""
    return steps > MEASURED_STEPS
