"""A distillation's plan: every value the recipe's `train:` section leaves to a rule, decided once before training.

`plan_distillation(cfg, layer, steps)` turns `auto` and the capabilities of the run's kind into numbers: the learning
rate and warm-up (recipe/schedule_rule.py), the dead window, AuxK's k_aux (or none), whether the selection bias is
balanced, the resampling cadence (or none) and the code-share floor. The trainer builds its parts from the plan, and
upcycle records the plan's own values (metrics.json `train`, the card), so no stage resolves a setting again or
compares it with "auto" (issue 36). Every layer of a run has one spec, so one layer stands for all of them.
"""

from dataclasses import dataclass

from expertize.modeling import SparseLayer

from ..recipe import TrainConfig
from ..recipe.schedule_rule import ResolvedSchedule
from .auxk import auto_k_aux, dead_window_tokens, supports_auxk
from .balance import balanced
from .resample import UNTIL_FRACTION, auto_every_tokens, supports_resampling

__all__ = ["DistillPlan", "plan_distillation", "recipe_schedule"]


@dataclass(frozen=True)
class DistillPlan:
    """What a distillation of `steps` steps does, with every rule applied (see the module docstring)."""

    steps: int
    tokens_per_step: int
    schedule: ResolvedSchedule
    """Peak lr, warm-up, decay, and the rules' values beside them."""
    dead_window_tokens: int
    """Tokens without firing after which a unit counts as dead (the log's dead counts, AuxK, the resampler)."""
    k_aux: int | None
    """Dead units AuxK reconstructs the error with, per token; None: AuxK off (auxk_coef 0, or the kind has none)."""
    balance: bool
    """The selection bias is balanced (train.balance is not none and the kind has a selection bias)."""
    balance_rule: str
    """The train.balance rule in effect: "floor" or "bias" when `balance`, else "none"."""
    balance_floor: float
    """train.balance_floor (what the "floor" rule holds each unit's firing share to)."""
    resample_every_tokens: int
    """Tokens between resamplings of dead units; 0: off (the setting, or the kind cannot resample)."""
    resample_until_tokens: int
    """No resampling after this many tokens (a late resampled unit has no time to learn)."""
    code_share_floor: bool
    """The code-share penalty is on (train.code_share_floor > 0)."""
    preact_coef: float = 0.0
    """The weight of the pre-activation loss on dead latents in effect (train.preact_coef for a threshold kind, else
    0: the kind computes none)."""


def plan_distillation(cfg: TrainConfig, layer: SparseLayer, steps: int) -> DistillPlan:
    """The plan of a distillation of `steps` optimizer steps of layers like `layer` under `cfg`."""
    per_step = cfg.tokens_per_step
    k = getattr(layer.spec, "k", 1)
    if cfg.dead_window_tokens == "auto":  # a run without distillation (train.distill: false) has no window
        window = dead_window_tokens(steps * per_step, per_step) if steps else 0
    elif cfg.dead_window_tokens == "interval":  # the resampler's cadence: dead means "missed a whole interval"
        window = auto_every_tokens(layer.num_units, k, per_step)
    else:
        window = cfg.dead_window_tokens
    auxk = cfg.auxk_coef > 0 and supports_auxk(layer)
    resample = bool(cfg.resample_every_tokens) and supports_resampling(layer)
    balance = cfg.balance != "none" and balanced(layer)
    return DistillPlan(
        steps=steps,
        tokens_per_step=per_step,
        schedule=cfg.resolved(steps, layer.spec.auto_lr_factor),
        dead_window_tokens=window,
        k_aux=(auto_k_aux(layer.spec.d_out) if cfg.auxk_k == "auto" else cfg.auxk_k) if auxk else None,
        balance=balance,
        balance_rule=cfg.balance if balance else "none",
        balance_floor=cfg.balance_floor,
        resample_every_tokens=(
            (auto_every_tokens(layer.num_units, k, per_step) if cfg.resample_every_tokens == "auto"
             else cfg.resample_every_tokens) if resample else 0
        ),
        resample_until_tokens=int(UNTIL_FRACTION * steps * per_step),
        code_share_floor=cfg.code_share_floor > 0,
        preact_coef=cfg.preact_coef if layer.supports_preact_loss else 0.0,
    )


def recipe_schedule(recipe) -> ResolvedSchedule:
    """The schedule `plan_distillation` gives `recipe`'s layers, for a caller that builds none (a benchmark stating
    the rate a run will use): the same `TrainConfig.resolved`, with the factor the kind's spec declares."""
    from ..recipe.layer_config import spec_class

    return recipe.train.resolved(recipe.distill_steps(), spec_class(recipe.layer.kind).auto_lr_factor)
