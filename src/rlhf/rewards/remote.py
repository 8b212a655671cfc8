"""`remote`: a reward computed by an HTTP service (a code sandbox, a judge model, a checker in any language).

Wire format, one POST per batch to ``args.url`` with ``Content-Type: application/json``::

    request:  {"rows": [{"prompt": str, "response": str, "ground_truth": <the dataset's value or null>}, ...]}
    reply:    {"scores": [float, ...]}      # HTTP 200, one finite number per row, in the rows' order

Failures to reach the service (refused, unreachable, timed out after ``timeout_s``, HTTP 5xx or 429) are
retried ``max_retries`` times, waiting ``backoff_s``, then twice that, and so on; then the run stops with an
error naming the URL and the last failure. Another HTTP error or a malformed reply stops it at once: retrying
would not fix it.

`remote` is not a verifier (it does not feed `objective/verifiable_correct_rate`): scores may use any scale.
To count a remote check as correctness, register a wrapper of your own:
``@register("reward", "my_check") @verifier def my_check(**kw): return remote(**kw)``.
"""

from __future__ import annotations

import json
import math

from rlhf.errors import require
from rlhf.registry import register
from rlhf.rewards.combine import as_score, shown
from rlhf.web import RetriesExhausted, is_http_url, post_with_retries

_EXAMPLE = "{name: remote, args: {url: 'http://127.0.0.1:8000/score'}}"  # quoted in the missing-url error


class RemoteRewardError(RuntimeError):
    """The scoring service could not be reached, or answered something other than one score per row."""


def _post(url: str, body: bytes, timeout_s: float, max_retries: int, backoff_s: float) -> bytes:
    """The reply's body to a POST of ``body`` (`rlhf.web.post_with_retries`: ``timeout_s`` bounds each whole
    exchange, transient failures are retried); RemoteRewardError when every try failed or the reply is not a 2xx."""
    try:
        status, reply = post_with_retries(url, body, timeout_s, "args.timeout_s", max_retries, backoff_s)
    except RetriesExhausted as err:
        raise RemoteRewardError(
            f"reward function remote: POST {url} failed {err.tries} times; last failure: {err.last!r}. "
            "Check that the scoring service is up at that address, or raise args.timeout_s / args.max_retries"
        ) from err.last
    if not 200 <= status < 300:
        detail = reply[:300].decode("utf-8", "replace")
        raise RemoteRewardError(f"reward function remote: {url} answered HTTP {status}: {detail!r}")
    return reply


def _read_scores(reply: bytes, rows: int, url: str) -> list[float]:
    """The ``scores`` of a reply, checked: valid JSON, one finite number per row."""
    try:
        scores = json.loads(reply)["scores"]
    except (ValueError, KeyError, TypeError) as err:
        raise RemoteRewardError(
            f'reward function remote: {url} replied {reply[:200]!r}, not JSON of the form {{"scores": [...]}}'
        ) from err
    if not isinstance(scores, list) or len(scores) != rows:
        count = len(scores) if isinstance(scores, list) else type(scores).__name__
        raise RemoteRewardError(f"reward function remote: {url} returned {count} scores for {rows} rows")
    for i, score in enumerate(scores):
        number = None if isinstance(score, bool) or not isinstance(score, (int, float)) else as_score(score)
        if number is None or not math.isfinite(number):  # JSON's 1e400 reads as inf, and 10**400 as an int
            message = f"reward function remote: {url} returned score {shown(score)} for row {i}, not a finite number"
            raise RemoteRewardError(message)
    return [float(score) for score in scores]


@register("reward", "remote")
def remote(
    prompts, responses, ground_truths, url: str = "", timeout_s: float = 30.0, max_retries: int = 2,
    backoff_s: float = 1.0, **_,
) -> list[float]:
    """The scores an HTTP service returns for the batch (wire format in the module docstring)."""
    check_remote_args("args", url, timeout_s, max_retries, backoff_s)
    truths = ground_truths if ground_truths is not None else [None] * len(responses)
    rows = [{"prompt": p, "response": r, "ground_truth": g} for p, r, g in zip(prompts, responses, truths)]
    body = json.dumps({"rows": rows}, default=str).encode()  # a ground truth JSON cannot hold goes as str()
    reply = _post(url, body, timeout_s, max_retries, backoff_s)
    return _read_scores(reply, len(rows), url)


def check_remote_args(at: str, url: str = "", timeout_s: float = 30.0, max_retries: int = 2, backoff_s: float = 1.0, **_) -> None:
    """ConfigError for args `remote` cannot use (``at``: where they sit, for the message): an http(s) URL with a host,
    a positive timeout, retries and backoff not negative. Runs when the reward set is built, before any model loads."""
    require(bool(url), f"reward function remote needs {at}.url, e.g. reward.functions=[{_EXAMPLE}]")
    require(
        is_http_url(url),
        f"reward function remote: {at}.url={url!r} is not an http(s) URL with a host; give one such as "
        f"http://127.0.0.1:8000/score",
    )
    require(timeout_s > 0, f"reward function remote: {at}.timeout_s={timeout_s} must be > 0 seconds")
    require(max_retries >= 0, f"reward function remote: {at}.max_retries={max_retries} must be >= 0")
    require(backoff_s >= 0, f"reward function remote: {at}.backoff_s={backoff_s} must be >= 0 seconds")


remote.check_args = check_remote_args
