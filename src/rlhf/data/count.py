"""The built-in long-tail task: count up to N, `7=` -> `1234567`, `12=` -> `123456789012`.

Correct responses run from 1 to `dataset.max_count` tokens, and many prompts ask for a short count: each N appears
about max_count / (4 N) times (at least once), so with max_count 60, 95 prompts, 39% of them want 6 tokens or fewer,
the median 13, the mean 20, and 11 want 50 or more. Response lengths spread over two orders of magnitude, as on reasoning tasks: a schedule that waits for a
batch's longest response pays for the tail at every step (schedule=stream does not). The last digit of a count is
the last digit of N, so a small model learns the pattern quickly and where to stop slowly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlhf.data.config import DatasetConfig
from rlhf.data.prompts import PromptExample, PromptSplits
from rlhf.errors import require
from rlhf.registry import register

DIGITS = "1234567890"


def count_answer(n: int) -> str:
    """The first ``n`` digits of 1234567890 repeated."""
    return (DIGITS * (n // len(DIGITS) + 1))[:n]


def copies(n: int, max_count: int) -> int:
    """How often the count to ``n`` appears among the prompts: about max_count / (4 n), at least once."""
    return max(1, round(max_count / (4 * n)))


def count_problems(max_count: int) -> list[tuple[str, str]]:
    """Every (prompt, answer) pair `n=` for 1 <= n <= max_count, each `copies` times, in a fixed order."""
    return [(f"{n}=", count_answer(n)) for n in range(1, max_count + 1) for _ in range(copies(n, max_count))]


@dataclass
class CountDatasetConfig(DatasetConfig):
    max_count: int = 60  # the longest count asked for (the longest correct response, in tokens)
    max_prompt_length: int = 8  # tokens; `60=` with BOS is 4

    def check(self, at: str) -> None:
        super().check(at)
        require(1 <= self.max_count <= 99, f"{at}.max_count={self.max_count} must be within 1..99 (a two-digit prompt)")


@register("dataset", "count")
def count_dataset(cfg: CountDatasetConfig, tokenizer, seed: int = 1) -> PromptSplits:
    """The counting prompts, long-tailed; evaluation runs on the same prompts, in a fixed shuffled order (so
    `eval.max_prompts` takes a sample of the same distribution)."""
    examples = []
    for prompt, answer in count_problems(cfg.max_count):
        ids = tuple(tokenizer(prompt)["input_ids"])
        if len(ids) > cfg.max_prompt_length:
            raise ValueError(f"prompt {prompt!r} has {len(ids)} tokens > dataset.max_prompt_length={cfg.max_prompt_length}")
        examples.append(PromptExample(text=prompt, token_ids=ids, ground_truth=answer))
    shuffled = examples[:]
    random.Random(0).shuffle(shuffled)
    return PromptSplits(train=examples, eval=shuffled)


count_dataset.config = CountDatasetConfig  # its keys (`dataset.*`)
