"""`judge`: a language model behind an OpenAI-compatible endpoint (`vllm serve`, or a hosted API) scores each response
against a rubric.

Each row's rubric (a Jinja template of ``prompt``, ``response``, ``ground_truth``, ``low`` and ``high``) is rendered
into one user message and POSTed to ``{base_url}/chat/completions``; the text of the reply is read as a score:

- ``parse: number``: the reply's first number, which must lie in [low, high]; it is rescaled to [0, 1] as
  (number - low) / (high - low), so a judge on any scale weighs alike beside a verifier's 0/1.
- ``parse: yes_no``: the reply's first word: yes is 1.0, no is 0.0 (case and punctuation aside).

A row the judge could not score is `Unscored(reason)`, never 0.0: the service refused or was out of reach, timed out
(``timeout_s`` bounds each whole exchange, so a server that trickles its reply ends too), stayed busy (429, 5xx) after
``max_retries`` tries with backoff, answered another HTTP error or something that is not the API's JSON (an HTML
page), or a text with no score in it or a number out of range. Each kind is counted in the returned metrics.
HTTP 401, 403 and 404 stop the run instead: a wrong key, model name or URL fails every row alike.

``extra_body`` adds fields to each request, e.g. vLLM's ``{structured_outputs: {choice: [yes, no]}}``, with which a
small judge can only answer yes or no.

Identical requests (the same URL, model, messages and sampling settings) are sent once per batch, and a score is
kept in a bounded in-memory cache (``cache_size`` entries, least recently used out first; 0 turns it off); a
failure is never cached.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from threading import Lock

import jinja2
import jinja2.meta
from jinja2.sandbox import SandboxedEnvironment

from rlhf.errors import ConfigError, require
from rlhf.registry import register
from rlhf.rewards.failure import Unscored
from rlhf.rewards.rules import Scores
from rlhf.web import BusyReply, RetriesExhausted, is_http_url, post_with_retries

log = logging.getLogger(__name__)

VARIABLES = frozenset({"prompt", "response", "ground_truth", "low", "high"})  # what a rubric may use
PARSE_MODES = ("number", "yes_no")
FAILURES = ("unreachable", "timeout", "busy", "http_error", "bad_reply", "unparsed", "out_of_range")  # counted kinds
_STOPPING_CODES = {401: "args.api_key_env", 403: "args.api_key_env", 404: "args.model or args.base_url"}
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_WORD = re.compile(r"[A-Za-z]+")
_ENVIRONMENT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV = SandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False)  # rubrics come from configs: sandboxed


class JudgeError(RuntimeError):
    """The judge's service refused every request for a reason of the config's (key, model name, URL)."""


@register("reward", "judge")
def judge(
    prompts, responses, ground_truths, base_url: str = "", model: str = "", api_key_env: str | None = None,
    rubric: str = "", parse: str = "number", low: float = 0.0, high: float = 10.0, max_concurrency: int = 8,
    timeout_s: float = 60.0, max_retries: int = 2, backoff_s: float = 1.0, temperature: float = 0.0,
    max_tokens: int = 16, cache_size: int = 4096, extra_body: dict | None = None,
) -> Scores:
    """One score in [0, 1] per response, or `Unscored` where the judge could not give one; metrics: ``requests``
    (sent, retries aside), ``cache_hits`` (rows served from the cache), ``unscored`` and ``unscored_<kind>``."""
    check_judge_args("args", base_url, model, api_key_env, rubric, parse, low, high, max_concurrency, timeout_s,
                     max_retries, backoff_s, temperature, max_tokens, cache_size, extra_body)
    template = _template(_rubric_text(rubric, "args.rubric"))
    truths = ground_truths if ground_truths is not None else [None] * len(responses)
    settings = {**plain(extra_body or {}), "model": model, "temperature": temperature, "max_tokens": max_tokens}
    bodies = [
        _request_body(_render(template, "args.rubric", prompt=p, response=r, ground_truth=g, low=low, high=high), settings)
        for p, r, g in zip(prompts, responses, truths)
    ]
    url = base_url.rstrip("/") + "/chat/completions"
    headers = _auth_headers(api_key_env)
    rows_of = Counter(bodies)  # each distinct request once, in the rows' order
    results: dict[bytes, float | Unscored] = {}
    for body in rows_of if cache_size > 0 else ():
        cached = _CACHE.get((url, body))
        if cached is not None:
            results[body] = cached
    hits = sum(rows_of[body] for body in results)
    todo = [body for body in rows_of if body not in results]

    def ask(body: bytes) -> float | Unscored:
        return _score_reply(url, body, headers, parse, low, high, timeout_s, max_retries, backoff_s)

    if todo:
        with ThreadPoolExecutor(max_workers=min(max_concurrency, len(todo)), thread_name_prefix="judge") as pool:
            for body, value in zip(todo, pool.map(ask, todo)):
                results[body] = value
                if not isinstance(value, Unscored) and cache_size > 0:
                    _CACHE.put((url, body), value, cache_size)
    values = [results[body] for body in bodies]
    return Scores(values, _metrics(values, len(todo), hits))


def _metrics(values: list, requests: int, hits: int) -> dict[str, float]:
    """The batch's counts, and one warning line when rows went unscored."""
    kinds = Counter(value.reason.split(":", 1)[0] for value in values if isinstance(value, Unscored))
    unscored = sum(kinds.values())
    if unscored:
        first = next(value.reason for value in values if isinstance(value, Unscored))
        log.warning("judge: %d of %d rows unscored (%s); first: %s", unscored, len(values), dict(kinds), first)
    return {"requests": requests, "cache_hits": hits, "unscored": unscored} | {f"unscored_{k}": kinds[k] for k in FAILURES}


def _score_reply(
    url: str, body: bytes, headers: dict, parse: str, low: float, high: float, timeout_s: float, max_retries: int,
    backoff_s: float,
) -> float | Unscored:
    """The score the judge's reply to ``body`` gives, or Unscored("<kind>: <detail>") (kinds: `FAILURES`)."""
    try:
        status, reply = post_with_retries(url, body, timeout_s, "args.timeout_s", max_retries, backoff_s, headers)
    except RetriesExhausted as err:
        kind = "timeout" if isinstance(err.last, TimeoutError) else "busy" if isinstance(err.last, BusyReply) else "unreachable"
        return Unscored(f"{kind}: POST {url} failed {err.tries} times; last failure: {err.last!r}")
    detail = reply[:200].decode("utf-8", "replace")
    if status in _STOPPING_CODES:
        raise JudgeError(f"reward function judge: {url} answered HTTP {status}: {detail!r}; check {_STOPPING_CODES[status]}")
    if not 200 <= status < 300:
        return Unscored(f"http_error: {url} answered HTTP {status}: {detail!r}")
    text = reply_text(reply)
    if text is None:
        return Unscored(f"bad_reply: {url} replied {detail!r}, not a chat completion's JSON")
    return read_score(text, parse, low, high)


def reply_text(reply: bytes) -> str | None:
    """The message text of a chat completion's JSON ``reply`` (its first choice), or None if it is not one."""
    try:
        text = json.loads(reply)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return text if isinstance(text, str) else None


def read_score(text: str, parse: str, low: float, high: float) -> float | Unscored:
    """The score ``text`` (the judge's reply) gives in ``parse`` mode (see the module docstring), or Unscored."""
    if parse == "yes_no":
        word = _WORD.search(text)
        verdict = word.group().lower() if word else None
        if verdict in ("yes", "no"):
            return float(verdict == "yes")
        return Unscored(f"unparsed: the reply {text[:100]!r} does not start with yes or no")
    number = _NUMBER.search(text)
    if number is None:
        return Unscored(f"unparsed: the reply {text[:100]!r} holds no number")
    value = float(number.group())
    if not low <= value <= high:
        return Unscored(f"out_of_range: the reply {text[:100]!r} gives {value:g}, outside [{low:g}, {high:g}]")
    return (value - low) / (high - low)


def _request_body(message: str, settings: dict) -> bytes:
    """The chat completion request for one rendered rubric, as the bytes sent (and the cache's key)."""
    return json.dumps({"messages": [{"role": "user", "content": message}], **settings}, sort_keys=True).encode()


def plain(value):
    """``value`` with every mapping a dict and every other collection a list (a config's nodes), for json.dumps."""
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) or (isinstance(value, Sequence) and not isinstance(value, (str, bytes))):
        return [plain(item) for item in value]
    return value


def _auth_headers(api_key_env: str | None) -> dict[str, str]:
    """The Authorization header with the key the environment variable ``api_key_env`` holds (none without one)."""
    if not api_key_env:
        return {}
    key = os.environ.get(api_key_env)
    require(bool(key), f"reward function judge: args.api_key_env={api_key_env!r}: that environment variable is not set; export it")
    return {"Authorization": f"Bearer {key}"}


class _Lru:
    """A bounded map of request -> score shared by the process's judges, the least recently used out first."""

    def __init__(self) -> None:
        self._items: OrderedDict = OrderedDict()
        self._lock = Lock()

    def get(self, key):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
            return self._items.get(key)

    def put(self, key, value, size: int) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > size:
                self._items.popitem(last=False)


_CACHE = _Lru()


# -- the rubric, checked before any model loads --------------------------------------------------------------------


def _rubric_text(rubric: str, at: str) -> str:
    """The template ``rubric`` holds: itself when it has a Jinja tag or a line break, else the file it names."""
    if "{{" in rubric or "{%" in rubric or "\n" in rubric:
        return rubric
    path = Path(rubric).expanduser()
    require(
        path.is_file(),
        f"reward function judge: {at}={rubric!r} is neither a template (it has no {{{{ }}}}) nor a file; give the "
        f"rubric inline, e.g. 'Rate this answer to {{{{ prompt }}}} from 0 to 10: {{{{ response }}}}', or a path",
    )
    return path.read_text()


@functools.lru_cache(maxsize=16)
def _template(text: str) -> jinja2.Template:
    return _ENV.from_string(text)


def _render(template: jinja2.Template, at: str, **variables) -> str:
    """``template`` rendered; ConfigError naming ``at`` when it cannot be."""
    try:
        return template.render(**variables)
    except jinja2.TemplateError as err:
        raise ConfigError(f"reward function judge: {at} does not render: {type(err).__name__}: {err}") from err


class _AnyValue:
    """A stand-in ground truth for the check's sample row: any attribute, item or iteration of it is itself, so a
    rubric that reads ``ground_truth.answer`` renders before the dataset's real values are checked."""

    def __getattr__(self, name):
        return self

    def __getitem__(self, key):
        return self

    def __iter__(self):
        return iter([self])

    def __str__(self) -> str:
        return "<a ground truth>"


def check_rubric(rubric: str, at: str) -> jinja2.Template:
    """The compiled rubric; ConfigError naming ``at`` when it is missing, does not parse, uses a variable the judge
    does not give, or does not render on a sample row."""
    require(bool(rubric), f"reward function judge needs {at}: a Jinja template of {', '.join(sorted(VARIABLES))}, or its path")
    text = _rubric_text(rubric, at)
    try:
        unknown = jinja2.meta.find_undeclared_variables(_ENV.parse(text)) - VARIABLES
        template = _template(text)
    except jinja2.TemplateSyntaxError as err:
        raise ConfigError(f"reward function judge: {at} is not a valid Jinja template: line {err.lineno}: {err.message}") from err
    require(
        not unknown,
        f"reward function judge: {at} uses {', '.join(sorted(unknown))}, which the judge does not give; a rubric may "
        f"use {', '.join(sorted(VARIABLES))}",
    )
    _render(template, at, prompt="<a prompt>", response="<a response>", ground_truth=_AnyValue(), low=0, high=1)
    return template


def check_judge_args(
    at: str, base_url: str = "", model: str = "", api_key_env: str | None = None, rubric: str = "", parse: str = "number",
    low: float = 0.0, high: float = 10.0, max_concurrency: int = 8, timeout_s: float = 60.0, max_retries: int = 2,
    backoff_s: float = 1.0, temperature: float = 0.0, max_tokens: int = 16, cache_size: int = 4096,
    extra_body: dict | None = None,
) -> None:
    """ConfigError for args `judge` cannot use (``at``: where they sit, for the message); runs when the reward set is
    built, before any model loads."""
    require(
        is_http_url(base_url),
        f"reward function judge: {at}.base_url={base_url!r} is not an http(s) URL with a host; give the endpoint's "
        f"OpenAI base URL, e.g. http://127.0.0.1:8000/v1 for `vllm serve`",
    )
    require(isinstance(model, str) and bool(model), f"reward function judge needs {at}.model: the model name the endpoint serves")
    if api_key_env:
        require(
            _ENVIRONMENT_NAME.fullmatch(str(api_key_env)) is not None,
            f"reward function judge: {at}.api_key_env is the NAME of an environment variable holding the key (e.g. "
            f"OPENAI_API_KEY), not the key itself; never put a key in a config",
        )
        require(
            bool(os.environ.get(api_key_env)),
            f"reward function judge: {at}.api_key_env={api_key_env!r}: that environment variable is not set; export it",
        )
    require(parse in PARSE_MODES, f"reward function judge: {at}.parse={parse!r} must be one of {', '.join(PARSE_MODES)}")
    if parse == "number":
        require(
            math.isfinite(low) and math.isfinite(high) and low < high,
            f"reward function judge: {at}.low={low} and {at}.high={high} must be finite numbers with low < high",
        )
    check_rubric(rubric, f"{at}.rubric")
    for key, value, least in (("max_concurrency", max_concurrency, 1), ("max_tokens", max_tokens, 1),
                              ("max_retries", max_retries, 0), ("cache_size", cache_size, 0)):
        require(isinstance(value, int) and value >= least, f"reward function judge: {at}.{key}={value!r} must be an integer >= {least}")
    require(timeout_s > 0, f"reward function judge: {at}.timeout_s={timeout_s} must be > 0 seconds")
    require(backoff_s >= 0, f"reward function judge: {at}.backoff_s={backoff_s} must be >= 0 seconds")
    require(temperature >= 0, f"reward function judge: {at}.temperature={temperature} must be >= 0")
    _check_extra_body(at, extra_body)


def _check_extra_body(at: str, extra_body) -> None:
    """ConfigError unless ``extra_body`` is null or a mapping JSON can hold, apart from the fields the judge sets."""
    if extra_body is None:
        return
    require(isinstance(extra_body, Mapping), f"reward function judge: {at}.extra_body must be a mapping of request fields")
    taken = sorted({"messages", "model", "temperature", "max_tokens"} & set(map(str, extra_body)))
    require(not taken, f"reward function judge: {at}.extra_body sets {', '.join(taken)}; set {at}.<key> instead (messages come from the rubric)")
    try:
        json.dumps(plain(extra_body))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"reward function judge: {at}.extra_body cannot be sent as JSON: {err}") from err


def check_truths(truths: list, origins: list[str], rubric: str = "", low: float = 0.0, high: float = 10.0, **_) -> None:
    """The rubric rendered with each of the dataset's ground truths (a sample row's prompt and response), before any
    model loads; ConfigError naming the row whose truth it cannot render."""
    template = _template(_rubric_text(rubric, "args.rubric"))
    for truth, origin in zip(truths, origins):
        try:
            template.render(prompt="<a prompt>", response="<a response>", ground_truth=truth, low=low, high=high)
        except jinja2.TemplateError as err:
            raise ConfigError(
                f"reward function judge: args.rubric does not render with the ground truth of {origin} ({truth!r:.80}): "
                f"{type(err).__name__}: {err}"
            ) from err


judge.check_args = check_judge_args
judge.check_truths = check_truths
