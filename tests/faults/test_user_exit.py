"""User code that calls `sys.exit` inside a run (a reward function here; environments and agents run through the same
step) is reported as that code's error: exit 6, the function and its line named, the last complete step saved. Before
this, `SystemExit` passed every `except Exception` and the run ended with exit 0, "finished", after 1 of 20 steps,
with no model, no checkpoint and no message."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlhf import exits

REWARDS = '''
import sys

calls = 0


def exits_on_call(prompts, responses, ground_truths, at=4, **_):
    global calls
    calls += 1
    if calls == at:
        sys.exit(0)
    return [0.0] * len(responses)
'''


def run(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    (tmp_path / "exiting_rewards.py").write_text(REWARDS)
    return subprocess.run(
        [sys.executable, "-m", "rlhf.train", "train.num_steps=20", "eval.every=0", "logging.tensorboard=false",
         f"hydra.run.dir={tmp_path / 'run'}", *overrides],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )


@pytest.mark.parametrize("schedule", ["sync", "async", "stream"])
def test_sys_exit_in_a_reward_function_stops_the_run_as_its_error_with_the_last_step_saved(tmp_path, schedule):
    # calls 1 and 2 score the evaluation at step 0, call 3 step 1, call 4 (step 2) exits; stream scores each of a
    # step's 16 groups as it ends: calls 3-18 are step 1's, call 20 one of step 2's
    at = 20 if schedule == "stream" else 4
    done = run(tmp_path, f"reward.functions=[{{name: exiting_rewards.exits_on_call, args: {{at: {at}}}}}]", f"schedule={schedule}")
    output = done.stdout + done.stderr
    assert done.returncode == exits.RUN_RAISED, output[-3000:]
    assert "UserExit: sys.exit(0) was called in exits_on_call (" in output
    assert "exiting_rewards.py:11) inside the run" in output  # the line of sys.exit(0)
    assert (tmp_path / "run" / "checkpoints" / "step_00000001" / "trainer_state.json").is_file()
    assert not (tmp_path / "run" / "final_model").exists()


def test_sys_exit_in_a_reward_function_fails_the_preflight_naming_it(tmp_path):
    done = run(tmp_path, "reward.functions=[{name: exiting_rewards.exits_on_call, args: {at: 1}}]", "preflight=true")
    output = done.stdout + done.stderr
    assert done.returncode == exits.RUN_RAISED, output[-3000:]
    assert "UserExit: sys.exit(0) was called in exits_on_call" in output


@pytest.mark.parametrize("code", [0, 3])
def test_sys_exit_in_a_reward_function_during_the_first_evaluation_is_its_error_not_the_runs_exit_code(tmp_path, code):
    """Calls 1 and 2 score the evaluation at step 0, before any step: before, a sys.exit there ended the run silently
    with the user's code (0 as "finished", 3 as "non-finite loss")."""
    rewards = REWARDS.replace("sys.exit(0)", f"sys.exit({code})")
    (tmp_path / "exiting_rewards.py").write_text(rewards)
    done = subprocess.run(
        [sys.executable, "-m", "rlhf.train", "train.num_steps=2", "logging.tensorboard=false",
         f"hydra.run.dir={tmp_path / 'run'}", "reward.functions=[{name: exiting_rewards.exits_on_call, args: {at: 1}}]"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    output = done.stdout + done.stderr
    assert done.returncode == exits.RUN_RAISED, output[-3000:]
    assert f"UserExit: sys.exit({code}) was called in exits_on_call" in output
