"""The environment interface of multi-turn rollouts, and the checks every environment's answers pass.

An environment is gym-like and speaks text:

    reset(seed) -> (observation, info)
    step(action_text) -> (observation, reward, terminated, truncated, info)

either method may be ``async def``. A factory registered as kind ``env`` is called as
``factory(cfg=<env config>, tokenizer=..., rewards=<the run's RewardSet>)`` and returns an `EnvMaker`: it makes
one fresh environment per episode. Its class attribute ``config`` is its config class: `EnvConfig` (the keys the
agent loop reads, whatever the environment) extended with the environment's own keys and defaults (`rlhf.parts`).

Tasks: a maker with ``uses_dataset = True`` gets each episode's dataset row (`PromptExample`, drawn from the run's
prompt stream, so checkpoints keep the stream); one without gets ``None`` and tells task instances apart by the
reset seed alone: `seed_tasks` makes those seeds the stream's tasks instead, so they are drawn, checkpointed and
resumed the same way. Episodes of one group (`algorithm.num_samples_per_prompt`) share the task and the reset seed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from rlhf.data.prompts import PromptExample, PromptSplits
from rlhf.envs.templates import TEMPLATES
from rlhf.errors import ConfigError, require
from rlhf.parts import PartConfig, choose

REDUCTIONS = ("sum", "last")  # `env.reward_reduce`: a trajectory's score from its turn rewards


@dataclass
class EnvConfig(PartConfig):
    """The keys the agent loop reads, whatever the environment (`env.name` null: single-turn prompts, no node)."""

    name: Optional[str] = None  # an environment: arith_retry, gem, agent_func, single_turn, or an import path; null = single-turn prompts scored by `reward`
    template: str = "no"  # how observations become text: no (as is), qwen3_game, qwen3_general, chat (the tokenizer's chat template)
    num_parallel: int = 32  # episodes whose turns are generated together (one generate call per turn and batch)
    max_turns: int = 4  # actions per episode; an episode still running after them ends as truncated
    max_tokens: int = 256  # tokens per trajectory, prompt included; an action that would pass it ends the episode as truncated
    max_concurrency: int = 32  # environment reset/step calls in flight at once
    step_timeout_s: float = 60.0  # a reset/step call still running after this loses its episode (counted in env/failed_episodes)
    failed_retries: int = 1  # a failed episode (the environment or agent raised, timed out, answered malformed) is played again, fresh with the same task and seed, this many times; those episodes only
    max_failed_share: float = 0.5  # past this share of a training batch's episodes still failed after retries, the run stops (the last step saved), naming the environment; 1: only when all fail
    reward_reduce: str = "sum"  # a trajectory's score from its turn rewards: sum or last
    eval_size: int = 32  # environments without a dataset: held-out task instances (reset seeds 0..N-1) evaluated

    def check(self, at: str) -> None:
        for key in ("num_parallel", "max_turns", "max_concurrency", "eval_size"):
            require(getattr(self, key) >= 1, f"{at}.{key}={getattr(self, key)} must be >= 1")
        require(self.max_tokens >= 2, f"{at}.max_tokens={self.max_tokens} must be >= 2 (a prompt token and an action token)")
        require(self.step_timeout_s > 0, f"{at}.step_timeout_s={self.step_timeout_s} must be > 0")
        require(self.failed_retries >= 0, f"{at}.failed_retries={self.failed_retries} must be >= 0")
        require(0 < self.max_failed_share <= 1, f"{at}.max_failed_share={self.max_failed_share} must be in (0, 1]")
        require(self.reward_reduce in REDUCTIONS, f"{at}.reward_reduce={self.reward_reduce!r}; choose one of {', '.join(REDUCTIONS)}")
        require(self.template in TEMPLATES, f"{at}.template={self.template!r}; choose one of {', '.join(TEMPLATES)}")


def env_config(cfg) -> EnvConfig | None:
    """The run's `env` node typed by its environment's config class, every key it leaves out at its default (an
    environment named by import path starts from the `env=none` node, which holds only `name`; one that declares no
    class is typed by `EnvConfig`); None for env=none. Read the environment's keys here, not from the node as written."""
    return None if cfg.env.name is None else choose("env", cfg.env, "env", base=EnvConfig).config


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


def check_prompt_room(prompts: list[PromptExample], max_tokens: int) -> int:
    """Before models load, for an environment whose first observation is the dataset prompt: ConfigError naming
    `env.max_tokens` when no training prompt leaves room for an action token (each episode would fail at once);
    otherwise how many prompts leave none (their episodes will fail, so the caller may warn)."""
    lengths = [len(ex.token_ids) for ex in prompts if ex.token_ids]
    full = sum(n >= max_tokens for n in lengths)
    if lengths and full == len(lengths):
        raise ConfigError(
            f"env.max_tokens={max_tokens} (tokens per episode, prompt included) leaves no room for an action: every "
            f"training prompt is at least {min(lengths)} tokens (the longest {max(lengths)}); raise env.max_tokens above "
            f"{max(lengths)} plus the action tokens wanted (e.g. + generator.max_new_tokens per turn)"
        )
    return full


class EnvError(RuntimeError):
    """An environment broke its contract (raised, hung, or answered malformed); the episode is lost, not the run."""


@dataclass(frozen=True)
class StepResult:
    """One checked answer of `Environment.step`."""

    observation: str  # the next observation's text
    reward: float  # the turn's reward
    terminated: bool  # the episode ended
    truncated: bool  # the episode was cut short
    info: dict[str, Any] = field(default_factory=dict)  # the environment's extras (``success``, ...)


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
    number = finite_reward(reward, bools=True)
    if number is None:
        raise EnvError(
            f"step() reward must be a finite number (an int, float or bool, or a one-element tensor; not a str or "
            f"None); got {_short(reward)} ({type(reward).__name__})"
        )
    return StepResult(observation, number, bool(terminated), bool(truncated), dict(info or {}))


def finite_reward(value: Any, bools: bool = False) -> float | None:
    """``value`` as a float when it is a finite number: an int or float, or a one-element tensor or array holding one;
    with ``bools`` (Python environment code, where `step()` may return ``action == answer``) a bool as 1.0 or 0.0.
    None for anything else: a str and None (``float("1")`` would take it), and a bool unless ``bools`` (a JSON `true`
    posted as a reward)."""
    if isinstance(value, bool) and bools:
        return float(value)
    if value is None or isinstance(value, (bool, str, bytes)):
        return None
    if not isinstance(value, (int, float)):
        try:
            value = value.item()  # a one-element tensor or numpy value
        except (AttributeError, TypeError, ValueError, RuntimeError):
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
    value = float(value)
    return value if math.isfinite(value) else None


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def as_episode_error(err: BaseException) -> BaseException:
    """``err`` raised by the user's environment code, safe to hand to an event loop: an Exception or a cancellation as
    is; a SystemExit, KeyboardInterrupt or other BaseException (which would stop the loop and leave every call on it
    waiting until `env.step_timeout_s`) as an EnvError naming it, so its episode is lost at once like any raise."""
    if isinstance(err, (Exception, asyncio.CancelledError)):
        return err
    return EnvError(
        f"{type(err).__name__}({', '.join(map(repr, err.args))}) raised by the environment's code (sys.exit ends only "
        f"this episode here; return or raise an exception instead)"
    )


def in_daemon_thread(fn: Callable, args: tuple) -> concurrent.futures.Future:
    """Run ``fn(*args)`` in a daemon thread: one that hangs can be abandoned without blocking the process's exit."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        try:
            outcome = (future.set_result, fn(*args))
        except BaseException as err:  # handed to the waiting episode
            outcome = (future.set_exception, as_episode_error(err))
        try:
            outcome[0](outcome[1])
        except concurrent.futures.InvalidStateError:  # the episode stopped waiting (timed out): nobody to tell
            pass

    threading.Thread(target=target, daemon=True, name="rlhf-env-call").start()
    return future
