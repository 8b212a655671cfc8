"""LoRA through the real CLI: it learns (single- and multi-turn), resumes exactly after kill -9, checkpoints hold the
adapters only, and the exports load with plain transformers and peft."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from run_records import records
from test_cli import run_cli
from test_resume import kill_at_a_checkpoint, resume_and_compare
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.models.loading import load_causal_lm

pytestmark = pytest.mark.slow

STEPS = 40
LORA = ["policy.lora.rank=8", "policy.lora.alpha=16", "algorithm.beta=0.02", "seed=5"]  # beta > 0: the KL against the adapters-off base


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """An uninterrupted LoRA GRPO run on the built-in task, evaluated at its start and end."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    run_cli(*LORA, f"train.num_steps={STEPS}", f"eval.every={STEPS}", f"hydra.run.dir={run_dir}", cwd=run_dir.parent)
    return run_dir


def test_lora_grpo_learns_the_builtin_task_with_a_kl_to_the_base(lora_run):
    steps = records(lora_run)
    start, end = steps[0], steps[STEPS]
    assert end["eval/greedy_correct_rate"] - start["eval/greedy_correct_rate"] >= 0.3, (start, end)
    assert end["eval/sampled_correct_rate"] - start["eval/sampled_correct_rate"] >= 0.3, (start, end)
    kl = [steps[s]["objective/kl"] for s in range(1, STEPS + 1)]
    assert kl[0] < 1e-6 < kl[-1], "adapters start at zero (policy == base), then move away from it"
    sync_mb = steps[1]["perf/weight_sync_mb"]
    assert 0 < sync_mb
    log = (lora_run / "train.log").read_text()
    assert "policy trains LoRA adapters (rank 8, alpha 16)" in log and "weight sync per step" in log
    assert "reference: the policy's base weights with its LoRA adapters off" in log


def test_exports_are_a_merged_model_and_a_peft_adapter_that_generate_the_same_tokens(lora_run):
    merged = AutoModelForCausalLM.from_pretrained(lora_run / "final_model")
    tokenizer = AutoTokenizer.from_pretrained(lora_run / "final_model")
    base = load_causal_lm("builtin:tiny_arith")
    adapted = PeftModel.from_pretrained(load_causal_lm("builtin:tiny_arith"), lora_run / "final_adapter")
    prompt = tokenizer(["3+4=", "9+9=", "41+17=", "5+60="], return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        assert torch.equal(merged.generate(**prompt, **kwargs), adapted.generate(**prompt, **kwargs))
        assert not torch.equal(merged(**prompt).logits, base(**prompt).logits), "the trained adapters were exported"
    assert sorted(p.name for p in (lora_run / "final_adapter").glob("adapter_*")) == ["adapter_config.json", "adapter_model.safetensors"]


def test_kill_9_then_resume_reproduces_the_uninterrupted_lora_run(lora_run, tmp_path):
    """SIGKILL at a random checkpoint, resume=auto: every later step matches the uninterrupted run bitwise; the
    checkpoints hold the adapters and their optimiser state only."""
    run_dir = tmp_path / "run"
    args = [*LORA, f"train.num_steps={STEPS}", f"eval.every={STEPS}", "checkpoint.every=2", "checkpoint.keep_last=0",
            f"hydra.run.dir={run_dir}"]
    kill_at_a_checkpoint(args, run_dir, random.Random().choice([4, 6, 8]), STEPS)
    saved = sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "policy" / "model"
    assert (saved / "adapter_model.safetensors").is_file() and not list(saved.glob("model*.safetensors"))
    resume_and_compare(args, run_dir, lora_run, STEPS)

def test_the_multiturn_preset_learns_with_lora(tmp_path):
    """`experiment=multiturn_tiny` with rank-8 adapters, shortened to 30 steps: success on the episodes rises clearly."""
    out = tmp_path / "run"
    run_cli("experiment=multiturn_tiny", "policy.lora.rank=8", "policy.lora.alpha=32", "train.num_steps=30", "eval.every=30",
            f"hydra.run.dir={out}", cwd=tmp_path)
    steps = records(out)
    start, end = steps[0], steps[30]
    assert end["eval/greedy_success_rate"] - start["eval/greedy_success_rate"] >= 0.3, (start, end)
    assert end["eval/sampled_success_rate"] - start["eval/sampled_success_rate"] >= 0.2, (start, end)
