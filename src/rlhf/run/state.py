"""What every schedule shares: the run's progress state, the non-finite guard, and preemption signals."""

from __future__ import annotations

import logging
import signal
import time
import uuid
from dataclasses import dataclass, field

from rlhf.errors import StopNow, stop_requested

log = logging.getLogger("rlhf")


class NonFiniteError(RuntimeError):
    """Too many optimiser steps in a row had a non-finite loss or gradient."""


class NonFiniteGuard:
    """Counts optimiser steps skipped for a non-finite loss or gradient; raises after too many in a row."""

    def __init__(self, max_in_row: int, total: int = 0, in_row: int = 0) -> None:
        self.max_in_row, self.total, self.in_row = max_in_row, total, in_row

    def record(self, skipped: bool, what: str = "") -> None:
        if not skipped:
            self.in_row = 0
            return
        self.total += 1
        self.in_row += 1
        log.warning("optimiser step skipped: non-finite %s (%d in a row, %d in total)", what or "loss or gradient", self.in_row, self.total)
        if self.in_row >= self.max_in_row:
            raise NonFiniteError(
                f"{self.in_row} optimiser steps in a row had a non-finite {what or 'loss or gradient'} "
                f"(train.max_skipped_steps_in_row={self.max_in_row}); lower train.lr, check the rewards for inf/NaN, "
                f"or raise the limit"
            )


@dataclass
class RunState:
    """Progress that a checkpoint carries besides the components' own state."""

    step: int = 0
    first_eval: dict[str, float] = field(default_factory=dict)
    last_eval: dict[str, float] = field(default_factory=dict)
    guard: NonFiniteGuard = field(default_factory=lambda: NonFiniteGuard(3))
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    preempted: bool = False
    elapsed: float = 0.0  # seconds the run took (not checkpointed)

    def to_dict(self) -> dict:
        return {
            "first_eval": self.first_eval,
            "last_eval": self.last_eval,
            "skipped_total": self.guard.total,
            "skipped_in_row": self.guard.in_row,
            "run_id": self.run_id,
        }

    @classmethod
    def from_dict(cls, state: dict, max_in_row: int) -> "RunState":
        return cls(
            step=state["step"],
            first_eval=state["first_eval"],
            last_eval=state["last_eval"],
            guard=NonFiniteGuard(max_in_row, state["skipped_total"], state["skipped_in_row"]),
            run_id=state["run_id"],
        )


class StopSignals:
    """Within the block, SIGTERM and SIGINT ask the schedule to stop at the next safe point instead of killing it.

    A second SIGINT raises KeyboardInterrupt, so an impatient user can still abort; a second SIGTERM raises `StopNow`
    (exit 143, 128 + SIGTERM, no checkpoint), for a step held up in user code that never returns (a reward function
    that hangs; one stuck inside a single C call runs no Python, and so no handler, until it returns: kill -9 then).
    A SIGTERM within ``REPEAT_S`` of the first is one signal fanned out twice (to a process group, and forwarded by
    a launcher), not a second request.
    """

    REPEAT_S = 1.0  # a SIGTERM this soon after the first counts as the same one

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, object] = {}
        self._first_at = 0.0

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            if time.monotonic() - self._first_at < self.REPEAT_S:
                return
            log.error("a second SIGTERM: stopping now, without finishing the step or saving a checkpoint")
            raise StopNow(128 + signal.SIGTERM)
        self.requested, self._first_at = signal.Signals(signum).name, time.monotonic()
        stop_requested.set()
        log.warning("%s: finishing the current step, then saving a checkpoint (before the first step: stopping once "
                    "the models have loaded, nothing to save); send it again to stop at once, without one", self.requested)
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def __enter__(self) -> "StopSignals":
        stop_requested.clear()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def arm(self) -> None:
        """Take the signals back after code that installed handlers of its own inside the block (`ray.init` puts in
        a SIGTERM handler that exits at once); the handlers found on entry are still the ones put back on exit."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(sig) != self._handle and not (sig == signal.SIGINT and self.requested == "SIGINT"):
                signal.signal(sig, self._handle)

    def __exit__(self, *exc) -> None:
        stop_requested.clear()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
