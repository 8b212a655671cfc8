"""The endpoint is safe to expose: session URLs check the session's key, request bodies are bounded in size and depth,
posted rewards obey the reward functions' bound, and listening beyond the loopback is said plainly. Real HTTP on
127.0.0.1, the real `openai` SDK and the tiny model's HF generator."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace

import httpx

from rlhf.agents.endpoint import AgentRunner, OpenAIAgentConfig
from rlhf.rewards.combine import MAX_ABS_SCORE

from endpoint_play import client_of, configured, play


async def until(ready, deadline_s: float = 120.0) -> None:
    """Wait (without blocking the agents) until ``ready()``; generous, so a busy machine is no failure."""
    end = time.monotonic() + deadline_s
    while not ready():
        assert time.monotonic() < end, "the other agent never got there"
        await asyncio.sleep(0.01)


def test_another_sessions_key_or_a_garbage_one_is_a_401_that_touches_nothing(runner, generator, tokenizer):
    """Before: an agent extended, rewarded and ended another agent's episode through that episode's URL with its own
    key or a garbage one (the URL alone named the session)."""
    shared, statuses = {}, {}

    async def agent(task, client):
        llm = client_of(client)
        if task.label == 3:  # the victim: waits for the attack, then plays its episode
            shared["victim"] = client
            await until(lambda: "attacked" in shared)
            await llm.chat.completions.create(model=client.model, messages=[{"role": "user", "content": task.prompt}])
            return 1.0
        await until(lambda: "victim" in shared)
        victim = shared["victim"]
        ask = {"model": client.model, "messages": [{"role": "user", "content": "9+9="}]}
        async with httpx.AsyncClient(timeout=60) as http:
            for name, headers in (("own key", client.headers), ("garbage key", {"Authorization": "Bearer sk-0"}), ("no key", {})):
                chat = await http.post(victim.base_url + "/chat/completions", json=ask, headers=headers)
                reward = await http.post(victim.reward_url, json={"reward": 5.0, "finished": True}, headers=headers)
                statuses[name] = (chat.status_code, reward.status_code)
            plain = await http.post(client.base_url.split("/sessions/")[0] + "/v1/chat/completions", json=ask,
                                    headers={"Authorization": "Bearer sk-0"})
            statuses["garbage key, plain route"] = (plain.status_code, plain.json()["error"]["type"])
        shared["attacked"] = True
        await llm.chat.completions.create(model=client.model, messages=[{"role": "user", "content": task.prompt}])
        return 0.0

    episodes = play(runner, generator, tokenizer, agent, group_size=1)
    assert statuses == {"own key": (401, 401), "garbage key": (401, 401), "no key": (401, 401),
                        "garbage key, plain route": (401, "authentication_error")}
    victim = next(ep for ep in episodes if ep.task.ground_truth == 3)
    assert not victim.failed and victim.episode_return == 1.0  # not ended, not rewarded by the attacker
    assert len(victim.turns) == 1 and "9+9=" not in victim.turns[0].observation  # not extended either


def test_listing_the_models_under_a_session_url_takes_that_sessions_key_only(runner, generator, tokenizer):
    """Before: GET /sessions/<id>/v1/models answered 200 to any key or none; the chat route already checked."""
    statuses = {}

    async def agent(task, client):
        async with httpx.AsyncClient(timeout=60) as http:
            for name, headers in (("own key", client.headers), ("garbage key", {"Authorization": "Bearer sk-0"}), ("no key", {})):
                statuses[name] = (await http.get(client.base_url + "/models", headers=headers)).status_code
            unknown = client.base_url.replace(client.base_url.split("/sessions/")[1].split("/")[0], "no-such-session")
            statuses["unknown session"] = (await http.get(unknown + "/models", headers=client.headers)).status_code
            statuses["plain route"] = (await http.get(client.base_url.split("/sessions/")[0] + "/v1/models")).status_code
        await client_of(client).chat.completions.create(model=client.model, messages=[{"role": "user", "content": task.prompt}])
        return 1.0

    with configured(runner, max_requests=1):  # a listing is no request of the episode: the one chat request still fits
        episodes = play(runner, generator, tokenizer, agent, group_size=1, problems=((1, 2),))
    assert statuses == {"own key": 200, "garbage key": 401, "no key": 401, "unknown session": 404, "plain route": 200}
    assert not episodes[0].failed and episodes[0].episode_return == 1.0


def test_a_body_past_env_max_request_bytes_is_a_413_and_a_deep_one_a_400_without_a_traceback(runner):
    """Before: a 10 MB message was parsed, rendered and tokenised under the sessions' lock (26-61 s), and a deeply
    nested body was a 500 with uvicorn's 64-line traceback on the console."""
    seen = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = seen.append
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(handler)
    url = runner.server.url + "/v1/chat/completions"
    try:
        with configured(runner, max_request_bytes=4096):
            big = httpx.post(url, json={"messages": [{"role": "user", "content": "x" * 5000}]}, timeout=60)
        nested = httpx.post(url, content=b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", timeout=60)
        parsed_but_deep = httpx.post(url, json={"messages": [{"role": "user", "content": "1"}], "x": _nested(70)}, timeout=60)
    finally:
        uvicorn_log.removeHandler(handler)
    assert big.status_code == 413 and "env.max_request_bytes=4096" in big.json()["error"]["message"]
    for answer in (nested, parsed_but_deep):
        assert answer.status_code == 400 and "deeper than 64" in answer.json()["error"]["message"]
    assert not [r for r in seen if r.levelno >= logging.ERROR], [r.getMessage() for r in seen]


class OwnedLock:
    """The sessions' lock, knowing which thread holds it."""

    def __init__(self, lock) -> None:
        self.lock, self.owner = lock, None

    def __enter__(self):
        self.lock.acquire()
        self.owner = threading.get_ident()

    def __exit__(self, *exc) -> None:
        self.owner = None
        self.lock.release()

    def held_here(self) -> bool:
        return self.owner == threading.get_ident()


class WatchedTokenizer:
    """The run's tokenizer, noting for each rendering or tokenising call whether the sessions' lock was held."""

    def __init__(self, tokenizer, lock: OwnedLock) -> None:
        self._tokenizer, self._lock, self.calls = tokenizer, lock, []

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        self.calls.append(("tokenize", self._lock.held_here()))
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls.append(("apply_chat_template", self._lock.held_here()))
        return self._tokenizer.apply_chat_template(*args, **kwargs)


def test_a_request_is_rendered_and_tokenised_outside_the_sessions_lock(runner, generator, tokenizer):
    """Before: a request's messages were rendered and tokenised under the one lock every session shares, so a big
    body (up to `env.max_request_bytes`) stalled every other agent's requests and the serving thread for seconds."""
    lock = OwnedLock(runner.lock)
    watched = WatchedTokenizer(runner.render.tokenizer, lock)

    async def agent(task, client):
        llm = client_of(client)
        first = [{"role": "user", "content": task.prompt}]
        reply = await llm.chat.completions.create(model=client.model, messages=first)  # a first request
        later = first + [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "and?"}]
        await llm.chat.completions.create(model=client.model, messages=later)  # extends the chain
        await llm.completions.create(model=client.model, prompt=task.prompt)  # a text prompt
        return 1.0

    saved = runner.lock, runner.render.tokenizer
    runner.lock, runner.render.tokenizer = lock, watched
    try:
        episodes = play(runner, generator, tokenizer, agent, group_size=2, problems=((1, 2),))
    finally:
        runner.lock, runner.render.tokenizer = saved
    assert all(not ep.failed for ep in episodes)
    assert {name for name, _ in watched.calls} == {"tokenize", "apply_chat_template"}
    assert not [name for name, held in watched.calls if held], watched.calls


def _nested(depth: int):
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


def test_posted_rewards_obey_the_reward_functions_bound_per_post_and_summed(runner, generator, tokenizer):
    """Before: 1e308 posted twice summed to inf and was trained on."""
    answers = {}

    async def agent(task, client):
        await client_of(client).chat.completions.create(model=client.model, messages=[{"role": "user", "content": task.prompt}])
        async with httpx.AsyncClient(timeout=60) as http:
            posts = {3: [1e308, 1e308], 7: [6e5, 6e5], 11: [6e5]}[task.label]
            answers[task.label] = [(await http.post(client.reward_url, json={"reward": r}, headers=client.headers)).status_code
                                   for r in posts]
        return {3: 1.0, 7: None, 11: 6e5}[task.label]

    episodes = play(runner, generator, tokenizer, agent, group_size=1, problems=((1, 2), (3, 4), (5, 6)))
    assert answers == {3: [400, 400], 7: [200, 400], 11: [200]}
    by_label = {ep.task.ground_truth: ep for ep in episodes}
    assert by_label[3].episode_return == 1.0 and by_label[7].episode_return == 6e5
    assert by_label[11].failed and f"|sum| <= {MAX_ABS_SCORE:g}" in by_label[11].error
    assert runner.last_metrics["env/no_reward_episodes"] == 1


def test_listening_beyond_the_loopback_is_said_plainly(tokenizer):
    """Before: env.host=0.0.0.0 served every interface without a word."""
    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = seen.append
    logging.getLogger("rlhf").addHandler(handler)
    try:
        for host in ("0.0.0.0", "127.0.0.1"):
            cfg = OpenAIAgentConfig(name="openai_agent", chat_template="plain", host=host, port=0)
            AgentRunner(SimpleNamespace(run=None), cfg, tokenizer, tokenizer.eos_token_id).close()
    finally:
        logging.getLogger("rlhf").removeHandler(handler)
    warnings = [r.getMessage() for r in seen if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "env.host=0.0.0.0" in warnings[0] and "env.host=127.0.0.1" in warnings[0]
