"""`experiment=agent_tiny` (the built-in multi-turn task as an OpenAI-SDK agent) trains under every schedule, and
the preset itself runs from the CLI as the README shows. (Ray: tests/distributed/test_ray_backend.py; vLLM:
tests/generators/test_vllm.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from run_records import records
from rlhf.config.compose import compose_config
from rlhf.errors import ConfigError
from rlhf.config.validate import validate
from rlhf.train import train

SMALL = ["experiment=agent_tiny", "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=4", "train.micro_batch_size=16",
         "eval.max_prompts=4", "eval.num_samples=2", "eval.every=2", "logging.tensorboard=false", "checkpoint.save_final_model=false"]


def run(out: Path, *overrides: str) -> dict[int, dict]:
    train(compose_config([*SMALL, *overrides]), out)
    return records(out)


@pytest.mark.parametrize("schedule", ["sync", "async", "hybrid"])
def test_the_agent_preset_trains_under_every_schedule(tmp_path, schedule):
    steps = run(tmp_path / schedule, "train.num_steps=2", f"schedule={schedule}")
    for s in (1, 2):
        assert steps[s]["env/num_episodes"] == 16 and steps[s]["env/failed_episodes"] == 0
        assert 1.0 <= steps[s]["env/num_turns_per_episode"] <= 2.0
        assert steps[s]["env/generate_calls"] < steps[s]["env/generated_rows"]
    assert "eval/greedy_success_rate" in steps[2]


def test_env_chains_all_is_refused_with_a_grouped_estimator():
    validate(compose_config([*SMALL, "env.chains=all"]))  # rebn: any number of rows per task
    grouped = ["env=openai_agent", "env.path=examples/agents/arith_retry.py", "env.chat_template=plain", "env.chains=all"]
    with pytest.raises(ConfigError, match="env.chains=all .* algorithm.advantage=grpo"):
        validate(compose_config(grouped))


@pytest.mark.slow
def test_the_preset_runs_from_the_command_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "rlhf.train", *SMALL, "train.num_steps=1", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "agent endpoint listening on http://127.0.0.1:" in out.stderr + out.stdout
    assert "HTTP Request" not in out.stderr + out.stdout  # the agents' clients do not flood the log
