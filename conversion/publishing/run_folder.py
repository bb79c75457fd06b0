"""The run folder of `expertize upcycle`: its file names, its lock/resume state, atomic writes and the final publish.

    OUTPUT_DIR/
        .expertize.lock                   held (fcntl.flock) by the run that claimed the folder, until it ends: a
                                          second run on the same folder is refused naming the holder's pid; the
                                          kernel releases it when the process dies (a kill leaves no stale lock)
        checkpoint/recipe.resolved.yaml   the claim: written by `claim()` once every check has passed; a rerun of the
                                          same recipe resumes, a different recipe is refused (or `--restart`). It
                                          holds the recipe's identity (`run_identity`): no output_dir, local paths
                                          resolved, so how the folder or a file is spelled never decides a resume
        checkpoint/state.pt               distillation state (training/engine.py)
        checkpoint/heal.pt                healing state (training/heal.py)
        train_log.jsonl, heal_log.jsonl   one JSON line per logged step
        .final.XXXX/                      staging: the finished model and its records are written here ...
    ─► publish(): ... then moved in, metrics.json last (its presence marks the run complete), checkpoint/ removed:
        model files, tokenizer, README.md, recipe.resolved.yaml, provenance.json, plots/, lm_eval/, metrics.json

This module is the only place that knows these names (model files aside). Every JSON it writes is strict JSON
(`strict_json`): a non-finite float (NaN, ±inf) is written as `null` — JSON has no NaN, and a reader treats null as
"no value" — and the paths of the values it replaced are returned so the caller can report them.

Several processes (torchrun / accelerate launch): every rank builds a `RunFolder` with its own `is_main_process`;
only the main process writes anything into the folder. On the others `claim`, `restart`, the writes and `publish`
do nothing (and never fail), and `staging()` hands out a private temporary folder outside the run folder.
"""

import contextlib
import copy
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from ..errors import ExpertizeError
from .folder_lock import LOCK, FolderLock, RunFolderBusy, busy
from ..recipe.layer_config import has_preact_loss
from ..recipe.loader import PLACEMENT_KEYS
from expertize.modeling import LAYER_KINDS

__all__ = [
    "CHECKPOINT", "HEAL_LOG", "HEAL_STATE", "LM_EVAL", "METRICS", "MODEL_CARD", "PLOTS", "PROVENANCE",
    "RESOLVED_RECIPE", "STAGING_PREFIX", "TRAIN_LOG", "TRAIN_STATE",
    "RunFolder", "RunFolderBusy", "RunFolderError", "RunFolderTaken", "Staging", "run_identity", "staging_folder",
    "strict_json", "write_json", "write_text", "write_yaml",
]

METRICS = "metrics.json"
RESOLVED_RECIPE = "recipe.resolved.yaml"
PROVENANCE = "provenance.json"
PLOTS = "plots"
TRAIN_LOG = "train_log.jsonl"
HEAL_LOG = "heal_log.jsonl"
CHECKPOINT = "checkpoint"
TRAIN_STATE = "state.pt"
HEAL_STATE = "heal.pt"
MODEL_CARD = "README.md"
LM_EVAL = "lm_eval"
STAGING_PREFIX = ".final."

TRACKING = "tracking"
"""Experiment-tracker files (train.log_with: tensorboard event files, ...)."""
_UNFINISHED = (CHECKPOINT, TRAIN_LOG, HEAL_LOG, TRACKING)
"""What an unfinished run leaves in the folder (besides staging folders); `restart()` removes exactly these."""


class RunFolderError(ExpertizeError, ValueError):
    """The output folder cannot take this run (a file, a different unfinished run, ...); the message says the fix."""


class RunFolderTaken(ExpertizeError, FileExistsError):
    """The output folder holds a finished run or files that are not an expertize run; choose another output_dir."""




# ----------------------------------------------------------------------------------------------------------------
# Strict JSON and atomic writes


def strict_json(value: Any, path: str = "") -> tuple[Any, list[str]]:
    """(`value` with every non-finite float replaced by None, the dotted paths of the replaced values).

    Tuples become lists and mapping keys strings, as `json.dumps` would write them; anything else is left for
    `json.dumps` to accept or refuse."""
    if isinstance(value, float) and not math.isfinite(value):
        return None, [path or "<root>"]
    if isinstance(value, Mapping):
        out, nulled = {}, []
        for key, item in value.items():
            out[str(key)], sub = strict_json(item, f"{path}.{key}" if path else str(key))
            nulled += sub
        return out, nulled
    if isinstance(value, (list, tuple)):
        out, nulled = [], []
        for i, item in enumerate(value):
            clean, sub = strict_json(item, f"{path}[{i}]")
            out.append(clean)
            nulled += sub
        return out, nulled
    return value, []


def _atomic_write(path: Path, text: str) -> Path:
    """Write through a temporary file in the same folder and rename it: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8", newline="")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json(path: str | os.PathLike, data: Any) -> list[str]:
    """Write `data` as indented strict JSON, atomically; returns the paths of non-finite floats written as null."""
    import json

    clean, nulled = strict_json(data)
    _atomic_write(Path(path), json.dumps(clean, indent=2, allow_nan=False) + "\n")
    return nulled


def write_text(path: str | os.PathLike, text: str) -> Path:
    return _atomic_write(Path(path), text)


def write_yaml(path: str | os.PathLike, data: Any) -> Path:
    return _atomic_write(Path(path), yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def staging_folder(parent: str | os.PathLike, prefix: str) -> Path:
    """A new, uniquely named folder `parent/prefix<random>`, made as `mkdir` makes one: 0777 less the umask (0755
    under umask 0022), as a run folder is. `tempfile.mkdtemp` makes 0700, and a staging folder that is renamed into
    place *is* the output: an export or a saved model would be private to its owner (another user or a container
    on a shared machine could not read it)."""
    import secrets

    for _ in range(100):
        path = Path(parent) / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free staging folder name {prefix}* in {parent}")


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for key in sorted(set(a) | set(b)) for k in _diff_keys(a.get(key), b.get(key), f"{prefix}{key}.")]
    return [] if a == b else [prefix.rstrip(".")]


def _local_path(value: Any) -> Any:
    """A path string made absolute and canonical (symlinks, `..`, a trailing slash, `~`); anything else unchanged."""
    return os.path.realpath(os.path.expanduser(value)) if isinstance(value, str) and value else value


def run_identity(resolved_recipe: dict) -> dict:
    """What decides whether a folder's unfinished (or finished) run is the same run as `resolved_recipe`: the recipe
    without `output_dir` (the folder names itself: `runs/a`, `runs/a/`, `/abs/runs/a` and `../runs/a` from a
    subfolder are one folder), without the base's placement (device_map, max_memory, offload_folder: a run resumed
    with the base spread differently computes the same numbers), and with its local paths canonical (a base model
    folder, data.paths and eval_paths, the activation cache), so a rerun spelled differently resumes instead of
    being refused; data.token_cache is left out
    (it changes where token ids come from, not which). A Hub id stays as it is."""
    tree = copy.deepcopy(dict(resolved_recipe))
    tree.pop("output_dir", None)
    for key in PLACEMENT_KEYS:  # where the base's weights sit, not what is computed
        tree.pop(key, None)
    base = tree.get("base_model")
    if isinstance(base, str) and os.path.exists(os.path.expanduser(base)):
        tree["base_model"] = _local_path(base)
    data = tree.get("data")
    if isinstance(data, dict):
        for key in ("paths", "eval_paths"):
            if isinstance(data.get(key), list):
                data[key] = [_local_path(p) for p in data[key]]
        data["activation_cache"] = _local_path(data.get("activation_cache"))
        data.pop("token_cache", None)  # where token ids are kept between runs: the same ids either way
    _settle_preact(tree)
    return tree


def _settle_preact(tree: dict) -> None:
    """train.preact_coef as the run used it: absent where the kind computes no pre-activation loss (the setting
    decides nothing there), 0 where a recipe written before the setting existed leaves it out (issue 47: those runs
    trained without it). So a finished MxD run of an older version is still this recipe's run, and an older JumpReLU
    run is not the run of today's default. train.threshold_lr_scale likewise: absent where no threshold trains, 1
    where a recipe from before the setting leaves it out (the thresholds trained at the learning rate)."""
    train, layer = tree.get("train"), tree.get("layer")
    if not isinstance(train, dict) or not isinstance(layer, dict):
        return
    kind = layer.get("kind")
    if kind in LAYER_KINDS and not has_preact_loss(kind):
        train.pop("preact_coef", None)
        train.pop("threshold_lr_scale", None)
    else:
        train.setdefault("preact_coef", 0.0)
        train.setdefault("threshold_lr_scale", 1.0)


def _lookup(tree: Any, dotted: str) -> Any:
    for key in dotted.split(".") if dotted else []:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def _recipe_differs(path: Path, resolved_recipe: dict) -> list[str]:
    """The keys at which the recipe YAML at `path` differs from `resolved_recipe` in `run_identity` (["<unreadable>"]:
    not a recipe), each as `key (the folder's run: A, this recipe: B)`."""
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        saved = None
    if not isinstance(saved, dict):
        return ["<unreadable>"]
    theirs, ours = run_identity(saved), run_identity(resolved_recipe)
    return [f"{key} (the folder's run: {_lookup(theirs, key)!r}, this recipe: {_lookup(ours, key)!r})"
            for key in _diff_keys(theirs, ours)]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------------------------
# Staging


class Staging:
    """A folder where the finished run is assembled before `RunFolder.publish` moves it in."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def plots_dir(self) -> Path:
        return self.path / PLOTS

    @property
    def lm_eval_dir(self) -> Path:
        return self.path / LM_EVAL

    def relative(self, value: Any) -> Any:
        """A path string inside the staging folder as a POSIX path relative to it (= relative to the run folder
        once published); any other value unchanged."""
        if not isinstance(value, str):
            return value
        for root in {str(self.path), str(self.path.resolve())}:
            if value == root or value.startswith(root + os.sep):
                return Path(os.path.relpath(value, root)).as_posix()
        return value

    def _relative_tree(self, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {key: self._relative_tree(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._relative_tree(item) for item in value]
        return self.relative(value)

    def write_metrics(self, metrics: Any) -> list[str]:
        """metrics.json (a `Metrics` or its dict): strict JSON, paths into the staging folder made relative.
        Returns the dotted keys whose non-finite values were written as null."""
        data = metrics.to_dict() if hasattr(metrics, "to_dict") else metrics
        return write_json(self.path / METRICS, self._relative_tree(data))

    def write_json(self, name: str, data: Any) -> list[str]:
        return write_json(self.path / name, data)

    def write_text(self, name: str, text: str) -> Path:
        return write_text(self.path / name, text)

    def write_yaml(self, name: str, data: Any) -> Path:
        return write_yaml(self.path / name, data)


# ----------------------------------------------------------------------------------------------------------------
# The run folder


class RunFolder:
    """One `expertize upcycle` output folder. Checks (`check_claimable`) write nothing; `claim` takes the folder."""

    def __init__(self, root: str | os.PathLike, *, is_main_process: bool = True) -> None:
        self.root = Path(root)
        self.is_main_process = is_main_process
        self.is_resume = False
        """True once `claim` found an unfinished run of the same recipe (the run continues from its checkpoint)."""
        self._lock = FolderLock(self.root)

    # -- names -------------------------------------------------------------------------------------------------------

    metrics_path = property(lambda self: self.root / METRICS)
    recipe_path = property(lambda self: self.root / RESOLVED_RECIPE)
    provenance_path = property(lambda self: self.root / PROVENANCE)
    card_path = property(lambda self: self.root / MODEL_CARD)
    plots_dir = property(lambda self: self.root / PLOTS)
    lm_eval_dir = property(lambda self: self.root / LM_EVAL)
    train_log = property(lambda self: self.root / TRAIN_LOG)
    heal_log = property(lambda self: self.root / HEAL_LOG)
    checkpoint_dir = property(lambda self: self.root / CHECKPOINT)
    train_state = property(lambda self: self.root / CHECKPOINT / TRAIN_STATE)
    heal_state = property(lambda self: self.root / CHECKPOINT / HEAL_STATE)
    claimed_recipe_path = property(lambda self: self.root / CHECKPOINT / RESOLVED_RECIPE)

    @property
    def is_finished(self) -> bool:
        return self.metrics_path.is_file()

    def finished_recipe_differs(self, resolved_recipe: dict) -> list[str]:
        """The keys at which the finished run's recipe.resolved.yaml differs from `resolved_recipe` in
        `run_identity` ([]: the same run), each with both values."""
        return _recipe_differs(self.recipe_path, resolved_recipe)

    # -- lock -------------------------------------------------------------------------------------------------------

    def check_not_busy(self) -> None:
        """RunFolderBusy when another process holds the folder's lock (a run of it is in progress). Main process
        only (the other ranks of this run share the main process's folder)."""
        if self.is_main_process and self._lock.fd is None and self._lock.is_held():
            raise busy(self.root, self._lock.path)

    def lock(self) -> None:
        """Hold the folder's lock until `unlock` or the process ends (RunFolderBusy when another run holds it);
        `claim` takes it. Main process only."""
        if self.is_main_process:
            self._lock.acquire()

    def unlock(self) -> None:
        self._lock.release()

    # -- claim ------------------------------------------------------------------------------------------------------

    def check_claimable(self, resolved_recipe: dict, *, restart: bool = False) -> bool:
        """Whether this run can use the folder; True when it would resume an unfinished run of the same recipe.
        Writes nothing. Raises RunFolderError / RunFolderTaken naming the problem and the fix.

        restart: the unfinished run in the folder (of any recipe) is to be discarded (`restart()`), so no resume.
        On other processes than the main one only the file check runs (the main process may be claiming the
        folder at the same moment; it reports every other problem).
        """
        out = self.root
        for parent in (out, *out.parents):
            if parent.exists() and not parent.is_dir():
                where = "output_dir" if parent == out else f"output_dir {out}: its parent"
                raise RunFolderError(
                    f"{where} {parent} is a file, not a folder; set output_dir to a folder path (it is created when "
                    "missing)"
                )
        if not self.is_main_process:
            return not restart and self.claimed_recipe_path.is_file()
        if not out.exists():
            return False
        self.check_not_busy()  # before anything else: a run in progress makes every other answer moot
        if self.is_finished:
            raise RunFolderTaken(
                f"{out} already holds a finished run ({METRICS}); choose another output_dir, or delete {out} if you "
                "no longer need that model (--restart only discards unfinished runs)"
            )
        saved = self.claimed_recipe_path
        if saved.is_file():
            if restart:
                return False
            changed = _recipe_differs(saved, resolved_recipe)
            if changed:
                raise RunFolderError(
                    f"{out} holds an unfinished run of a different recipe (differs at {'; '.join(changed)}). To "
                    f"resume it, run with the folder's recipe ({saved}, or set those values back); to keep it and "
                    "start this recipe, choose another output_dir; only if that run is no longer wanted, pass "
                    "--restart (it deletes its checkpoint and logs)"
                )
            return True
        entries = sorted(p.name for p in out.iterdir() if p.name != LOCK)
        foreign = [name for name in entries if name not in _UNFINISHED and not name.startswith(STAGING_PREFIX)]
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise RunFolderTaken(
                f"{out} exists and is not an expertize run folder (it holds {shown}); choose another output_dir"
            )
        if entries and not restart:
            raise RunFolderError(
                f"{out} holds leftovers of an unfinished run ({', '.join(entries)}) but no record of its recipe; pass "
                "--restart to discard them, or choose another output_dir"
            )
        return False

    def claim(self, resolved_recipe: dict, *, restart: bool = False) -> bool:
        """Take the folder for this run, after every other check has passed (a refused start leaves it untouched).

        Re-checks (`check_claimable`), takes the folder's lock (held until `unlock` or the process ends; a second run
        is refused naming this one's pid), discards the unfinished run when `restart`, removes staging leftovers of
        an interrupted publish, and records the recipe's identity (checkpoint/recipe.resolved.yaml, `run_identity`)
        that a rerun must match. Returns `is_resume`. On other processes than the main one it writes nothing; call it there after the
        main process's claim (e.g. after `accelerator.wait_for_everyone()`).
        """
        if not self.is_main_process:
            self.is_resume = not restart and self.claimed_recipe_path.is_file()
            return self.is_resume
        self.check_claimable(resolved_recipe, restart=restart)  # a busy folder is refused before it is created
        self.lock()
        try:
            # Checked again under the lock: another run may have claimed (or finished) the folder meanwhile.
            self.is_resume = self.check_claimable(resolved_recipe, restart=restart)
            if restart:
                self.restart()
            for leftover in self.root.glob(f"{STAGING_PREFIX}*"):
                _remove(leftover)
            if not self.is_resume:
                write_yaml(self.claimed_recipe_path, run_identity(resolved_recipe))
        except BaseException:
            self.unlock()
            raise
        return self.is_resume

    def restart(self) -> list[str]:
        """Discard an unfinished run: checkpoint/, train_log.jsonl, heal_log.jsonl and staging folders; nothing
        else in the folder is touched. Refuses a finished run. Returns the names removed."""
        if not self.is_main_process or not self.root.is_dir():
            return []
        if self.is_finished:
            raise RunFolderTaken(
                f"{self.root} holds a finished run ({METRICS}); --restart only discards unfinished runs: choose "
                f"another output_dir, or delete {self.root} if you no longer need that model"
            )
        removed = []
        for path in sorted(self.root.iterdir()):
            if path.name in _UNFINISHED or path.name.startswith(STAGING_PREFIX):
                _remove(path)
                removed.append(path.name)
        self.is_resume = False
        return removed

    # -- writes -----------------------------------------------------------------------------------------------------

    def write_json(self, name: str, data: Any) -> list[str]:
        """`name` (relative to the folder) as strict JSON, atomically; main process only. See `write_json`."""
        return write_json(self.root / name, data) if self.is_main_process else []

    def write_text(self, name: str, text: str) -> None:
        if self.is_main_process:
            write_text(self.root / name, text)

    def write_yaml(self, name: str, data: Any) -> None:
        if self.is_main_process:
            write_yaml(self.root / name, data)

    # -- staging and publish ----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def staging(self) -> Iterator[Staging]:
        """A fresh staging folder inside the run folder (same filesystem: publishing is a rename), removed on exit
        whether or not it was published. On other processes: a private temporary folder outside the run folder."""
        if self.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            path = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.root))
        else:
            path = Path(tempfile.mkdtemp(prefix="expertize-rank-"))
        try:
            yield Staging(path)
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def publish(self, staging: Staging) -> None:
        """Move the staged files into the folder, metrics.json last (it marks the run complete), then remove
        checkpoint/. Does nothing on other processes than the main one."""
        if not self.is_main_process:
            return
        if not (staging.path / METRICS).is_file():
            raise RuntimeError(f"{staging.path} has no {METRICS}: write it (Staging.write_metrics) before publishing")
        names = sorted(p.name for p in staging.path.iterdir() if p.name != METRICS) + [METRICS]
        for name in names:
            target = self.root / name
            if target.exists() or target.is_symlink():
                _remove(target)
            (staging.path / name).replace(target)
        shutil.rmtree(self.checkpoint_dir, ignore_errors=True)
