"""What the tests' misbehaving HTTP servers share: a handler that replies with a body, quietly, and a reply that
promises a long body and drips it forever."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler


class Replies(BaseHTTPRequestHandler):
    """A request handler whose `reply` sends a status and a whole body, and that logs nothing (pytest's output stays
    clean). ``before_reply()`` runs first (a server counting requests in flight stops counting this one there)."""

    def before_reply(self) -> None:
        pass

    def reply(self, code: int, body: bytes, kind: str = "application/json") -> None:
        self.before_reply()
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def drip_forever(handler, body: bytes, stop: threading.Event) -> None:
    """Send a 200 whose Content-Length promises 1000 times ``body``, then one byte every 0.2 s (well inside any
    per-read timeout) until ``stop`` is set or the client goes away."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body) * 1000))
    handler.end_headers()
    while not stop.wait(0.2):
        try:
            handler.wfile.write(b" ")
            handler.wfile.flush()
        except OSError:
            return


def error_within(call, error: type[BaseException], stop: threading.Event, wait_s: float = 120.0) -> BaseException | None:
    """Run ``call`` in a thread and wait for it (generously: a hang fails the caller's assertion, never the suite's
    clock); then set ``stop`` (the server's drip ends). The ``error`` it raised, or None; AssertionError if it never
    ended."""
    caught: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except error as err:
            caught.append(err)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=wait_s)
    stop.set()
    assert not worker.is_alive(), "the request never ended"
    return caught[0] if caught else None
