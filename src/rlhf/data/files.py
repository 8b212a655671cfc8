"""Reading local prompt files (JSON Lines, JSON, Parquet) with errors that name the key, the file, the line and the fix.

JSON and JSON Lines are parsed here line by line (not by `datasets`), so a malformed line is reported by its
number, or counted and skipped with `dataset.strict=false`, instead of failing as a library traceback.
"""

from __future__ import annotations

import bisect
import codecs
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.errors import ConfigError

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SPLIT_WORDS = ("train", "training", "test", "testing", "eval", "validation", "valid", "val", "dev")  # as in file names


@dataclass
class RowSpan:
    """One file's run of a source's rows (or a hub split's), for naming a row where a user finds it."""

    name: str  # the file as the user gave it (or the hub split, `openai/gsm8k[train]`)
    start: int  # the index of its first row among the source's rows
    lines: list[int] | None = None  # each row's line number in a JSON Lines file; None where rows are not lines


@dataclass
class FileRows:
    """The rows read from a source's files (or a hub split), where each came from, and the malformed lines skipped
    (``strict=false`` only)."""

    rows: list[dict[str, Any]] = field(default_factory=list)  # a `datasets` split (indexable the same way) for Parquet
    skipped: list[str] = field(default_factory=list)  # "<file> line <n>: <why>", one per malformed line
    spans: list[RowSpan] = field(default_factory=list)  # each file's rows, in order

    def where(self, index: int) -> str:
        """Row ``index`` of ``rows`` as an editor finds it, counted from 1: `<file> line <n>` in a JSON Lines file,
        `<file> row <n>` in a JSON array, a Parquet file or a hub split."""
        span = self.spans[bisect.bisect_right(self.spans, index, key=lambda s: s.start) - 1]
        if span.lines is not None:
            return f"{span.name} line {span.lines[index - span.start]}"
        return f"{span.name} row {index - span.start + 1}"

    def extend(self, part: FileRows) -> None:
        """Append another file's rows (a split's next shard), keeping each row's place."""
        self.spans += [RowSpan(s.name, s.start + len(self.rows), s.lines) for s in part.spans]
        self.rows += part.rows
        self.skipped += part.skipped


def missing_path_error(key: str, path: str) -> ConfigError:
    """The error for a local-looking path that does not exist (never a hub lookup)."""
    return ConfigError(
        f"{key}.path={path}: no such file or folder, relative to {os.getcwd()} (the launch folder); give an existing "
        f".jsonl, .json or .parquet file or a folder of them, or a hub dataset name such as openai/gsm8k"
    )


METADATA_FILES = ("dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json")  # hub and save_to_disk metadata, not prompts


def _words(file: Path) -> set[str]:
    """The words of a file's name (`gsm8k_train-0` -> gsm8k, train)."""
    return set(re.split(r"[^a-z]+", file.stem.lower())) - {""}


def _names_a_split(file: Path) -> bool:
    """Whether a file's name holds a split word as a word of its own (`test.jsonl`, `train_prefs-0.parquet`)."""
    return any(word in SPLIT_WORDS for word in _words(file))


def _split_files(files: list[Path], split: str) -> list[Path]:
    """The files of ``split``: those named `<split>` or `<split>-*`; when there are none, those holding the split as
    a word of their own (`gsm8k_train.jsonl`), as `datasets` reads such names (`train_prefs` beside `train.jsonl` is
    a split of its own)."""
    named = [p for p in files if p.stem == split or p.stem.startswith(split + "-")]
    return named or [p for p in files if split.lower() in _words(p)]


def _check_one_format(folder: Path, split: str, files: list[Path], key: str) -> list[Path]:
    if len({LOCAL_FORMATS[p.suffix] for p in files}) > 1:
        raise ConfigError(
            f"{key}.path: {folder}: split {split!r} mixes file formats ({', '.join(p.name for p in files)}); "
            f"keep one format (JSON Lines or Parquet) per split"
        )
    return files


def folder_files(folder: Path, split: str, key: str, shown: str) -> list[Path] | None:
    """The files of a local folder that make up ``split``: `<split>.<ext>`, `<split>-*.<ext>` or a name holding the
    split as a word (`gsm8k_train.jsonl`), or, for `train`, every file when no file name names a split (as `datasets`
    reads such a folder); metadata files (`dataset_infos.json`) are not prompts. None for a folder in the hub's layout
    (prompt files only in subfolders), left to `datasets`; ConfigError for a folder without prompt files. ``shown``:
    the path as the user gave it."""
    top = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in LOCAL_FORMATS and p.name not in METADATA_FILES)
    named = _split_files(top, split)
    if named:
        return _check_one_format(folder, split, named, key)
    if top and split == "train" and not any(_names_a_split(p) for p in top):
        return _check_one_format(folder, split, top, key)
    if top:
        raise ConfigError(
            f"{key}.path={shown}: the folder has no file for split {split!r} (it holds "
            f"{', '.join(p.name for p in top[:6])}{' ...' if len(top) > 6 else ''}); name the files {split}.jsonl or "
            f"{split}-<n>.jsonl, or choose the split the files are named for"
        )
    if any(p.suffix in LOCAL_FORMATS for p in folder.rglob("*") if p.is_file()):
        return None
    raise ConfigError(
        f"{key}.path={shown}: the folder holds no .jsonl, .json or .parquet file; put the prompt files there, or give "
        f"one file"
    )


def _line_error(key: str, file: Path, number: int, why: str) -> ConfigError:
    return ConfigError(
        f"{key}.path: {file} line {number}: {why}; fix or delete that line (every line must be one JSON object), "
        f"or set dataset.strict=false to count and skip malformed lines"
    )


def _not_text_error(key: str, file: Path, number: int, why: str) -> ConfigError:
    return ConfigError(
        f"{key}.path: {file} is not a JSON Lines file (line {number}: {why}); give a UTF-8 text file with one JSON "
        f"object per line, or a .parquet file"
    )


def _parse_line(raw: bytes) -> dict[str, Any]:
    """One JSON Lines line as a row; ValueError says why it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 text (byte {err.start})") from None
    if "\x00" in text:
        raise ValueError("binary data (a NUL byte)")
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"a JSON {type(row).__name__}, not an object")
    return row


def _json_array_rows(data: bytes, key: str, file: Path) -> list[dict[str, Any]]:
    """The rows of a .json file holding one JSON array of objects; ConfigError naming the line where it breaks."""
    try:
        whole = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise _not_text_error(key, file, data[: err.start].count(b"\n") + 1, "not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{key}.path: {file} line {err.lineno}: not valid JSON ({err.msg} at column {err.colno}); a .json file "
            f"that starts with `[` must be one JSON array of objects (or use JSON Lines, one object per line)"
        ) from None
    for number, row in enumerate(whole, start=1):
        if not isinstance(row, dict):
            raise ConfigError(
                f"{key}.path: {file} row {number} is a JSON {type(row).__name__}, not an object; a JSON array must "
                f"hold one object per row"
            )
    return whole


def read_json_rows(file: Path, key: str, strict: bool) -> FileRows:
    """Rows of a JSON Lines file (or a .json array); malformed lines raise ConfigError, or are skipped if not strict."""
    data = file.read_bytes().removeprefix(codecs.BOM_UTF8)  # read as utf-8-sig: editors on Windows write a BOM
    if not data.strip():
        raise ConfigError(f"{key}.path: {file} is empty; give a JSON Lines file with one JSON object per line")
    if file.suffix == ".json" and data.lstrip().startswith(b"["):
        return FileRows(rows=_json_array_rows(data, key, file), spans=[RowSpan(str(file), 0)])
    out, lines, first_bad = FileRows(), [], 0
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            out.rows.append(_parse_line(raw))
            lines.append(number)
        except ValueError as err:
            if not (out.rows or out.skipped) and ("UTF-8" in str(err) or "binary" in str(err)):
                raise _not_text_error(key, file, number, str(err)) from None  # whatever dataset.strict says
            if strict:
                raise _line_error(key, file, number, str(err)) from None
            first_bad = first_bad or number
            out.skipped.append(f"{file} line {number}: {err}")
    if not out.rows:
        raise _not_text_error(key, file, first_bad, "no line is a JSON object")
    out.spans = [RowSpan(str(file), 0, lines)]
    return out


def read_parquet(file: Path, key: str):
    """A Parquet file as a `datasets` split; a file pyarrow cannot read raises ConfigError naming it."""
    from datasets import load_dataset  # 1.5 s to import: only runs that read a Parquet file pay it
    from datasets.exceptions import DatasetGenerationError

    try:
        return load_dataset("parquet", data_files=str(file), split="train")
    except (ValueError, OSError, DatasetGenerationError) as err:  # pyarrow's ArrowInvalid is a ValueError
        reason = str(err.__cause__ or err).strip().splitlines()
        raise ConfigError(
            f"{key}.path: {file} is not a readable Parquet file ({reason[0] if reason else type(err).__name__}); "
            f"rewrite it (e.g. with pyarrow.parquet.write_table) or give a .jsonl file"
        ) from None


def read_files(files: list[Path], key: str, strict: bool) -> FileRows:
    """The rows of ``files`` (one split's shards, in order, all of one format), concatenated."""
    if files[0].suffix == ".parquet":
        from datasets import concatenate_datasets

        parts = [read_parquet(file, key) for file in files]
        starts = [sum(len(part) for part in parts[:i]) for i in range(len(parts))]
        return FileRows(
            rows=parts[0] if len(parts) == 1 else concatenate_datasets(parts),
            spans=[RowSpan(str(file), start) for file, start in zip(files, starts)],
        )
    out = FileRows()
    for file in files:
        out.extend(read_json_rows(file, key, strict))
    return out
