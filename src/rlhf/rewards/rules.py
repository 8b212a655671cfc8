"""Verifiable, rule-based reward functions.

A reward function is registered as kind ``reward`` and called as
``fn(prompts=[str], responses=[str], ground_truths=[...], **args) -> list[float]``, one score per response.
Functions that verify correctness set ``is_verifier = True``; they feed `objective/verifiable_correct_rate`.

Extra metrics: a function may return ``Scores(values, metrics={"no_answer_rate": 0.25})`` instead of a plain
list. `Scores` is a list, so every caller that reads only the scores works unchanged; `RewardSet.score` also
logs each metric as ``reward/<function name>_<metric>`` (e.g. `reward/math_verify_no_answer_rate`).
More functions: `rlhf.rewards.math` (`math_verify`, `boxed_format`), `rlhf.rewards.remote` (`remote`, HTTP).
"""

from __future__ import annotations

import re

from rlhf.data.count import count_answer
from rlhf.registry import register

_INTEGER = re.compile(r"-?\d+")


class Scores(list):
    """One score per response (a list of floats) plus ``metrics`` ({short name: float}) for `RewardSet`."""

    def __init__(self, values, metrics: dict[str, float] | None = None) -> None:
        super().__init__(values)
        self.metrics = dict(metrics or {})


def verifier(fn):
    """Mark a reward function as a correctness check (score > 0 means correct)."""
    fn.is_verifier = True
    return fn


@register("reward", "exact_match")
@verifier
def exact_match(prompts, responses, ground_truths, **_) -> list[float]:
    """1.0 when the stripped response equals the stripped ground truth, else 0.0."""
    return [float(r.strip() == str(g).strip()) for r, g in zip(responses, ground_truths)]


def _same_integer(response: str, truth) -> bool:
    """Whether ``response`` is a bare integer equal to ``truth`` (an int, or a string such as "7" or "7.0")."""
    if _INTEGER.fullmatch(response.strip()) is None:
        return False
    try:
        value = float(str(truth).strip())
    except ValueError:
        return False
    return value.is_integer() and int(response.strip()) == int(value)


@register("reward", "arith_correct")
@verifier
def arith_correct(prompts, responses, ground_truths, **_) -> list[float]:
    """1.0 when the response is exactly the integer answer (surrounding whitespace allowed), else 0.0."""
    return [float(_same_integer(r, g)) for r, g in zip(responses, ground_truths)]


@register("reward", "last_integer_correct")
@verifier
def last_integer_correct(prompts, responses, ground_truths, **_) -> list[float]:
    """1.0 when the response's last integer is the answer (a chat model's "25 + 60 = 85" answers 85), else 0.0."""
    return [float(bool(found := _INTEGER.findall(r)) and _same_integer(found[-1], g)) for r, g in zip(responses, ground_truths)]


@register("reward", "integer_format")
def integer_format(prompts, responses, ground_truths, **_) -> list[float]:
    """1.0 when the response is a bare integer (the task's answer format), else 0.0."""
    return [float(_INTEGER.fullmatch(r.strip()) is not None) for r in responses]


@register("reward", "length_penalty")
def length_penalty(prompts, responses, ground_truths, target_chars: int = 0, **_) -> list[float]:
    """Minus the number of characters beyond ``target_chars``: discourages rambling."""
    return [-float(max(0, len(r) - target_chars)) for r in responses]


@register("reward", "count_closeness")
def count_closeness(prompts, responses, ground_truths, **_) -> list[float]:
    """How near a well-formed count stops: 1 - |len(response) - N| / N, at least 0; 0 for a response that is not
    the start of 1234567890 repeated (`dataset=count`)."""
    scores = []
    for response, truth in zip(responses, ground_truths):
        response, n = response.strip(), len(str(truth))
        well_formed = bool(response) and response == count_answer(len(response))
        scores.append(max(0.0, 1.0 - abs(len(response) - n) / n) if well_formed else 0.0)
    return scores
