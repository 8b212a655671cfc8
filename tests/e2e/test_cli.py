"""End-to-end runs of the real CLI (`python -m rlhf.train`) on the built-in task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.slow

COMMON_METRICS = [
    "objective/scores",
    "objective/rlhf_reward",
    "objective/non_score_reward",
    "objective/entropy",
    "objective/verifiable_correct_rate",
    "val/sequence_lengths",
    "val/num_stop_token_ids",
    "episode",
    "epoch",
    "lr",
    "time/generation",
    "time/training",
    "time/step",
    "eval/sampled_correct_rate",
    "eval/greedy_correct_rate",
]
WITH_REFERENCE = ["objective/kl", "objective/kl_coef"]  # presets with beta > 0 load a reference
POLICY_GRADIENT_METRICS = ["loss/policy_avg", "policy/approxkl_avg", "policy/clipfrac_avg", "val/ratio"]
ALGORITHM_METRICS = {  # every preset of conf/algorithm: the metrics it logs besides COMMON_METRICS
    "grpo": POLICY_GRADIENT_METRICS + WITH_REFERENCE + ["loss/kl_avg"],
    "dr_grpo": POLICY_GRADIENT_METRICS,
    "dapo": POLICY_GRADIENT_METRICS + [
        "dynamic_sampling/kept_share", "dynamic_sampling/rounds", "dynamic_sampling/kept_groups", "reward/overlong_penalty",
    ],
    "gspo": POLICY_GRADIENT_METRICS,
    "cispo": POLICY_GRADIENT_METRICS,
    "reinforce": POLICY_GRADIENT_METRICS + WITH_REFERENCE,
    "reinforce_pp": POLICY_GRADIENT_METRICS + WITH_REFERENCE,
    "reinforce_pp_baseline": POLICY_GRADIENT_METRICS + WITH_REFERENCE + ["loss/kl_avg"],
    "remax": POLICY_GRADIENT_METRICS + WITH_REFERENCE + ["objective/greedy_baseline_scores", "time/greedy_baseline"],
    "rloo": POLICY_GRADIENT_METRICS + WITH_REFERENCE,
    "ppo": POLICY_GRADIENT_METRICS + WITH_REFERENCE + ["loss/value_avg", "val/clipfrac_avg", "critic/grad_norm"],
    "opd": POLICY_GRADIENT_METRICS + ["distill/reverse_kl", "distill/teacher_logprob"],
    "online_dpo": [
        "objective/kl", "objective/scores_margin", "logps/chosen", "logps/rejected", "reward/chosen", "reward/rejected",
        "reward_margin", "objective/loss",
    ],
}


def run_cli(*overrides: str, cwd: Path, env_extra: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.train", *overrides], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the run's TensorBoard events."""
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def text_tags(run_dir: Path) -> list[str]:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    return acc.Tags()["tensors"]


def test_default_run_prints_progress_and_summary(tmp_path):
    """`python -m rlhf.train` with no arguments: a console line at the last step (and every `logging.log_every`) and a start -> end summary."""
    proc = run_cli("train.num_steps=5", cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert "step    5/5" in log
    assert "eval start -> end" in log and "eval/sampled_correct_rate" in log
    runs = list((tmp_path / "outputs").glob("*/*/tensorboard"))
    assert len(runs) == 1, "the default output folder is Hydra's outputs/<date>/<time>"
    run = runs[0].parent
    assert (run / ".hydra" / "config.yaml").is_file(), "Hydra keeps the composed config with the run"
    assert json.loads((run / "derived_sizes.json").read_text())["samples_per_step"] == 128


def test_multirun_gives_each_job_its_own_folder(tmp_path):
    proc = run_cli("--multirun", "train.lr=1e-4,3e-4", "train.num_steps=2", "eval.num_samples=1", cwd=tmp_path)
    jobs = sorted((tmp_path / "multirun").glob("*/*/[0-9]*"))
    assert [j.name for j in jobs] == ["0", "1"], proc.stdout
    for job in jobs:
        lr = {json.loads(line).get("lr") for line in (job / "metrics.jsonl").read_text().splitlines()} - {None}
        assert lr == {1e-4} if job.name == "0" else lr == {3e-4}
        assert (job / "tensorboard").is_dir()


def test_cfg_job_prints_the_composed_config(tmp_path):
    proc = run_cli("--cfg", "job", "algorithm=rloo", cwd=tmp_path)
    assert "advantage:\n    name: rloo" in proc.stdout and "name_or_path: builtin:tiny_arith" in proc.stdout
    assert not (tmp_path / "outputs").exists(), "--cfg job must not train"


def test_user_reward_function_plugs_in_from_the_command_line(tmp_path):
    """A reward function in the user's own module, named by import path in an override, drives training."""
    (tmp_path / "my_rewards.py").write_text(
        "def prefers_seven(prompts, responses, ground_truths, bonus=1.0, **_):\n"
        "    return [bonus if r.strip() == '7' else 0.0 for r in responses]\n"
    )
    out = tmp_path / "run"
    run_cli(
        "reward.functions=[{name: my_rewards.prefers_seven, weight: 1.0, args: {bonus: 2.0}}]",
        "train.num_steps=40",
        "eval.every=0",
        f"hydra.run.dir={out}",
        cwd=tmp_path,
        env_extra={"PYTHONPATH": str(tmp_path)},
    )
    series = scalars(out)
    assert "reward/my_rewards.prefers_seven" in series
    seven = [v for _, v in series["reward/my_rewards.prefers_seven"]]
    assert sum(seven[-5:]) / 5 > sum(seven[:5]) / 5 + 0.5, "training should move towards answering 7"
    assert "objective/verifiable_correct_rate" not in series, "the user function is no verifier"


@pytest.fixture(scope="module")
def other_vocab_model(tmp_path_factory):
    """A saved tiny model whose tokenizer differs from the built-in one."""
    from rlhf.models.tiny import build_char_tokenizer, build_tiny_llama

    folder = tmp_path_factory.mktemp("other_vocab")
    tokenizer = build_char_tokenizer("abcdefghij")
    build_tiny_llama(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_reference_with_another_vocabulary_fails_before_models_load(other_vocab_model, tmp_path):
    proc = run_cli(f"reference.name_or_path={other_vocab_model}", "train.num_steps=1", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    log = proc.stdout + proc.stderr
    assert "reference.name_or_path: vocabulary mismatch" in log and "Traceback" not in log


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.micro_batch_size=48"], "is not divisible by train.micro_batch_size=48"),
        (["train.bogus=1"], "bogus"),
        (["reward.functions=[{name: no_such_reward}]"], "unknown reward 'no_such_reward' (config key `reward.functions[0].name`)"),
        (["model.name_or_path=/does/not/exist"], "/does/not/exist"),
    ],
)
def test_bad_config_fails_fast_with_a_clear_message(overrides, expected, tmp_path):
    proc = run_cli(*overrides, "train.num_steps=1", cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr
    assert not list(tmp_path.rglob("model.safetensors"))
