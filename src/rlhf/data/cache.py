"""The on-disk cache of tokenised prompt splits: one JSON file per key, written atomically, rebuilt when unreadable."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from rlhf.data.prompts import PromptExample, PromptSplits

log = logging.getLogger("rlhf")


def cache_folder(cfg) -> Path:
    """`dataset.cache_dir`, or $RLHF_CACHE/datasets, or ~/.cache/rlhf/datasets."""
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    return Path(os.environ.get("RLHF_CACHE", Path.home() / ".cache" / "rlhf")) / "datasets"


def dump_splits(splits: PromptSplits) -> dict:
    """The JSON form of ``splits``: [text, token ids, ground truth, origin] rows per split, and the report."""
    def rows(examples):
        return [[e.text, list(e.token_ids), e.ground_truth, e.origin] for e in examples]

    return {"train": rows(splits.train), "eval": rows(splits.eval), "report": splits.report}


def _examples(rows: Any) -> list[PromptExample]:
    """Examples from cached rows; ValueError if the rows do not have the cached shape."""
    if not isinstance(rows, list):
        raise ValueError(f"a split is a {type(rows).__name__}, not a list")
    examples = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str) and isinstance(row[1], list)
                and all(isinstance(i, int) for i in row[1]) and (row[3] is None or isinstance(row[3], str))):
            raise ValueError("a row is not [text, token ids, ground truth, origin]")
        examples.append(PromptExample(row[0], tuple(row[1]), row[2], row[3]))
    return examples


def load_splits(data: Any) -> PromptSplits:
    """``dump_splits``'s JSON back as splits; ValueError naming what is wrong if it has another shape."""
    if not isinstance(data, dict) or not {"train", "eval", "report"} <= data.keys():
        raise ValueError("not an object with train, eval and report")
    if not isinstance(data["report"], dict) or not isinstance(data["report"].get("sources"), list):
        raise ValueError("the report has no list of sources")
    train = _examples(data["train"])
    if not train:
        raise ValueError("no training prompt")
    return PromptSplits(train=train, eval=_examples(data["eval"]), report=data["report"] | {"cache": "hit"})


def read_cache(path: Path) -> PromptSplits | None:
    """The cached splits at ``path``; None if there are none, or if the file is corrupt (then it is deleted)."""
    if not path.is_file():
        return None
    try:
        splits = load_splits(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, ValueError) as err:  # JSONDecodeError is a ValueError
        log.warning("dataset cache %s is corrupt (%s); deleting it and rebuilding the dataset", path, err)
        path.unlink(missing_ok=True)
        return None
    log.info("dataset cache hit: %s", path)
    return splits


def write_cache(path: Path, splits: PromptSplits) -> None:
    """Write ``splits`` to ``path`` atomically (a temp file, then os.replace); a failed write only warns."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(dump_splits(splits), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as err:  # the run has its prompts; only the next run's shortcut is lost
        tmp.unlink(missing_ok=True)
        log.warning("dataset cache %s not written (%s); the next run rebuilds the dataset", path, err)
        return
    log.info("dataset cached: %s", path)
