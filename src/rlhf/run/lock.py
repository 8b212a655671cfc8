"""One run per folder: an exclusive lock file that names its holder (pid, host, start time).

The lock is `fcntl.flock` on `<folder>/.rlhf.lock`: the kernel drops it when the holding process dies, however it
dies, so a lock file whose process is gone is never honoured. Such a stale file is taken over with a warning that
names the process that left it. A live holder makes the second run refuse at once, naming that process.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from rlhf.errors import ConfigError

log = logging.getLogger("rlhf")

LOCK_FILE = ".rlhf.lock"


class FolderInUseError(ConfigError):
    """Another live process holds the lock on the folder this run would write to."""


def describe(holder: dict) -> str:
    """'pid 123 on host h, started 2026-01-01 12:00:00 UTC' from a lock file's contents."""
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if started else "at an unknown time"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {when}"


def _read_holder(fd: int) -> dict:
    """The holder recorded in an open lock file ({} when empty or unreadable)."""
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode("utf-8", errors="replace")
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _write_holder(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode())
    os.fsync(fd)


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a releasing holder unlinks it)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def lock_path(folder: Path, beside: bool = False) -> Path:
    """`<folder>/.rlhf.lock`, or `<parent>/.<name>.rlhf.lock` for a folder that is replaced whole (an HF export)."""
    return folder.parent / f".{folder.name}{LOCK_FILE}" if beside else folder / LOCK_FILE


def in_use(folder: Path, purpose: str, holder: dict) -> FolderInUseError:
    return FolderInUseError(
        f"{purpose} {folder} is in use by another run ({describe(holder)}); two runs in one folder would "
        f"overwrite each other's checkpoints and logs. Stop that run, or choose another {purpose}"
    )


def check_free(folder: Path, purpose: str) -> None:
    """FolderInUseError when a live process holds ``folder``'s lock, creating and writing nothing: the command line
    asks before Hydra writes the folder's `.hydra/` and log, which a refused run must leave as the live run has them."""
    path = lock_path(Path(folder))
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file: nobody holds the folder
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts with a holder's exclusive lock only
    except BlockingIOError:
        raise in_use(folder, purpose, _read_holder(fd)) from None
    except OSError:
        pass  # a filesystem without locks: `acquire` warns
    finally:
        os.close(fd)


def acquire(folder: Path, purpose: str, path: Path) -> int | None:
    """Lock ``folder`` for this process through the lock file ``path`` (folders created if missing); returns its fd.

    Raises FolderInUseError naming the holder when another live process has it. ``purpose`` names the folder in
    messages (e.g. "run folder"). Returns None, with a warning, on a filesystem without locks.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise in_use(folder, purpose, holder) from None
        except OSError as err:
            os.close(fd)
            log.warning(
                "%s %s: cannot lock %s (%s); a second run in this folder would not be stopped", purpose, folder, path, err
            )
            return None
        if _same_file(fd, path):
            break
        os.close(fd)  # the previous holder released and unlinked it between our open and our lock: try again
    previous = _read_holder(fd)
    if previous:
        log.warning(
            "%s %s: taking over a stale lock left by %s (that process is gone)", purpose, folder, describe(previous)
        )
    _write_holder(fd)
    return fd


def release(path: Path, fd: int | None) -> None:
    """Remove the lock file ``path`` and drop the lock (unlink first, so no one locks a file about to vanish)."""
    if fd is None:
        return
    try:
        if _same_file(fd, path):
            os.unlink(path)
    finally:
        os.close(fd)


@contextmanager
def folder_lock(folder: Path, purpose: str = "run folder", beside: bool = False):
    """Hold the lock on ``folder`` for the block; released on any exit (and by the kernel if the process dies).

    ``beside``: keep the lock file next to the folder, not in it (see `lock_path`)."""
    path = lock_path(Path(folder), beside)
    fd = acquire(Path(folder), purpose, path)
    try:
        yield
    finally:
        release(path, fd)
