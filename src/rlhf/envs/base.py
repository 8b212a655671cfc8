"""The environment interface of multi-turn rollouts, and the checks every environment's answers pass.

An environment is gym-like and speaks text:

    reset(seed) -> (observation, info)
    step(action_text) -> (observation, reward, terminated, truncated, info)

either method may be ``async def``. A factory registered as kind ``env`` is called as
``factory(cfg=<env config>, tokenizer=..., rewards=<the run's RewardSet>)`` and returns an `EnvMaker`: it makes
one fresh environment per episode. Its class attribute ``config_keys`` names the `env.*` keys it reads beyond
`BASE_KEYS` (`rlhf.config.ownership`).

Tasks: a maker with ``uses_dataset = True`` gets each episode's dataset row (`PromptExample`, drawn from the run's
prompt stream, so checkpoints keep the stream); one without gets ``None`` and tells task instances apart by the
reset seed alone: `seed_tasks` makes those seeds the stream's tasks instead, so they are drawn, checkpointed and
resumed the same way. Episodes of one group (`algorithm.num_samples_per_prompt`) share the task and the reset seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlhf.data.prompts import PromptExample, PromptSplits

# `env.*` keys the agent loop itself reads, whatever the environment
BASE_KEYS = ("name", "template", "num_parallel", "max_turns", "max_tokens", "max_concurrency", "step_timeout_s", "reward_reduce")


class Environment(Protocol):
    def reset(self, seed: int) -> tuple[str, dict]:
        """Start an episode: the first observation (the prompt, before `env.template`) and an info dict."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """Apply the policy's decoded action: (next observation, reward, terminated, truncated, info).

        ``info["success"]`` (bool), when given on the last step, is the episode's success; else success is a
        positive episode return."""


class EnvMaker(Protocol):
    uses_dataset: bool  # True: each episode's task is a dataset row passed to `make`; False: `make(None)`

    def make(self, task: PromptExample | None) -> Environment:
        """A fresh environment for one episode of ``task``."""


TRAIN_SEEDS = (1_000_000, 100_000)  # environments without a dataset: first training reset seed, and how many


def seed_tasks(env_id: str, eval_size: int) -> PromptSplits:
    """Task instances of an environment without a dataset, as reset seeds (each example's ground truth).

    Eval: seeds 0..eval_size-1, the same for every run; training: `TRAIN_SEEDS`, disjoint from them.
    """
    if eval_size < 1:
        raise ValueError(f"env.eval_size={eval_size} must be at least 1")

    def task(seed: int) -> PromptExample:
        return PromptExample(text=f"{env_id} #{seed}", token_ids=(), ground_truth=seed)

    first, count = TRAIN_SEEDS
    return PromptSplits(train=[task(s) for s in range(first, first + count)], eval=[task(s) for s in range(eval_size)])


class EnvError(RuntimeError):
    """An environment broke its contract (raised, hung, or answered malformed); the episode is lost, not the run."""


@dataclass(frozen=True)
class StepResult:
    """One checked answer of `Environment.step`."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)


def check_reset(answer: Any) -> tuple[str, dict]:
    """`reset`'s answer as (observation, info), or EnvError naming what is wrong."""
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise EnvError(f"reset() must return (observation, info); got {_short(answer)}")
    observation, info = answer
    if not isinstance(observation, str):
        raise EnvError(f"reset() observation must be a str; got {type(observation).__name__}")
    return observation, dict(info or {})


def check_step(answer: Any) -> StepResult:
    """`step`'s answer as a StepResult, or EnvError naming what is wrong (a 5-tuple with a finite reward)."""
    if not (isinstance(answer, tuple) and len(answer) == 5):
        raise EnvError(f"step() must return (observation, reward, terminated, truncated, info); got {_short(answer)}")
    observation, reward, terminated, truncated, info = answer
    if not isinstance(observation, str):
        raise EnvError(f"step() observation must be a str; got {type(observation).__name__}")
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvError(f"step() reward must be a number; got {_short(reward)}") from None
    if not math.isfinite(reward):
        raise EnvError(f"step() reward must be finite; got {reward}")
    return StepResult(observation, reward, bool(terminated), bool(truncated), dict(info or {}))


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
