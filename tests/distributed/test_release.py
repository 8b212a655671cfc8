"""`finishes`: how the end of a Ray run tells a cluster that releases its actors from one that no longer answers."""

from __future__ import annotations

import threading

from rlhf.distributed.cluster import finishes


def test_a_call_that_returns_finishes():
    calls = []
    assert finishes(lambda: calls.append(1), 5.0) and calls == [1]


def test_a_call_that_hangs_does_not_finish_and_is_left_behind():
    """A release waiting on a dead GCS: the end of the run goes on after the timeout, not after Ray's own 60 s."""
    release = threading.Event()
    assert not finishes(release.wait, 0.2)
    release.set()


def test_a_call_that_raises_does_not_finish_and_the_error_is_logged_not_raised(caplog):
    """Raised inside the `finally` that ends the run, it would hide the error that ended it."""
    def fail() -> None:
        raise RuntimeError("the actor is unavailable")

    assert not finishes(fail, 5.0)
    assert "releasing the Ray cluster failed" in caplog.text and "the actor is unavailable" in caplog.text
