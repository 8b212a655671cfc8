"""Verified weight sync (rlhf.checks.weight_sync): fingerprints by hand, and injected faults stopping real runs."""

from __future__ import annotations

import pytest
import torch

from push_faults import inject_push_faults
from rlhf.config import compose_config
from rlhf.train import train
from rlhf.checks.weight_sync import WeightSyncError
from rlhf.models.fingerprint import first_difference, fingerprint, tensor_fingerprint

SHORT = ["train.num_steps=3", "eval.every=0", "eval.max_prompts=4", "logging.tensorboard=false",
         "checkpoint.save_final_model=false"]
MISSED = "model.layers.0.mlp.up_proj.weight"


def test_a_bf16_generator_matches_the_trainer_tensor_cast_to_bf16():
    weights = torch.randn(300, 70)
    held = weights.to(torch.bfloat16)
    assert tensor_fingerprint(weights, torch.bfloat16) == tensor_fingerprint(held)
    assert tensor_fingerprint(weights) != tensor_fingerprint(held)  # uncast, the rounding shows


def test_a_stale_tensor_is_the_first_difference_and_equal_states_have_none():
    state = {"a": torch.randn(5000), "b": torch.randn(64, 64), "c": torch.randn(3)}
    same = {name: t.clone() for name, t in state.items()}
    assert first_difference(fingerprint(state), fingerprint(same)) is None
    stale = {**same, "b": same["b"] - 1e-3 * torch.randn(64, 64)}  # an optimiser step's worth of change
    assert first_difference(fingerprint(state), fingerprint(stale)) == "b"
    assert first_difference(fingerprint(state), fingerprint({"a": state["a"]})) == "b"  # a tensor never delivered


def test_bad_mode_names_the_key():
    from rlhf.config import ConfigError, validate

    with pytest.raises(ConfigError, match=r"checks\.weight_sync='sometimes'; choose one of every, first, off"):
        validate(compose_config(["checks.weight_sync=sometimes"]))


@pytest.fixture
def faults(monkeypatch):
    """``faults(stale_push=k)`` loses push k, ``faults(missed=name)`` keeps delivering push 1's `name` (`push_faults`)."""
    return lambda **injected: inject_push_faults(monkeypatch, **injected)


HF = ["generator=hf"]
VLLM = pytest.param(["generator=vllm", "generator.kv_cache_memory_bytes=33554432", "generator.enable_sleep=true",
                     "generator.enforce_eager=true"], marks=pytest.mark.slow, id="vllm")


@pytest.mark.parametrize("generator", [pytest.param(HF, id="hf"), VLLM])
@pytest.mark.parametrize(("schedule", "says"), [
    ("sync", r"holds a different `model\."), ("async", r"holds a different `model\."), ("stream", r"holds a different `model\."),
    ("hybrid", "still asleep"),  # the skipped push never woke the sleeping generator
])
def test_a_stale_push_stops_the_run_naming_the_step(generator, schedule, says, faults, tmp_path):
    faults(stale_push=2)
    with pytest.raises(WeightSyncError, match=rf"push after step {STEP[schedule]}: the generator .*{says}"):
        train(compose_config([*generator, f"schedule={schedule}", *SHORT]), tmp_path / "run")


# the step whose push the third load carries: under async and stream the generator loads the newest weights published
# before its next generate call (stream: its next chunk), so a push may be superseded before it loads, and the third
# load may carry step 3's; the message names the step of the weights it loaded
STEP = {"sync": "2", "hybrid": "2", "async": "[23]", "stream": "[23]"}


@pytest.mark.parametrize("generator", [pytest.param(HF, id="hf"), VLLM])
@pytest.mark.parametrize("schedule", ["sync", "async", "stream", "hybrid"])
def test_a_missed_parameter_stops_the_run_naming_it(generator, schedule, faults, tmp_path):
    faults(missed=MISSED)
    with pytest.raises(WeightSyncError, match=rf"push after step {STEP[schedule]}: the generator holds a different `{MISSED}`"):
        train(compose_config([*generator, f"schedule={schedule}", *SHORT]), tmp_path / "run")


@pytest.mark.parametrize("mode", ["first", "off"])
def test_first_and_off_let_a_later_fault_through(mode, faults, tmp_path):
    faults(missed=MISSED)
    state = train(compose_config([f"checks.weight_sync={mode}", *SHORT]), tmp_path / "run")
    assert state.step == 3


def test_a_resumed_run_names_the_real_step_of_a_failed_push(faults, tmp_path):
    """Resumed after step 2, the run's first push carries the checkpoint's weights (verified as the initial push);
    a stale third push is the one after step 4, and the message says so."""
    run = tmp_path / "run"
    assert train(compose_config([*SHORT[1:], "train.num_steps=2", "checkpoint.every=2"]), run).step == 2
    faults(stale_push=2)
    with pytest.raises(WeightSyncError, match=r"push after step 4: the generator holds a different"):
        train(compose_config([*SHORT[1:], "train.num_steps=5", "checkpoint.every=2", "resume=auto",
                              "checks.weight_sync=every"]), run)
