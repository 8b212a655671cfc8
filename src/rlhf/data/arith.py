"""The built-in verifiable task: single-digit addition, `3+4=` -> `7`.

Small enough for a tiny model to learn on a CPU in minutes, and checkable exactly, so the reward is a
verifier rather than a learned model.
"""

from __future__ import annotations

import random

from dataclasses import dataclass

from rlhf.data.config import DatasetConfig
from rlhf.data.prompts import PromptExample, PromptSplits
from rlhf.registry import register


@dataclass
class ArithDatasetConfig(DatasetConfig):
    max_operand: int = 9  # operands are drawn from 0..max_operand (9: 100 problems)
    eval_size: int = 0  # problems held out for eval; 0 = evaluate on all of them (the task is the whole table)
    max_prompt_length: int = 16  # tokens; `a+b=` with BOS is at most 6 (a longer prompt is an error)

ALPHABET = "0123456789+="
MAX_OPERAND = 49  # the largest operand the task (and its warm start) supports: 49+49= and its answer fit the tiny model


def arith_problems(max_operand: int) -> list[tuple[str, str]]:
    """Every (prompt, answer) pair `a+b=` with 0 <= a, b <= max_operand, in a fixed order."""
    return [(f"{a}+{b}=", str(a + b)) for a in range(max_operand + 1) for b in range(max_operand + 1)]


@register("dataset", "arith")
def arith_dataset(cfg, tokenizer, seed: int = 1) -> PromptSplits:
    """All addition problems as prompts; ``cfg.eval_size`` of them (seeded) held out for evaluation."""
    if not 0 <= cfg.max_operand <= MAX_OPERAND:
        raise ValueError(f"dataset.max_operand={cfg.max_operand} must be within 0..{MAX_OPERAND}")
    examples = []
    for prompt, answer in arith_problems(cfg.max_operand):
        ids = tuple(tokenizer(prompt)["input_ids"])
        if len(ids) > cfg.max_prompt_length:
            raise ValueError(
                f"prompt {prompt!r} has {len(ids)} tokens > dataset.max_prompt_length={cfg.max_prompt_length}"
            )
        examples.append(PromptExample(text=prompt, token_ids=ids, ground_truth=answer))
    if cfg.eval_size == 0:
        return PromptSplits(train=examples, eval=examples)
    if not 0 < cfg.eval_size < len(examples):
        raise ValueError(f"dataset.eval_size={cfg.eval_size} must be in 0..{len(examples) - 1} for {len(examples)} problems")
    shuffled = examples[:]
    random.Random(0).shuffle(shuffled)
    return PromptSplits(train=shuffled[cfg.eval_size :], eval=shuffled[: cfg.eval_size])


arith_dataset.config = ArithDatasetConfig  # its keys (`dataset.*`)
