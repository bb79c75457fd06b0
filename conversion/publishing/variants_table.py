"""The comparison table of a recipe's variants: `output_dir/variants.md`, written when every variant is finished and
printed at the end of `expertize upcycle`.

One row per variant: what it varies (kind, K, units, lr, dead-unit handling) and its results (ΔCE, KL, FVU, L0, dead
units, effective units and the code share — how much of what the layer explains its per-token code carries —
averaged over the replaced layers when there are several), its verdict on both axes (fidelity and code: a variant
whose dense path does the work is never "good"; evaluation/reading.py, as recorded in metrics.json), and the code's
health warnings (evaluation/health.py), listed under the table. Read from each variant folder's recipe.resolved.yaml and
metrics.json, the files a reader would open.
"""

from pathlib import Path

import yaml

from ..recipe.layer_config import has_preact_loss, has_selection_bias
from .formats import format_number, format_percent
from .metrics_schema import load_metrics
from .run_folder import METRICS, RESOLVED_RECIPE, write_text

__all__ = ["VARIANTS_TABLE", "variants_table", "write_variants_table"]

VARIANTS_TABLE = "variants.md"

_COLUMNS = ("variant", "kind", "K", "units", "lr", "dead-unit handling", "ΔCE", "KL", "FVU", "L0", "dead",
            "effective units", "code share", "verdict", "health")


def handling(train: dict, kind: str | None = None) -> str:
    """The dead-unit handling a resolved `train:` section gives a layer of `kind`, in a few words. A kind whose spec
    has no selection bias (no top K chosen by a score) is not balanced whatever `train.balance` says, and the row
    says so rather than echo the recipe."""
    parts = []
    balance = train.get("balance", "none")
    if balance != "none" and kind is not None and not has_selection_bias(kind):
        parts.append("no balancing (no selection bias)")
    elif balance == "floor":
        parts.append(f"floor {train.get('balance_floor', '')}".strip())
    elif balance != "none":
        parts.append(f"{balance} {train.get('balance_rate', '')}".strip())
    if train.get("resample_every_tokens"):
        parts.append(f"resample {train['resample_every_tokens']}")
    if train.get("auxk_coef"):
        parts.append(f"AuxK {train['auxk_coef']:g}")
    if train.get("preact_coef") and kind is not None and has_preact_loss(kind):
        parts.append(f"pre-activation loss {train['preact_coef']:g}")
    return ", ".join(parts) or "none"


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _verdict_cell(verdict: dict | None) -> str | None:
    """"poor (fidelity good, code poor)" from metrics.json's verdict; None when the run recorded none."""
    if not verdict:
        return None
    axes = [f"{axis} {verdict[axis]}" for axis in ("fidelity", "code") if verdict.get(axis)]
    return verdict["grade"] + (f" ({', '.join(axes)})" if axes else "")


def variants_table(folder: str | Path, names: list[str]) -> str:
    """Markdown table of the finished variants `names` under `folder` (variants without metrics.json are left
    out)."""
    folder = Path(folder)
    rows = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    warnings = []
    for name in names:
        run = folder / name
        if not (run / METRICS).is_file():
            continue
        metrics = load_metrics(run)
        recipe = yaml.safe_load((run / RESOLVED_RECIPE).read_text(encoding="utf-8"))
        layer, train = recipe["layer"], recipe["train"]
        layers = list(metrics.layers.values())
        units = _mean([m.num_units for m in layers])
        ce = metrics.ce
        problems = [f"- {name}, layer {i}: {w}" for i, m in metrics.layers.items() for w in m.health]
        warnings.extend(problems)
        cells = [
            name, layer["kind"], layer.get("k"), None if units is None else int(units), train["lr"],
            handling(train, layer["kind"]),
            format_number(None if ce is None else ce.delta),
            format_number(None if ce is None else ce.kl_base_spliced),
            format_number(_mean([m.fvu for m in layers])),
            format_number(_mean([m.l0 for m in layers]), 2),
            format_percent(_mean([m.dead_fraction for m in layers]), 1),
            format_number(_mean([m.effective_units for m in layers]), 0),
            format_percent(_mean([m.code_share for m in layers]), 0),
            _verdict_cell(metrics.verdict),
            "⚠ " + ", ".join(sorted({w.split(":")[0] for m in layers for w in m.health})) if problems else "ok",
        ]
        rows.append("| " + " | ".join("–" if c is None else f"{c:g}" if isinstance(c, float) else str(c)
                                      for c in cells) + " |")
    table = "\n".join(rows) + "\n"
    if warnings:
        table += "\nCode health warnings (evaluation/health.py):\n\n" + "\n".join(warnings) + "\n"
    return table


def write_variants_table(folder: str | Path, names: list[str]) -> Path:
    """Write `folder/variants.md` (atomically) and return its path."""
    path = Path(folder) / VARIANTS_TABLE
    write_text(path, f"# Variants in {Path(folder).name}\n\n" + variants_table(folder, names))
    return path
