"""Every wait on an agent has a whole deadline, whatever the agent does: an async agent that blocks its event loop, one
that asks again until it gets an answer, one that never ends, and a stop signal during the agents' phase. Real HTTP on
127.0.0.1, the real `openai` SDK and the tiny model's HF generator."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rlhf.errors import ConfigError, StopRequested
from rlhf.agents.agent_api import load_agent
from rlhf.agents.endpoint import OpenAIAgentConfig
from rlhf.run.state import stop_requested

from endpoint_play import client_of, configured, play


def ask(client, task):
    return client_of(client).chat.completions.create(model=client.model, messages=[{"role": "user", "content": task.prompt}])


def test_an_async_agent_that_blocks_its_event_loop_loses_its_episode_and_the_rest_play_on(runner, generator, tokenizer):
    """Before: `time.sleep` in an `async def run` froze the agents' loop; the agents not yet started never started and
    `env.step_timeout_s` never fired for them, so the batch waited as long as the block (here up to 120 s)."""
    release = threading.Event()

    async def agent(task, client):
        if task.label == 3:
            release.wait(timeout=120)  # a blocking call in a coroutine: no await, the loop stops with it
        await ask(client, task)
        return 1.0

    begun = time.monotonic()
    try:
        with configured(runner, step_timeout_s=5.0, max_concurrency=1):
            episodes = play(runner, generator, tokenizer, agent, group_size=1, problems=((1, 2), (3, 4), (5, 6)))
    finally:
        release.set()
    assert time.monotonic() - begun < 100  # generous: the blocked loop is given up at step_timeout_s
    failed = {ep.task.ground_truth: ep.error for ep in episodes if ep.failed}
    assert list(failed) == [3] and "event loop was blocked" in failed[3] and "time.sleep" in failed[3]
    assert runner.last_metrics["env/timed_out_episodes"] == 1
    assert not any(ep.failed for ep in play(runner, generator, tokenizer, agent, group_size=1, problems=((2, 2),)))


def test_the_example_agent_plays_on_after_another_agent_blocked_the_loop(runner, generator, tokenizer):
    """The shipped example keeps one connection pool per event loop (before: one for the process, bound to the loop
    it was first used on, which another agent then blocked)."""
    example = load_agent("builtin:agents/arith_retry.py")
    release = threading.Event()

    async def blocking(task, client):
        release.wait(timeout=120)
        return 1.0

    try:
        assert not any(ep.failed for ep in play(runner, generator, tokenizer, example, group_size=1))
        with configured(runner, step_timeout_s=5.0):
            assert all(ep.failed for ep in play(runner, generator, tokenizer, blocking, group_size=1, problems=((1, 2),)))
        with configured(runner, step_timeout_s=30.0):
            episodes = play(runner, generator, tokenizer, example, group_size=1)
    finally:
        release.set()
    assert not any(ep.failed for ep in episodes), [ep.error for ep in episodes]


def test_an_agent_that_asks_until_it_gets_an_answer_is_ended_by_env_max_requests(runner, generator, tokenizer):
    """Before: after env.max_turns every answer is empty at once, so an agent asking until one is not never ended (here
    it gives up after 2000 requests, which the old endpoint all answered)."""
    made = []

    async def agent(task, client):
        llm = client_of(client)
        first = await ask(client, task)
        asked = [{"role": "user", "content": task.prompt}, {"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "again"}]
        for attempt in range(2000):
            made.append(attempt)
            reply = await llm.chat.completions.create(model=client.model, messages=asked)
            if reply.choices[0].message.content:
                return 1.0
        return 0.0

    with configured(runner, max_turns=1, max_requests=20):
        episodes = play(runner, generator, tokenizer, agent, group_size=1, problems=((1, 2),))
    assert episodes[0].failed and "env.max_requests=20" in episodes[0].error
    assert len(made) == 20 and runner.last_metrics["env/over_budget_episodes"] == 1


def test_an_episode_past_env_episode_timeout_s_is_lost_though_its_agent_keeps_busy(runner, generator, tokenizer):
    """Before: only silence was timed (env.step_timeout_s); an agent that kept asking, or slept less than that between
    requests, ran as long as it liked."""

    async def agent(task, client):
        await ask(client, task)
        if task.label == 3:
            return 1.0
        for _ in range(300):  # 30 s of requests, each well inside env.step_timeout_s
            await asyncio.sleep(0.1)
            await ask(client, task)
        return 1.0

    with configured(runner, episode_timeout_s=5.0, step_timeout_s=60.0, max_requests=10_000):
        episodes = play(runner, generator, tokenizer, agent, group_size=1, problems=((1, 2), (3, 4)))
    failed = {ep.task.ground_truth: ep.error for ep in episodes if ep.failed}
    assert list(failed) == [7] and "env.episode_timeout_s=5" in failed[7]
    assert runner.last_metrics["env/timed_out_episodes"] == 1


def test_an_agent_that_ignores_its_cancellation_frees_its_place_when_its_episode_is_lost(runner, generator, tokenizer):
    """Before: a running agent held its place under env.max_concurrency until its coroutine ended, so one that
    swallowed its cancellation kept the agents queued behind it from ever starting (here for up to 120 s)."""

    async def agent(task, client):
        await ask(client, task)
        end = time.monotonic() + 120
        while task.label == 3 and time.monotonic() < end:
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                pass  # refuses to stop
        return 1.0

    begun = time.monotonic()
    with configured(runner, max_concurrency=1, episode_timeout_s=3.0):
        episodes = play(runner, generator, tokenizer, agent, group_size=1, problems=((1, 2), (3, 4), (5, 6)))
    assert time.monotonic() - begun < 100
    assert [ep.task.ground_truth for ep in episodes if ep.failed] == [3]


def test_a_stop_signal_abandons_the_agents_phase_at_once(runner, generator, tokenizer):
    """Before: SIGTERM was acknowledged and the step waited on its agents regardless (`stop_requested` is what the
    run's SIGTERM handler sets)."""
    started = threading.Event()

    async def agent(task, client):
        await ask(client, task)
        started.set()
        await asyncio.sleep(3600)

    def signal_when_started():
        started.wait(timeout=120)
        stop_requested.set()

    threading.Thread(target=signal_when_started, daemon=True).start()
    begun = time.monotonic()
    try:
        with pytest.raises(StopRequested, match="stop signal"):
            play(runner, generator, tokenizer, agent, group_size=1, problems=((1, 2),))
    finally:
        stop_requested.clear()
    assert time.monotonic() - begun < 60
    assert not any(ep.failed for ep in play(runner, generator, tokenizer, ask_once, group_size=1, problems=((1, 2),)))


async def ask_once(task, client):
    await ask(client, task)
    return 1.0


@pytest.mark.parametrize("key, value", [("episode_timeout_s", 0), ("max_requests", 0), ("max_request_bytes", 10)])
def test_the_budgets_are_config_errors_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"env.{key}={value}"):
        OpenAIAgentConfig(name="openai_agent", **{key: value}).check("env")
