"""Is the sparse code alive and really sparse? Warnings read off a layer's held-out unit statistics.

A faithful layer is not a success when its code is dead or collapsed: an MxD whose gate scores turned negative on
almost every token keeps a tiny ΔCE through its dense hidden path while its "experts" say nothing, and units that
never fire are parameters nobody can read. Each warning names what was measured, why it happens and the fix; the
end-of-run summary, metrics.json (`layers.<i>.health`), variants.md and the model card show them.

Bounds (held-out tokens, `evaluation.evaluate`):
- dead: more than DEAD_BOUND of the units never fired;
- collapsed: a top-K kind's mean L0 below COLLAPSE_BOUND · K (most selected units have a zero weight);
- off target: a threshold kind's (JumpReLU) mean L0 below COLLAPSE_BOUND or above OVERSHOOT_BOUND times the target L0
  it was trained to (its thresholds drifted above, or below, most pre-activations);
- concentrated: the effective number of units exp(H) of the firing distribution below CONCENTRATION_BOUND of the
  units that fire at all (a few units take most of the firings);
- dense path: the per-token code carries less than CODE_SHARE_BOUND of the variance the layer explains (giving every
  token the average code loses almost nothing: code_probe.py), so the fidelity is the dense path's, not the code's;
- selection bias: a bias left in the saved model changes more than BIAS_ALTERED_BOUND of the code's choices on
  held-out tokens (each a unit chosen over a better-scoring one).
"""

import dataclasses

from ..recipe import TrainConfig

DEAD_BOUND = 0.10
COLLAPSE_BOUND = 0.5
OVERSHOOT_BOUND = 2.0
CONCENTRATION_BOUND = 0.1
CODE_SHARE_BOUND = 0.2
BIAS_ALTERED_BOUND = 0.05


@dataclasses.dataclass(frozen=True)
class InEffect:
    """What a run already used against dead and concentrated codes, so that a warning's fix names only what is left
    to try (a run trained with `train.balance: floor` is not told to use it). `code_health` without one (a layer
    evaluated without its recipe) gives the general advice."""

    balance: str
    """The `train.balance` rule that moved the layer's selection bias: "floor", "bias", or "none"."""
    balance_floor: float
    """`train.balance_floor` (read with balance "floor")."""
    resampling: bool
    """Whether dead units were resampled (`train.resample_every_tokens` on, for a kind that resamples)."""
    can_balance: bool = True
    """Whether the kind has a selection bias at all (`train.balance` acts on it); False: no balance advice."""
    can_resample: bool = True
    """Whether the kind can resample dead units (`supports_resampling`); False: no resampling advice."""
    preact_coef: float = 0.0
    """The pre-activation loss on dead latents in effect (`train.preact_coef` for a threshold kind, else 0)."""

    @classmethod
    def of(cls, plan, layer) -> "InEffect":
        """From the run's distillation plan (training/distill_plan.py: what was in effect, every rule applied) and
        the trained layer's kind, which declares whether it has a selection bias and can resample."""
        return cls(
            balance=plan.balance_rule,
            balance_floor=plan.balance_floor,
            resampling=plan.resample_every_tokens > 0,
            can_balance=layer.spec.has_selection_bias(),
            can_resample=bool(getattr(layer, "supports_resampling", False)),
            preact_coef=plan.preact_coef,
        )


def _dead_fixes(used: InEffect | None, thresholded: bool) -> str:
    """The dead-unit remedies the run has not used yet, as one phrase; `thresholded`: a threshold kind (JumpReLU,
    CLT), whose remedy is the pre-activation loss, not balancing or resampling (resampling left more JumpReLU latents
    dead, at 2.5-4.8x the KL: docs/results/dead_units.md)."""
    if thresholded:
        fix = (f"a higher train.preact_coef (this run: {used.preact_coef:g})" if used is not None and used.preact_coef
               else f"train.preact_coef: {TrainConfig.preact_coef:g} (the default: pushes dead latents back over "
               "their thresholds)")
        return f"{fix}, more data.train_tokens"
    if used is None:
        return ("train.balance: floor (the default; a higher train.balance_floor, or train.resample_every_tokens: "
                "auto for units already dead), more data.train_tokens")
    fixes = []
    if used.can_balance and used.balance == "none":
        fixes.append("train.balance: floor (the default)")
    elif used.can_balance and used.balance == "floor":
        fixes.append(f"a higher train.balance_floor (this run: {used.balance_floor:g})")
    if used.can_resample and not used.resampling:
        fixes.append("train.resample_every_tokens: auto (re-points units already dead)")
    return ", ".join(fixes + ["more data.train_tokens"])


def _balance_bias_fix(used: InEffect | None, why: str) -> str | None:
    """"train.balance: bias (why)" unless the run used it already or the kind has no selection bias."""
    if used is not None and (used.balance == "bias" or not used.can_balance):
        return None
    return f"train.balance: bias ({why})"


def code_health(
    *, dead_fraction: float, l0: float, k: int | None, effective_units: float | None, num_units: int,
    code_share: float | None = None, bias_altered: float | None = None,
    in_effect: InEffect | None = None, thresholded: bool = False,
) -> list[str]:
    """Warnings for one layer's code (empty when healthy). `k`: the kind's top K (None for kinds without one), or
    with `thresholded` the target L0 a threshold kind was trained to; `in_effect`: what the run already used, left
    out of the fixes (None: the general advice)."""
    warnings = []
    if dead_fraction > DEAD_BOUND:
        warnings.append(
            f"dead: {dead_fraction:.0%} of the {num_units} units never fired on the held-out tokens (bound "
            f"{DEAD_BOUND:.0%}): "
            + ("their pre-activations sit under their thresholds, where no gradient reaches them" if thresholded
               else "they lost the top-K competition early and then got no gradient")
            + f". Fix: {_dead_fixes(in_effect, thresholded)}"
        )
    if k is not None and thresholded and not COLLAPSE_BOUND * k <= l0 <= OVERSHOOT_BOUND * k:
        low = l0 < COLLAPSE_BOUND * k
        warnings.append(
            f"off target: mean L0 {l0:.1f} against the target L0 {k} it was trained to (bounds "
            f"{COLLAPSE_BOUND:g}–{OVERSHOOT_BOUND:g}x): the thresholds sit "
            + ("above most pre-activations, so few latents fire and the silent ones get no gradient to come back"
               if low else "below many pre-activations, so the code is less sparse than asked")
            + ". Fix: more data.train_tokens" + (", a lower train.lr" if low else "")
        )
    elif k is not None and l0 < COLLAPSE_BOUND * k:
        fixes = ["a lower train.lr", _balance_bias_fix(in_effect, "the symmetric rule, which holds every unit at "
                                                                   "K / units")]
        warnings.append(
            f"collapsed: mean L0 {l0:.1f} of K={k} (bound {COLLAPSE_BOUND:g}·K): most selected units have a zero "
            "weight (their scores are negative), so a dense path (MxD's hidden code, a skip connection) does the "
            f"work and the code explains little. Fix: {', or '.join(f for f in fixes if f)}"
        )
    live = num_units * (1 - dead_fraction)
    if effective_units is not None and live >= 1 and effective_units < CONCENTRATION_BOUND * live:
        fix = _balance_bias_fix(in_effect, "every unit held at its fair share") or "more data.train_tokens"
        warnings.append(
            f"concentrated: the firings spread like {effective_units:.0f} equally used units, of {live:.0f} that "
            f"fire (bound {CONCENTRATION_BOUND:.0%}): a few units take most tokens. Fix: {fix}"
        )
    if code_share is not None and code_share < CODE_SHARE_BOUND:
        warnings.append(
            f"dense path: the per-token code carries {code_share:.0%} of the variance this layer explains (bound "
            f"{CODE_SHARE_BOUND:.0%}): giving every token the average code keeps most of the fidelity, which is "
            "the dense path's (MxD's hidden code, a skip connection) and the code explains little. Fix: a lower "
            "train.lr, more data.train_tokens, or a kind without a dense path"
        )
    if bias_altered is not None and bias_altered > BIAS_ALTERED_BOUND:
        warnings.append(
            f"selection bias: the bias saved with the layer changes {bias_altered:.0%} of the code's choices on the "
            f"held-out tokens (bound {BIAS_ALTERED_BOUND:.0%}); each is a unit chosen over a better-scoring one, a "
            "cost in fidelity. Fix: train.balance_anneal: [0.5, 0.8] (the default), which decays the bias to 0 "
            "before the end of training"
        )
    return warnings
