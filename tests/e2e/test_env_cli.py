"""Multi-turn environments through the real CLI: GEM, a seed-003-shaped agent file, and the built-in task under the
other schedules, backends and generators, and across a resume."""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import pytest
import torch
from test_cli import run_cli

from rlhf.models.tiny import build_char_tokenizer, build_tiny_llama

pytestmark = pytest.mark.slow

QUIET = ["logging.tensorboard=false", "checkpoint.save_final_model=false"]

AGENT = '''
async def step(state, action, label, turn=0, **kw):
    """Right answer: reward 1 and done; wrong: the question again, one retry."""
    right = action == label
    question = state[: state.index("=") + 1]
    return float(right), state + action + question, right or turn >= 1, {"success": right}
'''


def records(run_dir: Path) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], {}).update(record)
    return by_step


def generations(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "eval_generations.jsonl").read_text().splitlines()]


def test_gem_guess_the_number_runs_end_to_end(tmp_path):
    """A tiny random character model plays GEM's GuessTheNumber for two GRPO steps; transcripts are written."""
    alphabet = string.ascii_letters + string.digits + string.punctuation + " \n"
    model = tmp_path / "ascii_model"
    tokenizer = build_char_tokenizer(alphabet)
    torch.manual_seed(0)
    build_tiny_llama(len(tokenizer), max_positions=1024).save_pretrained(model)
    tokenizer.save_pretrained(model)
    out = tmp_path / "run"
    run_cli(
        "env=gem", "env.template=no", "env.max_tokens=600", "env.eval_size=4", f"model.name_or_path={model}",
        "train.num_steps=2", "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=2", "generator.max_new_tokens=12",
        "eval.num_samples=0", *QUIET, f"hydra.run.dir={out}", cwd=tmp_path,
    )
    steps = records(out)
    assert all(steps[s]["env/num_episodes"] == 8 and -0.1 <= steps[s]["env/episode_return"] <= 1.0 for s in (1, 2))
    assert "eval/greedy_success_rate" in steps[2]
    evals = generations(out)
    assert len(evals) == 2 * 4 and all(r["response"].startswith("[assistant]") for r in evals)
    assert all("GuessTheNumber" in r["prompt"] or "guess" in r["prompt"].lower() for r in evals)


def test_agent_function_file_runs_end_to_end(tmp_path):
    """`env=agent_func` with a seed-003-shaped step function and a JSONL of tasks: two turns per wrong first answer."""
    agent = tmp_path / "my_agent.py"
    agent.write_text(AGENT)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n" for a in range(5) for b in range(5)))
    out = tmp_path / "run"
    run_cli(
        "env=agent_func", f"env.path={agent}", "dataset=jsonl", f"dataset.path={tasks}", "dataset.ground_truth_key=label",
        "dataset.chat_template='{{ messages[0].content }}'", "train.num_steps=3", "train.prompts_per_step=8",
        "eval.max_prompts=8", *QUIET, f"hydra.run.dir={out}", cwd=tmp_path,
    )
    steps = records(out)
    for s in (1, 2, 3):
        assert 1.0 <= steps[s]["env/num_turns_per_episode"] <= 2.0 and steps[s]["env/failed_episodes"] == 0
        assert steps[s]["env/success_rate"] == pytest.approx(steps[s]["env/episode_return"])  # reward 1 exactly on success
    assert any("[user]" in r["response"] for r in generations(out))  # a retry after a wrong first answer


def test_the_multiturn_preset_learns(tmp_path):
    """`experiment=multiturn_tiny`, shortened to 25 steps: success rises clearly, retries included."""
    out = tmp_path / "run"
    run_cli("experiment=multiturn_tiny", "train.num_steps=25", "eval.every=0", f"hydra.run.dir={out}", cwd=tmp_path)
    steps = records(out)
    start, end = steps[0], steps[25]
    assert start["eval/greedy_num_turns_per_episode"] > 1.5, "the warm start is mostly wrong: most episodes retry"
    assert end["eval/greedy_success_rate"] - start["eval/greedy_success_rate"] >= 0.3, (start, end)
    assert end["eval/sampled_success_rate"] - start["eval/sampled_success_rate"] >= 0.25, (start, end)
    assert end["eval/sampled_later_turn_success_rate"] > start["eval/sampled_later_turn_success_rate"] + 0.1, (start, end)
    assert any("[user] " in g["response"] and "(reward 0.55)" in g["response"] for g in generations(out)), \
        "some retry was right and earned the retry reward"


# the built-in multi-turn task, small and short: these runs check the plumbing; tests/envs checks the learning
RETRY = ["env=arith_retry", "train.prompts_per_step=8", "eval.max_prompts=4", "eval.num_samples=0", *QUIET]
RESUMED = ("env/episode_return", "env/num_turns_per_episode", "loss/policy_avg", "policy/grad_norm", "epoch")


def test_resume_continues_the_same_episode_stream(tmp_path):
    """Two steps, a checkpoint, resume=auto to four: steps 3 and 4 equal an uninterrupted run's, bitwise."""
    ref, split = tmp_path / "ref", tmp_path / "split"
    run_cli(*RETRY, "train.num_steps=4", f"hydra.run.dir={ref}", cwd=tmp_path)
    run_cli(*RETRY, "train.num_steps=2", "checkpoint.every=2", f"hydra.run.dir={split}", cwd=tmp_path)
    run_cli(*RETRY, "train.num_steps=4", "checkpoint.every=2", "resume=auto", f"hydra.run.dir={split}", cwd=tmp_path)
    a, b = records(ref), records(split)
    for step in (3, 4):
        for key in RESUMED:
            assert a[step][key] == b[step][key], f"step {step} {key}: {a[step][key]} != {b[step][key]}"


def test_async_schedule_with_a_vllm_engine_plays_episodes_on_one_policy_version(tmp_path):
    if not os.environ.get("RLHF_REQUIRE_VLLM"):
        pytest.importorskip("vllm", reason="vLLM is not installed (see the README); CI sets RLHF_REQUIRE_VLLM=1")
    out = tmp_path / "run"
    run_cli(*RETRY, "schedule=async", "generator=vllm", "generator.kv_cache_memory_bytes=67108864", "train.num_steps=4",
            f"hydra.run.dir={out}", cwd=tmp_path)
    steps = records(out)
    for s in range(1, 5):
        assert steps[s]["async/staleness_max"] <= 1 and steps[s]["env/num_episodes"] == 8 * 8
        assert steps[s]["env/num_turns_per_episode"] >= 1.0 and abs(steps[s]["train/kl_sample_train_v1"]) < 1.0
    assert "eval/greedy_success_rate" in steps[4]


def test_hybrid_schedule_on_ray_plays_episodes_with_two_generator_ranks(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(
        *RETRY, "cluster=ray_local", "schedule=hybrid", "cluster.roles.generator.devices_per_node=2",
        "cluster.colocate=[[actor,ref,generator]]", "train.num_steps=3", f"hydra.run.dir={out}",
        cwd=tmp_path, env_extra={"RAY_AUTH_MODE": "disabled"},
    )
    assert "placed on Ray: actor x2, ref x2, generator x2" in proc.stdout + proc.stderr
    steps = records(out)
    assert all(steps[s]["env/num_episodes"] == 64 and steps[s]["memory/generator_freed_mb"] > 0 for s in (1, 2, 3))
    assert abs(steps[3]["train/kl_sample_train_v1"]) < 1e-3  # hybrid is on-policy: the generator's logprobs are the trainer's
