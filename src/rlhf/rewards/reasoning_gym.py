"""The `reasoning_gym` verifier: each task's own `score_answer`, for prompts of `dataset=reasoning_gym`.

The ground truth is ``{"task": name, "entry": entry}`` (see `rlhf.data.reasoning_gym`); the scorer is rebuilt
from the task name once per process, so the reward runs wherever the responses are scored.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Optional

from rlhf.data.reasoning_gym import load_package
from rlhf.registry import register
from rlhf.rewards.rules import Scores, verifier


@functools.lru_cache(maxsize=None)
def task_scorer(task: str) -> Callable[[Optional[str], dict], float]:
    """A reasoning-gym task's ``score_answer(answer, entry) -> [0, 1]`` (built once per process)."""
    return load_package().get_score_answer_fn(task)


def tagged_answer(response: str, tag: Optional[str]) -> Optional[str]:
    """The text inside the last ``<tag>...</tag>`` of ``response`` (the whole response when ``tag`` is None);
    None when there is none or it is empty."""
    if tag is None:
        answer = response.strip()
    else:
        matches = re.findall(f"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", response, flags=re.DOTALL)
        answer = matches[-1].strip() if matches else ""
    return answer or None


def check_ground_truth(truth: Any) -> tuple[str, dict]:
    """(task, entry) of a reasoning_gym ground truth; a ValueError naming the dataset to use otherwise."""
    if not (isinstance(truth, dict) and isinstance(truth.get("task"), str) and isinstance(truth.get("entry"), dict)):
        raise ValueError(
            f"reward reasoning_gym needs the ground truths of dataset=reasoning_gym ({{task, entry}}), "
            f"got {truth!r:.80}"
        )
    return truth["task"], truth["entry"]


@register("reward", "reasoning_gym")
@verifier
def reasoning_gym_reward(prompts, responses, ground_truths, answer_tag: Optional[str] = "answer", **_) -> Scores:
    """The task's `score_answer` (in [0, 1]) on the answer in ``<answer_tag>`` tags; 0 for no answer or a
    scorer error."""
    scores, missing, errors = [], 0, 0
    for response, truth in zip(responses, ground_truths):
        task, entry = check_ground_truth(truth)
        answer = tagged_answer(response, answer_tag)
        if answer is None:
            missing += 1
            scores.append(0.0)
            continue
        try:
            scores.append(float(task_scorer(task)(answer, entry)))
        except Exception:  # a task's parser may choke on free text; that answer is simply wrong
            errors += 1
            scores.append(0.0)
    n = max(1, len(responses))
    return Scores(scores, metrics={"no_answer_rate": missing / n, "scorer_error_rate": errors / n})
