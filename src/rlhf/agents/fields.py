"""A request body's fields, each served, ignored or refused by name.

Every field of OpenAI's chat completions and completions requests (and the sampling extensions vLLM adds, which
agents written for vLLM send) is one of:

- served: read here (`read_limits`, `read_tools`) or by the endpoint (``model``, ``messages``, ``prompt``);
- ignored: it changes neither what is sampled nor what is answered here (``user``, ``metadata``, ``store``,
  ``seed``, ...), so agents and SDKs that send it work unchanged;
- refused unless neutral: it would change what is sampled or answered, and this endpoint does not honour it; a
  value other than null or the neutral one is a 400 naming the field and why. Serving the request anyway would
  train on a sample drawn other than the agent asked, silently.

A field in none of these is refused as OpenAI refuses it ("unrecognized request argument"), with the known field it
resembles, so a misspelt ``temprature`` is not sampled at the run's temperature without a word.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from rlhf.agents.messages import RequestError, resembling

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

_SERVED = {
    "chat": ("model", "messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens", "max_completion_tokens",
             "n", "stop", "stream", "stream_options", "temperature", "top_p", "logprobs", "top_logprobs"),
    "completions": ("model", "prompt", "max_tokens", "n", "stop", "stream", "stream_options", "temperature", "top_p",
                    "logprobs"),
}
_IGNORED = {  # bookkeeping, caching and determinism hints: the sample and the answer are the same without them
    "chat": ("user", "metadata", "store", "seed", "service_tier", "safety_identifier", "prompt_cache_key",
             "prompt_cache_retention", "prompt_cache_options", "prediction", "request_id", "priority"),
    "completions": ("user", "seed", "request_id", "priority"),
}
_SAMPLING = "would change the sampling the policy is trained on"
_UNLESS_NEUTRAL: dict[str, tuple[tuple, str]] = {  # field -> (neutral values besides null, why any other is refused)
    "frequency_penalty": ((0,), _SAMPLING),
    "presence_penalty": ((0,), _SAMPLING),
    "logit_bias": (({},), _SAMPLING),
    "repetition_penalty": ((1,), _SAMPLING),  # vLLM's, as are the next five
    "top_k": ((-1, 0), _SAMPLING),
    "min_p": ((0,), _SAMPLING),
    "min_tokens": ((0,), _SAMPLING),
    "ignore_eos": ((False,), _SAMPLING),
    "stop_token_ids": (([],), "is not served; send stop strings (stop)"),
    "skip_special_tokens": ((True,), "replies are decoded without special tokens"),  # vLLM's, as are the next five
    "spaces_between_special_tokens": ((True,), "replies are decoded as vLLM does by default"),
    "include_stop_str_in_output": ((False,), "replies end before the stop string"),
    "return_tokens_as_token_ids": ((False,), "logprobs name tokens by their text"),
    "add_generation_prompt": ((True,), "the chat template always adds the assistant's turn to answer"),
    "continue_final_message": ((False,), "a reply is a new assistant turn, not the last message continued"),
    "response_format": (({"type": "text"},), "asks for constrained decoding, which is not served (the policy samples "
                                             "freely); ask for the format in the messages"),
    "reasoning_effort": ((), "is not served (the chat template is rendered without it)"),
    "verbosity": ((), "is not served"),
    "chat_template_kwargs": (({},), "is not served (the chat template is rendered without extra arguments)"),
    "functions": (([],), "the deprecated functions API is not served; send tools"),
    "function_call": (("none", "auto"), "the deprecated functions API is not served; send tool_choice"),
    "audio": ((), "audio output is not served"),
    "modalities": ((["text"],), "only text is served"),
    "web_search_options": ((), "web search is not served"),
    "moderation": ((), "moderation is not served"),
    "best_of": ((1,), "would sample best_of replies and return the likeliest, not the policy's sample"),
    "echo": ((False,), "echoing the prompt is not served"),
    "suffix": (("",), "insertion (a suffix) is not served"),
}
_COMPLETIONS_ONLY = ("best_of", "echo", "suffix")
_CHAT_ONLY = ("response_format", "reasoning_effort", "verbosity", "chat_template_kwargs", "functions", "function_call",
              "audio", "modalities", "web_search_options", "moderation", "add_generation_prompt", "continue_final_message")


@functools.cache
def known_fields(route: str) -> tuple[str, ...]:
    """Every field a ``route`` request (chat or completions) may carry: served, ignored, or refused unless neutral."""
    elsewhere = _CHAT_ONLY if route == "completions" else _COMPLETIONS_ONLY
    return _SERVED[route] + _IGNORED[route] + tuple(f for f in _UNLESS_NEUTRAL if f not in elsewhere)


def check_fields(body: dict, route: str) -> None:
    """RequestError naming the first field of ``body`` this endpoint does not know, or knows and cannot honour."""
    known = known_fields(route)
    for name, value in body.items():
        if name not in known:
            raise RequestError(_unknown(name, route, known), field_name=name)
        neutral, why = _UNLESS_NEUTRAL.get(name, (None, ""))
        if neutral is not None and value is not None and value not in neutral:
            raise RequestError(f"{name}={value!r}: {why}; leave it out", field_name=name)


def _unknown(name: str, route: str, known: tuple[str, ...]) -> str:
    other = "completions" if route == "chat" else "chat"
    if name in known_fields(other):
        return f"{name!r} is a field of {PATHS[other]}, not of {PATHS[route]}"
    return f"unrecognized field {name!r}{resembling(name, known)} ({PATHS[route]} refuses fields it does not know rather than ignore them)"


REWARD_FIELDS = ("reward", "finished")  # a reward body's (`POST /sessions/<id>/reward`)


def check_reward_fields(body: dict) -> None:
    """RequestError for a reward body with a field other than `REWARD_FIELDS`, or with neither: a misspelt
    ``rewrad`` would otherwise post a reward of 0 without a word."""
    unknown = [name for name in body if name not in REWARD_FIELDS]
    if unknown:
        raise RequestError(f"unrecognized field {unknown[0]!r}{resembling(unknown[0], REWARD_FIELDS)}: a reward body is {{\"reward\": x, \"finished\": "
                           f"false}}", field_name=unknown[0])
    if not body:
        raise RequestError('an empty reward body: send {"reward": x}, {"finished": true}, or both')


@dataclass(frozen=True)
class Limits:
    """What a request asks of the sampling, checked against the run's, and of the answer's shape."""

    max_new_tokens: int  # the request's max_tokens, at most `generator.max_new_tokens`
    n: int  # choices to sample
    stops: tuple[str, ...]  # strings that end a reply
    stream: bool = False  # answer as server-sent events
    logprobs: bool = False  # answer with each sampled token's logprob
    usage_chunk: bool = False  # a streamed answer ends with a chunk holding the usage (stream_options.include_usage)


def read_limits(body: dict, temperature: float, top_p: float, max_new_tokens: int, max_n: int, route: str = "chat") -> Limits:
    """A request's fields (`check_fields`), then its sampling, or RequestError naming the field: temperature and top_p
    may only repeat the run's (`generator.temperature`, `generator.top_p`: the trainer's logprobs assume them);
    max_tokens (or max_completion_tokens) at most the run's `generator.max_new_tokens` is honoured (more is cut to it)."""
    check_fields(body, route)
    for name, run_value, key in (("temperature", temperature, "generator.temperature"), ("top_p", top_p, "generator.top_p")):
        value = body.get(name)
        if value is not None and not (isinstance(value, (int, float)) and abs(value - run_value) < 1e-6):
            raise RequestError(
                f"{name}={value!r}: this run samples with {key}={run_value:g} (the trainer's logprobs assume it); "
                f"leave {name} out or send {run_value:g}", field_name=name,
            )
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    wanted = body.get(name)
    if wanted is None:
        wanted = max_new_tokens
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 1:
        raise RequestError(f"{name}={wanted!r} must be a positive integer", field_name=name)
    stream = _flag(body, "stream")
    if stream and route == "completions":
        raise RequestError(f"stream=true is served on {PATHS['chat']} only; leave it out here", field_name="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(f"stream_options={options!r} must be an object", field_name="stream_options")
    usage = _flag(options, "include_usage", "stream_options.include_usage")
    logprobs = _read_logprobs(body, route)
    return Limits(min(wanted, max_new_tokens), _read_n(body, max_n), _read_stops(body), stream, logprobs, stream and usage)


def _flag(body: dict, name: str, where: str | None = None) -> bool:
    """A true/false field (false when absent or null), or RequestError naming it."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{where or name}={value!r} must be true or false", field_name=where or name)
    return bool(value)


def _read_n(body: dict, max_n: int) -> int:
    """The request's ``n`` (1 when absent or null), or RequestError: an integer from 1 to `env.max_n`."""
    n = body.get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_n:
        raise RequestError(f"n={n!r} must be an integer from 1 to env.max_n={max_n}", field_name="n")
    return n


def _read_stops(body: dict) -> tuple[str, ...]:
    """The request's ``stop`` strings (none when absent, null or empty), or RequestError: a non-empty string or a
    list of up to 4 of them."""
    stop = body.get("stop")
    if stop is None or stop == "" or stop == []:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else None
    if stops is None or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise RequestError(f"stop={stop!r} must be a non-empty string or a list of up to 4 of them", field_name="stop")
    return stops


_NO_ALTERNATIVES = "the generator records each sampled token's logprob only, not the likeliest alternatives"


def _read_logprobs(body: dict, route: str) -> bool:
    """Whether the answer carries the sampled tokens' logprobs: chat's ``logprobs: true`` (``top_logprobs`` 0 or
    null), completions' ``logprobs: 0``; RequestError for alternatives, which are not recorded."""
    if route == "chat":
        top = body.get("top_logprobs")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top != 0):
            raise RequestError(f"top_logprobs={top!r}: {_NO_ALTERNATIVES}; leave it out or send 0 (with logprobs: true "
                               f"for the sampled tokens')", field_name="top_logprobs")
        if body.get("logprobs") == 0 and not isinstance(body.get("logprobs"), bool):
            return False  # 0 for false, as SDKs of other languages send it
        return _flag(body, "logprobs")
    value = body.get("logprobs")
    if value is None or value is False:
        return False
    if not isinstance(value, int) or isinstance(value, bool) or value != 0:
        raise RequestError(f"logprobs={value!r}: {_NO_ALTERNATIVES}; send 0 for the sampled tokens' logprobs, or leave "
                           f"it out", field_name="logprobs")
    return True


def read_tools(body: dict) -> tuple[list | None, bool]:
    """A chat request's ``tools`` (None when absent) and whether tool calls are looked for (``tool_choice``)."""
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError("tools must be a list of tool objects", field_name="tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(f"tool_choice={choice!r}: auto and none are served", field_name="tool_choice")
    look_for_calls = bool(tools) and choice != "none"
    _flag(body, "parallel_tool_calls")
    if look_for_calls and body.get("parallel_tool_calls") is False:
        raise RequestError(
            "parallel_tool_calls=false: every tool call the policy samples is returned (at most one would take "
            "constrained decoding, which is not served); leave it out or send true", field_name="parallel_tool_calls",
        )
    return tools or None, look_for_calls

