"""What a finished run wrote, read back for tests: its metrics.jsonl rows merged by step."""

from __future__ import annotations

import json
from pathlib import Path


def records(run_dir: Path) -> dict[int, dict]:
    """The run's metrics.jsonl rows merged by step (training, evaluation and timing rows of one step together)."""
    by_step: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], {}).update(record)
    return by_step
