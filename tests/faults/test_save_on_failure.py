"""A failure saves what it can: a user reward function that raises at step 3 (during scoring, before the update)
leaves a checkpoint of step 2, and `resume=auto` from it with the reward fixed trains to the end exactly as a run
that never failed (the prompt stream, reward statistics and RNGs are put back as step 3 found them)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlhf.run import checkpoint
from rlhf.config import compose_config
from rlhf.generators.hf import HFGenerator
from rlhf.models.loading import resolve_model_path
from rlhf.train import train

REWARDS = '''
calls = 0


def length_score(responses):
    return [len(r) % 3 / 2.0 for r in responses]


def flaky(prompts, responses, ground_truths, **_):
    global calls
    calls += 1
    if calls == 3:
        raise ValueError("the scoring service is down")
    return length_score(responses)


def steady(prompts, responses, ground_truths, **_):
    return length_score(responses)
'''
STEPS = 4


def config(reward: str, *extra: str):
    return compose_config([
        f"train.num_steps={STEPS}", f"reward.functions=[{{name: faulty_rewards.{reward}}}]", "eval.num_samples=0",
        "eval.greedy=false", "logging.tensorboard=false", "train.prompts_per_step=4", "train.micro_batch_size=32",
        *extra,
    ])


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "faulty_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "faulty_rewards", raising=False)


def weights(run_dir):
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def test_a_reward_function_raising_at_step_3_saves_step_2_and_the_run_resumes_exactly(tmp_path, rewards_module, monkeypatch):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="the scoring service is down"):
        train(config("flaky"), run_dir)
    assert [p.name for p in checkpoint.complete_checkpoints(run_dir / "checkpoints")] == ["step_00000002"]
    assert not (run_dir / "final_model").exists()

    pushes = []
    load = HFGenerator.update_weights
    with monkeypatch.context() as patch:
        patch.setattr(HFGenerator, "update_weights", lambda self, state: (pushes.append({k: v.clone() for k, v in state.items()}), load(self, state))[1])
        state = train(config("steady", "resume=auto"), run_dir)
    assert state.step == STEPS
    # the generator loads the checkpoint's weights first, never the starting weights they replace; then one per step
    assert len(pushes) == 1 + STEPS - 2
    saved = load_file(str(run_dir / "checkpoints" / "step_00000002" / "policy" / "model" / "model.safetensors"))
    assert saved and set(saved) <= set(pushes[0])
    assert all(torch.equal(pushes[0][name], saved[name]) for name in saved)

    reference = train(config("steady"), tmp_path / "reference")
    assert reference.step == STEPS
    resumed, never_failed = weights(run_dir), weights(tmp_path / "reference")
    assert resumed.keys() == never_failed.keys()
    assert all(torch.equal(resumed[k], never_failed[k]) for k in resumed), "the resumed run diverged"
    start = load_file(f"{resolve_model_path('builtin:tiny_arith')}/model.safetensors")
    assert not all(torch.equal(start[k], never_failed[k]) for k in start), "training moved no weight: nothing compared"


def test_a_failure_in_the_first_step_saves_nothing(tmp_path, rewards_module, monkeypatch, caplog):
    import faulty_rewards

    monkeypatch.setattr(faulty_rewards, "calls", 2)  # the first call is the third
    with pytest.raises(ValueError):
        train(config("flaky"), tmp_path / "run")
    assert checkpoint.complete_checkpoints(tmp_path / "run" / "checkpoints") == []
    assert "before any step completed" in caplog.text
