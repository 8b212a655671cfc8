"""The built-in code tasks (`dataset=code_tasks`): "write a Python function that ...", checked by assert lines.

Each task comes from one of a few families (add a constant, scale, sum a list, count a character, ...), with its
constants and test inputs drawn from a generator seeded by the run's seed; its ground truth is the list of assert
lines the `code` reward runs (`rlhf.rewards.code`). Training and eval tasks are drawn from the same families with
different draws; an eval task may repeat a training one's text, as small families do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from rlhf.data.answers import with_suffix
from rlhf.data.config import DatasetConfig
from rlhf.data.prompts import PromptExample, PromptSplits
from rlhf.data.templates import encode_prompt, render_prompt, resolve_template
from rlhf.errors import require
from rlhf.registry import register


@dataclass(frozen=True)
class Family:
    """A kind of task: its prompt (``{k}`` the constant), its reference solution, and how to draw an input."""

    signature: str  # e.g. "add_k(x)"
    does: str  # what the function returns, with {k}
    solve: Callable  # (k, input) -> the right answer
    draw: Callable  # (rng) -> one input


def _ints(rng: random.Random) -> list[int]:
    return [rng.randint(-20, 20) for _ in range(rng.randint(0, 6))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeio") for _ in range(rng.randint(0, 8)))


FAMILIES = {
    "add": Family("add_k(x)", "returns the integer x plus {k}", lambda k, x: x + k, lambda r: r.randint(-50, 50)),
    "scale": Family("scale(x)", "returns the integer x multiplied by {k}", lambda k, x: x * k, lambda r: r.randint(-50, 50)),
    "square_plus": Family("square_plus(x)", "returns x squared plus {k}", lambda k, x: x * x + k, lambda r: r.randint(-20, 20)),
    "is_multiple": Family("is_multiple(n)", "returns True if the integer n is divisible by {k}, else False",
                          lambda k, n: n % k == 0, lambda r: r.randint(-60, 60)),
    "sum_list": Family("sum_plus(xs)", "returns the sum of the list of integers xs plus {k}",
                       lambda k, xs: sum(xs) + k, _ints),
    "count_above": Family("count_above(xs)", "returns how many integers in the list xs are greater than {k}",
                          lambda k, xs: sum(x > k for x in xs), _ints),
    "max_or": Family("max_or(xs)", "returns the largest integer in the list xs, or {k} if xs is empty",
                     lambda k, xs: max(xs) if xs else k, _ints),
    "count_char": Family("count_char(s)", "returns how many times the letter {k} occurs in the string s",
                         lambda k, s: s.count(k), _word),
    "reverse_repeat": Family("reverse_repeat(s)", "returns the string s reversed, repeated {k} times",
                             lambda k, s: s[::-1] * k, _word),
}
CONSTANTS = {"count_char": "abcdeio", "is_multiple": range(2, 10), "reverse_repeat": range(1, 4)}  # else -9..9


@dataclass
class CodeTasksConfig(DatasetConfig):
    """Generated Python function tasks with assert tests, seeded by the run."""

    families: list[str] = field(default_factory=lambda: sorted(FAMILIES))  # task families to mix evenly (rlhf/data/code_tasks.py::FAMILIES)
    train_size: int = 512  # training tasks, drawn from the families in turn
    eval_size: int = 64  # eval tasks, drawn after the training ones
    tests_per_task: int = 4  # assert lines per task
    prompt_suffix: str = "Reply with only the function, in a ```python code block."  # appended to every task: the format the code reward reads
    chat_template: str = "tokenizer"  # the model's own chat template (or simple_concat_with_space, tulu, a .jinja file)
    max_prompt_length: int = 128  # tokens; a task longer than this is an error

    def check(self, at: str) -> None:
        super().check(at)
        unknown = [name for name in self.families if name not in FAMILIES]
        require(bool(self.families) and not unknown,
                f"{at}.families={list(self.families)}: unknown or none; choose among {', '.join(sorted(FAMILIES))}")
        require(self.train_size >= 1 and self.eval_size >= 0,
                f"{at}.train_size={self.train_size} must be >= 1 and {at}.eval_size={self.eval_size} >= 0")
        require(self.tests_per_task >= 1, f"{at}.tests_per_task={self.tests_per_task} must be >= 1")


def make_task(family: str, rng: random.Random, tests: int) -> tuple[str, list[str]]:
    """(the task's question, its assert lines) for one draw of ``family``."""
    spec = FAMILIES[family]
    k = rng.choice(CONSTANTS.get(family, [c for c in range(-9, 10) if c not in (0, 1)]))
    name = spec.signature.split("(")[0]
    question = f"Write a Python function `{spec.signature}` that {spec.does.format(k=repr(k) if isinstance(k, str) else k)}."
    asserts = []
    for _ in range(tests):
        value = spec.draw(rng)
        asserts.append(f"assert {name}({value!r}) == {spec.solve(k, value)!r}")
    return question, asserts


def code_tasks(families: list[str], count: int, tests: int, rng: random.Random) -> list[tuple[str, list[str]]]:
    """``count`` tasks, the families taken in turn."""
    return [make_task(families[i % len(families)], rng, tests) for i in range(count)]


@register("dataset", "code_tasks")
def code_tasks_dataset(cfg, tokenizer, seed: int = 1) -> PromptSplits:
    """`dataset.train_size` then `dataset.eval_size` generated tasks, in the chat template, seeded by the run."""
    template = resolve_template(cfg.chat_template, tokenizer)
    rng = random.Random(seed)
    examples = []
    for i, (question, asserts) in enumerate(code_tasks(list(cfg.families), cfg.train_size + cfg.eval_size, cfg.tests_per_task, rng)):
        messages = with_suffix([{"role": "user", "content": question}], cfg.prompt_suffix)
        text = render_prompt(tokenizer, messages, template, cfg.chat_template, f"code task {i + 1}")
        ids = encode_prompt(tokenizer, text)
        require(len(ids) <= cfg.max_prompt_length,
                f"code task {question!r} has {len(ids)} tokens > dataset.max_prompt_length={cfg.max_prompt_length}; raise it")
        examples.append(PromptExample(text=text, token_ids=tuple(ids), ground_truth=asserts, origin=f"code task {i + 1}"))
    train, held_out = examples[: cfg.train_size], examples[cfg.train_size :]
    return PromptSplits(train=train, eval=held_out or train)


code_tasks_dataset.config = CodeTasksConfig  # its keys (`dataset.*`)
