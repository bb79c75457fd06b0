"""The folder `expertize inspect --output DIR` writes: who owns it, and how a report replaces the one before it.

    DIR/
        .expertize.lock        held while an inspect of DIR runs (publishing/folder_lock.py, as upcycle's run folder):
                               a second inspect of DIR is refused naming the first one's pid
        inspect.json           the owner: the model the report describes (its folder's canonical path) and the
                               files the report wrote; written last, so a report without it is not finished
        layer_<i>.json, index.html, delphi_cache/
        .inspect.XXXX/         staging: the new report is written here, then moved in

The rules, as `upcycle`'s for its run folder (publishing/run_folder.py):
- DIR does not exist or is empty: the report is written;
- DIR holds a report of the same model: it is replaced (a rerun), files of the old report that the new one does not
  write (layers no longer inspected, a delphi cache) are removed, anything else in DIR is kept;
- DIR holds a report of another model: refused, unless `overwrite` (`--overwrite`) asks to replace it;
- DIR holds anything else (a model folder, files of your own, a report that does not record its model): refused
  (`overwrite` replaces only a report that records its files, so it never deletes a file it did not write).
"""

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import ExpertizeError
from ..publishing.folder_lock import LOCK, FolderLock, busy
from ..publishing.run_folder import write_json

__all__ = ["MANIFEST", "ReportFolder", "ReportFolderTaken", "model_identity"]

MANIFEST = "inspect.json"
STAGING_PREFIX = ".inspect."
_REPORT_NAMES = ("index.html", "delphi_cache")
"""A report's files besides layer_<i>.json: what a folder from before inspect.json existed holds."""


class ReportFolderTaken(ExpertizeError, FileExistsError):
    """The --output folder holds another model's report, or files that are not a report; the message says the fix."""


def model_identity(model_dir: str | os.PathLike) -> str:
    """The owner a report records: the model folder's canonical path (however it was spelled on the command line)."""
    return os.path.realpath(os.path.expanduser(os.fspath(model_dir)))


def _is_report_name(name: str) -> bool:
    return name in _REPORT_NAMES or (name.startswith("layer_") and name.endswith(".json"))


def _busy(root: Path, lock: Path) -> ExpertizeError:
    return busy(root, lock, error=ReportFolderTaken, holder="command", rerun="", setting="--output",
                two="two reports written into one folder would mix their files")


class ReportFolder:
    """One inspect --output folder, for the report of `model` (its `model_identity`, or any name of a model given in
    memory). `check` writes nothing; `claim` locks the folder until `release` (or the process ends)."""

    def __init__(self, root: str | os.PathLike, model: str, *, overwrite: bool = False) -> None:
        self.root, self.model, self.overwrite = Path(root), model, overwrite
        self._created = False
        self._lock = FolderLock(self.root, refusal=_busy)

    def _manifest(self) -> dict | None:
        try:
            data = json.loads((self.root / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and isinstance(data.get("files"), list) else None

    def check(self) -> None:
        """Refuse (ReportFolderTaken) a folder another process is writing, another model's report, or a folder that
        is not a report; writes nothing."""
        out = self.root
        if out.exists() and not out.is_dir():
            raise ReportFolderTaken(f"--output {out} is a file, not a folder; give a folder path (it is created)")
        if not out.is_dir():
            return
        if self._lock.fd is None and self._lock.is_held():
            raise _busy(out, self._lock.path)
        manifest = self._manifest()
        if manifest is not None:
            owner = manifest.get("model")
            if owner != self.model and not self.overwrite:
                raise ReportFolderTaken(
                    f"{out} holds the inspect report of another model ({owner}); choose another --output, or pass "
                    "--overwrite to replace that report"
                )
            return
        entries = sorted(p.name for p in out.iterdir() if p.name != LOCK and not p.name.startswith(STAGING_PREFIX))
        if not entries:
            return
        if (out / "config.json").is_file():
            raise ReportFolderTaken(
                f"{out} is a model folder; write the report into a folder of its own, e.g. --output "
                f"{out / 'inspect'} (push leaves report subfolders out)"
            )
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        if all(_is_report_name(name) for name in entries):
            raise ReportFolderTaken(
                f"{out} holds an inspect report that does not record its model ({shown}: written before reports had "
                f"{MANIFEST}); delete it or choose another --output"
            )
        raise ReportFolderTaken(
            f"{out} exists and is not an inspect report folder (it holds {shown}); choose another --output (a new "
            "or empty folder)"
        )

    def claim(self) -> None:
        """Check, lock the folder (a second inspect of it is refused naming this process), check again under the
        lock (another run may have written meanwhile), and remove the staging leftovers of an interrupted run."""
        self.check()
        self._created = not self.root.exists()
        self._lock.acquire()
        try:
            self.check()
            for leftover in self.root.glob(f"{STAGING_PREFIX}*"):
                shutil.rmtree(leftover, ignore_errors=True)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Unlock; a folder the claim created and nothing was written into is removed (a refused or failed run
        leaves nothing behind)."""
        held = self._lock.fd is not None
        self._lock.release()
        if held and self._created:
            with contextlib.suppress(OSError):  # not empty (the report was written), or already gone
                self.root.rmdir()

    @contextlib.contextmanager
    def claimed(self) -> Iterator["ReportFolder"]:
        self.claim()
        try:
            yield self
        finally:
            self.release()

    def publish(self, write: Callable[[Path], list[Path]]) -> list[Path]:
        """Write a report through `write(staging folder) -> paths written there` and move it in, replacing the
        folder's previous report; returns the paths in the folder. Claims the folder for the write unless claimed."""
        if self._lock.fd is None:
            with self.claimed():
                return self.publish(write)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.root))
        try:
            names = sorted({Path(p).relative_to(staging).parts[0] for p in write(staging)})
            old = (self._manifest() or {}).get("files", [])
            # Owned by the new report from here on: a run killed while moving leaves a folder that this model's
            # rerun replaces (every name is listed) and another model's inspect refuses.
            write_json(self.root / MANIFEST, {"model": self.model, "files": sorted({*old, *names}), "complete": False})
            for name in names:
                target = self.root / name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                (staging / name).replace(target)
            for name in set(old) - set(names):
                if Path(name).name != name or not _is_report_name(name):  # only what a report writes, in the folder
                    continue
                target = self.root / name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    target.unlink(missing_ok=True)
            write_json(self.root / MANIFEST, {"model": self.model, "files": names, "complete": True})
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return [self.root / name for name in names]
