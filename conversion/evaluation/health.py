"""Is the sparse code alive and really sparse? Warnings read off a layer's held-out unit statistics.

A faithful layer is not a success when its code is dead or collapsed: an MxD whose gate scores turned negative on
almost every token keeps a tiny ΔCE through its dense hidden path while its "experts" say nothing, and units that
never fire are parameters nobody can read. Each warning names what was measured, why it happens and the fix; the
end-of-run summary, metrics.json (`layers.<i>.health`), variants.md and the model card show them.

Bounds (held-out tokens, `evaluation.evaluate`):
- dead: more than DEAD_BOUND of the units never fired;
- collapsed: a top-K kind's mean L0 below COLLAPSE_BOUND · K (most selected units have a zero weight);
- concentrated: the effective number of units exp(H) of the firing distribution below CONCENTRATION_BOUND of the
  units that fire at all (a few units take most of the firings);
- dense path: the per-token code carries less than CODE_SHARE_BOUND of the variance the layer explains (giving every
  token the average code loses almost nothing: code_probe.py), so the fidelity is the dense path's, not the code's;
- selection bias: a bias left in the saved model changes more than BIAS_ALTERED_BOUND of the code's choices on
  held-out tokens (each a unit chosen over a better-scoring one).
"""

DEAD_BOUND = 0.10
COLLAPSE_BOUND = 0.5
CONCENTRATION_BOUND = 0.1
CODE_SHARE_BOUND = 0.1
BIAS_ALTERED_BOUND = 0.05


def code_health(
    *, dead_fraction: float, l0: float, k: int | None, effective_units: float | None, num_units: int,
    code_share: float | None = None, bias_altered: float | None = None,
) -> list[str]:
    """Warnings for one layer's code (empty when healthy). `k`: the kind's top K (None for kinds without one)."""
    warnings = []
    if dead_fraction > DEAD_BOUND:
        warnings.append(
            f"dead: {dead_fraction:.0%} of the {num_units} units never fired on the held-out tokens (bound "
            f"{DEAD_BOUND:.0%}): they lost the top-K competition early and then got no gradient. Fix: train.balance: "
            "floor (the default; a higher train.balance_floor, or train.resample_every_tokens: auto for units "
            "already dead), more data.train_tokens"
        )
    if k is not None and l0 < COLLAPSE_BOUND * k:
        warnings.append(
            f"collapsed: mean L0 {l0:.1f} of K={k} (bound {COLLAPSE_BOUND:g}·K): most selected units have a zero "
            "weight (their scores are negative), so a dense path (MxD's hidden code, a skip connection) does the "
            "work and the code explains little. Fix: a lower train.lr, or train.balance: bias (the symmetric rule, "
            "which holds every unit at K / units)"
        )
    live = num_units * (1 - dead_fraction)
    if effective_units is not None and live >= 1 and effective_units < CONCENTRATION_BOUND * live:
        warnings.append(
            f"concentrated: the firings spread like {effective_units:.0f} equally used units, of {live:.0f} that "
            f"fire (bound {CONCENTRATION_BOUND:.0%}): a few units take most tokens. Fix: train.balance: bias (every "
            "unit held at its fair share)"
        )
    if code_share is not None and code_share < CODE_SHARE_BOUND:
        warnings.append(
            f"dense path: the per-token code carries {code_share:.0%} of the variance this layer explains (bound "
            f"{CODE_SHARE_BOUND:.0%}): giving every token the average code loses almost nothing, so the fidelity is "
            "the dense path's (MxD's hidden code, a skip connection) and the code explains little. Fix: a lower "
            "train.lr, more data.train_tokens, or a kind without a dense path (transcoder)"
        )
    if bias_altered is not None and bias_altered > BIAS_ALTERED_BOUND:
        warnings.append(
            f"selection bias: the bias saved with the layer changes {bias_altered:.0%} of the code's choices on the "
            f"held-out tokens (bound {BIAS_ALTERED_BOUND:.0%}); each is a unit chosen over a better-scoring one, a "
            "cost in fidelity. Fix: train.balance_anneal: [0.5, 0.8] (the default), which decays the bias to 0 "
            "before the end of training"
        )
    return warnings
