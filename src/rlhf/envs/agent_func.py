"""`env.name=agent_func`: a multi-turn environment written as one Python function in a file (`env.path`).

The file defines

    async def step(state, action, label, **kw) -> (reward, next_state, done, extra)

and optionally ``async def reset(state, label, **kw) -> state``. Plain ``def`` works too (it runs in a worker
thread). ``state`` is the conversation text so far: the dataset prompt (or what ``reset`` made of it), then after each
step the ``next_state`` the function returned. ``action`` is the policy's decoded action, ``label`` the prompt's
ground truth. ``reward`` is a number (a one-element tensor will do), ``done`` ends the episode, ``extra`` is a dict
passed on as the step's info (``extra["success"]``, a bool, marks the episode's success).

The observation appended to the trajectory after the action is ``extra["observation"]`` when given, else what
``next_state`` adds after ``state + action`` (so ``next_state = state + action + feedback`` appends ``feedback``); a
``next_state`` that does not extend ``state + action`` must give ``extra["observation"]``. Keywords offered to a
function that accepts them (by name or through ``**kw``): ``turn`` (0 for the first action) and ``seed`` (the reset
seed).

The file is loaded once per run, so its module-level variables are shared by every episode, concurrent ones
included: keep per-episode data in ``state``. Each episode's task is a dataset row (``uses_dataset = True``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import itertools
import sys
from dataclasses import dataclass
from typing import Optional
from pathlib import Path
from typing import Any, Callable

from rlhf.data.prompts import PromptExample
from rlhf.envs.base import EnvConfig, EnvError, finite_reward, in_daemon_thread
from rlhf.errors import ConfigError
from rlhf.registry import register

_module_numbers = itertools.count()
OFFERED_KEYWORDS = ("turn", "seed")  # passed to a user function that takes them
_EXAMPLE = "async def step(state, action, label, **kw): ... return reward, next_state, done, extra"


class AgentEpisode:
    """One episode of a task: the user's ``step`` (and ``reset``) over the conversation text."""

    def __init__(self, step: Callable, reset: Callable | None, task: PromptExample) -> None:
        self._step, self._reset = step, reset
        self.prompt, self.label = task.text, task.ground_truth
        self.state = self.prompt
        self.seed = 0
        self.turn = 0

    async def reset(self, seed: int) -> tuple[str, dict]:
        """The first observation: the prompt, or what the user's ``reset`` returned for it."""
        self.seed, self.turn, self.state = seed, 0, self.prompt
        if self._reset is not None:
            state = await call_user(self._reset, self.prompt, self.label, turn=0, seed=seed)
            if not isinstance(state, str):
                raise EnvError(f"agent_func reset() must return the initial state as a str; got {type(state).__name__}")
            self.state = state
        return self.state, {}

    async def step(self, action: str) -> tuple[str, Any, bool, bool, dict]:
        """The user's ``step`` on the current state; the observation is the new text it appends (or names)."""
        answer = await call_user(self._step, self.state, action, self.label, turn=self.turn, seed=self.seed)
        if not (isinstance(answer, tuple) and len(answer) == 4):
            got = type(answer).__name__
            raise EnvError(f"agent_func step() must return (reward, next_state, done, extra); got {got}")
        reward, next_state, done, extra = answer
        if finite_reward(reward, bools=True) is None:
            raise EnvError(
                f"agent_func step() returned reward={reward!r:.80} ({type(reward).__name__}): the 1st value must be a "
                f"finite number (an int, float or bool, or a one-element tensor), not a str or None"
            )
        if extra is not None and not isinstance(extra, dict):
            raise EnvError(
                f"agent_func step() returned extra={extra!r} ({type(extra).__name__}): the 4th value must be a dict "
                f"(the step's info, e.g. {{'success': True}}) or None"
            )
        info = dict(extra or {})
        observation = info.pop("observation", None)
        if observation is None:
            observation = _appended_text(self.state + action, next_state)
        self.state, self.turn = next_state, self.turn + 1
        return observation, reward, bool(done), False, info


def _appended_text(before: str, next_state: Any) -> str:
    """What ``next_state`` adds after ``before`` (the state and the action), or EnvError."""
    if not isinstance(next_state, str) or not next_state.startswith(before):
        raise EnvError(
            "agent_func step() returned a next_state that does not extend state + action; "
            "return extra['observation'] to say which text to append"
        )
    return next_state[len(before) :]


async def call_user(fn: Callable, *args: Any, **offered: Any) -> Any:
    """``fn(*args, **the offered keywords it accepts)``: awaited, or in a daemon thread when it is a plain function (one
    that never returns is abandoned at `env.step_timeout_s` and cannot keep the process alive at exit)."""
    kwargs = _accepted(fn, offered)
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.wrap_future(in_daemon_thread(lambda: fn(*args, **kwargs), ()))
    return await result if inspect.isawaitable(result) else result  # e.g. an object with an async __call__


def _accepted(fn: Callable, offered: dict[str, Any]) -> dict[str, Any]:
    """The keywords of ``offered`` that ``fn`` takes, by name or through ``**kw``."""
    parameters = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return offered
    return {name: value for name, value in offered.items() if name in parameters}


@dataclass
class AgentFuncConfig(EnvConfig):
    path: Optional[str] = None  # the Python file defining `async def step(state, action, label, **kw)` (required)


@register("env", "agent_func")
class AgentFuncMaker:
    """Loads `env.path` once; makes an `AgentEpisode` per dataset row."""

    config = AgentFuncConfig
    uses_dataset = True

    def __init__(self, *, cfg, tokenizer=None, rewards=None) -> None:
        self.path = cfg.path
        self.step, self.reset = load_functions(self.path)

    def make(self, task: PromptExample | None) -> AgentEpisode:
        """A fresh episode of the dataset row ``task``."""
        if task is None:
            raise ValueError("agent_func episodes need a dataset row (uses_dataset = True)")
        return AgentEpisode(self.step, self.reset, task)

    def __getstate__(self) -> dict:
        """Pickled as its path (the loaded module cannot be): another process loads the file again."""
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.path = state["path"]
        self.step, self.reset = load_functions(self.path)


def load_functions(path: str | None) -> tuple[Callable, Callable | None]:
    """(step, reset or None) of the file ``path``, checked, or ConfigError naming `env.path` and the fix."""
    if not path:
        raise ConfigError(f"env.name=agent_func needs env.path=<a Python file defining `{_EXAMPLE}`>")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"env.path={path!r} is not a file; give the Python file that defines `{_EXAMPLE}`")
    module = load_module(file, path)
    step = getattr(module, "step", None)
    if step is None:
        raise ConfigError(f"env.path={path!r} defines no `step`; add `{_EXAMPLE}`")
    check_function(step, "step", ("state", "action", "label"), path)
    reset = getattr(module, "reset", None)
    if reset is not None:
        check_function(reset, "reset", ("state", "label"), path)
    return step, reset


def load_module(file: Path, path: str):
    """Execute ``file`` as a fresh module of its own (a unique name, so two runs' files never clash)."""
    name = f"rlhf_agent_func_{next(_module_numbers)}_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"env.path={path!r} cannot be loaded as a Python module; give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ConfigError(f"env.path={path!r} failed to load: {type(err).__name__}: {err}; fix the file") from err
    return module


def check_function(fn: Any, name: str, positional: tuple[str, ...], path: str) -> None:
    """ConfigError unless ``fn`` is a plain or async function callable with ``positional`` arguments."""
    wanted = f"`async def {name}({', '.join(positional)}, **kw)`"
    if not callable(fn) or inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise ConfigError(f"env.path={path!r}: `{name}` must be a function: {wanted}")
    try:
        inspect.signature(fn).bind(*positional, **_accepted(fn, dict.fromkeys(OFFERED_KEYWORDS, 0)))
    except (TypeError, ValueError) as err:
        message = f"env.path={path!r}: `{name}` cannot be called as {wanted} ({err}); fix its parameters"
        raise ConfigError(message) from err
