"""The training logs (JSONL, one record per logged step) and the loss-curve plot drawn from them.

A record is `{"step", "tokens", "lr", "loss", ..., "seconds"}`; distillation adds per-layer "layers", healing its
objective and "aux". A resumed run first drops the records written after its checkpoint, so that its log equals an
uninterrupted run's.
"""

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path


class JsonlLog:
    """Append-only JSONL file of step records."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            # allow_nan=False: a non-finite value here is a bug (the engine stops before logging one), never bad JSON.
            f.write(json.dumps(record, allow_nan=False) + "\n")

    def truncate(self, step: int) -> None:
        truncate_log(self.path, step)

    def records(self) -> list[dict]:
        return read_log(self.path)

    def last(self) -> dict | None:
        records = self.records()
        return records[-1] if records else None


def read_log(path: Path) -> list[dict]:
    """The records of a JSONL log; [] when it does not exist. A torn last line (killed mid-write) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    return [record for line in path.read_text(encoding="utf-8").splitlines() if (record := _parse(line))]


def loss_drop_last_fifth(path: Path) -> float | None:
    """How much the training loss still fell over the run's last fifth: (mean loss of the records in the 70–80 % steps
    − that of the 90–100 % steps) / the former; None when a window holds no record (too few log steps)."""
    records = [r for r in read_log(path) if isinstance(r.get("loss"), (int, float))]
    if not records:
        return None
    last = records[-1]["step"]

    def mean_loss(low: float, high: float) -> float | None:
        losses = [r["loss"] for r in records if low * last <= r["step"] <= high * last]
        return sum(losses) / len(losses) if losses else None

    before, after = mean_loss(0.7, 0.8), mean_loss(0.9, 1.0)
    if before is None or after is None or before <= 0:
        return None
    return (before - after) / before


def _parse(line: str) -> dict | None:
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


def truncate_log(path: Path, step: int) -> None:
    """Drop JSONL log lines written after `step` (the checkpoint's), so a resumed run's log equals an
    uninterrupted one's."""
    path = Path(path)
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if (record := _parse(line)) and record["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


def plot_loss_curve(log_paths: Iterable[Path], png_path: Path) -> Path | None:
    """Loss against step, one panel per log that exists (e.g. train_log.jsonl: distillation, heal_log.jsonl:
    healing; their losses are different objectives, so they never share an axis). Distillation logs with several
    layers also get one thin line per layer. Returns `png_path`, or None when no log holds a record."""
    panels = [(Path(p), records) for p in log_paths if (records := [r for r in read_log(p) if "loss" in r])]
    if not panels:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A bare Figure on the Agg canvas: no pyplot global state, no display needed.
    fig = Figure(figsize=(5.5 * len(panels), 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, (path, records) in zip(axes[0], panels):
        steps = [r["step"] for r in records]
        layers = sorted({name for r in records for name in r.get("layers", {})}, key=_layer_order)
        if len(layers) > 1:
            for name in layers:
                ax.plot(steps, [r["layers"].get(name, {}).get("loss", math.nan) for r in records], lw=0.8,
                        alpha=0.6, label=f"layer {name}")
        ax.plot(steps, [r["loss"] for r in records], lw=2, color="black", label="mean" if len(layers) > 1 else "loss")
        if all(r["loss"] > 0 for r in records):
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(path.stem.removesuffix("_log"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=120)
    return Path(png_path)


def _layer_order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)
