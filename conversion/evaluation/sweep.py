"""Sweeps: one metric against K (or active parameters per token) for each method, over saved model folders.

    DIR ... ─► config.json sparse_layers (method = layer kind, K, active parameters) + metrics.json (the metric)
            ─► one line per method, sorted by x; the base model as a dashed reference line ─► PNG + JSON of the points

Metric names (`read_metric`; the lists come from the metrics.json schema, publishing/metrics_schema.py):
    ce.spliced, ce.delta, ce.kl_base_spliced, ce.ce_recovered_mean, generation.match_at_end, ...
                                 a dotted path into metrics.json (`SCALAR_METRICS`)
    fvu, nmse_paper, relative_mse, mse, l0, dead_fraction
                                 mean over the replaced layers (metrics.json "layers", `LAYER_METRICS`)
    lm_eval:TASK:METRIC          an lm-eval result recorded by `expertize eval` or eval.lm_eval_tasks, e.g.
                                 lm_eval:expertize_stories_cloze:acc (the ",none" filter is implied)
Base reference: ce.spliced -> ce.base; ce.delta and ce.kl_base_spliced -> 0; lm_eval:... -> the base's value.

Folders evaluated on different budgets (held-out tokens, an lm-eval --limit) or texts record different base values.
They are plotted side by side, one evaluation each: the folders that share a base value are one evaluation, drawn
with its own marker and its own dashed base line, labelled by its budget (`Evaluation`). `base=False` (`--no-base`)
leaves the base lines out.
"""

import difflib
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from ..publishing.metrics_schema import Metrics, layer_metric_names, metric_help, scalar_metric_paths
from ..publishing.model_folder import check_model_folder, read_metrics
from ..publishing.run_folder import write_json

__all__ = ["LAYER_METRICS", "SCALAR_METRICS", "Evaluation", "SweepPoint", "evaluations", "metric_help", "plot_sweep",
           "read_metric", "sweep_points"]

LAYER_METRICS = tuple(layer_metric_names())
SCALAR_METRICS = tuple(scalar_metric_paths())
_BASE_OF = {"ce.spliced": "ce.base"}
_ZERO_FOR_BASE = ("ce.delta", "ce.kl_base_spliced")
XAxis = Literal["k", "active_parameters"]


@dataclass
class SweepPoint:
    folder: str
    method: str
    k: int | None
    """The layers' top K; None for kinds without one (μMoE's soft gate), which plot against active parameters."""
    active_parameters: int
    value: float
    base_value: float | None
    budget: str | None = None
    """What the value was measured on, when metrics.json says: "32,768 eval tokens", "lm-eval limit 100"."""


def _dotted(tree: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _check_metric_name(metric: str, metrics: dict[str, Any]) -> None:
    """An unknown name (not in the schema, not in this file either: e.g. a newer expertize's) is a typo."""
    if metric.startswith("lm_eval:") or metric in LAYER_METRICS or metric in SCALAR_METRICS:
        return
    if _dotted(metrics, metric) is not None:
        return
    close = difflib.get_close_matches(metric, SCALAR_METRICS + LAYER_METRICS, n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    raise ValueError(f"unknown metric {metric!r}{hint}; use {metric_help()}")


def read_metric(metrics: dict[str, Any] | Metrics, metric: str) -> tuple[float | None, float | None]:
    """(value, base value) of `metric` (see the module docstring) in metrics.json; None where absent."""
    if isinstance(metrics, Metrics):
        metrics = metrics.to_dict()
    _check_metric_name(metric, metrics)
    if metric.startswith("lm_eval:"):
        _, task, name = (metric.split(":", 2) + ["", ""])[:3]
        if not task or not name:
            raise ValueError(f"metric {metric!r}: write lm_eval:TASK:METRIC, e.g. lm_eval:expertize_stories_cloze:acc")
        entry = _dotted(metrics, f"lm_eval.tasks.{task}.metrics") or {}
        m = entry.get(name if "," in name else f"{name},none") or {}
        return m.get("value"), m.get("base_value")
    if metric in LAYER_METRICS:
        values = [layer.get(metric) for layer in (metrics.get("layers") or {}).values()]
        values = [v for v in values if isinstance(v, (int, float))]
        return (sum(values) / len(values) if values else None), None
    value = _dotted(metrics, metric)
    base = 0.0 if metric in _ZERO_FOR_BASE else _dotted(metrics, _BASE_OF[metric]) if metric in _BASE_OF else None
    return (value if isinstance(value, (int, float)) else None), base


def sweep_points(folders: Sequence[str | os.PathLike], metric: str) -> list[SweepPoint]:
    """One point per folder: its method (layer kind), K, active parameters per token (summed over the replaced
    layers) and the metric. A folder without the metric is an error naming the folder and the metric."""
    from expertize.modeling import spec_from_dict

    points = []
    for folder in folders:
        config = check_model_folder(folder, read_weights=False)  # the points need its records, not its weights
        specs = [spec_from_dict(spec) for spec in (config.get("sparse_layers") or {}).values()]
        if not specs:
            raise ValueError(f"{folder}: config.json lists no sparse_layers")
        ks = {getattr(spec, "k", None) for spec in specs}
        if len(ks) > 1:
            raise ValueError(f"{folder}: its layers use different K ({sorted(ks)}); a sweep point needs one K")
        metrics = read_metrics(folder)
        value, base = read_metric(metrics, metric)
        if value is None:
            raise ValueError(
                f"{folder}: metrics.json has no value for {metric!r}; for lm-eval metrics run `expertize eval "
                f"{folder} --tasks TASK` first (see `expertize plot-sweep --help` for metric names)"
            )
        points.append(
            SweepPoint(
                folder=str(folder),
                method="+".join(dict.fromkeys(spec.kind for spec in specs)),
                k=ks.pop(),
                active_parameters=sum(spec.active_parameters() for spec in specs),
                value=float(value),
                base_value=None if base is None else float(base),
                budget=_budget(metrics, metric),
            )
        )
    return points


def _budget(metrics: dict[str, Any], metric: str) -> str | None:
    """What a folder's `metric` was measured on: its lm-eval task's limit (or document count), else the held-out
    tokens of the end-of-run evaluation."""
    if metric.startswith("lm_eval:"):
        task = _dotted(metrics, f"lm_eval.tasks.{metric.split(':')[1]}") or {}
        if task.get("limit") is not None:
            return f"lm-eval limit {task['limit']:,}"
        return f"{task['n_documents']:,} documents" if task.get("n_documents") is not None else None
    tokens = metrics.get("eval_tokens")
    return f"{tokens:,} eval tokens" if isinstance(tokens, int) else None


@dataclass
class Evaluation:
    """Folders that share one base value (evaluated on the same text and budget): one base line, one marker."""

    base_value: float | None
    label: str
    folders: list[str]


def evaluations(points: list[SweepPoint]) -> list[Evaluation]:
    """The points grouped by base value (in the order first seen; points without one join the first group), each
    labelled by its budget ("32,768 eval tokens") when the budgets tell the groups apart, else by its number."""
    groups: list[list[SweepPoint]] = []
    for p in points:
        home = next((g for g in groups if p.base_value is None or g[0].base_value is None or math.isclose(
            p.base_value, g[0].base_value, rel_tol=1e-9, abs_tol=1e-12)), None)
        if home is None:
            groups.append([p])
        else:
            home.append(p)
    budgets = [{p.budget for p in g} for g in groups]
    labels = [next(iter(b)) if len(b) == 1 else None for b in budgets]
    by_budget = None not in labels and len(set(labels)) == len(groups)
    return [
        Evaluation(
            base_value=next((p.base_value for p in g if p.base_value is not None), None),
            label=labels[i] if by_budget else f"evaluation {i + 1}",
            folders=[p.folder for p in g],
        )
        for i, g in enumerate(groups)
    ]


def plot_sweep(
    folders: Sequence[str | os.PathLike], metric: str, output: str | os.PathLike, *, x: XAxis = "k",
    base: bool = True,
) -> Path:
    """Plot `metric` against `x` per method to `output` (PNG), with the base model's value as a dashed line (not
    with `base=False`); folders evaluated on different budgets are plotted as separate evaluations (see the module
    docstring). The points go to the same name with .json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if x not in ("k", "active_parameters"):
        raise ValueError(f"x must be 'k' or 'active_parameters', got {x!r}")
    points = sweep_points(folders, metric)
    if not points:
        raise ValueError("give at least one model folder")
    no_k = [p for p in points if p.k is None]
    if x == "k" and no_k:
        raise ValueError(
            f"{no_k[0].folder}: its {no_k[0].method} layers choose no top K (every unit is gated softly), so it has no "
            "place on a K axis; plot against --x active_parameters"
        )
    groups = evaluations(points)
    several = len(groups) > 1
    fig, ax = plt.subplots(figsize=(6, 4))
    colors = {method: f"C{i}" for i, method in enumerate(sorted({p.method for p in points}))}
    markers, dashes = "os^DvP*X", [(4, 2), (1, 1), (6, 2, 1, 2), (2, 2, 6, 2)]
    for g, group in enumerate(groups):
        mine = [p for p in points if p.folder in group.folders]
        for method in sorted({p.method for p in mine}):
            ps = sorted((p for p in mine if p.method == method), key=lambda p: getattr(p, x))
            ax.plot([getattr(p, x) for p in ps], [p.value for p in ps], marker=markers[g % len(markers)],
                    color=colors[method], label=f"{method} ({group.label})" if several else method)
        if base and group.base_value is not None:
            ax.axhline(group.base_value, color="black", linewidth=1, dashes=dashes[g % len(dashes)],
                       label=f"base model ({group.label})" if several else "base model")
    xs = [getattr(p, x) for p in points]
    if min(xs) > 0 and max(xs) / min(xs) >= 8:
        ax.set_xscale("log", base=2 if x == "k" else 10)
    ax.set_xlabel("K (active units per token)" if x == "k" else "active parameters per token (sparse layers)")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs {'K' if x == 'k' else 'active parameters'}"
                 + (f" ({len(groups)} evaluations)" if several else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small" if several else None)
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    record = {"metric": metric, "x": x, "base_value": None if several else groups[0].base_value,
              "evaluations": [asdict(g) for g in groups], "points": [asdict(p) for p in points]}
    write_json(output.with_suffix(".json"), record)
    return output
