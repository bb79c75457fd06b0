"""Checks every command makes before any work: one rule per concern, shared by all of them.

    command-line counts   positive_int, non_negative_int, at_least(n), positive_float, int_list: argparse types, so
                          `--top-n 0` or `--left -3` is refused by the parser with the flag named (exit 2)
    devices               resolve_device (device.py): `--device` of every command and `train.device`
    output locations      check_output_location: the folder (or file) exists or can be created, is writable and its
                          disk has room for an estimate of what will be written
    weights               check_weight_file: a safetensors file whose header reads and whose tensors fit in it
                          (publishing/model_folder.check_model_folder calls it for every weight file)
    a full disk           NoSpaceLeft / disk_full / no_space_message: a write that fails for lack of space (after
                          the work started) says where and how much to free, and exits 1

Each check raises an `ExpertizeError` whose message names the problem and the fix; none writes anything that stays.
"""

import argparse
import errno
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from .errors import ExpertizeError, RunFailed
from .device import resolve_device


__all__ = [
    "NoSpaceLeft",
    "OutputLocationError",
    "at_least",
    "check_local_weights",
    "check_output_location",
    "check_weight_file",
    "disk_full",
    "int_list",
    "no_space_message",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "resolve_device",
]

MB = 1_000_000


# -- command-line counts ---------------------------------------------------------------------------------------------
# argparse prints "argument --top-n: <message>" for an ArgumentTypeError, so the flag is named without repeating it.


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def at_least(minimum: int, what: str | None = None):
    """An argparse type: an integer >= `minimum` (`what` it counts, for the message)."""

    def parse(text: str) -> int:
        value = _integer(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more{f' ({what})' if what else ''}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


positive_int = at_least(1, "a count")
"""A count: 1 or more (tokens, contexts per unit, batch size, shard size ...)."""

non_negative_int = at_least(0)
"""A window or an optional amount: 0 or more (`--left`, `--right`, `--num-fewshot`)."""


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated counts, e.g. `1,2,4,8`."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts such as 1,2,4, got {text!r}")
    return tuple(positive_int(p) for p in parts)


# -- output locations ------------------------------------------------------------------------------------------------


class OutputLocationError(ExpertizeError, ValueError):
    """An output folder or file cannot be written; the message names the location and the fix."""


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(os.sep)


def _probe_write(folder: Path) -> None:
    """Create and remove one hidden file in `folder`: the only test of writability that a read-only mount, an ACL
    or a quota cannot fool (os.access answers for the mode bits alone, and root passes it everywhere)."""
    fd, probe = tempfile.mkstemp(prefix=".expertize-write-check-", dir=folder)
    os.close(fd)
    os.unlink(probe)


def check_output_location(
    path: str | os.PathLike, *, what: str, need_bytes: int = 0, file: bool = False
) -> Path:
    """Refuse, before any work, an output that could not be written after it: `path` must be a folder (`file`: a
    file) or not exist yet, the nearest existing folder above it must be writable (folders are created), and its
    disk must have `need_bytes` free (an estimate of what will be written; 0 skips that). `what` names the setting
    in messages ("--output", "output_dir"). Writes nothing that stays; returns the path."""
    path = Path(os.path.expanduser(str(path)))
    label = f"{what} {str(path)!r}"
    if path.exists():
        if file and path.is_dir():
            raise OutputLocationError(f"{label} is a folder; give a file name (e.g. {path / 'out.json'})")
        if not file and not path.is_dir():
            raise OutputLocationError(f"{label} is a file, not a folder; choose another location or remove the file")
    folder = path.parent if file else path
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        raise OutputLocationError(
            f"{label} cannot be created: {existing} is a file, not a folder; choose another location"
        )
    try:
        _probe_write(existing)
    except OSError as e:
        why = "read-only file system" if e.errno == errno.EROFS else e.strerror or type(e).__name__
        raise OutputLocationError(
            f"{label} cannot be written: {existing} is not writable ({why}); choose a writable location, or make it "
            "writable (chmod / mount it read-write)"
        ) from None
    if file and path.is_file() and not os.access(path, os.W_OK):
        raise OutputLocationError(f"{label} exists and is not writable; choose another file name or chmod u+w it")
    if need_bytes > 0:
        free = shutil.disk_usage(existing).free
        if need_bytes > free:
            raise OutputLocationError(
                f"{label} needs about {_mb(need_bytes)} MB but {existing} has {_mb(free)} MB free; free "
                f"{_mb(need_bytes - free)} MB or choose a location on another disk"
            )
    return path


def _mb(n: int) -> int:
    return max(1, math.ceil(n / MB))


# -- weights ---------------------------------------------------------------------------------------------------------


def check_weight_file(path: str | os.PathLike) -> None:
    """Refuse a safetensors file that cannot be read whole: unreadable, a header that does not parse, or shorter
    than its header says (a download or copy cut short). Reads the header only (8 bytes + its JSON)."""
    path = Path(path)

    def damaged(why: str) -> ExpertizeError:
        return ExpertizeError(
            f"{path} is damaged ({why}); re-download it, or rerun the `expertize upcycle` that wrote the folder to "
            "rewrite it"
        )

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise damaged(f"{size} bytes, shorter than a safetensors header")
            header_len = int.from_bytes(head, "little")
            if header_len > size - 8:
                raise damaged(f"its header claims {header_len:,} bytes but the file has {size:,}")
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise ExpertizeError(f"{path} cannot be read ({e.strerror or e}); check its permissions") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise damaged("its header is not valid JSON") from None
    if not isinstance(header, dict):
        raise damaged("its header is not a JSON object")
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise damaged("its header lists a tensor without data offsets") from None
    if 8 + header_len + end > size:
        raise damaged(f"{size:,} bytes where its header needs {8 + header_len + end:,}: it was cut short")


def check_local_weights(model: str | os.PathLike) -> None:
    """`check_weight_file` for every safetensors file of a local model folder (a base model given by path); a Hub
    id is left to the Hub client."""
    folder = Path(os.path.expanduser(str(model)))
    if folder.is_dir():
        for weight in sorted(folder.glob("*.safetensors")):
            check_weight_file(weight)


# -- a full disk -----------------------------------------------------------------------------------------------------


class NoSpaceLeft(RunFailed):
    """A write failed for lack of space after the work started (exit 1); the message says where and how much to
    free, and what was kept."""


def disk_full(err: BaseException) -> bool:
    """True for the errors a full disk (or an exhausted quota) raises."""
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def no_space_message(folder: str | os.PathLike, need_bytes: int | None = None, then: str = "rerun") -> str:
    """"no space left on FOLDER: free N MB and rerun" (N: what `need_bytes` lacks beyond the free space now, when
    known)."""
    folder = Path(folder)
    amount = "some space"
    if need_bytes:
        try:
            free = shutil.disk_usage(_nearest_existing(folder)).free
            amount = f"{_mb(need_bytes - free)} MB" if need_bytes > free else f"{_mb(need_bytes)} MB"
        except OSError:
            amount = f"{_mb(need_bytes)} MB"
    return f"no space left on {folder}: free {amount} and {then}"
