"""Reads the records of an offline W&B run file (`run-<id>.wandb`), for tests that check what a run logged.

The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of chunks, each
with a 7-byte header (checksum, length, type: full, first, middle, last) and a slice of one protobuf Record.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
FILE_HEADER = 7
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def chunks(data: bytes):
    """(type, payload) of every chunk, skipping the zero padding at the end of each block."""
    offset = FILE_HEADER
    while offset + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - offset % BLOCK
        if left_in_block < CHUNK_HEADER:
            offset += left_in_block
            continue
        _checksum, length, kind = struct.unpack_from("<IHB", data, offset)
        start = offset + CHUNK_HEADER
        yield kind, data[start : start + length]
        offset = start + length


def records(path: Path) -> list:
    """Every protobuf Record in the file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pending = [], b""
    for kind, payload in chunks(data):
        if kind == 0:  # padding written by a pre-allocating writer
            continue
        pending += payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def history(path: Path) -> dict[int, dict]:
    """{step: {metric: value}} of every logged history row."""
    rows: dict[int, dict] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {item_key(item): json.loads(item.value_json) for item in record.history.item}
            rows.setdefault(int(row.get("_step", record.history.step.num)), {}).update(row)
    return rows


def config(path: Path) -> dict:
    """The run's config, as its updates last left it."""
    values: dict = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        updates = record.config.update if kind == "config" else record.run.config.update if kind == "run" else []
        for item in updates:
            values[item_key(item)] = json.loads(item.value_json)
    return values


def exit_code(path: Path) -> int | None:
    """The exit code `finish` recorded; None when the run never finished."""
    exits = [r.exit.exit_code for r in records(path) if r.WhichOneof("record_type") == "exit"]
    return exits[-1] if exits else None
