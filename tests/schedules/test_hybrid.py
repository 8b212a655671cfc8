"""The hybrid schedule: the generator sleeps (weights freed) while training and wakes with the new weights.

Sleeping and waking must be invisible to the learning: a hybrid run reproduces the sync run metric for metric.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from run_records import records
from rlhf.config.compose import compose_config
from rlhf.train import train

FAST = ["train.num_steps=6", "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=4", "train.micro_batch_size=16",
        "eval.max_prompts=8", "eval.num_samples=2", "logging.tensorboard=false", "checkpoint.save_final_model=false"]
SAME = ("objective/scores", "objective/kl", "objective/entropy", "loss/policy_avg", "policy/grad_norm", "eval/sampled_correct_rate")


def run(tmp_path: Path, name: str, *overrides: str) -> dict[int, dict]:
    out = tmp_path / name
    train(compose_config([*FAST, *overrides]), out)
    return records(out)


@pytest.mark.parametrize("offload", [False, True])
def test_hybrid_reproduces_the_sync_run(tmp_path, offload):
    """Same seed: every training and eval metric of the hybrid run equals the sync run's (optimiser offload or not)."""
    sync = run(tmp_path, "sync", "schedule=sync")
    hyb = run(tmp_path, "hybrid", "schedule=hybrid", f"schedule.offload_optimizer={str(offload).lower()}")
    assert sorted(sync) == sorted(hyb)
    for step in sync:
        for key in SAME:
            if key in sync[step]:
                assert hyb[step][key] == sync[step][key], (step, key)


def test_generator_holds_no_weights_while_training(tmp_path, monkeypatch, tiny_model_dir):
    """During every training phase the generator is asleep and holds 0 weight bytes; it reports what it freed."""
    from rlhf.generators.hf import HFGenerator
    from rlhf.step.learner import Learner

    seen, sleeping = [], []
    sleep, update = HFGenerator.sleep, Learner.update

    def sleep_and_note(generator):
        sleeping.append(generator)
        return sleep(generator)

    def watching(learner, *args):
        generator = sleeping[-1]  # the one the step just put to sleep
        seen.append((generator.asleep, generator.resident_bytes()))
        return update(learner, *args)

    monkeypatch.setattr(HFGenerator, "sleep", sleep_and_note)
    monkeypatch.setattr(Learner, "update", watching)
    steps = run(tmp_path, "hybrid", "schedule=hybrid")
    assert seen == [(True, 0)] * 6
    freed = [steps[s]["memory/generator_freed_mb"] for s in range(1, 7)]
    assert all(f > 0 and f == freed[0] for f in freed)


def test_a_generator_that_cannot_sleep_is_refused_by_name(tmp_path, monkeypatch):
    from rlhf.config import ConfigError
    from rlhf.generators.hf import HFGenerator

    monkeypatch.delattr(HFGenerator, "sleep")
    with pytest.raises(ConfigError, match=r"schedule=hybrid puts the generator to sleep while training; generator=hf cannot sleep \(it has no `sleep`\)"):
        run(tmp_path, "hybrid", "schedule=hybrid")
