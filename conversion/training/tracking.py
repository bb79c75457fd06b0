"""Experiment tracking through 🤗 Accelerate's trackers (`train.log_with`: tensorboard, wandb, ...).

At each log interval the engine sends the step's record as scalars: loss, L0, dead fraction, lr, throughput
(tokens per second) and whatever else the record holds (per-layer values as "layers/8/loss", ...). Distillation and
healing are two runs of the tracker, named after the stage ("distil", "heal"); trackers that write locally
(TensorBoard) write under OUTPUT_DIR/tracking/STAGE/. Only the main process tracks.

The tracker classes are Accelerate's own (`accelerate.tracking`), created the way `Accelerator.init_trackers`
creates them, so that healing (single process, no Accelerator) tracks exactly like distillation.
"""

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ExpertizeError
from ..publishing.run_folder import TRACKING as TRACKING_DIR  # the run folder owns its names

# The pip package each tracker needs (Accelerate's tracker name -> distribution name), for the error message.
_PACKAGES = {"comet_ml": "comet-ml"}


def tracking_dir(log_path: Path) -> Path:
    """Where a run whose JSONL log is `log_path` keeps its trackers' files: the run folder's `tracking/`."""
    return Path(log_path).parent / TRACKING_DIR


def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a log record, nested keys joined with "/" ({"layers": {"8": {"l0": 3}}} -> "layers/8/l0");
    "step" (the tracker's x axis) and non-numbers are left out."""
    out = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and name != "step":
            if math.isfinite(value):
                out[name] = value
    return out


class Tracking:
    """The trackers of one training stage; `log(values, step)` sends to each. `log_with="none"`: does nothing."""

    def __init__(self, log_with: str, run_name: str, logging_dir: Path, *, is_main_process: bool = True) -> None:
        self.log_with, self.run_name, self.logging_dir = log_with, run_name, Path(logging_dir)
        self.active = log_with != "none" and is_main_process
        self.trackers: list = []

    def start(self) -> None:
        """Create and start the trackers; an uninstalled tracker package is an ExpertizeError naming the fix."""
        if not self.active or self.trackers:
            return
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

        available = {str(t) for t in get_available_trackers()}
        if self.log_with not in available:
            package = _PACKAGES.get(self.log_with, self.log_with)
            extra = ' (pip install "expertize[tracking]")' if self.log_with == "tensorboard" else ""
            raise ExpertizeError(
                f"train.log_with={self.log_with!r} needs the {package!r} package, which is not installed; "
                f"pip install {package}{extra}, or set train.log_with: none (--set train.log_with=none)"
            )
        tracker_class = LOGGER_TYPE_TO_CLASS[self.log_with]
        if tracker_class.requires_logging_directory:
            self.logging_dir.mkdir(parents=True, exist_ok=True)
            tracker = tracker_class(self.run_name, str(self.logging_dir))
        else:
            tracker = tracker_class(self.run_name)
        tracker.start()
        self.trackers.append(tracker)

    def log(self, record: Mapping[str, Any], step: int) -> None:
        if not self.active:
            return
        self.start()
        values = scalars(record)
        for tracker in self.trackers:
            tracker.log(values, step=step)

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
