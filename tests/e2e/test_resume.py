"""Checkpoints, exact resume, preemption, export, and non-finite steps, through the real CLI."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from test_cli import run_cli, scalars

pytestmark = pytest.mark.slow

STEPS = 60  # long enough that a kill or a SIGTERM lands mid-run even on a fast machine (a step is ~30 ms here)

# metrics that depend on the samples, the weights and the optimiser: equal only if the state is restored exactly
COMPARED = ("objective/scores", "objective/kl", "objective/entropy", "loss/policy_avg", "policy/grad_norm", "epoch", "lr")


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "episode" in row}


def assert_same_curve(a: dict[int, dict], b: dict[int, dict], steps) -> None:
    for step in steps:
        for key in COMPARED:
            assert a[step][key] == b[step][key], f"step {step} {key}: {a[step][key]} != {b[step][key]}"


def checkpoint_steps(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if (p / "trainer_state.json").is_file()) if root.is_dir() else []


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    """An uninterrupted 60-step run (the curve resumed runs must reproduce)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    run_cli(f"train.num_steps={STEPS}", "eval.every=0", "seed=5", f"hydra.run.dir={run_dir}", cwd=run_dir.parent)
    return run_dir


def test_kill_9_then_resume_reproduces_the_uninterrupted_run(reference_run, tmp_path):
    """SIGKILL at a random step, resume=auto in the same folder: steps after the checkpoint match bitwise (CPU)."""
    run_dir = tmp_path / "run"
    args = [f"train.num_steps={STEPS}", "eval.every=0", "seed=5", "checkpoint.every=2", "checkpoint.keep_last=0", f"hydra.run.dir={run_dir}"]
    kill_at_a_checkpoint(args, run_dir, random.Random().choice([4, 6, 8, 10]))
    resume_and_compare(args, run_dir, reference_run)


def test_bf16_weights_with_float32_masters_resume_exactly(tmp_path):
    """`model.dtype=bfloat16` (bf16 weights, float32 masters in the optimiser): a checkpoint keeps the masters, so
    kill -9 and resume reproduce the uninterrupted run bitwise, as the float32 path does."""
    steps = 40  # the kill must land mid-run (a step is ~40 ms here)
    base = [f"train.num_steps={steps}", "eval.every=0", "seed=5", "model.dtype=bfloat16"]
    reference = tmp_path / "reference" / "run"
    reference.parent.mkdir()
    run_cli(*base, f"hydra.run.dir={reference}", cwd=reference.parent)
    run_dir = tmp_path / "run"
    args = [*base, "checkpoint.every=2", "checkpoint.keep_last=0", f"hydra.run.dir={run_dir}"]
    kill_at_a_checkpoint(args, run_dir, 4, steps)
    resume_and_compare(args, run_dir, reference, steps)


def kill_at_a_checkpoint(args: list[str], run_dir: Path, kill_after: int, steps: int = STEPS) -> None:
    """Start the CLI with ``args`` (its output in ``run_dir``) and SIGKILL it once a checkpoint of step >= ``kill_after``
    is complete, before the run ends."""
    proc = subprocess.Popen([sys.executable, "-m", "rlhf.train", *args], cwd=run_dir.parent, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not any(s >= kill_after for s in checkpoint_steps(run_dir)):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert checkpoint_steps(run_dir)[-1] < steps


def resume_and_compare(args: list[str], run_dir: Path, reference_run: Path, steps: int = STEPS) -> None:
    """Resume the killed run (resume=auto): each of its ``steps`` is logged once and matches ``reference_run`` bitwise."""
    run_cli(*args, "resume=auto", cwd=run_dir.parent)
    resumed, reference = metrics_by_step(run_dir), metrics_by_step(reference_run)
    assert sorted(resumed) == list(range(1, steps + 1)), "every step logged once: nothing replayed, nothing skipped"
    assert_same_curve(resumed, reference, range(1, steps + 1))


def test_resume_at_an_epoch_boundary_trains_the_next_epoch(tmp_path):
    """100 prompts, 20 per step: step 5 ends epoch 1. Resuming there continues into epoch 2 with no replay."""
    common = ["train.prompts_per_step=20", "train.micro_batch_size=32", "eval.every=0", "seed=7", "checkpoint.every=5"]
    full = tmp_path / "full"
    run_cli(*common, "train.num_steps=10", f"hydra.run.dir={full}", cwd=tmp_path)
    split = tmp_path / "split"
    run_cli(*common, "train.num_steps=5", f"hydra.run.dir={split}", cwd=tmp_path)
    assert checkpoint_steps(split) == [5]
    run_cli(*common, "train.num_steps=10", "resume=auto", f"hydra.run.dir={split}", cwd=tmp_path)
    a, b = metrics_by_step(full), metrics_by_step(split)
    assert sorted(b) == list(range(1, 11))
    assert b[5]["epoch"] == 1.0 and b[6]["epoch"] == 1.2 and b[10]["epoch"] == 2.0
    assert_same_curve(a, b, range(6, 11))


def test_resume_auto_starts_fresh_on_an_empty_or_partial_checkpoint_folder(tmp_path):
    run_dir = tmp_path / "run"
    partial = run_dir / "checkpoints" / "step_00000003"
    partial.mkdir(parents=True)  # a folder with no trainer_state.json: a save that never finished
    (run_dir / "checkpoints" / ".tmp-step_00000004-123").mkdir()
    proc = run_cli("train.num_steps=2", "eval.every=0", "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert "no complete checkpoint" in proc.stdout + proc.stderr
    assert sorted(metrics_by_step(run_dir)) == [1, 2]


def test_keep_last_prunes_old_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    run_cli("train.num_steps=8", "eval.every=0", "checkpoint.every=2", "checkpoint.keep_last=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert checkpoint_steps(run_dir) == [6, 8]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_resume_from_a_path_that_is_no_checkpoint_fails_clearly(tmp_path):
    proc = run_cli("train.num_steps=2", f"resume={tmp_path}", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "not a complete checkpoint folder" in proc.stdout + proc.stderr


def sigterm_after(args: list[str], run_dir: Path, steps: int, cwd: Path) -> str:
    """Start the CLI with ``args``, send SIGTERM once ``steps`` steps are logged in ``run_dir``, and return its output;
    it must exit 5 (interrupted and saved: rlhf.exits.INTERRUPTED_SAVED), not finish."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf.train", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + 300
    while not (run_dir / "metrics.jsonl").exists() or len(metrics_by_step(run_dir)) < steps:
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 5, out[-2000:]
    return out


def test_sigterm_saves_a_checkpoint_and_the_run_resumes(reference_run, tmp_path):
    run_dir = tmp_path / "run"
    args = [f"train.num_steps={STEPS}", "eval.every=0", "seed=5", f"hydra.run.dir={run_dir}"]
    out = sigterm_after(args, run_dir, 3, tmp_path)
    assert "SIGTERM" in out and "resume=auto" in out
    (saved,) = checkpoint_steps(run_dir)
    assert saved == max(metrics_by_step(run_dir)) < STEPS
    assert not (run_dir / "final_model").exists(), "a preempted run is not finished"
    run_cli(*args, "resume=auto", cwd=tmp_path)
    assert_same_curve(metrics_by_step(run_dir), metrics_by_step(reference_run), range(1, STEPS + 1))


def test_exported_model_loads_with_plain_transformers_and_generates_the_same_tokens(reference_run):
    """The final policy folder needs no code from this project, and matches the trained weights."""
    folder = reference_run / "final_model"
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert (folder / "model.safetensors").is_file()
    from rlhf.models.loading import load_causal_lm

    ours = load_causal_lm(str(folder))
    prompt = tokenizer(["3+4=", "9+9="], return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    plain = model.generate(**prompt, **kwargs)
    torch.manual_seed(0)
    mine = ours.generate(**prompt, **kwargs)
    assert torch.equal(plain, mine)
    assert not torch.equal(model.model.embed_tokens.weight, load_causal_lm("builtin:tiny_arith").model.embed_tokens.weight), "trained weights were exported"


NAN_LOSS = '''
from rlhf.algorithms.policy_losses import ppo_clip

bad_calls = {BAD}
calls = 0


def nan_on_some_steps(logp, batch, cfg):
    """GRPO's policy loss (ppo_clip) made NaN on the calls listed in `bad_calls` (a test hook plugged in by config)."""
    global calls
    out = ppo_clip(logp, batch, cfg)
    calls += 1
    if calls in bad_calls:
        out.loss = out.loss * float("nan")
    return out
'''


def write_nan_loss(folder: Path, bad_calls: set[int]) -> dict:
    (folder / "nan_loss.py").write_text(NAN_LOSS.replace("{BAD}", repr(bad_calls)))
    return {"PYTHONPATH": str(folder)}


def test_non_finite_loss_is_skipped_and_counted(tmp_path):
    env = write_nan_loss(tmp_path, {3, 4})  # one micro batch per step: steps 3 and 4 get a NaN loss
    run_dir = tmp_path / "run"
    run_cli(
        "algorithm.policy_loss.name=nan_loss.nan_on_some_steps", "train.num_steps=6", "eval.every=0",
        "train.micro_batch_size=128", f"hydra.run.dir={run_dir}", cwd=tmp_path, env_extra=env,
    )
    skipped = dict(scalars(run_dir)["train/skipped_steps"])
    assert skipped == {1: 0, 2: 0, 3: 1, 4: 2, 5: 2, 6: 2}
    rows = metrics_by_step(run_dir)
    assert "policy/grad_norm" not in rows[3] and "policy/grad_norm" in rows[5]


def test_too_many_non_finite_steps_in_a_row_stop_the_run(tmp_path):
    env = write_nan_loss(tmp_path, {2, 3, 4})
    proc = run_cli(
        "algorithm.policy_loss.name=nan_loss.nan_on_some_steps", "train.num_steps=6", "eval.every=0",
        "train.micro_batch_size=128", "train.max_skipped_steps_in_row=3", cwd=tmp_path, env_extra=env, check=False,
    )
    assert proc.returncode == 3
    assert "3 optimiser steps in a row had a non-finite loss (train.max_skipped_steps_in_row=3)" in proc.stdout + proc.stderr
