"""The keys every dataset builder reads (`DatasetConfig`, extended by each builder's own class beside its code) and
one source of the mixing builder (`DataSourceConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from rlhf.errors import require
from rlhf.parts import PartConfig


@dataclass
class DatasetConfig(PartConfig):
    max_prompt_length: int = 64  # prompts with more tokens are dropped and counted (arith: an error)

    def check(self, at: str) -> None:
        require(self.max_prompt_length >= 1, f"{at}.max_prompt_length={self.max_prompt_length} must be >= 1")


@dataclass
class DataSourceConfig:
    path: str = MISSING  # hub dataset name, or a local .jsonl / .json / .parquet file, or a folder of them
    split: str = "train"  # split to read (a single local file only has `train`)
    amount: float = 1.0  # a fraction of the split (<= 1) or a number of rows (a whole number > 1), seeded
    revision: str | None = None  # hub revision (pin it: the tokenised cache keys on it, not on hub contents)
    subset: str | None = None  # hub dataset configuration (load_dataset's `name`), e.g. main for openai/gsm8k
