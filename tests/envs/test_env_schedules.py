"""Env runs in-process under every schedule: hybrid reproduces sync metric for metric, async plays within its staleness
bound, resume=auto continues the same episode stream bitwise, and an OpenRLHF-style agent file trains.

(The CLI runs of the preset, GEM and the agent file are in tests/e2e/test_env_cli.py; Ray in
tests/distributed/test_ray_backend.py; vLLM in tests/generators/test_vllm.py.)"""

from __future__ import annotations

import json
from pathlib import Path

from run_records import records
from rlhf.config.compose import compose_config
from rlhf.train import train

# the built-in multi-turn task, small: 4 problems x 4 episodes per step
RETRY = ["env=arith_retry", "model=tiny_arith_retry", "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=4",
         "train.micro_batch_size=16", "eval.max_prompts=4", "eval.num_samples=2", "logging.tensorboard=false",
         "checkpoint.save_final_model=false"]
SAME = ("env/episode_return", "env/num_turns_per_episode", "objective/entropy", "loss/policy_avg", "policy/grad_norm",
        "eval/sampled_success_rate")

AGENT = '''
async def step(state, action, label, turn=0, **kw):
    """Right answer: reward 1 and done; wrong: the question again, one retry."""
    right = action == label
    question = state[: state.index("=") + 1]
    return float(right), state + action + question, right or turn >= 1, {"success": right}
'''


def run(out: Path, *overrides: str) -> dict[int, dict]:
    train(compose_config([*RETRY, *overrides]), out)
    return records(out)


def assert_same(a: dict[int, dict], b: dict[int, dict], steps) -> None:
    for step in steps:
        for key in SAME:
            if key in a[step]:
                assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])


def test_hybrid_env_run_reproduces_the_sync_run(tmp_path):
    sync = run(tmp_path / "sync", "train.num_steps=3")
    hybrid = run(tmp_path / "hybrid", "train.num_steps=3", "schedule=hybrid")
    assert sorted(sync) == sorted(hybrid) == [0, 1, 2, 3]
    assert_same(sync, hybrid, sync)
    assert all(hybrid[s]["memory/generator_freed_mb"] > 0 for s in (1, 2, 3))


def test_async_env_run_stays_within_the_staleness_bound(tmp_path):
    steps = run(tmp_path / "async", "train.num_steps=4", "schedule=async")
    for s in range(1, 5):
        assert steps[s]["async/staleness_max"] <= 1 and steps[s]["env/num_episodes"] == 16
        assert 1.0 <= steps[s]["env/num_turns_per_episode"] <= 2.0
    assert steps[1]["async/staleness_max"] == 0 and max(steps[s]["async/staleness_max"] for s in (2, 3, 4)) == 1


def test_resume_continues_the_same_episode_stream(tmp_path):
    """Two steps, a checkpoint, resume=auto to four: steps 3 and 4 equal an uninterrupted run's, bitwise."""
    ref = run(tmp_path / "reference", "train.num_steps=4")
    run(tmp_path / "split", "train.num_steps=2", "checkpoint.every=2")
    resumed = run(tmp_path / "split", "train.num_steps=4", "checkpoint.every=2", "resume=auto")
    assert_same(ref, resumed, (3, 4))
    assert ref[4]["epoch"] == resumed[4]["epoch"]


def test_agent_function_file_trains(tmp_path):
    """`env=agent_func` with an OpenRLHF-shaped step function over a JSONL of tasks: wrong first answers retry."""
    agent = tmp_path / "my_agent.py"
    agent.write_text(AGENT)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n" for a in range(5) for b in range(5)))
    steps = run(
        tmp_path / "run", "train.num_steps=2", "env=agent_func", f"env.path={agent}", "env.max_turns=2", "env.max_tokens=64",
        "dataset=jsonl", "dataset.max_prompt_length=60",
        f"dataset.path={tasks}", "dataset.ground_truth_key=label", "dataset.chat_template='{{ messages[0].content }}'",
    )
    for s in (1, 2):
        assert 1.0 <= steps[s]["env/num_turns_per_episode"] <= 2.0 and steps[s]["env/failed_episodes"] == 0
        assert steps[s]["env/success_rate"] == steps[s]["env/episode_return"]  # reward 1 exactly on success
    rows = [json.loads(line) for line in (tmp_path / "run" / "eval_generations.jsonl").read_text().splitlines()]
    assert any("[user] " in r["response"] for r in rows)  # a retry after a wrong first answer
