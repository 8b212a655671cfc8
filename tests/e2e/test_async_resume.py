"""kill -9, then resume=auto, under schedule=async, stream and hybrid: the resumed run trains the same prompts in
the same order as an uninterrupted run (`prompts.jsonl`), and async and stream never exceed `schedule.max_staleness`.

The killed run is the real CLI. It hangs in the policy loss of step HANG_STEP (a test hook plugged in by config),
so the kill lands at a known point: step HANG_STEP - 1 trained and logged after the last checkpoint (step 2) and,
under async and stream, batches HANG_STEP and HANG_STEP + 1 drawn and sampled ahead of training (stream: possibly
half-sampled, then drawn again on resume). The reference and the resumed
run go through `rlhf.train.train` in this process (two interpreters fewer).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from rlhf.config.compose import compose_config
from rlhf.train import train
from test_resume import assert_same_curve, checkpoint_steps, metrics_by_step, sigterm_after

pytestmark = pytest.mark.slow

STEPS, HANG_STEP = 6, 4
COMMON = [
    f"train.num_steps={STEPS}", "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=4",
    "train.micro_batch_size=16",  # one policy-loss call per step
    "eval.every=0", "eval.max_prompts=4", "eval.num_samples=1", "eval.greedy=false", "logging.tensorboard=false",
    "checkpoint.save_final_model=false", "checkpoint.every=2", "checkpoint.keep_last=0", "seed=3",
    "algorithm.policy_loss.name=hang_loss.hang_on_a_call",
]
SCHEDULES = {
    "async": ["schedule=async", "schedule.max_staleness=1"], "hybrid": ["schedule=hybrid"],
    "stream": ["schedule=stream", "schedule.max_staleness=1", "schedule.chunk_tokens=1"],
}

HANG_LOSS = '''
import os
import pathlib
import time

from rlhf.algorithms.policy_losses import ppo_clip

calls = 0


def hang_on_a_call(logp, batch, cfg):
    """GRPO's policy loss (ppo_clip); with HANG_AT_CALL set, call number HANG_AT_CALL touches HANG_MARKER and hangs."""
    global calls
    calls += 1
    if calls == int(os.environ.get("HANG_AT_CALL", 0)):
        pathlib.Path(os.environ["HANG_MARKER"]).touch()
        time.sleep(600)
    return ppo_clip(logp, batch, cfg)
'''


def trained_prompts(run_dir: Path) -> dict[int, list[int]]:
    """Step -> the training-split indices of the prompts it trained, from `prompts.jsonl`."""
    rows = [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows]
    assert steps == sorted(set(steps)), f"each step recorded once, in order: {steps}"
    return {row["step"]: row["prompts"] for row in rows}


@pytest.fixture
def hook(tmp_path, monkeypatch) -> Path:
    """The folder holding `hang_loss.py`, importable here and by the CLI (PYTHONPATH)."""
    folder = tmp_path / "hook"
    folder.mkdir()
    (folder / "hang_loss.py").write_text(HANG_LOSS)
    monkeypatch.syspath_prepend(str(folder))
    return folder


def kill_9_in_step(args: list[str], run_dir: Path, hook: Path) -> None:
    """Run the CLI until it hangs in the update of step HANG_STEP, then SIGKILL it."""
    marker = run_dir.parent / "hanging"
    pythonpath = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": pythonpath, "HANG_AT_CALL": str(HANG_STEP), "HANG_MARKER": str(marker)}
    proc = subprocess.Popen([sys.executable, "-m", "rlhf.train", *args, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not marker.exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # under async, the producer samples batch HANG_STEP + 1 meanwhile (version HANG_STEP - 1 is out)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_kill_9_then_resume_trains_the_same_prompts_in_the_same_order(schedule, tmp_path, hook):
    args = [*COMMON, *SCHEDULES[schedule]]
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "killed" / "run"
    run_dir.parent.mkdir()
    train(compose_config(args), reference_dir)
    kill_9_in_step(args, run_dir, hook)
    assert checkpoint_steps(run_dir) == [2]
    assert sorted(trained_prompts(run_dir)) == [1, 2, 3], "step 3 trained and logged after the checkpoint"
    with open(run_dir / "prompts.jsonl", "a") as f:
        f.write('{"step": 4, "prom')  # as a kill in the middle of a write would leave it
    train(compose_config([*args, "resume=auto"]), run_dir)

    reference, resumed = trained_prompts(reference_dir), trained_prompts(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == reference, "the same prompts at every step, in the same order"
    counts = Counter(i for ids in resumed.values() for i in ids)
    assert counts == Counter(i for ids in reference.values() for i in ids) and None not in counts
    rows = metrics_by_step(run_dir)
    assert sorted(rows) == list(range(1, STEPS + 1)), "every step logged once: nothing replayed, nothing skipped"
    if schedule == "hybrid":  # synchronous: the resumed run is the uninterrupted one, bit for bit (CPU)
        assert_same_curve(rows, metrics_by_step(reference_dir), range(1, STEPS + 1))
    else:  # the generator restarts on the checkpoint's weights: its first batch is on-policy, no older one is reused
        staleness = {step: rows[step]["async/staleness_max"] for step in rows}
        assert max(staleness.values()) <= 1 and staleness[3] == 0, staleness
        assert rows[3]["async/policy_version"] == 2


def test_sigterm_under_stream_on_the_long_tail_task_then_resume_trains_the_same_prompts(tmp_path):
    """SIGTERM while responses are half-sampled (the long-tail counting task, 4-token chunks): the run saves and
    exits 5; resumed, it draws the unfinished groups again and trains, step for step, the prompts an uninterrupted
    run trains, every step logged once."""
    steps = 8
    args = ["experiment=stream_count_tiny", f"train.num_steps={steps}", "train.prompts_per_step=4", "eval.every=0",
            "eval.max_prompts=4", "eval.greedy=false", "eval.num_samples=1", "logging.tensorboard=false",
            "checkpoint.save_final_model=false", "checkpoint.keep_last=0", "schedule.chunk_tokens=4", "seed=3"]
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    train(compose_config(args), reference_dir)
    sigterm_after([*args, f"hydra.run.dir={run_dir}"], run_dir, 2, tmp_path)
    (saved,) = checkpoint_steps(run_dir)
    assert saved < steps
    state = json.loads((run_dir / "checkpoints" / f"step_{saved:08d}" / "trainer_state.json").read_text())
    assert state["prompts"]["replay"], "groups drawn ahead of training are listed to be drawn again"
    train(compose_config([*args, "resume=auto"]), run_dir)
    assert trained_prompts(run_dir) == trained_prompts(reference_dir)
    assert sorted(metrics_by_step(run_dir)) == list(range(1, steps + 1))
