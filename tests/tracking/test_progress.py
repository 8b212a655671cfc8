"""The console: a live bar only where asked (auto = a terminal), plain lines every `logging.log_every` steps."""

from __future__ import annotations

import io
import logging
import sys

import pytest
from omegaconf import OmegaConf

from rlhf.config.schema import LoggingConfig
from rlhf.tracking.progress import ProgressBar, postfix, wants_bar
from rlhf.tracking.tracker import Tracker

METRICS = {"objective/scores": 0.25, "objective/kl": 0.0031, "time/step": 0.42, "loss/policy_avg": -0.1}
CONTROL = ("\r", "\x1b")  # what a bar writes and a log file must never hold


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def settings(**overrides):
    return OmegaConf.merge(OmegaConf.structured(LoggingConfig), overrides)


@pytest.mark.parametrize(
    ("setting", "stream", "expected"),
    [("auto", io.StringIO(), False), ("auto", Terminal(), True), ("true", io.StringIO(), True),
     (True, io.StringIO(), True), ("True", io.StringIO(), True), ("false", Terminal(), False),
     (False, Terminal(), False)],
)
def test_auto_shows_the_bar_on_a_terminal_only_and_true_false_force_it(setting, stream, expected, monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    assert wants_bar(setting, stream) is expected


def test_a_dumb_terminal_gets_no_bar(monkeypatch):
    monkeypatch.setenv("TERM", "dumb")
    assert not wants_bar("auto", Terminal())


def test_the_bar_shows_step_eta_score_kl_and_seconds_per_step():
    stream = Terminal()
    bar = ProgressBar(stream)
    for step in (1, 2, 3):
        bar.update(step, 10, METRICS)
    bar.close()
    shown = stream.getvalue().split("\r")[-1]
    assert "step 3/10" in shown and "<" in shown, shown  # elapsed<remaining
    assert "score +0.250, kl 0.0031, s/step 0.42" in shown
    assert postfix({"time/step": 1.0}) == "s/step 1.00"


def test_a_resumed_run_starts_the_bar_at_its_first_step():
    stream = Terminal()
    bar = ProgressBar(stream)
    bar.update(41, 50, METRICS)
    assert bar.bar.n == 41 and bar.bar.initial == 40
    bar.close()


def test_off_a_terminal_only_plain_lines_every_log_every_steps_and_at_the_last(tmp_path, caplog, capsys):
    tracker = Tracker(tmp_path, tensorboard=False, settings=settings(log_every=4))  # stderr is pytest's capture
    assert tracker.bar is None
    with caplog.at_level(logging.INFO, logger="rlhf"), tracker:
        for step in range(1, 11):
            tracker.console(step, 10, METRICS)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split("|")[0].strip() for line in lines] == ["step    4/10", "step    8/10", "step   10/10"]
    assert lines[-1] == "step   10/10 | score +0.250 | kl 0.0031 | loss -0.1000 | s/step 0.42"
    captured = capsys.readouterr()
    assert not any(c in captured.out + captured.err for c in CONTROL)


def test_without_settings_the_tracker_prints_every_step(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="rlhf"), Tracker(tmp_path, tensorboard=False) as tracker:
        for step in range(1, 4):
            tracker.console(step, 3, METRICS)
    assert len(caplog.records) == 3


def test_log_records_print_above_an_open_bar(monkeypatch):
    """While the bar is open, console handlers (as Hydra's, on stdout or stderr) write through tqdm."""
    root = logging.getLogger()
    monkeypatch.setattr(sys, "stderr", Terminal())
    handler = logging.StreamHandler(sys.stderr)
    root.addHandler(handler)
    try:
        bar = ProgressBar(Terminal())
        bar.update(1, 5, METRICS)
        assert handler not in root.handlers, "the console handler is swapped for tqdm's while the bar is open"
        bar.close()
        assert handler in root.handlers
    finally:
        root.removeHandler(handler)


def test_on_a_terminal_the_bar_moves_each_step_and_lines_come_every_log_every(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setenv("TERM", "xterm")
    with caplog.at_level(logging.INFO, logger="rlhf"):
        with Tracker(tmp_path, tensorboard=False, settings=settings(log_every=2)) as tracker:
            for step in range(1, 4):
                tracker.console(step, 3, METRICS)
            assert tracker.bar.bar.n == 3
    assert [r.getMessage()[:12] for r in caplog.records] == ["step    2/3 ", "step    3/3 "]
    assert "step 3/3" in sys.stderr.getvalue() and "s/step 0.42" in sys.stderr.getvalue()
