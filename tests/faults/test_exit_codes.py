"""Exit codes say what happened (`rlhf.exits`), and an error in user code is one paragraph naming the user's function,
with the traceback kept in the run's log file. `rlhf.train.main` runs in-process with `train` replaced."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import rlhf.train
from rlhf import exits
from rlhf.config import ConfigError
from rlhf.distributed.remote import WorkerError
from rlhf.run.state import NonFiniteError, RunState

USER_MODULE = '''
def my_reward(prompts, responses, ground_truths, **_):
    return helper(responses)


def helper(responses):
    raise KeyError("no score for " + repr(responses[0]))
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards_for_exits.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_rewards_for_exits

    return user_rewards_for_exits


def raised_by(fn, *args) -> Exception:
    try:
        fn(*args)
    except Exception as err:
        return err
    raise AssertionError("did not raise")


def test_the_message_names_the_users_innermost_function_and_line(user_module):
    err = raised_by(user_module.my_reward, [], ["7"], [])
    message = exits.describe_failure(err, "fix it")
    assert message.startswith("helper() raised KeyError: \"no score for '7'\"")
    assert "user_rewards_for_exits.py:7: raise KeyError" in message
    assert message.endswith("(full traceback in the run's log file; fix it)")


def test_an_error_from_our_own_code_says_so_without_a_user_frame():
    err = raised_by(RunState.from_dict, {}, 3)
    assert exits.user_frame(err) is None
    assert exits.describe_failure(err).startswith("the run raised KeyError: 'step'")


def run_main(tmp_path, monkeypatch, outcome) -> int:
    """Exit code of `python -m rlhf.train` (in-process) when `train` returns or raises ``outcome``."""

    def fake_train(cfg, out):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(rlhf.train, "train", fake_train)
    monkeypatch.setattr(sys, "argv", ["rlhf.train", f"hydra.run.dir={tmp_path / 'run'}", "hydra.job.name=train"])
    with pytest.raises(SystemExit) as exited:
        rlhf.train.main()
    return exited.value.code


@pytest.mark.parametrize(
    ("outcome", "code"),
    [
        (ConfigError("train.lr=-1 must be > 0"), exits.CONFIG_ERROR),
        (NonFiniteError("3 optimiser steps in a row"), exits.NON_FINITE),
        (WorkerError("policy rank 0 died"), exits.WORKER_FAILED),
        (RunState(step=3, preempted=True), exits.INTERRUPTED_SAVED),
    ],
)
def test_each_outcome_has_its_own_exit_code(tmp_path, monkeypatch, outcome, code):
    assert run_main(tmp_path, monkeypatch, outcome) == code


def test_user_code_raising_exits_6_with_one_paragraph_and_the_traceback_in_the_log(tmp_path, monkeypatch, user_module, capsys):
    assert run_main(tmp_path, monkeypatch, raised_by(user_module.my_reward, [], ["7"], [])) == exits.RUN_RAISED
    console = capsys.readouterr()
    assert "helper() raised KeyError" in console.out + console.err
    assert "Traceback" not in console.out + console.err
    log_file = (tmp_path / "run" / "train.log").read_text()
    assert "helper() raised KeyError" in log_file and "Traceback (most recent call last)" in log_file


@pytest.mark.slow
def test_the_cli_exits_6_naming_the_reward_function_and_saves_the_last_complete_step(tmp_path):
    (tmp_path / "breaking_rewards.py").write_text(
        "calls = 0\n\n\ndef breaks_at_step_2(prompts, responses, ground_truths, **_):\n    global calls\n    calls += 1\n"
        "    if calls == 2:\n        raise RuntimeError('judge timed out')\n    return [0.5] * len(responses)\n"
    )
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable, "-m", "rlhf.train", "train.num_steps=3", "train.prompts_per_step=4", "train.micro_batch_size=32",
            "eval.num_samples=0", "eval.greedy=false", "logging.tensorboard=false", f"hydra.run.dir={run_dir}",
            "reward.functions=[{name: breaking_rewards.breaks_at_step_2}]",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == exits.RUN_RAISED, console[-3000:]
    assert "breaks_at_step_2() raised RuntimeError: judge timed out" in console
    assert "breaking_rewards.py:8" in console and "Traceback" not in console
    assert "saved the last complete step 1" in console
    assert (run_dir / "checkpoints" / "step_00000001" / "trainer_state.json").is_file()
    assert "Traceback (most recent call last)" in (run_dir / "train.log").read_text()
    assert "fix it, then continue with resume=auto" in console


def test_a_failure_before_any_checkpoint_does_not_advise_resume(tmp_path):
    """Nothing was saved (the first step failed): resume=auto would start from step 0, so the advice is to start
    again, not to resume."""
    from rlhf.run.checkpoint import resume_hint

    assert resume_hint(tmp_path / "checkpoints") == (
        "fix it, then start the run again: no checkpoint was saved, so resume=auto would start from step 0")
    (tmp_path / "checkpoints" / "step_00000003").mkdir(parents=True)
    assert "start the run again" in resume_hint(tmp_path / "checkpoints")  # an unfinished save is no checkpoint
    (tmp_path / "checkpoints" / "step_00000003" / "trainer_state.json").write_text("{}")
    assert resume_hint(tmp_path / "checkpoints") == "fix it, then continue with resume=auto"


@pytest.mark.parametrize("override", ["train.bogus=1", "train.lr=fast", "algorithm=nope", "experiment=nope"])
def test_a_composition_error_exits_2_like_every_config_error(override):
    """Hydra's own errors (unknown key without `+`, wrong type, unknown group option or experiment) exit with the
    config-error code the README documents, 2, not Hydra's 1; Hydra's message stays."""
    done = subprocess.run([sys.executable, "-m", "rlhf.train", override], capture_output=True, text=True, timeout=300)
    assert done.returncode == exits.CONFIG_ERROR, done.stderr[-2000:]
    assert done.stderr.strip(), "the message that names the key"


def test_a_run_folder_that_cannot_be_made_is_a_config_error_not_hydras_traceback(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")  # root writes anywhere; a file in the path stops anyone
    proc = subprocess.run([sys.executable, "-m", "rlhf.train", f"hydra.run.dir={tmp_path / 'a_file' / 'run'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == exits.CONFIG_ERROR, proc.stderr[-2000:]
    assert f"hydra.run.dir={tmp_path / 'a_file' / 'run'}: the folder cannot be made (Not a directory)" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
