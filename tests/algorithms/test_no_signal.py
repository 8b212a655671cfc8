"""A constant reward carries no signal: the estimators whose float arithmetic used to turn it into small same-signed
advantages (REINFORCE++'s batch whitening, REBN's return normalisation) leave the weights untouched, to the bit,
through real training steps. (A KL loss is off here: its gradient on the policy's and the reference's logprobs, equal
only to float rounding, is a signal of its own that Adam scales up.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf.config import compose_config
from rlhf.models.loading import load_causal_lm
from rlhf.train import train


@pytest.mark.parametrize("overrides", [
    ["algorithm=reinforce_pp"], ["algorithm=remax"], ["algorithm=reinforce_pp_baseline", "algorithm.beta=0"],
    ["algorithm=grpo", "algorithm/advantage=rebn", "algorithm.beta=0"],
], ids=["reinforce_pp", "remax", "reinforce_pp_baseline", "rebn"])
def test_a_constant_reward_leaves_the_weights_untouched(overrides, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    cfg = compose_config([
        *overrides, "train.num_steps=2", "eval.every=0", "logging.tensorboard=false", "logging.sample_every=0",
        "reward.functions=[{name: constant_reward.seven_tenths}]", "reward.non_stop_penalty=false",
    ])
    train(cfg, tmp_path)
    start = load_causal_lm("builtin:tiny_arith", "float32", None, False, torch.device("cpu")).state_dict()
    end = load_file(tmp_path / "final_model" / "model.safetensors")
    assert all(torch.equal(end[name], start[name]) for name in end), "a step with no signal moved the weights"


@pytest.mark.parametrize("overrides", [
    ["algorithm=opd"],
    ["algorithm=grpo", "algorithm.beta=0", "algorithm.distill_coef=0.5"],
], ids=["opd", "distill_coef"])
def test_a_teacher_equal_to_the_student_leaves_the_weights_untouched(overrides, tmp_path, monkeypatch):
    """The teacher's signal is built against the trainer's pre-update logprobs, computed by the same forward as the
    teacher's, so a teacher that is the student gives 0 exactly (before, against the generator's, off by ~1e-6, a
    step at lr 1e-3 moved the weights 9.3e-4)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    cfg = compose_config([
        *overrides, "teacher.name_or_path=builtin:tiny_arith", "train.num_steps=1", "train.lr=1e-3", "eval.every=0",
        "logging.tensorboard=false", "logging.sample_every=0", "reward.functions=[{name: constant_reward.seven_tenths}]",
        "reward.non_stop_penalty=false",
    ])
    train(cfg, tmp_path)
    start = load_causal_lm("builtin:tiny_arith", "float32", None, False, torch.device("cpu")).state_dict()
    end = load_file(tmp_path / "final_model" / "model.safetensors")
    assert all(torch.equal(end[name], start[name]) for name in end), "a teacher equal to the student moved the weights"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["distill/reverse_kl"] for row in rows if "distill/reverse_kl" in row] == [0.0]
