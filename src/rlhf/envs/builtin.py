"""`env.name=arith_retry`: the built-in multi-turn task, single-digit addition with one retry after a miss.

Each episode's task is a row of `dataset=arith` (``uses_dataset = True``); ``reset`` returns the problem
(`3+4=`). A right answer ends the episode; a wrong one earns one retry, whose observation is the problem again,
so the policy reads `<bos>3+4=8<eos>3+4=` and answers once more (only digits, `+` and `=`, the tiny model's
alphabet: being asked again is what says "wrong"). The second answer ends the episode, right or wrong.

Every answer is scored like a single-turn response (`SingleTurnEpisode`: the weighted `reward.functions`, right
when every verifier passes); a retry earns `RETRY_SCALE` times that, so a first-try answer is worth more than a
retry and a right retry more than a second miss. ``info["success"]`` is the last answer's verdict.

The built-in tiny model never saw a token after <eos>; `builtin:tiny_arith_retry` (`python -m rlhf.warmstart
--retry`) is warm-started on both turns and is the model of `experiment=multiturn_tiny`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.data.prompts import PromptExample
from rlhf.envs.base import EnvConfig
from rlhf.envs.single_turn import SingleTurnEpisode
from rlhf.errors import ConfigError
from rlhf.registry import register
from rlhf.rewards.combine import RewardSet

ATTEMPTS = 2  # the first answer and one retry
RETRY_SCALE = 0.5  # a retry's reward relative to the same answer given first


class ArithRetryEpisode:
    """One problem: up to `ATTEMPTS` answers; the episode ends at the first right one."""

    def __init__(self, scorer: SingleTurnEpisode, task: PromptExample) -> None:
        self.scorer = scorer  # scores one answer with reward.functions
        self.task = task
        self.attempt = 0

    def reset(self, seed: int) -> tuple[str, dict]:
        """The problem text; ``seed`` is unused (the task is the dataset row)."""
        self.attempt = 0
        return self.task.text, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """(the problem again after a miss with a try left, else "", the scaled reward, done, False, info)."""
        _, reward, _, _, info = self.scorer.step(action)
        self.attempt += 1
        if self.attempt > 1:
            reward *= RETRY_SCALE
        done = info["success"] or self.attempt >= ATTEMPTS
        info["attempt"] = self.attempt
        return ("" if done else self.task.text), reward, done, False, info


@dataclass
class ArithRetryConfig(EnvConfig):
    max_turns: int = 2  # the first answer and the retry
    max_tokens: int = 32  # room for the prompt (5 tokens), the problem again (4) and two answers of up to 4 tokens


@register("env", "arith_retry")
class ArithRetryMaker:
    """Makes an `ArithRetryEpisode` per `dataset=arith` row, scored by the run's rule reward functions."""

    config = ArithRetryConfig
    uses_dataset = True

    def __init__(self, *, cfg, tokenizer, rewards: RewardSet) -> None:
        if rewards.cfg.path is not None or not rewards.verifiers:
            raise ConfigError(
                "env.name=arith_retry grants the retry when a verifier among reward.functions fails, and scores "
                "with rule functions only: use reward=arith (arith_correct + integer_format) and reward.path=null"
            )
        if cfg.max_turns < ATTEMPTS:
            raise ConfigError(
                f"env.max_turns={cfg.max_turns} leaves no turn for the retry; set env.max_turns={ATTEMPTS}"
            )
        self.functions = rewards.functions

    def make(self, task: PromptExample | None) -> ArithRetryEpisode:
        """A fresh episode of the dataset row ``task``."""
        if task is None:
            raise ValueError("arith_retry episodes need a dataset row (uses_dataset = True)")
        return ArithRetryEpisode(SingleTurnEpisode(self.functions, task), task)
