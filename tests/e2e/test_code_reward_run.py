"""`reward=code` wired end to end: the real chat model (SmolLM2-135M-Instruct) trains two GRPO steps on the built-in
code tasks through the CLI, its replies' code run in the sandbox."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_records import records

pytestmark = pytest.mark.slow

# Two steps of 2 prompts x 4 replies (8 sandbox runs a step; training time goes with the rows), and a greedy eval of
# one prompt before the first step and after the last (each eval's generate call decodes as long as a step's does).
SHORT = ["experiment=grpo_code_smollm2", "train.num_steps=2", "train.prompts_per_step=2",
         "algorithm.num_samples_per_prompt=4", "train.micro_batch_size=8", "eval.every=0", "eval.max_prompts=1",
         "eval.num_samples=0", "logging.tensorboard=false", "checks.parity_prompts=2", "checkpoint.save_final_model=false"]


def test_two_grpo_steps_scored_by_the_sandbox(tmp_path: Path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlhf.train", *SHORT, f"hydra.run.dir={out}"], cwd=tmp_path,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    steps = records(out)
    for step in (1, 2):
        row = steps[step]
        assert row["episode"] == 8 * step
        assert 0.0 <= row["reward/code_pass_rate"] <= 1.0 and row["reward/code_unscored"] == 0.0
        assert 0.0 <= row["reward/code_no_code_rate"] <= 1.0
        assert row["policy/grad_norm"] > 0  # the sandbox's scores differed within a group: a real update
    assert 0.0 <= steps[2]["eval/greedy_correct_rate"] <= 1.0  # the eval after the last step scored in the sandbox too
