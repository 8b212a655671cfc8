"""Durable writes, disk-space messages and output ownership, shared by checkpoints, exports and the preflight checks.

Ownership: every folder a command writes whole (an exported model, a reward model, a warm start, a checkpoint root)
gets an `OWNER_FILE` naming the command and the key that chose it. Before any training, `check_own_output` lets a
command write only where nothing is, into an empty folder, or over its own earlier output under the same key: a
user's folder of files, or a file, is never deleted to make room.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
from pathlib import Path

from typing import Callable

from rlhf.errors import FULL_DISK_ERRNOS, ConfigError, FileSizeLimitError, NoSpaceError

OWNER_FILE = ".rlhf-owner"  # in each folder a command writes whole: "<command> <key>", the one writer that may replace it
OWN_PREFIX = ".rlhf"  # this project's own bookkeeping in a folder (the owner file, `.rlhf.lock`, write tests)
TRAIN_EXPORT = "rlhf.train checkpoint.save_final_model"  # <run folder>/final_model
TRAIN_ADAPTER = "rlhf.train policy.lora.rank"  # <run folder>/final_adapter, beside final_model under LoRA
TRAIN_CHECKPOINTS = "rlhf.train checkpoint.dir"  # the checkpoint root, whose step_* folders the run prunes
REWARD_MODEL = "rlhf.train_reward save_dir"  # the trained reward model
WARM_START = "rlhf.warmstart --output-dir"  # a warm-start model (the committed assets carry it too)

PACKAGE_PREFIX = "package:"  # package:<importable module>/<path of a file inside it>: a file an installed package ships
LOCAL_PREFIXES = ("/", "./", "../", "~", PACKAGE_PREFIX)  # how a local reference starts; a hub name never does
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")  # the row files `dataset.path` reads; a hub name never ends so


def looks_local(name_or_path: str) -> bool:
    """Whether a model's or dataset's reference means a local file or folder (or a file an installed package ships)
    rather than a hub name (`Qwen/Qwen2.5-0.5B`, `openai/gsm8k`): it starts like a path, names a row file, or exists
    here. A missing local one is then named as missing, never looked up on the hub."""
    return (name_or_path.startswith(LOCAL_PREFIXES) or Path(name_or_path).suffix in DATA_SUFFIXES
            or Path(name_or_path).expanduser().exists())


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


def lack_of_room(err: BaseException, folder: Path, what: str, needed: int | None) -> NoSpaceError | None:
    """The error to raise instead of ``err``, a failed save of about ``needed`` bytes into ``folder``, when room was
    what it lacked (None otherwise): a file past this process's file size limit (`FileSizeLimitError`), or a full
    disk (`no_space_error`)."""
    if isinstance(err, NoSpaceError):
        return None  # already named
    if out_of_space(err, folder, needed):  # first: a full disk raises torch's "unexpected pos" too
        return no_space_error(folder, what, needed)
    limit = file_size_limit()
    if limit is not None and _past_file_size_limit(err):
        return FileSizeLimitError(
            f"A file of {what} in {folder} passes this process's file size limit (ulimit -f: {megabytes(limit)} MB); "
            f"raise it (ulimit -f unlimited)"
        )
    return None


def file_size_limit() -> int | None:
    """This process's limit on the size of a file it writes, in bytes (`ulimit -f`); None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def _past_file_size_limit(err: BaseException) -> bool:
    """Whether ``err`` is a write refused for the file size limit: an OSError saying so, or the serializers' own
    reports of the same (safetensors' "File too large (os error 27)", torch's "unexpected pos")."""
    if isinstance(err, OSError):
        return err.errno == errno.EFBIG
    text = str(err)
    return "File too large" in text or f"os error {errno.EFBIG}" in text or "unexpected pos" in text


def out_of_space(err: BaseException, folder: Path, needed: int | None) -> bool:
    """Whether a failed save of about ``needed`` bytes into ``folder`` ran out of disk: an OSError saying so, or
    another error (torch's "unexpected pos", safetensors' own) raised while less than ``needed`` is free, the
    serializers' way of reporting the same."""
    if isinstance(err, OSError):
        return err.errno in FULL_DISK_ERRNOS
    return isinstance(err, Exception) and bool(needed) and free_bytes(folder) < needed


def claim(folder: Path, owner: str) -> None:
    """Mark ``folder`` as ``owner``'s output (one of the names above), the only writer that may replace it later."""
    (Path(folder) / OWNER_FILE).write_text(owner + "\n", encoding="utf-8")


def owner_of(folder: Path) -> str | None:
    """The writer ``folder``'s `OWNER_FILE` names, or None when it has none."""
    try:
        return (Path(folder) / OWNER_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def check_own_output(path: Path, key: str, owner: str, fix: str = "", ours: Callable[[Path], bool] | None = None) -> None:
    """ConfigError unless ``path`` (chosen by ``key``) is missing, an empty folder, or ``owner``'s earlier output;
    ``fix``: what to do instead (default: choose another ``key``); ``ours``: an entry ``owner`` wrote before it marked
    its folders (an older run's checkpoints), which does not count as someone else's."""
    path, fix = Path(path), fix or f"choose another {key}"
    if not path.exists():
        return
    if not path.is_dir():
        raise ConfigError(f"{key}={path} is a file, which this command did not write and would replace with a folder; {fix}")
    found = owner_of(path)
    if found == owner:
        return
    if found is not None:
        raise ConfigError(f"{key}={path} holds the output of `{found}`, which `{owner}` must not replace; {fix}")
    others = sorted(p.name for p in path.iterdir() if not p.name.startswith(OWN_PREFIX) and not (ours and ours(p)))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ConfigError(
            f"{key}={path} is a folder holding files this command did not write ({shown}), which writing there would "
            f"delete; {fix}, or empty that folder"
        )


def check_writable_folder(path: Path, key: str) -> None:
    """ConfigError naming ``key`` when folder ``path`` cannot be made or written (a read-only disk, a file where a
    folder should be): said before Hydra tries to make it and fails with a traceback. Makes the folder."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".rlhf-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"{key}={path}: the folder cannot be {'written' if path.is_dir() else 'made'} ({err.strerror or err}); "
            f"choose a writable folder with {key}=..."
        ) from None
