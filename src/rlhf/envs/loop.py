"""The agent loop: episodes run turn by turn, the live ones generated together, the environments stepped concurrently.

Token in, token out: an episode is a growing list of token ids. Each turn the generator samples an action after the
whole history; those exact tokens (and their logprobs) are kept, the decoded text goes to `step`, and the next
observation, rendered by `env.template`, is tokenised on its own and appended. History is never re-tokenised, so
the trainer sees exactly the tokens the generator sampled.

An environment that raises (sys.exit included), answers malformed, or hangs past `env.step_timeout_s` loses its
episode (logged once per distinct error), never the run. A stop signal abandons the calls being waited on at once
(`StopRequested`): the run saves its last complete step and ends as interrupted.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from rlhf.data.templates import encode_prompt
from rlhf.data.prompts import PromptExample
from rlhf.envs.base import EnvError, EnvMaker, as_episode_error, check_reset, check_step, in_daemon_thread
from rlhf.envs.templates import render
from rlhf.errors import StopRequested, stop_requested
from rlhf.generators.base import SamplingParams
from rlhf.rewards.failure import retry_failed
from rlhf.trajectory import Trajectories

log = logging.getLogger("rlhf")
STOP_POLL_S = 0.1  # how often a wait on environment calls looks for a stop signal


@dataclass
class Turn:
    """One observation and the action that answered it."""

    observation: str  # the observation text (before the template); turn 0: the prompt
    observation_ids: list[int]  # the tokens appended for it (templated)
    action_ids: list[int] = field(default_factory=list)  # the tokens the generator sampled, exactly
    action_logp: list[float] = field(default_factory=list)  # the generator's logprob of each
    action: str = ""  # the decoded action given to `step`
    reward: float = 0.0  # what `step` returned for it
    stopped: bool = False  # the action ended with the stop token
    version: int | None = None  # the policy version that sampled the action, when known


@dataclass
class Episode:
    """One task instance played to its end."""

    group: int  # episodes of one task instance share it (GRPO/RLOO groups)
    seed: int  # the reset seed
    task: PromptExample | None  # the dataset row (environments that use a dataset)
    turns: list[Turn] = field(default_factory=list)
    end: str = ""  # terminated | truncated (by the environment) | max_turns | max_tokens | failed
    error: str | None = None  # why it failed
    info: dict = field(default_factory=dict)  # the last info the environment returned

    @property
    def failed(self) -> bool:
        return self.end == "failed"

    @property
    def episode_return(self) -> float:
        return sum(t.reward for t in self.turns)

    @property
    def success(self) -> bool:
        """``info["success"]`` of the last step when given, else a positive return."""
        return bool(self.info["success"]) if "success" in self.info else self.episode_return > 0

    @property
    def stopped(self) -> bool:
        """The last action ended with the stop token (it was not cut by a token limit)."""
        return bool(self.turns) and self.turns[-1].stopped

    def token_ids(self) -> list[int]:
        """Every token so far: observations and actions, in order."""
        return [i for t in self.turns for i in t.observation_ids + t.action_ids]


class EpisodeRunner:
    """Plays batches of episodes of one environment with a generator (`run`)."""

    def __init__(self, maker: EnvMaker, cfg, tokenizer, stop_id: int) -> None:
        self.maker, self.cfg, self.tokenizer, self.stop_id = maker, cfg, tokenizer, stop_id
        self._loop = asyncio.new_event_loop()  # waits for the calls and keeps their time limits
        # the loop environment coroutines run on: one for the run (async environments may keep loop-bound state), in a
        # daemon thread of its own, so a coroutine that blocks it (time.sleep instead of await asyncio.sleep) cannot
        # stop `_loop` from timing the call out, and cannot keep the process alive at exit
        self._env_loop = asyncio.new_event_loop()
        threading.Thread(target=self._env_loop.run_forever, daemon=True, name="rlhf-env-loop").start()
        self._logged: set[str] = set()  # errors already logged (each distinct one once)
        self.stop_text = tokenizer.convert_ids_to_tokens(stop_id)  # what later observations follow

    # -- environment calls ---------------------------------------------------------------------------------
    async def _call(self, name: str, fn: Callable, args: tuple, limit: asyncio.Semaphore) -> Any:
        timeout = self.cfg.step_timeout_s
        async with limit:
            try:
                result = await asyncio.wait_for(self._start(fn, args), timeout)
                if inspect.isawaitable(result):  # a plain method that returned a coroutine
                    result = await asyncio.wait_for(self._on_env_loop(result), timeout)
                return result
            except (asyncio.TimeoutError, TimeoutError):
                raise EnvError(
                    f"{name}() did not return within env.step_timeout_s={timeout:g} s (an async {name}() that blocks "
                    f"its event loop, time.sleep instead of await asyncio.sleep, ends here too, and so do the calls "
                    f"after it)"
                ) from None

    def _start(self, fn: Callable, args: tuple):
        if inspect.iscoroutinefunction(fn):
            return self._on_env_loop(fn(*args))
        return asyncio.wrap_future(in_daemon_thread(fn, args))

    def _on_env_loop(self, awaitable) -> asyncio.Future:
        """``awaitable`` run on the environments' own loop, awaitable from `_loop`."""

        async def run():
            try:
                return await awaitable
            except BaseException as err:  # a SystemExit here would stop the environments' loop, and every call on it
                checked = as_episode_error(err)
                if checked is err:
                    raise
                raise checked from None

        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self._env_loop))

    def _call_all(self, name: str, calls: list[tuple[Callable, tuple]]) -> list[Any]:
        """``fn(*args)`` for every call, at most `env.max_concurrency` at once; an exception is returned, not raised.
        A stop signal (SIGTERM/SIGINT) abandons the calls within `STOP_POLL_S`: `StopRequested`."""

        async def gather():
            limit = asyncio.Semaphore(self.cfg.max_concurrency)
            answers = asyncio.gather(*(self._call(name, fn, args, limit) for fn, args in calls), return_exceptions=True)
            while not answers.done():
                if stop_requested.is_set():
                    answers.cancel()
                    answers.add_done_callback(lambda done: done.cancelled() or done.exception())  # nothing left unread
                    await asyncio.wait({answers}, timeout=1.0)  # let the calls take their cancellation
                    raise StopRequested(f"a stop signal arrived while the environments' {name}() calls ran; their "
                                        f"episodes were abandoned")
                await asyncio.wait({answers}, timeout=STOP_POLL_S)
            return answers.result()

        return self._loop.run_until_complete(gather()) if calls else []

    def _fail(self, episode: Episode, what: str, err: BaseException) -> None:
        episode.end = "failed"
        episode.error = f"{what}: {type(err).__name__}: {err}"
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise err
        key = f"{what}:{type(err).__name__}:{err}"
        if key not in self._logged:
            self._logged.add(key)
            log.warning("environment %s: episode lost (seed %d): %s (further episodes failing the same way are only counted)",
                        self.cfg.name, episode.seed, episode.error)

    # -- the loop ------------------------------------------------------------------------------------------
    def _observe(self, episode: Episode, text: str, first: bool) -> None:
        """Append a new turn holding the rendered, tokenised observation. The first is tokenised as a dataset prompt
        (the row's own tokens when it is the row's text; else BOS added unless the text has it); later ones get no
        special tokens (they follow the action's stop token)."""
        rendered = render(self.cfg.template, text, self.tokenizer, first, self.stop_text)
        task = episode.task
        if first and task is not None and task.token_ids and rendered == task.text:
            ids = list(task.token_ids)
        elif first:
            ids = encode_prompt(self.tokenizer, rendered)
        else:
            ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        episode.turns.append(Turn(observation=text, observation_ids=list(ids)))

    def run(
        self, generator, tasks: list[PromptExample | None], seeds: list[int], group_size: int, sampling: SamplingParams
    ) -> list[Episode]:
        """Play ``group_size`` episodes of each task (reset with its seed); episodes of a task are contiguous."""
        episodes = [Episode(group=g, seed=seeds[g], task=tasks[g]) for g in range(len(tasks)) for _ in range(group_size)]
        envs: list[Any] = [None] * len(episodes)
        for i, ep in enumerate(episodes):
            try:
                envs[i] = self.maker.make(ep.task)
            except Exception as err:  # the user's environment code
                self._fail(ep, "make", err)
        live = [i for i, ep in enumerate(episodes) if not ep.failed]
        answers = self._call_all("reset", [(envs[i].reset, (episodes[i].seed,)) for i in live])
        for i, answer in zip(live, answers):
            try:
                if isinstance(answer, BaseException):
                    raise answer
                observation, info = check_reset(answer)
                episodes[i].info = info
                self._observe(episodes[i], observation, first=True)
            except Exception as err:
                self._fail(episodes[i], "reset", err)
        live = [i for i in live if not episodes[i].failed]
        for _ in range(self.cfg.max_turns):
            live = self._budgeted(episodes, live)
            if not live:
                break
            self._act(generator, episodes, live, sampling)
            live = self._step(envs, episodes, live)
        for i in live:
            episodes[i].end = "max_turns"
        for ep in episodes:  # an observation no action answered is not part of the trajectory
            if len(ep.turns) > 1 and not ep.turns[-1].action_ids:
                ep.turns.pop()
        for env in envs:
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as err:  # closing is best effort
                    log.debug("environment close() raised: %s", err)
        return episodes

    def _budgeted(self, episodes: list[Episode], live: list[int]) -> list[int]:
        """The live episodes with room for at least one more action token; the others end at max_tokens (an episode
        whose first observation leaves no room fails: there is no action to train on)."""
        kept = []
        for i in live:
            used = len(episodes[i].token_ids())
            if used < self.cfg.max_tokens:
                kept.append(i)
            elif len(episodes[i].turns) == 1:
                self._fail(episodes[i], "reset", EnvError(no_room(used, self.cfg.max_tokens)))
            else:
                episodes[i].end = "max_tokens"
        return kept

    def _act(self, generator, episodes: list[Episode], live: list[int], sampling: SamplingParams) -> None:
        """Sample each live episode's next action, `env.num_parallel` episodes per generate call. A generator that
        names the policy version of each call (`generate_versioned`: schedule=stream's, which loads pushed weights
        before each call) tags the turns with it."""
        size = self.cfg.num_parallel
        versioned = getattr(generator, "generate_versioned", None)
        for start in range(0, len(live), size):
            chunk = live[start : start + size]
            contexts = [episodes[i].token_ids() for i in chunk]
            batch, version = versioned(contexts, sampling) if versioned else (generator.generate(contexts, sampling), None)
            for (i, context), (ids, logp, stopped) in zip(zip(chunk, contexts), sampled(batch)):
                turn = episodes[i].turns[-1]
                turn.version = version
                room = self.cfg.max_tokens - len(context)
                turn.action_ids, turn.action_logp, turn.stopped, cut = within_budget(ids, logp, stopped, room)
                if cut:  # this action ends the episode
                    episodes[i].end = "max_tokens"
                turn.action = self.tokenizer.decode(turn.action_ids, skip_special_tokens=True)

    def _step(self, envs: list[Any], episodes: list[Episode], live: list[int]) -> list[int]:
        """Step every live episode's environment with its action; the episodes still running afterwards."""
        acting = [i for i in live if not episodes[i].end]
        answers = self._call_all("step", [(envs[i].step, (episodes[i].turns[-1].action,)) for i in acting])
        still = []
        for i, answer in zip(acting, answers):
            ep = episodes[i]
            try:
                if isinstance(answer, BaseException):
                    raise answer
                result = check_step(answer)
            except Exception as err:
                self._fail(ep, "step", err)
                continue
            ep.turns[-1].reward = result.reward
            ep.info = result.info
            if result.terminated or result.truncated:
                ep.end = "terminated" if result.terminated else "truncated"
                continue
            try:
                self._observe(ep, result.observation, first=False)
            except Exception as err:  # a template or tokenizer that cannot take this observation
                self._fail(ep, "observation", err)
                continue
            still.append(i)
        return still


def no_room(used: int, max_tokens: int) -> str:
    """Why an episode whose first observation is ``used`` tokens has no action: `env.max_tokens`, and the fix."""
    return (
        f"the first observation (the prompt, templated) is {used} tokens, which fills env.max_tokens={max_tokens} "
        f"(tokens per episode, prompt included) and leaves no room for an action; raise env.max_tokens above {used} "
        f"plus the action tokens wanted (e.g. + generator.max_new_tokens per turn)"
    )


def sampled(batch: Trajectories) -> list[tuple[list[int], list[float], bool]]:
    """Each row's sampled tokens, their generator logprobs and whether the stop token ended them, as lists."""
    batch = batch.to("cpu")
    window, mask = batch.window_ids, batch.loss_mask.bool()
    return [
        (window[row][mask[row]].tolist(), batch.gen_logp[row][mask[row]].tolist(), bool(batch.stopped[row]))
        for row in range(len(batch))
    ]


def within_budget(ids: list[int], logp: list[float], stopped: bool, room: int) -> tuple[list[int], list[float], bool, bool]:
    """An action cut to the ``room`` tokens left of the episode's budget (`env.max_tokens`): its ids, logprobs, whether
    the stop token ended it, and whether it was cut (then it did not stop, and it ends the episode)."""
    if len(ids) <= room:
        return ids, logp, stopped, False
    return ids[:room], logp[:room], False, True


def play_retrying(
    runner, generator, tasks: list[PromptExample | None], seeds: list[int], group_size: int, sampling: SamplingParams,
    retries: int,
) -> tuple[list[Episode], int, dict[str, float]]:
    """``runner.run`` (an `EpisodeRunner`, or an environment's own loop such as the agent endpoint's), then each failed
    episode played again, fresh with its task and reset seed, alone with the others that failed, up to ``retries``
    more times (`env.failed_retries`, the rule of `rlhf.rewards.failure.retry_failed`). Returns the episodes (a group's
    together, a retried one in its failed one's place; an agent's session may give several), how many were played
    again, and the runner's `last_metrics` summed over its runs."""
    counts: dict[str, float] = {}

    def played(episodes: list[Episode]) -> list[Episode]:
        for key, value in getattr(runner, "last_metrics", {}).items():
            counts[key] = counts.get(key, 0.0) + value
        return episodes

    first = played(runner.run(generator, tasks, seeds, group_size, sampling))
    slots = [[ep] for ep in first]  # a slot per episode played: what replaces it when it is played again

    def again(rows: list[int]) -> list[list[Episode]]:
        failed = [slots[row][0] for row in rows]
        retried = played(runner.run(generator, [ep.task for ep in failed], [ep.seed for ep in failed], 1, sampling))
        by_slot: list[list[Episode]] = [[] for _ in rows]
        for ep in retried:  # group n: the n-th failed episode's
            by_slot[ep.group].append(replace(ep, group=failed[ep.group].group))
        return by_slot

    slots, asked = retry_failed(slots, lambda slot: any(ep.failed for ep in slot), again, retries)
    return [ep for slot in slots for ep in slot], asked, counts
