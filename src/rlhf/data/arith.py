"""The built-in verifiable task: addition, `3+4=` -> `7` for the tiny model, or a question in a chat model's template
("What is 25 + 60? Reply with just the number.") for a real one (`dataset=arith_chat`).

Small enough for a tiny model to learn on a CPU in minutes, and checkable exactly, so the reward is a
verifier rather than a learned model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

from rlhf.data.config import DatasetConfig
from rlhf.data.templates import encode_prompt, render_prompt, resolve_template
from rlhf.errors import ConfigError, require
from rlhf.data.prompts import PromptExample, PromptSplits
from rlhf.registry import register


@dataclass
class ArithDatasetConfig(DatasetConfig):
    max_operand: int = 9  # operands are drawn from min_operand..max_operand (0..9: 100 problems), at most 99
    min_operand: int = 0  # the smallest operand (10 with max_operand 99: every two-digit sum, 8,100 problems)
    eval_size: int = 0  # problems held out for eval; 0 = evaluate on all of them (the task is the whole table)
    max_prompt_length: int = 16  # tokens; `a+b=` with BOS is at most 6 (a longer prompt is an error)
    question: Optional[str] = None  # the prompt's text, with {a} and {b} for the operands (e.g. "What is {a} + {b}? Reply with just the number."); null = `a+b=`
    chat_template: Optional[str] = None  # render the question as a user message: tokenizer (the model's own), a built-in, a .jinja file or inline Jinja (as dataset=jsonl's); null = the bare text

    def check(self, at: str) -> None:
        super().check(at)
        require(0 <= self.min_operand <= self.max_operand <= 99,
                f"{at}.min_operand={self.min_operand} and {at}.max_operand={self.max_operand} must satisfy 0 <= min_operand <= max_operand <= 99")
        if self.question is not None:
            try:
                self.question.format(a=1, b=2)
            except (KeyError, IndexError, ValueError) as err:
                raise ConfigError(
                    f"{at}.question={self.question!r} is not a format string over {{a}} and {{b}} ({type(err).__name__}: "
                    f"{err}); write the operands as {{a}} and {{b}}, and literal braces as {{{{ and }}}}"
                ) from None

ALPHABET = "0123456789+="
MAX_OPERAND = 49  # the largest operand the tiny model's warm start (python -m rlhf.warmstart) trains on: its data grows as its square


def arith_problems(max_operand: int, min_operand: int = 0, question: str | None = None) -> list[tuple[str, str]]:
    """Every (prompt, answer) pair with min_operand <= a, b <= max_operand, in a fixed order; the prompt is `a+b=`, or
    ``question`` with the operands put in."""
    operands = range(min_operand, max_operand + 1)
    return [(question.format(a=a, b=b) if question else f"{a}+{b}=", str(a + b)) for a in operands for b in operands]


@register("dataset", "arith")
def arith_dataset(cfg, tokenizer, seed: int = 1) -> PromptSplits:
    """All addition problems as prompts (in the chat template when ``cfg.chat_template`` is set); ``cfg.eval_size`` of
    them (seeded) held out for evaluation."""
    template = resolve_template(cfg.chat_template, tokenizer) if cfg.chat_template else None
    examples = []
    for question, answer in arith_problems(cfg.max_operand, cfg.min_operand, cfg.question):
        prompt = question if template is None else render_prompt(tokenizer, [{"role": "user", "content": question}], template)
        ids = tuple(encode_prompt(tokenizer, prompt))
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
