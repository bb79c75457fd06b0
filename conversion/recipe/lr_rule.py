"""`train.lr: auto`: the distillation's peak learning rate from the run's length (DRAFT: constants to be fit)."""

LR_REF = 1e-2
STEPS_REF = 256
EXPONENT = 0.5
LR_MAX = 3e-2
LR_MIN = 1e-4


def rule_lr(steps: int, tokens_per_step: int = 1024) -> float:
    """The rule's peak learning rate for a run of `steps` optimizer steps of `tokens_per_step` tokens."""
    lr = LR_REF * (STEPS_REF / max(steps, 1)) ** EXPONENT
    return float(min(LR_MAX, max(LR_MIN, lr)))
