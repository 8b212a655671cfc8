"""Rows in flight on a vLLM engine, for schedule=stream: each row stays one request of the engine between
`continue_rows` calls.

A call steps the engine itself (`LLMEngine.step`: one token for every running request, new ones prefilled as they
join) until every row asked for holds ``steps`` new tokens or has ended, and hands out at most ``steps`` a row; a
row that ran further keeps the rest for the next call. The engine never stops between calls, so a row is read
(prefilled) once, not once a chunk, and vLLM's own continuous batching keeps its batch full.

New weights end every request (`drop`) and discard the tokens not yet handed out: they came from the old weights,
and a token is tagged with the version the caller holds when it receives it. The next call adds each row again with
its prompt and the tokens handed out, read under the new weights (the prefix cache is reset with the weights), so an
unfinished response continues under them, as the hf generator's continuous batch does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlhf.generators.base import SamplingParams
from rlhf.generators.continuous import Continued, Request


def sampled_logprobs(completion) -> list[float]:
    """The logprob of each token of a vLLM completion (``CompletionOutput``), as its sampler gave it."""
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


@dataclass
class Live:
    """A row the engine is sampling: its request, the row's length as the caller knows it, what it sampled since."""

    request_id: str
    length: int  # prompt + tokens handed out: a call that asks with another length gets the row added again
    tokens: list[int] = field(default_factory=list)  # sampled, not yet handed out
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False  # the engine ended the request (stop token or its token budget)
    stopped: bool = False  # ended by the stop token


class EngineRows:
    """`continue_rows` on one vLLM engine (``engine``: its `LLMEngine`). ``params(sampling)`` makes vLLM's sampling
    parameters for a row, its new tokens returned at every step (`RequestOutputKind.DELTA`)."""

    def __init__(self, engine, params) -> None:
        self.engine, self.params = engine, params
        self.rows: dict[int, Live] = {}  # row key -> its request
        self.keys: dict[str, int] = {}  # request id -> row key
        self.added = 0  # requests added since the start: a row is added once, and again only after new weights

    def continue_rows(self, requests: list[Request], sampling: SamplingParams, steps: int) -> list[Continued]:
        """Up to ``steps`` more tokens for each row of ``requests``; rows held and not asked for are ended."""
        asked = {key for key, _, _ in requests}
        self._end([key for key in self.rows if key not in asked])
        for key, tokens, room in requests:
            live = self.rows.get(key)
            if live is None or live.length != len(tokens):
                self._end([key])
                self._add(key, tokens, replace(sampling, max_new_tokens=room))
        wanted = [self.rows[key] for key, _, _ in requests]
        while any(not live.finished and len(live.tokens) < steps for live in wanted):
            self._step()
        return [self._hand_out(key, steps) for key, _, _ in requests]

    def drop(self) -> None:
        """End every request (before new weights load, or before another use of the engine)."""
        self._end(list(self.rows))

    def _add(self, key: int, tokens: list[int], sampling: SamplingParams) -> None:
        request_id = f"stream-{self.added}"
        self.added += 1
        self.engine.add_request(request_id, {"prompt_token_ids": list(tokens)}, self.params(sampling))
        self.rows[key], self.keys[request_id] = Live(request_id, len(tokens)), key

    def _step(self) -> None:
        outputs = self.engine.step()
        if not outputs and not self.engine.has_unfinished_requests():
            raise RuntimeError("the vLLM engine holds none of the rows in flight: they were ended outside schedule=stream")
        for out in outputs:
            key = self.keys.get(out.request_id)
            if key is None:
                continue
            live, sampled = self.rows[key], out.outputs[0]
            live.tokens += sampled.token_ids
            live.logprobs += sampled_logprobs(sampled)
            live.finished, live.stopped = out.finished, sampled.finish_reason == "stop"

    def _hand_out(self, key: int, steps: int) -> Continued:
        live = self.rows[key]
        tokens, logprobs = live.tokens[:steps], live.logprobs[:steps]
        live.tokens, live.logprobs, live.length = live.tokens[steps:], live.logprobs[steps:], live.length + len(tokens)
        ended = live.finished and not live.tokens
        if ended:  # the engine let the request go
            del self.rows[key], self.keys[live.request_id]
        return tokens, logprobs, ended and live.stopped

    def _end(self, keys: list[int]) -> None:
        running = [self.rows[key].request_id for key in keys if key in self.rows and not self.rows[key].finished]
        if running:
            self.engine.abort_request(running)
        for key in keys:
            live = self.rows.pop(key, None)
            if live is not None:
                del self.keys[live.request_id]
