"""The lock that gives one process a run folder: an exclusive `fcntl.flock` on FOLDER/.expertize.lock.

A second `expertize upcycle` on a folder in use (a resume, or `--restart` from another shell) would interleave its
steps into the first one's train_log.jsonl and race it for checkpoint/state.pt; it is refused instead, naming the
holder's pid. flock belongs to the open file, so the kernel releases it when the holder exits or is killed: a lock
is never stale and needs no cleanup.
"""

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import ExpertizeError

__all__ = ["LOCK", "FolderLock", "RunFolderBusy", "busy", "lock_holder"]

LOCK = ".expertize.lock"


class RunFolderBusy(ExpertizeError, ValueError):
    """Another process holds the output folder's lock (a run of it is in progress); the message names its pid."""


def lock_holder(path: Path) -> str:
    """The pid recorded in a held lock file, as text ("unknown" when it cannot be read)."""
    try:
        return path.read_text(encoding="utf-8").strip() or "unknown"
    except OSError:
        return "unknown"


def busy(
    root: Path, lock: Path, *, error: type[ExpertizeError] = RunFolderBusy, holder: str = "run",
    two: str = "two runs in one folder would mix their checkpoints and logs",
    rerun: str = " and run this command again (it resumes)", setting: str = "output_dir",
) -> ExpertizeError:
    """The refusal of a folder another process holds, naming its pid (defaults: an upcycle run folder's)."""
    pid = lock_holder(lock)
    stop = f" or stop it (kill {pid})" if pid.isdigit() else " or stop it"
    return error(
        f"{root} is in use by another expertize {holder} (pid {pid}, holding {lock.name}); {two}. Wait for it to "
        f"finish{stop}{rerun}, or choose another {setting}"
    )


class FolderLock:
    """An exclusive `fcntl.flock` on ROOT/.expertize.lock with the holder's pid written in it.

    flock belongs to the open file: the kernel drops it when the process exits or is killed, so a lock is never
    stale. The file is removed on release; a process that locked a file just unlinked by its previous holder
    notices (the path no longer names its inode) and locks the new file instead."""

    ATTEMPTS, PAUSE_S = 20, 0.05
    """A checker (`is_held`) holds a shared lock for an instant: retry briefly before calling the folder busy."""

    def __init__(self, root: Path, refusal: Callable[[Path, Path], Exception] = busy) -> None:
        """`refusal(root, lock path)`: the error `acquire` raises when another process holds the lock (default: a
        run folder's, `busy`)."""
        self.root, self.path, self.fd = root, root / LOCK, None
        self.refusal = refusal

    def is_held(self) -> bool:
        """Whether another process holds the lock (takes and drops a shared lock; creates nothing)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):  # no lock; a file in the way is check_claimable's to report
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return True
            raise
        finally:
            os.close(fd)  # also drops the shared lock
        return False

    def acquire(self) -> None:
        """Take the lock (RunFolderBusy when another process holds it). Idempotent."""
        if self.fd is not None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        for attempt in range(self.ATTEMPTS):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                if attempt + 1 == self.ATTEMPTS:
                    raise self.refusal(self.root, self.path) from None
                time.sleep(self.PAUSE_S)
                continue
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder removed the file between our open and our lock
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self.fd = fd
            return
        raise self.refusal(self.root, self.path)

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still held: nobody can have locked this inode meanwhile
        os.close(self.fd)
        self.fd = None
