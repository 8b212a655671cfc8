"""Durable writes and disk-space messages, shared by checkpoints, exports and the preflight checks."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rlhf.errors import FULL_DISK_ERRNOS, NoSpaceError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file and folder under ``path`` to disk before it is renamed into place."""
    for item in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if item.is_file():
            with open(item, "rb") as f:
                os.fsync(f.fileno())
        else:
            fsync_dir(item)
    fsync_dir(path)


def megabytes(n: int) -> str:
    """``n`` bytes in MiB, for messages: one decimal below 100 ("0.9"), whole above ("1524")."""
    return f"{n / 2**20:.1f}" if n < 100 * 2**20 else f"{n / 2**20:.0f}"


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or, for a folder not yet made, its nearest parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def tree_bytes(path: Path) -> int:
    """Bytes in the files under ``path`` (0 when it does not exist)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if Path(path).exists() else 0


def no_space_error(folder: Path, what: str, needed: int | None) -> NoSpaceError:
    """'No space left on <folder>: <what> needs about N MB, M MB free' (the need left out when unknown)."""
    need = f"{what} needs about {megabytes(needed)} MB, " if needed else ""
    return NoSpaceError(f"No space left on {folder}: {need}{megabytes(free_bytes(folder))} MB free")


def out_of_space(err: BaseException, folder: Path, needed: int | None) -> bool:
    """Whether a failed save of about ``needed`` bytes into ``folder`` ran out of disk: an OSError saying so, or
    another error (torch's "unexpected pos", safetensors' own) raised while less than ``needed`` is free, the
    serializers' way of reporting the same."""
    if isinstance(err, NoSpaceError):
        return False  # already named
    if isinstance(err, OSError):
        return err.errno in FULL_DISK_ERRNOS
    return isinstance(err, Exception) and bool(needed) and free_bytes(folder) < needed
