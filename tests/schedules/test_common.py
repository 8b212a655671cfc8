"""What every schedule shares: the non-finite step guard, the run state a checkpoint carries, and stop signals."""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import pytest

from rlhf.errors import StopNow
from rlhf.run.state import NonFiniteError, NonFiniteGuard, RunState, StopSignals

# --- NonFiniteGuard -----------------------------------------------------------------------------------


def test_guard_counts_skips_and_a_good_step_resets_the_row():
    """Skips add to both counters; a good step zeroes the in-row counter but keeps the total."""
    guard = NonFiniteGuard(max_in_row=5)
    guard.record(False)
    assert (guard.total, guard.in_row) == (0, 0)
    guard.record(True, "loss")
    guard.record(True, "gradient")
    assert (guard.total, guard.in_row) == (2, 2)
    guard.record(False)
    assert (guard.total, guard.in_row) == (2, 0)
    guard.record(True)
    assert (guard.total, guard.in_row) == (3, 1)


def test_guard_never_raises_when_good_steps_interleave():
    """Isolated skips below the limit, however many in total, never stop the run."""
    guard = NonFiniteGuard(max_in_row=3)
    for _ in range(10):
        guard.record(True)
        guard.record(True)
        guard.record(False)
    assert (guard.total, guard.in_row) == (20, 0)


def test_guard_raises_when_the_limit_in_a_row_is_reached():
    """The max_in_row-th skip in a row raises NonFiniteError naming `train.max_skipped_steps_in_row`."""
    guard = NonFiniteGuard(max_in_row=3)
    guard.record(True, "loss")
    guard.record(True, "loss")
    with pytest.raises(NonFiniteError, match=r"train\.max_skipped_steps_in_row=3") as err:
        guard.record(True, "gradient")
    assert "non-finite gradient" in str(err.value)
    assert isinstance(err.value, RuntimeError)
    assert (guard.total, guard.in_row) == (3, 3)


def test_guard_with_limit_one_raises_on_the_first_skip():
    """max_in_row=1 tolerates no skipped step at all."""
    with pytest.raises(NonFiniteError, match="max_skipped_steps_in_row=1"):
        NonFiniteGuard(max_in_row=1).record(True)


def test_guard_restored_mid_row_raises_at_the_right_step():
    """A guard rebuilt with in_row=2 (as after resume) raises on the next skip when the limit is 3."""
    guard = NonFiniteGuard(max_in_row=3, total=4, in_row=2)
    with pytest.raises(NonFiniteError):
        guard.record(True)
    assert guard.total == 5


def test_guard_logs_each_skip(caplog):
    """Every skipped step is logged as a warning with what was non-finite and the counts."""
    guard = NonFiniteGuard(max_in_row=9)
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        guard.record(True, "loss")
    assert "non-finite loss" in caplog.text and "1 in a row" in caplog.text


# --- RunState -----------------------------------------------------------------------------------------


def test_run_state_round_trips_through_json_and_from_dict():
    """to_dict is JSON-safe; with the step (saved beside it by the checkpoint) from_dict rebuilds the state."""
    state = RunState(
        step=7,
        first_eval={"eval/greedy_scores": 0.25},
        last_eval={"eval/greedy_scores": 0.75},
        guard=NonFiniteGuard(3, total=4, in_row=1),
        run_id="0123456789ab",
    )
    saved = json.loads(json.dumps(state.to_dict()))
    restored = RunState.from_dict({"step": state.step, **saved}, max_in_row=5)
    assert restored.step == 7
    assert restored.first_eval == state.first_eval and restored.last_eval == state.last_eval
    assert restored.run_id == "0123456789ab"
    assert (restored.guard.total, restored.guard.in_row) == (4, 1)
    assert restored.guard.max_in_row == 5  # the limit comes from the (possibly changed) config, not the checkpoint
    assert restored.preempted is False


def test_run_state_defaults():
    """A fresh state starts at step 0 with empty evals, a zeroed guard and a random 12-hex-digit run id."""
    a, b = RunState(), RunState()
    assert (a.step, a.first_eval, a.last_eval, a.preempted) == (0, {}, {}, False)
    assert (a.guard.total, a.guard.in_row) == (0, 0)
    assert len(a.run_id) == 12 and int(a.run_id, 16) >= 0
    assert a.run_id != b.run_id
    assert a.guard is not b.guard


# --- StopSignals --------------------------------------------------------------------------------------


def wait_for(predicate, timeout: float = 2.0) -> None:
    """Sleep in small slices until ``predicate()`` holds (Python runs signal handlers between bytecodes)."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)


def test_sigterm_inside_the_block_is_recorded_not_fatal():
    """SIGTERM sent to this process inside the block sets `requested` and the test keeps running."""
    with StopSignals() as stop:
        assert stop.requested is None
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: stop.requested is not None)
        assert stop.requested == "SIGTERM"
    assert stop.requested == "SIGTERM"


def test_first_sigint_is_recorded_second_interrupts():
    """A first SIGINT asks for a graceful stop; a second one raises KeyboardInterrupt."""
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        wait_for(lambda: stop.requested is not None)
        assert stop.requested == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            wait_for(lambda: False, timeout=1.0)


def test_a_second_sigterm_stops_at_once_and_a_fanned_out_repeat_does_not():
    """A SIGTERM right after the first (the same signal sent to a process group and forwarded by a launcher) is the
    same request; one after `REPEAT_S` aborts with SystemExit(143), no checkpoint."""
    with StopSignals() as stop:
        stop.REPEAT_S = 0.3
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # at once: the same request
        wait_for(lambda: stop.requested is not None)
        wait_for(lambda: False, timeout=0.05)
        assert stop.requested == "SIGTERM"
        time.sleep(0.35)
        with pytest.raises(SystemExit) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for(lambda: False, timeout=1.0)
    assert stopped.value.code == 128 + signal.SIGTERM and isinstance(stopped.value, StopNow)


def test_a_ctrl_c_after_a_sigterm_interrupts():
    """Any second request stops at once: Ctrl-C after a SIGTERM raises KeyboardInterrupt (before, it was recorded
    again, and a third signal was needed)."""
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: stop.requested is not None)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            wait_for(lambda: False, timeout=1.0)


def test_handlers_are_restored_on_exit():
    """Leaving the block (normally or by an exception) puts back the SIGTERM and SIGINT handlers."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with StopSignals():
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) != before[signal.SIGINT]
    assert {sig: signal.getsignal(sig) for sig in before} == before
    with pytest.raises(ValueError, match="boom"):
        with StopSignals():
            raise ValueError("boom")
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_handlers_restored_after_a_second_sigint_escalation():
    """Even after a second SIGINT switched to the default handler, exiting restores the original ones."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        wait_for(lambda: stop.requested is not None)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_no_signal_means_no_stop_request():
    """Without a signal `requested` stays None."""
    with StopSignals() as stop:
        pass
    assert stop.requested is None


def test_a_sigterm_while_the_models_load_stops_before_the_first_step_cleanly(tmp_path, monkeypatch, caplog):
    """Before, the handlers were installed only when the schedule began: a SIGTERM while the models loaded or the
    parity gate ran killed the process with no message and no cleanup (engines, workers)."""
    import rlhf.train as train_module
    from rlhf.config import compose_config
    from rlhf.run import checkpoint

    build = train_module.build_components
    closed = []

    def build_then_terminated(*args, **kwargs):
        components = build(*args, **kwargs)
        close = components.close
        components.close = lambda: (closed.append(True), close())
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's stop, while the run is still starting
        return components

    monkeypatch.setattr(train_module, "build_components", build_then_terminated)
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        state = train_module.train(compose_config(["train.num_steps=3", "logging.tensorboard=false"]), tmp_path / "run")
    assert state.preempted and state.step == 0 and closed == [True]
    assert "SIGTERM received before the first step: stopped" in caplog.text
    assert checkpoint.complete_checkpoints(tmp_path / "run" / "checkpoints") == []
    assert not (tmp_path / "run" / "final_model").exists()
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are put back


def test_the_run_takes_the_signals_back_from_a_build_that_installs_its_own(tmp_path, monkeypatch, caplog):
    """`ray.init` installs a SIGTERM handler that exits at once; the run's handler must be the one in place once the
    components are built, and the handler found before the run is the one put back after."""
    import rlhf.train as train_module
    from rlhf.checks import parity
    from rlhf.config import compose_config

    build = train_module.build_components

    def ray_like(signum, frame):
        raise SystemExit(signum)  # ray's handler: sys.exit(signum), at once

    def build_like_ray(*args, **kwargs):
        components = build(*args, **kwargs)
        signal.signal(signal.SIGTERM, ray_like)  # as ray.init puts in its own
        return components

    gate = parity.gate

    def gate_then_terminated(*args, **kwargs):
        gate(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(train_module, "build_components", build_like_ray)
    monkeypatch.setattr(parity, "gate", gate_then_terminated)
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        state = train_module.train(compose_config(["train.num_steps=3", "logging.tensorboard=false"]), tmp_path / "run")
    assert state.preempted and state.step == 0
    assert "SIGTERM received before the first step: stopped" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is before
