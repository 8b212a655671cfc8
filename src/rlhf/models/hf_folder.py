"""Hugging Face folders (final_model, reward models, warm-start assets) written atomically.

The folder is assembled in a hidden sibling and renamed into place, so a save that fails half-way (full disk,
an exception in the serializer, a kill) never leaves a folder with `config.json` but no weights; an existing
folder is replaced only once the new one is complete. A full disk is named as such (NoSpaceError). Each folder is
marked with its writer (`rlhf.disk.claim`), so a later save checks it replaces only its own output.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rlhf.disk import claim, fsync_dir, fsync_tree, lack_of_room  # the checkpoints' own flushes and messages
from rlhf.models.dtypes import tensor_bytes


def save_hf_folder(path: Path, model, tokenizer, *, owner: str, **save_kwargs) -> None:
    """``model.save_pretrained`` and ``tokenizer.save_pretrained`` into ``path``, all or nothing, marked as ``owner``'s.

    A full disk raises NoSpaceError: 'No space left on <path>: the export needs about N MB, M MB free'."""
    try:
        with atomic_folder(Path(path), owner=owner) as tmp:
            model.save_pretrained(tmp, **save_kwargs)
            tokenizer.save_pretrained(tmp)
    except Exception as err:
        lacking = lack_of_room(err, Path(path), "the export", weights_bytes(model, save_kwargs.get("state_dict")))
        if lacking is None:
            raise
        raise lacking from err


def weights_bytes(model, state_dict: dict | None = None) -> int:
    """Bytes of the weights an export writes: ``state_dict``'s tensors when given, else the model's parameters."""
    tensors = state_dict.values() if state_dict is not None else model.parameters()
    return tensor_bytes(tensors)


@contextmanager
def atomic_folder(path: Path, *, owner: str) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``path`` to write into; it becomes ``path``, marked as ``owner``'s
    (`rlhf.disk.claim`), only if the block succeeds."""
    path = Path(os.path.abspath(path))  # "." or "a/..": a folder with a name, whose parent holds the sibling
    path.parent.mkdir(parents=True, exist_ok=True)
    _recover_replaced(path)
    for stale in path.parent.glob(f".tmp-{path.name}-*"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        yield tmp
        claim(tmp, owner)
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _swap_into_place(tmp, path)


def _swap_into_place(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path``; an existing ``path`` is moved aside first and deleted only after the swap."""
    old = path.parent / f".old-{path.name}-{os.getpid()}"
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _recover_replaced(path: Path) -> None:
    """Put back the previous ``path`` if a save was killed between moving it aside and renaming the new one in."""
    olds = sorted(path.parent.glob(f".old-{path.name}-*"))
    if olds and not path.exists():
        os.replace(olds.pop(0), path)
    for old in olds:  # a save killed while deleting the replaced copy
        shutil.rmtree(old, ignore_errors=True)
