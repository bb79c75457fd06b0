"""How to read a run's key metrics: what a good and a bad value look like, for the end of `expertize upcycle`.

The bare numbers ("greedy continuations identical to base: 0.00%", "dead 49%") tell a newcomer nothing about whether
the run worked. Each line here says what the metric measures, which end is good, and where this run stands against
rules of thumb: the MxD paper's ΔCE at a full budget (+0.003 nats, GPT-2, K=32) and, for dead units, the bound of the
code-health warning (health.DEAD_BOUND: one number, so a run graded "poor" is the run that was warned about).
"""

from ..publishing.metrics_schema import Metrics
from .health import DEAD_BOUND

__all__ = ["GRADES", "reading_lines"]

GRADES = {
    "ΔCE": (0.02, 0.1),
    "FVU": (0.1, 0.3),
    "dead": (0.05, DEAD_BOUND),
}
"""Rules of thumb (good below the first bound, poor above the second, fair between)."""


def _grade(metric: str, value: float) -> str:
    good, poor = GRADES[metric]
    return "good" if value < good else "poor" if value > poor else "fair"


def _agree_for(curve: list[float]) -> int:
    """How many leading generated tokens at least half of the continuations share with the base's."""
    return next((i for i, share in enumerate(curve) if share < 0.5), len(curve))


def reading_lines(metrics: Metrics) -> list[str]:
    """A few lines: for ΔCE, FVU, dead units and the greedy-continuation match, what good and bad look like and
    where this run stands (lines for metrics the run does not have are left out)."""
    out = []
    ce = metrics.ce
    if ce is not None and ce.delta is not None:
        recovered = (f"; CE recovered {ce.ce_recovered_mean:.0%} (100 % = the base, 0 % = no better than the MLP's "
                     "mean output)" if ce.ce_recovered_mean is not None else "")
        out.append(
            f"ΔCE {ce.delta:+.3f} nats is {_grade('ΔCE', ce.delta)}: the next-token loss the replacement adds on the "
            f"held-out documents (0 = lossless; good < {GRADES['ΔCE'][0]}, poor > {GRADES['ΔCE'][1]}; the MxD paper "
            f"reaches +0.003 with a full budget){recovered}"
        )
    for index, layer in sorted(metrics.layers.items(), key=lambda kv: int(kv[0])):
        if layer.fvu is not None:
            out.append(
                f"layer {index}: FVU {layer.fvu:.3f} is {_grade('FVU', layer.fvu)}: the share of the MLP output's "
                f"variance the sparse layer misses (0 = exact, 1 = no better than its mean; good < "
                f"{GRADES['FVU'][0]}, poor > {GRADES['FVU'][1]})"
            )
        if layer.dead_fraction is not None:
            out.append(
                f"layer {index}: {layer.dead_fraction * 100:.3g} % dead is {_grade('dead', layer.dead_fraction)}: "
                f"units that "
                f"never fired on the held-out text are parameters wasted (a few % is healthy, poor > "
                f"{GRADES['dead'][1]:.0%}, the health warning's bound); train.balance (default floor) and more "
                f"data.train_tokens revive them (docs/dead_units.md)"
            )
    generation = metrics.generation
    if generation is not None and generation.match_at_end is not None and generation.match_curve:
        n, prompts = len(generation.match_curve), generation.n_prompts
        out.append(
            f"greedy continuations identical to base {generation.match_at_end:.0%}: the share of {prompts} held-out "
            f"prompts whose whole {n}-token continuation equals the base's; one different token makes a miss, so "
            f"0 % is usual while ΔCE is above ~0.05 and 100 % needs ΔCE near 0. Here at least half agree for the "
            f"first {_agree_for(generation.match_curve)} token(s) (plots/generation_match.png)"
        )
    train = metrics.train
    if out and train is not None and train.tokens:
        out.append(f"trained on {train.tokens:,} tokens: ΔCE, FVU and dead units improve with data.train_tokens "
                   "(the quickstart's 200,000 are a one-minute demo)")
    if out and metrics.lm_eval is not None and metrics.lm_eval.tasks:
        out.append("lm-eval scores other text, each document from its start: there the model can even beat its base "
                   "while ΔCE is positive (docs/eval.md: when lm-eval and ΔCE disagree)")
    return out
