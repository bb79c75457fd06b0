"""The comparison table of a recipe's variants: `output_dir/variants.md`, written when every variant is finished and
printed at the end of `expertize upcycle`.

One row per variant: what it varies (kind, K, units, lr, AuxK coefficient) and its results (ΔCE, KL, FVU, L0 and
dead units, averaged over the replaced layers when there are several). Read from each variant folder's
recipe.resolved.yaml and metrics.json, the files a reader would open.
"""

from pathlib import Path

import yaml

from .card import format_number, format_percent
from .metrics_schema import load_metrics
from .run_folder import METRICS, RESOLVED_RECIPE, write_text

__all__ = ["VARIANTS_TABLE", "variants_table", "write_variants_table"]

VARIANTS_TABLE = "variants.md"

_COLUMNS = ("variant", "kind", "K", "units", "lr", "AuxK", "ΔCE", "KL", "FVU", "L0", "dead")


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def variants_table(folder: str | Path, names: list[str]) -> str:
    """Markdown table of the finished variants `names` under `folder` (variants without metrics.json are left
    out)."""
    folder = Path(folder)
    rows = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
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
        cells = [
            name, layer["kind"], layer.get("k"), None if units is None else int(units), train["lr"],
            train.get("auxk_coef"),
            format_number(None if ce is None else ce.delta),
            format_number(None if ce is None else ce.kl_base_spliced),
            format_number(_mean([m.fvu for m in layers])),
            format_number(_mean([m.l0 for m in layers]), 2),
            format_percent(_mean([m.dead_fraction for m in layers]), 1),
        ]
        rows.append("| " + " | ".join("–" if c is None else f"{c:g}" if isinstance(c, float) else str(c)
                                      for c in cells) + " |")
    return "\n".join(rows) + "\n"


def write_variants_table(folder: str | Path, names: list[str]) -> Path:
    """Write `folder/variants.md` (atomically) and return its path."""
    path = Path(folder) / VARIANTS_TABLE
    write_text(path, f"# Variants in {Path(folder).name}\n\n" + variants_table(folder, names))
    return path
