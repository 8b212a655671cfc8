"""`env.name=gem`: any environment of the GEM package (``pip install gem-llm requests``) as a multi-turn environment.

`env.id` names the GEM environment (``game:GuessTheNumber-v0-easy``); `env.wrappers` lists GEM wrappers, applied in
order through GEM's wrapper factory. Task instances differ by the reset seed alone (``uses_dataset = False``).

GEM's games draw from Python's and NumPy's *global* generators, and ``reset(seed)`` seeds both. So that an episode
neither sees nor disturbs anyone else's draws (other episodes, the run itself), every GEM call runs under one lock
on the episode's own generator states, swapped in and out around it; seeds are taken modulo 2**32 (NumPy's range).

GEM reports no success flag: an episode that ends not truncated with a reward of at least 1 (GEM's success reward)
is a success, unless GEM's info says ``correct``.

Wrappers: our agent loop keeps the whole conversation in the token sequence and appends each new observation, so
the ``concat*`` observation wrappers (which repeat the history in every observation, for loops that re-prompt from
scratch each turn) are usually not wanted; GEM's hint for the next turn (``info["suffix"]``, e.g. "Enter your next
guess.") is only added by them.

``game:GuessTheNumber-v0-easy`` (hand-checked against gem-llm 0.1.0): a secret integer in 1..10, 4 guesses. The
action is any text; its last ``\\boxed{N}`` (N digits only) is the guess, e.g. "I guess \\boxed{5}". Per step:

- no ``\\boxed{N}`` (or N = 0): "At turn t, you did not provide a valid guess.", reward -0.1, terminated;
- the secret: "Congratulations! You guessed the correct number ...", reward 1.0, terminated (a success);
- outside 1..10 or guessed before: reward 0.0, the episode goes on; a new wrong guess: a hint ("the target number
  is higher/lower than N"), reward 0.0;
- the 4th guess, if wrong: "You have reached the maximum number of turns.", terminated and truncated, reward
  1 - |guess - secret| / 9 (0.0 if out of range): partial credit, not a success.

The secret after ``reset(seed)`` is ``env.unwrapped.game_number``.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import random
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlhf.envs.base import EnvConfig
from rlhf.errors import ConfigError
from rlhf.registry import register

_RNG_LOCK = threading.Lock()  # GEM calls run one at a time: they share the process's global generators
_SUCCESS_REWARD = 1.0  # GEM's `LanguageGameReward.success_reward`


def _import_gem():
    """The `gem` package, or ConfigError saying how to install it."""
    try:
        import gem
        import gem.wrappers.wrapper_factory  # noqa: F401  (imported here: it pulls in GEM's tools)
    except ImportError as err:
        raise ConfigError(f"env.name=gem needs the GEM package: pip install gem-llm requests ({err})") from err
    return gem


class _EpisodeRandom:
    """One episode's Python and NumPy global-generator states, active only inside `active()`."""

    def __init__(self) -> None:
        self.states: tuple | None = None  # None: the first call starts from a copy of the run's states

    @contextlib.contextmanager
    def active(self):
        """Run the block on this episode's generator states; the run's states are back afterwards."""
        with _RNG_LOCK:
            run_states = random.getstate(), np.random.get_state()
            if self.states is not None:
                random.setstate(self.states[0])
                np.random.set_state(self.states[1])
            try:
                yield
            finally:
                self.states = random.getstate(), np.random.get_state()
                random.setstate(run_states[0])
                np.random.set_state(run_states[1])


class GemEpisode:
    """One GEM environment, one episode at a time (sync methods: GEM is sync)."""

    def __init__(self, env) -> None:
        self.env = env
        self.random = _EpisodeRandom()

    def reset(self, seed: int) -> tuple[str, dict]:
        """GEM's ``reset(seed=seed % 2**32)``: the first observation and GEM's info."""
        with self.random.active():
            observation, info = self.env.reset(seed=int(seed) % 2**32)
        return observation, dict(info or {})

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """GEM's ``step(action)``; ``info["success"]`` is set when the episode ends."""
        with self.random.active():
            observation, reward, terminated, truncated, info = self.env.step(action)
        info = dict(info or {})
        if terminated or truncated:
            info.setdefault("success", bool(info.get("correct", not truncated and float(reward) >= _SUCCESS_REWARD)))
        return observation, reward, terminated, truncated, info


@dataclass
class GemConfig(EnvConfig):
    id: str = "game:GuessTheNumber-v0-easy"  # the GEM environment id; list them with python -c 'import gem; gem.print_envs()'
    wrappers: str = ""  # comma-separated GEM wrapper names applied in order (the agent loop already keeps the history: concat would repeat it)
    template: str = "qwen3_game"  # Qwen chat turns with GEM's "language games" instruction and a \boxed{} answer
    max_tokens: int = 2048  # prompt (about 200 tokens) and 4 reasoned guesses with their feedback


@register("env", "gem")
class GemMaker:
    """Makes a fresh GEM environment of `env.id`, wrapped with `env.wrappers`, per episode."""

    config = GemConfig
    uses_dataset = False

    def __init__(self, *, cfg, tokenizer, rewards=None) -> None:
        self.gem = _import_gem()
        self.env_id = _checked_id(cfg.id, self.gem)
        self.wrappers = _wrapper_fns(cfg.wrappers, tokenizer)
        if cfg.eval_size < 1:
            raise ConfigError(f"env.eval_size={cfg.eval_size} must be >= 1 (held-out task instances evaluated)")
        self.eval_size = int(cfg.eval_size)
        self._dataset = None  # a dataset-backed GEM environment's dataset, loaded by the first one made and shared

    def make(self, task=None) -> GemEpisode:
        """A fresh environment; ``task`` is ignored (instances differ by the reset seed)."""
        kwargs: dict[str, Any] = {} if self._dataset is None else {"dataset": self._dataset}
        with _EpisodeRandom().active():  # some GEM constructors reset, drawing from the global generators
            env = self.gem.make(self.env_id, **kwargs)
        if self._dataset is None:
            self._dataset = getattr(env, "dataset", None)
        for wrap in self.wrappers:
            env = wrap(env)
        return GemEpisode(env)


def _checked_id(env_id: str | None, gem) -> str:
    """``env_id`` if GEM registers it, else ConfigError naming `env.id` with close or example ids."""
    known = list(gem.envs.registration.ENV_REGISTRY)
    if env_id in known:
        return env_id
    close = difflib.get_close_matches(str(env_id), known, n=5, cutoff=0.5) or known[:5]
    problem = " is required" if env_id is None else f"={env_id!r} is not a GEM environment"
    raise ConfigError(
        f"env.id{problem}; e.g. {', '.join(close)} ({len(known)} in all: python -c 'import gem; gem.print_envs()')"
    )


def _wrapper_fns(names: str, tokenizer) -> list:
    """GEM's wrapper constructors for the comma-separated ``names``, or ConfigError naming `env.wrappers`."""
    from gem.wrappers.wrapper_factory import WRAPPER_FACTORY, get_wrapper_fns

    wanted = [name.strip() for name in (names or "").split(",") if name.strip()]
    unknown = [name for name in wanted if name not in WRAPPER_FACTORY]
    if unknown:
        raise ConfigError(
            f"env.wrappers names unknown GEM wrappers {unknown}; "
            f"choose from {', '.join(WRAPPER_FACTORY)} (comma-separated)"
        )
    with contextlib.redirect_stdout(io.StringIO()):  # the factory prints what it builds
        return get_wrapper_fns(",".join(wanted), tokenizer=tokenizer)
