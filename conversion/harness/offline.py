"""Offline machines: which lm-eval tasks need a dataset from the Hugging Face Hub that is not cached here.

With HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, a task such as `hellaswag` (dataset `Rowan/hellaswag`) fails deep
inside the harness, after the models are loaded and output folders made. `check_task_data_offline` finds that out
from the task configs alone, before anything is loaded or written, and says how to proceed.
"""

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ExpertizeError

__all__ = ["check_task_data_offline", "hub_dataset", "hub_datasets_missing", "is_offline"]

# `datasets` loaders that read local files (data_files) rather than a Hub dataset.
_PACKAGED = {"json", "csv", "text", "parquet", "arrow", "pandas", "xml", "sql", "generator", "webdataset",
             "imagefolder", "audiofolder", "videofolder", "cache"}
_TRUE = {"1", "on", "yes", "true"}


def is_offline() -> bool:
    """True when the Hub libraries are told not to use the network (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE)."""
    import huggingface_hub.constants

    env = any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return env or bool(huggingface_hub.constants.HF_HUB_OFFLINE)


def _leaf_configs(manager, name: str, seen: set[str]) -> Iterable[dict[str, Any]]:
    """The configs of the tasks `name` (a task, group or tag) runs; Python-only tasks have none to inspect."""
    if name in seen:
        return
    seen.add(name)
    entry = manager.task_index.get(name)
    if entry is None:
        return
    kind = entry.kind.name
    if kind == "TAG":
        for member in sorted(entry.tags):
            yield from _leaf_configs(manager, member, seen)
    elif kind == "GROUP":
        members = (entry.cfg or {}).get("task") or []
        for member in members if isinstance(members, list) else [members]:
            if isinstance(member, str):
                yield from _leaf_configs(manager, member, seen)
            elif isinstance(member, dict):
                base = manager.task_index.get(member.get("task")) if isinstance(member.get("task"), str) else None
                yield {**((base.cfg or {}) if base is not None else {}), **member}
    elif entry.cfg:
        yield entry.cfg


def _cached(dataset: str) -> bool:
    """Whether the Hub dataset has a copy in the local caches (the Hub's file cache or datasets' own)."""
    import datasets.config
    import huggingface_hub.constants

    hub = Path(huggingface_hub.constants.HF_HUB_CACHE) / f"datasets--{dataset.replace('/', '--')}"
    own = Path(datasets.config.HF_DATASETS_CACHE) / dataset.replace("/", "___")
    return hub.is_dir() or own.is_dir()


def hub_dataset(cfg: Mapping[str, Any]) -> str | None:
    """The Hub dataset a task config reads (its `dataset_path`), None when its data is local: a `custom_dataset`
    loader (the tasks `expertize tasks` writes and the ones expertize ships), a packaged loader over data_files
    (json, csv, text, ...) or a local path."""
    path = cfg.get("dataset_path")
    if cfg.get("custom_dataset") or not isinstance(path, str) or path in _PACKAGED or Path(path).expanduser().exists():
        return None
    return path


def hub_datasets_missing(manager, tasks: Sequence[str]) -> dict[str, str]:
    """task name -> Hub dataset id, for the tasks whose dataset comes from the Hub and is not cached locally."""
    missing = {}
    for name in tasks:
        for cfg in _leaf_configs(manager, name, set()):
            path = hub_dataset(cfg)
            if path is None:
                continue
            if not _cached(path):
                missing[str(cfg.get("task", name))] = path
    return missing


def check_task_data_offline(manager, tasks: Sequence[str], error: type[ExpertizeError] = ExpertizeError) -> None:
    """Raise `error` when offline mode is on and a task needs an uncached Hub dataset; nothing otherwise."""
    if not is_offline():
        return
    missing = hub_datasets_missing(manager, tasks)
    if not missing:
        return
    shown = ", ".join(f"{task} (dataset {path})" for task, path in list(missing.items())[:5])
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    raise error(
        f"offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) and lm-eval task(s) {shown}{more} need a dataset "
        "from the Hugging Face Hub that is not cached on this machine; run once with the network (unset "
        "HF_HUB_OFFLINE and HF_DATASETS_OFFLINE) to download it, or use offline tasks: `expertize tasks --list`, "
        "or your own with `expertize tasks TEXT --name NAME --output DIR` and --include-path DIR"
    )
