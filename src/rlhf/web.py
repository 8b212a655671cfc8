"""HTTP for the parts that call a service (`reward=remote`, `reward=judge`, `teacher.url`): one URL check, one JSON
POST whose whole exchange is bounded, and that POST retried with backoff.

A socket timeout bounds each read only: a server that accepts the request and then trickles its reply, a byte at a
time, would hold the run for ever. `post_json` starts a watchdog when it has connected, which shuts the connection
down at the deadline; whatever read was waiting then ends, and the call raises TimeoutError.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.parse


def is_http_url(url: str) -> bool:
    """Whether ``url`` is an http(s) URL with a host (``host:8000/v1``, without a scheme, is not)."""
    parsed = urllib.parse.urlparse(str(url))
    return parsed.scheme in ("http", "https") and bool(parsed.netloc)


RETRIED_HTTP_CODES = frozenset({429, 500, 502, 503, 504})  # busy or restarting: worth another try


class RetriesExhausted(RuntimeError):
    """Every try of `post_with_retries` failed; ``last`` is the last failure (a transport error or `BusyReply`)."""

    def __init__(self, tries: int, last: Exception) -> None:
        super().__init__(f"{tries} tries failed; last failure: {last!r}")
        self.tries, self.last = tries, last


class BusyReply(RuntimeError):
    """A reply whose status (`RETRIED_HTTP_CODES`) says: try again later."""


def post_json(
    url: str, body: bytes, timeout_s: float, timeout_key: str, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """(HTTP status, reply body) of one POST of the JSON ``body`` to ``url`` (``headers``: more request headers, e.g.
    Authorization). TimeoutError, naming ``timeout_key`` (the config key holding ``timeout_s``), when connecting,
    sending and reading the whole reply take longer than ``timeout_s``; OSError or http.client.HTTPException when the
    transport fails otherwise."""
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    expired = threading.Event()
    try:
        connection.connect()  # bounded by the socket's timeout, ``timeout_s``
        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _cut, (connection.sock, expired))
        watchdog.daemon = True
        watchdog.start()
        try:
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            connection.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
            reply = connection.getresponse()
            status, data = reply.status, reply.read()
        finally:
            watchdog.cancel()
    except (OSError, http.client.HTTPException):
        if not expired.is_set():
            raise
    finally:
        connection.close()
    if expired.is_set():  # a read the watchdog ended, with an error or a reply cut short
        raise TimeoutError(f"the reply took longer than {timeout_key}={timeout_s:g} s")
    return status, data


def post_with_retries(
    url: str, body: bytes, timeout_s: float, timeout_key: str, max_retries: int, backoff_s: float,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """(HTTP status, body) of the first reply to a `post_json` of ``body`` that is not a transient failure (a 2xx, or
    an HTTP error retrying would not fix, such as 400). A transient failure (refused, unreachable, timed out, dropped,
    or a status in `RETRIED_HTTP_CODES`) is retried ``max_retries`` times, waiting ``backoff_s``, then twice that,
    and so on; RetriesExhausted when every try failed."""
    failure: Exception | None = None
    for attempt in range(max_retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            status, reply = post_json(url, body, timeout_s, timeout_key, headers)
        except (OSError, http.client.HTTPException) as err:  # refused, unreachable, timed out, dropped
            failure = err
            continue
        if status not in RETRIED_HTTP_CODES:
            return status, reply
        failure = BusyReply(f"HTTP {status}: {reply[:100].decode('utf-8', 'replace')!r}")
    raise RetriesExhausted(max_retries + 1, failure)


def _cut(sock: socket.socket, expired: threading.Event) -> None:
    """The watchdog: mark the request expired and shut its socket down, ending any read waiting on it."""
    expired.set()
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed: the request ended at the deadline
        pass
