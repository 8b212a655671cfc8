"""A reward function that never returns: SIGTERM asks for a graceful stop, which cannot come while the step waits in
user code, so a second SIGTERM stops the run at once (exit 143, nothing saved). Before, every SIGTERM was
acknowledged and ignored, and only SIGKILL ended the process (`timeout`, and a scheduler's stop, never got it back).
The hang is in a training step (async: in the producer thread, the trainer waiting for its batch) or in the first
evaluation, which runs outside the steps' error handling."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

HANGING_REWARD = '''
import inspect
import pathlib
import time

HANG_IN = {where!r}


def score(prompts, responses, ground_truths, **_):
    evaluating = any(frame.function == "run_eval" for frame in inspect.stack())
    if evaluating == (HANG_IN == "eval"):
        pathlib.Path(__file__).with_name("scoring").touch()
        time.sleep(10**6)
    return [0.0] * len(responses)
'''


@pytest.mark.parametrize("schedule,where", [("sync", "step"), ("async", "step"), ("sync", "eval")])
def test_a_second_sigterm_ends_a_run_stuck_in_a_reward_function(tmp_path, schedule, where):
    (tmp_path / "hang_reward.py").write_text(HANGING_REWARD.format(where=where))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf.train", "reward.functions=[{name: hang_reward.score}]", f"schedule={schedule}",
         "train.num_steps=3", "eval.every=0", "logging.tensorboard=false", f"hydra.run.dir={tmp_path / 'run'}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        deadline = time.monotonic() + 600  # generous: model set-up on a loaded machine
        while not (tmp_path / "scoring").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=60)[0][-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        time.sleep(2.0)  # past the window in which a repeat counts as the same signal
        assert proc.poll() is None  # the first asks for a graceful stop, which waits for the step
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]  # generous; the async producer is not waited for (it was 60 s)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "send it again to stop at once" in output and "a second SIGTERM: stopping now" in output
    assert "sys.exit" not in output and "raised" not in output  # not reported as the user's error (exit 6)
    assert not list((tmp_path / "run" / "checkpoints").glob("*"))  # stopped at once: nothing saved
