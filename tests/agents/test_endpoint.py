"""The endpoint for real: uvicorn on the loopback, the real `openai` SDK as the agents' client, the real HF generator
on the tiny model. Rows hold exactly what the generator sampled (logprobs checked against the model), requests of
concurrent agents share generate calls, and every fault loses at most its own episode, counted."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import socket
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf.agents.endpoint import PLAIN_TEMPLATE, AgentRunner, OpenAIAgentConfig, OpenAIAgentMaker
from rlhf.envs.rows import episode_rows
from rlhf.errors import ConfigError

from endpoint_play import client_of, play


async def ask_twice(task, client):
    llm = client_of(client)
    messages = [{"role": "user", "content": task.prompt}]
    first = await llm.chat.completions.create(model=client.model, messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": task.prompt}]
    second = await llm.chat.completions.create(model=client.model, messages=messages)
    return float(second.choices[0].message.content.strip() == str(task.label))


def test_rows_hold_exactly_what_the_generator_sampled(runner, generator, tokenizer, tiny_model_dir):
    episodes = play(runner, generator, tokenizer, ask_twice)
    assert len(episodes) == 4 and not any(ep.failed for ep in episodes)
    assert [ep.group for ep in episodes] == [0, 0, 1, 1]
    for ep in episodes:
        asked_again = tokenizer(ep.task.text, add_special_tokens=False)["input_ids"]
        closing = [] if ep.turns[0].stopped else [tokenizer.eos_token_id]  # a reply cut short: the template's EOS is observed
        assert len(ep.turns) == 2 and ep.turns[1].observation_ids == closing + asked_again
        assert ep.turns[0].observation_ids == list(ep.task.token_ids)  # <bos>1+2= as the dataset tokenises it
    # four sessions, two requests each: one generate call per turn, all four agents' requests in it
    assert runner.last_metrics["env/generate_calls"] == 2 and runner.last_metrics["env/generated_rows"] == 8
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for ep in episodes:
        ids = torch.tensor(ep.token_ids())
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0].float(), dim=-1)
        start, sampled, expected = 0, [], []
        for turn in ep.turns:
            start += len(turn.observation_ids)
            for k, token in enumerate(turn.action_ids):
                expected.append(logp[start + k - 1, token].item())
            sampled += turn.action_logp
            start += len(turn.action_ids)
        assert sampled == pytest.approx(expected, abs=1e-4)  # the generator's logprobs, never zero-filled
    rows = episode_rows(episodes, "sum", tokenizer.pad_token_id)
    assert rows.gen_logp[rows.loss_mask.bool()].tolist() == [x for ep in episodes for t in ep.turns for x in t.action_logp]


def test_a_retried_request_gets_the_recorded_reply_and_no_orphan_row(runner, generator, tokenizer):
    async def retries(task, client):
        body = {"model": client.model, "messages": [{"role": "user", "content": task.prompt}]}
        async with httpx.AsyncClient() as http:
            first, second = await asyncio.gather(*(http.post(f"{client.base_url}/chat/completions", json=body, headers=client.headers) for _ in range(2)))
            third = await http.post(f"{client.base_url}/chat/completions", json=body, headers=client.headers)
        answers = [r.json()["choices"][0]["message"]["content"] for r in (first, second, third)]
        assert answers[0] == answers[1] == answers[2]
        return 1.0

    episodes = play(runner, generator, tokenizer, retries, group_size=1, problems=((1, 2),))
    assert len(episodes) == 1 and len(episodes[0].turns) == 1
    assert runner.last_metrics["env/retried_requests"] == 2 and runner.last_metrics["env/forked_chains"] == 0


def test_streaming_completions_models_and_the_bearer_key_route(runner, generator, tokenizer):
    seen = {}

    async def many_routes(task, client):
        plain = openai.AsyncOpenAI(base_url=client.base_url.split("/sessions/")[0] + "/v1", api_key=client.api_key, max_retries=0)
        seen["models"] = [m.id async for m in plain.models.list()]
        stream = await plain.chat.completions.create(model=client.model, messages=[{"role": "user", "content": task.prompt}], stream=True)
        chunks = [chunk async for chunk in stream]
        seen["streamed"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        seen["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        done = await client_of(client).completions.create(model=client.model, prompt="5+5=")
        seen["completion"] = done.choices[0].text
        seen["version"] = done.model_extra.get("policy_version", "missing")
        return 0.0

    episodes = play(runner, generator, tokenizer, many_routes, group_size=1, problems=((1, 2),))
    assert seen["models"] == ["policy"] and seen["finish"] and seen["finish"][0] in ("stop", "length")
    assert seen["version"] is None or isinstance(seen["version"], int)
    (ep,) = episodes
    assert ep.turns[-1].action == seen["completion"]  # env.chains=last: the completions chain came last


def test_n_choices_and_concurrent_requests_in_one_session(runner, generator, tokenizer):
    async def branches(task, client):
        llm = client_of(client)
        asked = [{"role": "user", "content": task.prompt}]
        many = await llm.chat.completions.create(model=client.model, messages=asked, n=3)
        assert len(many.choices) == 3
        pick = many.choices[2].message.content
        await asyncio.gather(*(
            llm.chat.completions.create(model=client.model, messages=asked + [{"role": "assistant", "content": pick}, {"role": "user", "content": q}])
            for q in ("1=", "2=")
        ))
        return 1.0

    episodes = play(runner, generator, tokenizer, branches, group_size=1, problems=((1, 2),))
    assert not episodes[0].failed
    assert runner.last_metrics["env/forked_chains"] == 1  # the second concurrent request on one chain forked it


def test_bad_requests_are_answered_with_the_field_named_and_the_episode_goes_on(runner, generator, tokenizer):
    errors = {}

    async def hostile(task, client):
        llm = client_of(client)
        asked = [{"role": "user", "content": task.prompt}]
        for name, call in {
            "temperature": llm.chat.completions.create(model=client.model, messages=asked, temperature=0.3),
            "model": llm.chat.completions.create(model="gpt-9", messages=asked),
            "role": llm.chat.completions.create(model=client.model, messages=[{"role": "robot", "content": "x"}]),
        }.items():
            try:
                await call
            except openai.APIStatusError as err:
                errors[name] = (err.status_code, str(err))
        async with httpx.AsyncClient() as http:
            bad = await http.post(f"{client.base_url}/chat/completions", content=b"{not json")
            errors["json"] = (bad.status_code, bad.text)
            nobody = await http.post(client.base_url.split("/sessions/")[0] + "/v1/chat/completions", json={"messages": asked})
            errors["no key"] = (nobody.status_code, nobody.text)
            unknown = await http.post(client.base_url.split("/sessions/")[0] + "/sessions/nope/v1/chat/completions", json={"messages": asked})
            errors["unknown"] = (unknown.status_code, unknown.text)
            for name, body in (("rewrad", {"rewrad": 1.0}), ("empty reward", {})):  # before: a reward of 0, silently
                posted = await http.post(client.reward_url, json=body, headers=client.headers)
                errors[name] = (posted.status_code, posted.text)
        reply = await llm.chat.completions.create(model=client.model, messages=asked)
        return float(reply.choices[0].message.content == "3")

    episodes = play(runner, generator, tokenizer, hostile, group_size=1, problems=((1, 2),))
    assert not episodes[0].failed
    assert errors["temperature"][0] == 400 and "generator.temperature" in errors["temperature"][1]
    assert errors["model"][0] == 404 and "'policy'" in errors["model"][1]
    assert errors["role"][0] == 400 and "messages[0].role" in errors["role"][1]
    assert errors["json"][0] == 400 and "not JSON" in errors["json"][1]
    assert errors["no key"][0] == 401 and errors["unknown"][0] == 404
    assert errors["rewrad"][0] == 400 and "unrecognized field 'rewrad'; did you mean 'reward'?" in errors["rewrad"][1]
    assert errors["empty reward"][0] == 400 and "an empty reward body" in errors["empty reward"][1]
    assert runner.last_metrics["env/rejected_requests"] == 3


def test_agent_faults_lose_their_own_episode_counted_and_late_calls_get_410(runner, generator, tokenizer):
    late = {}

    async def agent(task, client):
        llm = client_of(client, timeout=30)
        reply = await llm.chat.completions.create(model=client.model, messages=[{"role": "user", "content": task.prompt}])
        late["client"] = client
        if task.label == 3:
            raise KeyError("the agent broke")
        if task.label == 7:
            await asyncio.sleep(3600)  # hangs
        if task.label == 11:
            return None  # posts no reward
        if task.label == 13:
            async with httpx.AsyncClient() as http:
                await http.post(client.reward_url, json={"reward": 0.25, "finished": True}, headers=client.headers)
            return None
        return float(reply.choices[0].message.content == str(task.label))

    # only the hanging agent goes quiet this long, even on a loaded machine (the others wait for replies or return)
    cfg = OpenAIAgentConfig(**{**vars(runner.cfg), "step_timeout_s": 10.0})
    saved = runner.cfg
    try:
        episodes = play(runner, generator, tokenizer, agent, group_size=1, cfg=cfg, problems=((1, 2), (3, 4), (5, 6), (6, 7), (4, 5)))
    finally:
        runner.cfg = saved
    failed = {ep.task.ground_truth: ep.error for ep in episodes if ep.failed}
    assert set(failed) == {3, 7, 11}
    assert "KeyError" in failed[3] and "env.step_timeout_s" in failed[7] and "no reward" in failed[11]
    kept = [ep for ep in episodes if not ep.failed]
    assert len(episodes) - len(kept) == 3 and sorted(ep.task.ground_truth for ep in kept) == [9, 13]
    assert next(ep for ep in kept if ep.task.ground_truth == 13).episode_return == 0.25
    m = runner.last_metrics
    assert (m["env/raised_episodes"], m["env/timed_out_episodes"], m["env/no_reward_episodes"]) == (1, 1, 1)
    after = httpx.post(late["client"].base_url + "/chat/completions", json={"messages": [{"role": "user", "content": "1"}]},
                       headers=late["client"].headers, timeout=30)
    assert after.status_code == 410 and "ended" in after.json()["error"]["message"]


def test_a_request_that_fills_env_max_tokens_loses_its_episode_naming_the_key(runner, generator, tokenizer):
    """Before: "the agent asked the endpoint for nothing", though it asked and got an empty reply: no room was left."""
    replies = []

    async def agent(task, client):
        reply = await client_of(client).chat.completions.create(model=client.model, messages=[{"role": "user", "content": task.prompt}])
        replies.append((reply.choices[0].message.content, reply.choices[0].finish_reason))
        return 1.0

    saved = runner.cfg
    runner.cfg = OpenAIAgentConfig(**{**vars(saved), "max_tokens": 3})
    try:
        episodes = play(runner, generator, tokenizer, agent, group_size=1, problems=((1, 2),))
    finally:
        runner.cfg = saved
    assert replies == [("", "length")] and episodes[0].failed
    assert "fills env.max_tokens=3" in episodes[0].error and "raise env.max_tokens above" in episodes[0].error
    assert "asked the endpoint for nothing" not in episodes[0].error


@pytest.mark.parametrize("path", ["/sessions/any/reward", "/v1/chat/completions"])
def test_a_client_that_disconnects_before_its_body_arrives_is_no_traceback(runner, path):
    """Before: each such request printed uvicorn's 50-line "Exception in ASGI application ... ClientDisconnect"."""
    seen = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = seen.append
    loggers = [logging.getLogger("uvicorn.error"), logging.getLogger("rlhf")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    try:
        host, port = runner.server.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 100\r\n\r\n{{\"reward\"".encode())
            time.sleep(0.3)  # the handler is reading the body when the client leaves
        deadline = time.monotonic() + 60  # event-driven: until the server has handled the disconnect
        while not any("disconnected before sending its body" in r.getMessage() for r in seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(runner.server.url + "/v1/models", timeout=10).status_code == 200  # still serving
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
    assert any(f"disconnected before sending its body" in r.getMessage() and path in r.getMessage() for r in seen)
    assert not [r for r in seen if r.levelno >= logging.WARNING], [r.getMessage() for r in seen]


def test_a_taken_port_is_a_config_error_naming_env_port(tokenizer):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = OpenAIAgentConfig(name="openai_agent", chat_template="plain", port=port)
        with pytest.raises(ConfigError, match=f"env.port={port}"):
            AgentRunner(SimpleNamespace(run=None), cfg, tokenizer, tokenizer.eos_token_id)


def test_a_tokenizer_without_a_chat_template_is_refused_with_the_fix(tokenizer):
    with pytest.raises(ConfigError, match="env.chat_template"):
        AgentRunner(SimpleNamespace(run=None), OpenAIAgentConfig(name="openai_agent"), tokenizer, tokenizer.eos_token_id)


@pytest.mark.parametrize("value, message", [
    ("nosuch.jinja", "env.chat_template=nosuch.jinja: no such file"),
    ("templates/nosuch", "env.chat_template=templates/nosuch: no such file"),
    ("plian", "env.chat_template='plian' is not a template; choose null"),
])
def test_a_missing_chat_template_file_or_misspelt_name_is_a_config_error_before_models_load(value, message):
    """Before: `nosuch.jinja` was taken as an inline template and failed as "renders an assistant message differently"."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        OpenAIAgentConfig(name="openai_agent", chat_template=value).check("env")


def test_a_jinja_file_is_an_env_chat_template_as_it_is_a_dataset_one(tmp_path, tokenizer):
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN_TEMPLATE)
    cfg = OpenAIAgentConfig(name="openai_agent", chat_template=str(path), port=0)
    cfg.check("env")
    runner = AgentRunner(SimpleNamespace(run=None), cfg, tokenizer, tokenizer.eos_token_id)
    try:
        assert runner.render.chat_template == PLAIN_TEMPLATE
    finally:
        runner.close()


@pytest.mark.parametrize("text, message", [
    (None, "needs env.path"),
    ("def step(x): pass\n", "defines no `run`"),
    ("def run(task): pass\n", "cannot be called as"),
    ("raise ValueError('boom')\n", "failed to load"),
])
def test_a_bad_agent_file_is_a_config_error_naming_env_path(tmp_path, text, message):
    path = None
    if text is not None:
        path = tmp_path / "agent.py"
        path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        OpenAIAgentMaker(cfg=OpenAIAgentConfig(name="openai_agent", path=None if path is None else str(path)))


def test_a_plain_function_agent_with_the_sync_client_and_one_that_exits(runner, generator, tokenizer):
    """`def run` runs in a worker thread (the synchronous SDK works); SystemExit inside an agent loses its episode
    only: the agents' event loop and the other agents go on."""

    def sync_agent(task, client):
        llm = openai.OpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
        reply = llm.chat.completions.create(model=client.model, messages=[{"role": "user", "content": task.prompt}])
        return float(reply.choices[0].message.content == str(task.label))

    async def exiting(task, client):
        await client_of(client).chat.completions.create(model=client.model, messages=[{"role": "user", "content": task.prompt}])
        if task.label == 7:
            raise SystemExit(3)
        return 1.0

    assert not any(ep.failed for ep in play(runner, generator, tokenizer, sync_agent, group_size=2))
    episodes = play(runner, generator, tokenizer, exiting, group_size=1)
    assert [ep.failed for ep in episodes] == [False, True] and "SystemExit" in episodes[1].error
    assert not any(ep.failed for ep in play(runner, generator, tokenizer, exiting, group_size=1, problems=((1, 2), (2, 2))))


def test_env_chains_all_trains_every_chain_of_a_session_in_its_group(runner, generator, tokenizer):
    """A session whose agent rewrote a reply holds two chains: `env.chains=last` trains the fork (the chain the last
    request extended), `all` trains both, each in the task's group with the session's reward."""

    async def rewriting(task, client):
        llm = client_of(client)
        asked = [{"role": "user", "content": task.prompt}]
        await llm.chat.completions.create(model=client.model, messages=asked)
        await llm.chat.completions.create(model=client.model, messages=asked + [
            {"role": "assistant", "content": "99"}, {"role": "user", "content": task.prompt}])
        return 0.5

    saved = runner.cfg
    try:
        last = play(runner, generator, tokenizer, rewriting, group_size=2, problems=((1, 2),))
        runner.cfg = OpenAIAgentConfig(**{**vars(saved), "chains": "all"})
        every = play(runner, generator, tokenizer, rewriting, group_size=2, problems=((1, 2),))
    finally:
        runner.cfg = saved
    assert len(last) == 2 and len(every) == 4 and {ep.group for ep in every} == {0}
    assert all(ep.episode_return == 0.5 for ep in every)
    assert all(len(ep.turns) == 1 for ep in last)  # the fork: its history (with the rewritten "99") is one observation
    assert sorted(len(ep.turns) for ep in every) == [1, 1, 1, 1]
    assert runner.last_metrics["env/forked_chains"] == 2 and runner.last_metrics["env/rewritten_messages"] == 2


def test_logprobs_served_are_the_ones_each_row_trains_on(runner, generator, tokenizer):
    """Before: logprobs=true was refused (400) and completions' logprobs=0 answered with null. Each choice's
    logprobs (chat, streamed chat, completions) are its sampled tokens and the generator's logprobs of them, exactly
    what its row trains on; the stream ends with the usage chunk stream_options.include_usage asks for."""
    served, seen = [], {}

    async def asks_for_logprobs(task, client):
        llm = client_of(client)
        asked = [{"role": "user", "content": task.prompt}]
        plain = await llm.chat.completions.create(model=client.model, messages=asked)
        seen["plain"] = plain.choices[0].logprobs
        asked += [{"role": "assistant", "content": plain.choices[0].message.content}, {"role": "user", "content": "1="}]
        both = await llm.chat.completions.create(model=client.model, messages=asked, logprobs=True, top_logprobs=0, n=2)
        for choice in both.choices:
            served.append([(t.token, t.logprob, t.bytes, t.top_logprobs) for t in choice.logprobs.content])
        again = asked + [{"role": "assistant", "content": both.choices[0].message.content}, {"role": "user", "content": "2="}]
        stream = await llm.chat.completions.create(model=client.model, messages=again, logprobs=True, stream=True,
                                                   stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        served.append([(t.token, t.logprob, t.bytes, t.top_logprobs) for c in chunks for ch in c.choices
                       if ch.logprobs for t in ch.logprobs.content])
        seen["usage"] = chunks[-1].usage if not chunks[-1].choices else None
        done = await llm.completions.create(model=client.model, prompt="5+5=", logprobs=0)
        lp = done.choices[0].logprobs
        seen["completion"] = (lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset)
        return 1.0

    saved = runner.cfg
    runner.cfg = OpenAIAgentConfig(**{**vars(saved), "chains": "all"})
    try:
        episodes = play(runner, generator, tokenizer, asks_for_logprobs, group_size=1, problems=((1, 2),))
    finally:
        runner.cfg = saved
    assert seen["plain"] is None  # not asked: not sent

    def texts(ids):
        return [tokenizer.decode([i]) for i in ids]

    # rows: the chat chain (its unasked first reply, the n=2 request's choice 0, the streamed reply), choice 1's twin
    # of it, and the completions chain (one reply)
    assert sorted(len(ep.turns) for ep in episodes) == [1, 2, 3]
    chat_trained = sorted((texts(t.action_ids), t.action_logp) for ep in episodes for t in ep.turns[1:])
    chat_served = sorted(([t for t, *_ in s], [lp for _, lp, *_ in s]) for s in served)
    assert chat_served == chat_trained
    tokens, logprobs, top, offsets = seen["completion"]
    (completion,) = [ep.turns[0] for ep in episodes if len(ep.turns) == 1]
    assert (tokens, logprobs) == (texts(completion.action_ids), completion.action_logp)
    assert top == [{text: logprob} for text, logprob in zip(tokens, logprobs)]
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    assert all(b == list(t.encode()) and alternatives == [] for s in served for t, _, b, alternatives in s)
    assert all(math.isfinite(lp) and lp <= 0 for s in served for _, lp, *_ in s)
    assert seen["usage"] is not None and seen["usage"].completion_tokens == len(served[-1])


def test_unknown_and_unhonoured_fields_get_a_400_naming_them_and_bookkeeping_fields_pass(runner, generator, tokenizer):
    """Before: a field the endpoint did not read was accepted and ignored: a misspelt `temprature`, a JSON
    response_format or vLLM's top_k were answered with a reply sampled freely, and trained on."""
    errors, replies = {}, []

    async def agent(task, client):
        llm = client_of(client)
        asked = [{"role": "user", "content": task.prompt}]
        for name, options in {
            "temprature": {"extra_body": {"temprature": 0.2}},
            "response_format": {"response_format": {"type": "json_object"}},
            "top_k": {"extra_body": {"top_k": 5}},
            "top_logprobs": {"logprobs": True, "top_logprobs": 3},
        }.items():
            try:
                await llm.chat.completions.create(model=client.model, messages=asked, **options)
            except openai.BadRequestError as err:
                errors[name] = (err.param, err.message)
        reply = await llm.chat.completions.create(  # what SDKs and agent frameworks send besides: ignored
            model=client.model, messages=asked, user="u1", metadata={"episode": "1"}, store=False, seed=7,
            service_tier="auto", parallel_tool_calls=True, stream_options={"include_usage": True},
            response_format={"type": "text"}, presence_penalty=0, extra_body={"top_k": -1},
        )
        replies.append(reply.choices[0].message.content)
        return 1.0

    episodes = play(runner, generator, tokenizer, agent, group_size=1, problems=((1, 2),))
    assert not episodes[0].failed and len(replies) == 1
    assert set(errors) == {"temprature", "response_format", "top_k", "top_logprobs"}
    assert {name: param for name, (param, _) in errors.items()} == {name: name for name in errors}
    assert "did you mean 'temperature'?" in errors["temprature"][1]
    assert "constrained decoding" in errors["response_format"][1] and "sampling" in errors["top_k"][1]
    assert runner.last_metrics["env/rejected_requests"] == 4
