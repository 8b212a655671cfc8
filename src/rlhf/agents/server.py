"""The HTTP side of the endpoint: OpenAI's routes on FastAPI, served by uvicorn in a thread of the run.

Routes, each also under ``/sessions/<id>`` (a session's own base URL; without it, the session is the one whose key
is the ``Authorization: Bearer`` token):

- ``POST /v1/chat/completions``: messages, tools, tool_choice (auto, none), temperature and top_p (the run's
  values only), max_tokens, n, stop, stream (server-sent events, with stream_options.include_usage), logprobs (the
  sampled tokens'); other fields as `rlhf.agents.fields` sorts them (ignored, or refused unless neutral);
- ``POST /v1/completions``: a text prompt, and logprobs=0 for the sampled tokens' logprobs;
- ``GET /v1/models``: the one model served (`env.model_name`; under a session's URL, for that session's key only);
- ``POST /sessions/<id>/reward``: ``{"reward": x, "finished": false}`` adds ``x`` to the episode's reward;
  ``finished: true`` ends the episode.

Every answer carries ``policy_version`` (also as the header ``x-policy-version``). Errors follow OpenAI's shape
(``{"error": {"message", "type", "param"}}``) with 400 (a bad field, named; a body nested too deep), 401 (no key, or
not the session's: under ``/sessions/<id>`` the bearer token must be that session's key), 404 (an unknown session or
model), 410 (a session that has ended) or 413 (a body over `env.max_request_bytes`), none of which the OpenAI SDK
retries.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
import threading
import time
import uuid
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from rlhf.agents.messages import RequestError
from rlhf.agents.sessions import Choice, Reply
from rlhf.errors import ConfigError

log = logging.getLogger("rlhf")

MAX_JSON_DEPTH = 64  # arrays and objects nested deeper in a request body are refused (a chat request with tools: about 10)


def error_response(err: RequestError) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error", 410: "session_closed"}.get(err.status, "invalid_request_error")
    body = {"error": {"message": str(err), "type": kind, "param": err.field, "code": None}}
    return JSONResponse(body, status_code=err.status)


def chat_body(reply: Reply, model: str, token_text: Callable[[int], str] | None = None) -> dict[str, Any]:
    """A chat completion object for ``reply``; with ``token_text`` (a token id -> its text), each choice's logprobs."""
    choices = []
    for k, choice in enumerate(reply.choices):
        message: dict[str, Any] = {"role": "assistant", "content": choice.message.content}
        if choice.message.tool_calls:
            message["tool_calls"] = [c.as_openai() for c in choice.message.tool_calls]
            message["content"] = choice.message.content or None
        logprobs = None if token_text is None else {"content": token_logprobs(choice, token_text), "refusal": None}
        choices.append({"index": k, "message": message, "finish_reason": choice.finish_reason, "logprobs": logprobs})
    return _envelope("chat.completion", reply, model, choices)


def token_logprobs(choice: Choice, token_text: Callable[[int], str]) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content`` of a chat choice: each sampled token (as trained, so the stop token too), its
    text, the UTF-8 bytes of that text and the generator's logprob; no alternatives (they are not recorded)."""
    return [
        {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")), "top_logprobs": []}
        for text, logprob in zip(token_texts(choice, token_text), choice.logprobs)
    ]


def token_texts(choice: Choice, token_text: Callable[[int], str]) -> list[str]:
    """The text of each token ``choice`` sampled (``token_text``: a token id -> its text)."""
    return [token_text(t) for t in choice.token_ids]


def completion_body(reply: Reply, model: str, token_text: Callable[[int], str] | None = None) -> dict[str, Any]:
    """A text completion object for ``reply``; with ``token_text``, each choice's logprobs in the completions shape
    (``top_logprobs`` holds the sampled token alone, as ``logprobs: 0`` asks)."""
    choices = []
    for k, choice in enumerate(reply.choices):
        logprobs = None
        if token_text is not None:
            texts = token_texts(choice, token_text)
            offsets = list(itertools.accumulate(map(len, texts), initial=0))[:-1]  # where each token's text starts
            logprobs = {"tokens": texts, "token_logprobs": choice.logprobs, "text_offset": offsets,
                        "top_logprobs": [{text: logprob} for text, logprob in zip(texts, choice.logprobs)]}
        choices.append({"index": k, "text": choice.message.content, "finish_reason": choice.finish_reason, "logprobs": logprobs})
    return _envelope("text_completion", reply, model, choices)


def _envelope(kind: str, reply: Reply, model: str, choices: list) -> dict[str, Any]:
    completion = sum(c.completion_tokens for c in reply.choices)
    usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": completion, "total_tokens": reply.prompt_tokens + completion}
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()), "model": model,
        "choices": choices, "usage": usage, "policy_version": reply.version,
    }


def chat_events(body: dict[str, Any], usage_chunk: bool = False):
    """A chat completion as OpenAI's stream: one chunk per choice with its whole reply (and its logprobs), one with
    its finish reason, then (``usage_chunk``: stream_options.include_usage) one with the usage and no choices, then
    ``[DONE]`` (the reply is sampled whole before it is sent)."""
    base = {k: body[k] for k in ("id", "created", "model", "policy_version")} | {"object": "chat.completion.chunk"}
    if usage_chunk:
        base["usage"] = None  # on every chunk but the last, as OpenAI sends it
    for choice in body["choices"]:
        delta = dict(choice["message"])
        for k, call in enumerate(delta.get("tool_calls") or ()):
            call["index"] = k
        index = choice["index"]
        yield _event(base | {"choices": [{"index": index, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}]})
        yield _event(base | {"choices": [{"index": index, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}]})
    if usage_chunk:
        yield _event(base | {"choices": [], "usage": body["usage"]})
    yield "data: [DONE]\n\n"


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def make_app(hub) -> FastAPI:
    """The routes, answering through ``hub`` (`rlhf.agents.endpoint.AgentRunner`)."""
    app = FastAPI(title="rlhf agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    async def answer(request: Request, session_id: str | None, route: str):
        try:
            body = await _json(request, hub.cfg.max_request_bytes)
            session = hub.session_for(session_id, request.headers.get("authorization"))
            pending, limits = hub.submit(session, route, body)
            reply = await asyncio.wrap_future(pending) if not isinstance(pending, Reply) else pending
        except ClientDisconnect:
            return _gone(request)
        except RequestError as err:
            return error_response(err)
        token_text = hub.render.token_text if limits.logprobs else None
        if route == "completions":
            return JSONResponse(completion_body(reply, hub.model_name, token_text), headers=_version(reply))
        out = chat_body(reply, hub.model_name, token_text)
        if limits.stream:
            return StreamingResponse(chat_events(out, limits.usage_chunk), media_type="text/event-stream", headers=_version(reply))
        return JSONResponse(out, headers=_version(reply))

    def routes(route: str):
        """The handlers of ``route``: on the plain /v1 path (session by key) and under a session's own URL."""

        async def by_key(request: Request):
            return await answer(request, None, route)

        async def in_session(session_id: str, request: Request):
            return await answer(request, session_id, route)

        return by_key, in_session

    for route, path in (("chat", "chat/completions"), ("completions", "completions")):
        by_key, in_session = routes(route)
        app.post(f"/v1/{path}")(by_key)
        app.post(f"/sessions/{{session_id}}/v1/{path}")(in_session)

    def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": hub.model_name, "object": "model", "created": 0, "owned_by": "rlhf"}]})

    def session_models(session_id: str, request: Request) -> JSONResponse:
        try:
            hub.check_key(session_id, request.headers.get("authorization"))
        except RequestError as err:
            return error_response(err)
        return models()

    app.get("/v1/models")(models)
    app.get("/sessions/{session_id}/v1/models")(session_models)

    @app.post("/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request):
        try:
            body = await _json(request, hub.cfg.max_request_bytes)
            hub.post_reward(hub.session_for(session_id, request.headers.get("authorization")), body)
        except ClientDisconnect:
            return _gone(request)
        except RequestError as err:
            return error_response(err)
        return JSONResponse({"ok": True})

    return app


def _gone(request: Request) -> Response:
    """The answer to a request whose client left before its body arrived (an agent that was stopped or gave up, e.g.
    after its episode ended): nobody reads it, so a debug line rather than uvicorn's traceback."""
    log.debug("agent endpoint: the client of %s %s disconnected before sending its body", request.method, request.url.path)
    return Response(status_code=499)


async def _json(request: Request, max_bytes: int) -> dict:
    """The request's JSON object, or RequestError: 413 for a body over ``max_bytes`` (`env.max_request_bytes`; the
    rest is read and dropped, so the client gets the answer), 400 for one that is not JSON, not an object, or nests
    deeper than `MAX_JSON_DEPTH`."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= max_bytes:
            chunks.append(chunk)
    if size > max_bytes:
        raise RequestError(f"the request body is {size} bytes, over env.max_request_bytes={max_bytes}; send less (cut "
                           f"long tool outputs), or raise env.max_request_bytes", 413)
    too_deep = RequestError(f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH}")
    try:
        body = json.loads(b"".join(chunks) or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body is not JSON: {err}") from None
    except RecursionError:  # Python's parser gives up near 1000 levels
        raise too_deep from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if _depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise too_deep
    return body


def _depth(value: Any, limit: int) -> int:
    """How deep ``value`` nests lists and dicts (a scalar: 0), counted up to ``limit + 1``, without recursion."""
    level, depth = [value], 0
    while depth <= limit:
        level = [x for x in level if isinstance(x, (list, dict))]
        if not level:
            return depth
        depth += 1
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x)]
    return depth


def _version(reply: Reply) -> dict[str, str]:
    return {"x-policy-version": "" if reply.version is None else str(reply.version)}


class Server:
    """uvicorn serving ``app`` on ``host:port`` in a daemon thread; the socket is bound here, so a taken port is a
    ConfigError naming `env.port` at once."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError as err:
            self.socket.close()
            raise ConfigError(f"env.host={host} env.port={port}: cannot listen there ({err}); choose another port, or env.port=0 for a free one") from None
        self.host, self.port = host, self.socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True, name="rlhf-agent-endpoint")
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {host}:{self.port}")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()
