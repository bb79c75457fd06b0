"""The first lines of the end-of-run summary (`expertize upcycle`): metrics.json's key numbers
(`Metrics.summary_lines`), with a caveat in place of a ratio whose denominator is near zero. Two ratios have one:

- CE recovered vs mean ablation divides by how much mean-ablating the MLP raises the CE. Where the ablations raise
  it by less than reading.ABLATION_GAP nats (or lower it), the ratio is noise (1396.68 % on a tiny random model):
  the headline prints "n/a" and why, as the verdict says "cannot judge" (evaluation/reading.py).
- FVU divides by the variance of the MLP's output over the held-out tokens (mse / fvu, per output element). Below
  VARIANCE_FLOOR the MLP's output barely varies (a tiny random model's MLP: ~1e-11), and FVU 33279 says nothing
  about the layer: the headline names the variance beside it.
"""

from ..publishing.formats import format_number, format_percent
from ..publishing.metrics_schema import LayerMetrics, Metrics

__all__ = ["VARIANCE_FLOOR", "headline_lines", "output_variance"]

VARIANCE_FLOOR = 1e-8
"""Variance of the MLP's output per element below which FVU is printed with a caveat: trained models' MLP outputs
vary by 1e-4 and more per element (GPT-2, Pythia, Llama), tiny random test models' by as little as 1e-11."""


def output_variance(layer: LayerMetrics) -> float | None:
    """The variance of the MLP's output per element over the held-out positions FVU covers (mse / fvu: both sum the
    same squared errors, mse over the elements and FVU over the total variance); None when not recorded."""
    if layer.mse is None or not layer.fvu:  # FVU 0 (exact) or null (a zero variance gives a non-finite FVU)
        return None
    return layer.mse / layer.fvu


def headline_lines(metrics: Metrics) -> list[str]:
    """`metrics.summary_lines()` with the caveats above in place of the bare ratios."""
    from .reading import ABLATION_GAP, ablations_judge

    lines = metrics.summary_lines()
    ce = metrics.ce
    if ce is not None and ce.ce_recovered_mean is not None and ablations_judge(metrics) is False:
        bare = f"CE recovered vs mean ablation {format_percent(ce.ce_recovered_mean)}"
        caveat = (f"CE recovered vs mean ablation n/a (cannot judge: removing the MLP barely changes the CE on this "
                  f"text, mean ablation {ce.mean_ablation - ce.base:+.2g} nats, under {ABLATION_GAP})")
        lines = [line.replace(bare, caveat) for line in lines]
    for index, layer in metrics.layers.items():
        variance = output_variance(layer)
        if variance is None or variance >= VARIANCE_FLOOR:
            continue
        bare = f"layer {index}: FVU {format_number(layer.fvu)}"
        caveat = (f"{bare} (not a grade: the MLP's output barely varies on this text, variance {variance:.2g} per "
                  f"element, under {VARIANCE_FLOOR:g})")
        lines = [caveat + line[len(bare):] if line.startswith(bare + ",") else line for line in lines]
    return lines
