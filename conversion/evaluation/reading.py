"""How to read a run's key metrics: one verdict on the replacement, then what each metric says, for the end of
`expertize upcycle`, metrics.json (`verdict`), variants.md, the model card and `expertize inspect`.

The verdict has two axes, and the overall grade is the worse of the two:

- **fidelity** — do the sparse layers behave like the MLPs they replace? It reads the metrics that measure that
  directly — each layer's FVU, KL(base ‖ spliced) and the CE recovered between the ablation baselines — and takes the
  worst grade among them. ΔCE alone cannot grade a run: on text the base does not model, the spliced model can beat
  the base (a negative ΔCE) while reconstructing nothing (FVU > 1), and removing the MLP may not hurt at all. When the
  mean and zero ablations raise the CE by less than ABLATION_GAP nats, the text cannot tell a faithful replacement
  from a broken one by CE, and the verdict says "cannot judge" unless FVU or KL already show it is poor.
- **code** — is the fidelity the sparse code's? Each layer's code share (evaluation/code_probe.py: the share of what
  the layer explains that is lost when every token gets the average code) is graded by CODE_SHARE: a layer whose
  dense path (MxD's hidden code, a skip connection) does the work is faithful in spite of its experts, and the
  question a reader asks — which units explain this token? — has a poor answer. So a layer is never graded "good"
  overall when its code carries less than CODE_SHARE[0] of what it explains, and "poor" below CODE_SHARE[1] (the
  dense-path warning's bound, health.CODE_SHARE_BOUND). Transcoders carry everything by construction (share 1).

Not weighed: ΔCE (read beside CE recovered), dead units (the health warnings), the greedy-continuation match and
lm-eval scores — each has its own line below the verdict.

Rules of thumb: the MxD paper's ΔCE at a full budget (+0.003 nats, GPT-2, K=32); for dead units, the bound of the
code-health warning (health.DEAD_BOUND: one number, so a run graded "poor" is the run that was warned about); for the
code share, half of what the layer explains (issue 35; docs/results/code_share.md measures where each kind lands).
"""

import dataclasses

from ..publishing.metrics_schema import Metrics
from .health import CODE_SHARE_BOUND, DEAD_BOUND

__all__ = ["ABLATION_GAP", "CE_RECOVERED", "CODE_SHARE", "GRADES", "WEIGHS", "Verdict", "code_share_phrase",
           "quality_verdict", "reading_lines"]

GRADES = {
    "ΔCE": (0.02, 0.1),
    "KL": (0.02, 0.1),
    "FVU": (0.1, 0.3),
    "dead": (0.05, DEAD_BOUND),
}
"""Rules of thumb, lower is better: good below the first bound, poor above the second, fair between."""
CE_RECOVERED = (0.9, 0.5)
"""CE recovered vs the mean ablation, higher is better: good at or above the first bound, poor below the second."""
CODE_SHARE = (0.5, CODE_SHARE_BOUND)
"""A layer's code share, higher is better: good at or above the first bound (the code carries at least half of what
the layer explains), poor below the second (the dense-path warning's bound)."""
WEIGHS = "weighs FVU, KL, CE recovered and the code share; ΔCE, dead units and greedy match are read below, not weighed"
"""What the verdict reads, said on its line (the other metrics have their own lines)."""
ABLATION_GAP = 0.05
"""nats: below this rise of the CE under both ablations, the text cannot judge a replacement by its CE."""
LOSS_DROP_BOUND = 0.05
"""Under a constant learning rate, a training loss that still fell by more than this fraction over the run's last fifth:
the run looks under-trained. (Under a decaying schedule the decay itself lowers the loss by 5-23 % over the last fifth
of healthy runs — docs/results/dead_units.md — so there the drop says nothing and only the learning rate is read.)"""
LR_BELOW_RULE = 3.0
"""A peak learning rate this many times below the `auto` rule's for the run's length: under-trained (on a real
GPT-NeoX, 3x below the best rate left MxD ten times worse in KL)."""
_ORDER = ("good", "fair", "poor")


def _grade(metric: str, value: float) -> str:
    good, poor = GRADES[metric]
    return "good" if value < good else "poor" if value > poor else "fair"


def _grade_recovered(value: float) -> str:
    good, poor = CE_RECOVERED
    return "good" if value >= good else "poor" if value < poor else "fair"


def _grade_code(share: float) -> str:
    good, poor = CODE_SHARE
    return "good" if share >= good else "poor" if share < poor else "fair"


@dataclasses.dataclass
class Verdict:
    """Whether the replacement behaves like the MLP *because of its code*: `grade` is "good", "fair", "poor" or
    "cannot judge", the worse of `fidelity` (FVU, KL, CE recovered) and `code` (the code share; None when no layer
    has one); `reasons` name the metric behind each grade (worst first)."""

    grade: str
    reasons: list[str]
    fidelity: str | None = None
    code: str | None = None

    def axes(self) -> str:
        """"fidelity good, code poor" (the axes that were graded)."""
        return ", ".join(f"{name} {grade}" for name, grade in (("fidelity", self.fidelity), ("code", self.code))
                         if grade is not None)

    def line(self) -> str:
        axes = f"{self.axes()}; " if self.axes() else ""
        return f"verdict: {self.grade} ({axes}{WEIGHS}) — " + "; ".join(self.reasons)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Verdict":
        """From metrics.json's `verdict` (folders written before the code axis have only grade and reasons)."""
        return cls(grade=data["grade"], reasons=list(data.get("reasons") or []), fidelity=data.get("fidelity"),
                   code=data.get("code"))


def ablations_judge(metrics: Metrics) -> bool | None:
    """Whether removing the MLPs raises the CE on the evaluation text enough (ABLATION_GAP) to judge a replacement by
    its CE; None when the ablations were not measured."""
    ce = metrics.ce
    if ce is None or ce.base is None or ce.mean_ablation is None:
        return None
    rises = [a - ce.base for a in (ce.mean_ablation, ce.zero_ablation) if a is not None]
    return min(rises) >= ABLATION_GAP


def _worst(grades: list[str]) -> str:
    return _ORDER[max(_ORDER.index(g) for g in grades)]


def code_share_phrase(share: float) -> str:
    """"the code carries 5 % of what the layer explains: poor (good ≥ 50 %, poor < 20 %)"."""
    return (f"the code carries {share:.0%} of what the layer explains: {_grade_code(share)} (good ≥ "
            f"{CODE_SHARE[0]:.0%}, poor < {CODE_SHARE[1]:.0%})")


def _code_grades(metrics: Metrics) -> list[tuple[str, str]]:
    """(grade, reason) per layer with a code share."""
    graded = []
    for index, layer in sorted(metrics.layers.items(), key=lambda kv: int(kv[0])):
        if layer.code_share is None:
            continue
        grade = _grade_code(layer.code_share)
        graded.append((grade, f"layer {index}'s code carries {layer.code_share:.0%} of what it explains: {grade} "
                              f"(good ≥ {CODE_SHARE[0]:.0%}, poor < {CODE_SHARE[1]:.0%}"
                              + ("; below, a dense path does the work and the units explain little)"
                                 if grade != "good" else ")")))
    return graded


def quality_verdict(metrics: Metrics) -> Verdict | None:
    """The verdict on the replacement (None when the run has no evaluation to judge)."""
    graded: list[tuple[str, str]] = []  # (grade, reason) of the fidelity axis
    for index, layer in sorted(metrics.layers.items(), key=lambda kv: int(kv[0])):
        if layer.fvu is not None:
            grade = _grade("FVU", layer.fvu)
            graded.append((grade, f"layer {index} FVU {layer.fvu:.3f} is {grade} (good < {GRADES['FVU'][0]}, "
                                  f"poor > {GRADES['FVU'][1]})"))
    ce = metrics.ce
    if ce is not None and ce.kl_base_spliced is not None:
        grade = _grade("KL", ce.kl_base_spliced)
        graded.append((grade, f"KL(base ‖ spliced) {ce.kl_base_spliced:.3g} nats/token is {grade} (good < "
                              f"{GRADES['KL'][0]}, poor > {GRADES['KL'][1]})"))
    judge = ablations_judge(metrics)
    unjudged = None
    if judge and ce.ce_recovered_mean is not None:
        grade = _grade_recovered(ce.ce_recovered_mean)
        graded.append((grade, f"CE recovered {ce.ce_recovered_mean:.0%} is {grade} (good ≥ {CE_RECOVERED[0]:.0%}, "
                              f"poor < {CE_RECOVERED[1]:.0%})"))
    elif judge is False:
        zero = f", zero ablation {ce.zero_ablation:.3f}" if ce.zero_ablation is not None else ""
        unjudged = (f"this text cannot judge the replacement by its CE: removing the MLP barely changes it (mean "
                    f"ablation {ce.mean_ablation:.3f}{zero} vs base {ce.base:.3f} nats, a rise under "
                    f"{ABLATION_GAP} nats); evaluate on text the base models (data.eval_paths)")
    if not graded:
        return None
    code_graded = _code_grades(metrics)
    fidelity = _worst([g for g, _ in graded])
    code = _worst([g for g, _ in code_graded]) if code_graded else None
    if unjudged is not None and fidelity != "poor":
        fidelity = "cannot judge"
    both = graded + code_graded
    reasons = [r for g, r in sorted(both, key=lambda gr: -_ORDER.index(gr[0]))]
    if fidelity == "cannot judge":
        overall = "poor" if code == "poor" else "cannot judge"
        return Verdict(overall, [unjudged] + reasons, fidelity=fidelity, code=code)
    overall = _worst([fidelity] + ([code] if code else []))
    return Verdict(overall, reasons + ([unjudged] if unjudged else []), fidelity=fidelity, code=code)


def _agree_for(curve: list[float]) -> int:
    """How many leading generated tokens at least half of the continuations share with the base's."""
    return next((i for i, share in enumerate(curve) if share < 0.5), len(curve))


def _dead(fraction: float) -> str:
    """A dead fraction as a percentage to three significant digits: a nonzero share never reads as 0 %."""
    return f"{fraction * 100:.3g} %"


def _under_training(train) -> list[str]:
    """Why the run looks under-trained, if it does: a learning rate far below the rule's, or a loss still falling
    steeply at the end of a constant schedule."""
    out = []
    if train.lr is not None and train.lr_rule is not None and train.lr * LR_BELOW_RULE <= train.lr_rule:
        out.append(
            f"under-trained: the peak learning rate {train.lr:.3g} is {train.lr_rule / train.lr:.0f}x below the rate "
            f"the `train.lr: auto` rule gives for {train.steps:,} steps ({train.lr_rule:.3g}); at 3x below the best "
            "rate layers stay far less faithful (docs/results/dead_units.md). Set train.lr: auto"
        )
    drop = train.loss_drop_last_fifth
    if train.schedule == "constant" and drop is not None and drop > LOSS_DROP_BOUND:
        out.append(
            f"under-trained: the training loss still fell {drop:.0%} over the last fifth of the run at a constant "
            f"learning rate (bound {LOSS_DROP_BOUND:.0%}): more data.train_tokens would lower FVU and KL further "
            "(plots/loss.png)"
        )
    return out


def reading_lines(metrics: Metrics) -> list[str]:
    """A few lines: the verdict, then for ΔCE, FVU, dead units and the greedy-continuation match, what good and bad
    look like and where this run stands (lines for metrics the run does not have are left out)."""
    out = []
    verdict = quality_verdict(metrics)
    if verdict is not None:
        out.append(verdict.line())
    ce = metrics.ce
    if ce is not None and ce.delta is not None:
        recovered = (f"; CE recovered {ce.ce_recovered_mean:.0%} (100 % = the base, 0 % = no better than the MLP's "
                     "mean output)" if ce.ce_recovered_mean is not None else "")
        if ce.delta < 0 or ablations_judge(metrics) is False:
            standing = ("is not a grade: on this text the spliced model's loss is below the base's or removing the "
                        "MLP does not hurt, so ΔCE says nothing about fidelity (read the verdict's FVU and KL)")
        else:
            standing = f"is {_grade('ΔCE', ce.delta)}"
        out.append(
            f"ΔCE {ce.delta:+.3f} nats {standing}: the next-token loss the replacement adds on the held-out documents "
            f"(0 = lossless; good < {GRADES['ΔCE'][0]}, poor > {GRADES['ΔCE'][1]}; the MxD paper reaches +0.003 with "
            f"a full budget){recovered}"
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
                f"layer {index}: {_dead(layer.dead_fraction)} dead is {_grade('dead', layer.dead_fraction)}: units "
                f"that never fired on the held-out text are parameters wasted (a few % is healthy, poor > "
                f"{GRADES['dead'][1]:.0%}, the health warning's bound); train.balance (default floor) and more "
                f"data.train_tokens revive them (docs/dead_units.md)"
            )
        if layer.code_share is not None:
            out.append(
                f"layer {index}: the per-token code carries {layer.code_share:.0%} of the variance the layer explains, "
                f"{_grade_code(layer.code_share)} (100 % = all of it, as in a code without a dense path; near 0 = a "
                f"dense path does the work and the units explain little; good ≥ {CODE_SHARE[0]:.0%}, poor < "
                f"{CODE_SHARE[1]:.0%})"
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
    if out and train is not None:
        out.extend(_under_training(train))
    if out and metrics.lm_eval is not None and metrics.lm_eval.tasks:
        out.append("lm-eval scores other text, each document from its start: there the model can even beat its base "
                   "while ΔCE is positive (docs/eval.md: when lm-eval and ΔCE disagree)")
    return out

