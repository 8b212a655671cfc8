"""Log-prob parity (rlhf.checks.parity): the gate before step 1, the jump watch during training, and their figures."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch

from rlhf.config import ConfigError, compose_config, validate
from rlhf.functional.kl import logprob_gap
from rlhf.generators.hf import HFGenerator
from rlhf.checks.parity import GapWatch, LogprobGapError, ParityError
from rlhf.train import train

SHORT = ["train.num_steps=4", "eval.every=0", "eval.max_prompts=4", "logging.tensorboard=false",
         "checkpoint.save_final_model=false"]


def test_gap_figures_by_hand():
    gen = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    train_ = torch.tensor([[-1.5, -2.0, -1.0], [-0.5, -1.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the 2.0 gap in column 2 is padding
    figures = logprob_gap(gen, train_, mask)
    assert figures["mean"] == pytest.approx((0.5 + 0 + 0 + 1.0) / 4)
    assert figures["max"] == 1.0
    r = torch.tensor([-0.5, 0.0, 0.0, -1.0])  # train - gen on the action tokens
    assert figures["k3"] == pytest.approx((torch.expm1(r) - r).mean().item())
    assert logprob_gap(gen, gen, mask) == {"mean": 0.0, "max": 0.0, "k3": 0.0}


def test_the_watch_warns_on_a_jump_but_not_on_noise_or_drift(caplog):
    watch = GapWatch(factor=10.0, floor=1e-3, stop=False)
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        for gap in (1e-7, 5e-6, 2e-5):  # a 50x rise far under the floor is numerical noise
            watch.observe(gap)
        assert not caplog.records
        watch.level = 0.01
        for gap in (0.015, 0.03, 0.05):  # drift: each step within 10x of the running level
            watch.observe(gap)
        assert not caplog.records
        level = watch.level
        watch.observe(1.0)
    assert "jumped to 1" in caplog.text and "checks.gap_jump_factor=10" in caplog.text
    assert watch.level == level  # a jumped step does not become the new normal


def test_stop_on_gap_turns_the_warning_into_a_stop():
    watch = GapWatch(factor=5.0, floor=1e-3, stop=True)
    watch.observe(0.01)
    watch.observe(0.04)
    with pytest.raises(LogprobGapError, match=r"jumped to 0\.5.*checks\.stop_on_gap=true stopped the run"):
        watch.observe(0.5)


@pytest.mark.parametrize(("override", "says"), [
    ("checks.parity_prompts=-1", r"checks\.parity_prompts=-1 must be >= 0"),
    ("checks.max_logprob_gap=0", r"checks\.max_logprob_gap=0\.0 must be > 0, or null"),
    ("checks.gap_jump_factor=1", r"checks\.gap_jump_factor=1\.0 must be > 1"),
])
def test_bad_thresholds_name_the_key(override, says):
    with pytest.raises(ConfigError, match=says):
        validate(compose_config([override]))


def sampling_at(temperature_factor: float, from_call: int):
    """HFGenerator.generate sampling at ``temperature_factor`` times the asked temperature from call ``from_call`` on
    (1 = the parity probe): a generator run at another temperature than the trainer assumes."""
    original = HFGenerator.generate
    calls = []

    def generate(self, prompts, sampling):
        calls.append(len(prompts))
        if len(calls) >= from_call and not sampling.greedy:
            sampling = replace(sampling, temperature=sampling.temperature * temperature_factor)
        return original(self, prompts, sampling)

    return generate


def test_the_gate_refuses_a_generator_at_another_temperature(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(HFGenerator, "generate", sampling_at(3.0, from_call=1))
    with pytest.raises(ParityError, match=r"mean \|Δ log p\| .* is above checks\.max_logprob_gap=0\.01 for model\.dtype=float32\. "
                                          r"Usual causes: .*temperature"):
        train(compose_config(SHORT), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step


def test_the_gate_passes_a_matching_generator_and_leaves_the_run_unchanged(tmp_path, caplog):
    """The probe's figures are printed, and the run then samples and trains exactly what it would without it."""
    with caplog.at_level(logging.INFO, logger="rlhf"):
        train(compose_config(SHORT), tmp_path / "gated")
    assert "log-prob parity (generator vs trainer, 4 probe prompts): mean |Δ log p|" in caplog.text
    train(compose_config(["checks.parity_prompts=0", *SHORT]), tmp_path / "ungated")
    gated, ungated = (
        [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("gated", "ungated")
    )
    keys = ("objective/scores", "loss/policy_avg", "val/sequence_lengths")
    assert [[r.get(k) for k in keys] for r in gated] == [[r.get(k) for k in keys] for r in ungated]


@pytest.mark.parametrize("stop", [False, True])
def test_a_gap_jump_mid_run_warns_or_stops(stop, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(HFGenerator, "generate", sampling_at(3.0, from_call=6))  # probe, step-0 eval (greedy, sampled), steps 1, 2
    cfg = compose_config([f"checks.stop_on_gap={str(stop).lower()}", *SHORT])
    if stop:
        with pytest.raises(LogprobGapError, match="checks/logprob_gap_mean jumped to"):
            train(cfg, tmp_path / "run")
        return
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        state = train(cfg, tmp_path / "run")
    assert state.step == 4 and "checks/logprob_gap_mean jumped to" in caplog.text


def test_under_async_the_watch_compares_only_the_rows_the_trained_weights_generated(tmp_path, caplog):
    """`schedule=async`: a stale row's gap is the policy's own change since it was sampled, not a fault. Before, a
    healthy async run warned on 19 of 20 steps and `checks.stop_on_gap=true` stopped it at step 2; now it runs to the
    end without a word (the start-up gate still checks the numerics)."""
    cfg = compose_config(["schedule=async", "checks.stop_on_gap=true", "train.num_steps=6", *SHORT[1:]])
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        state = train(cfg, tmp_path / "run")
    assert state.step == 6 and "jumped" not in caplog.text


def test_the_fresh_rows_are_the_ones_the_trained_version_generated():
    from rlhf.step.learner import fresh_rows
    from rlhf.step.scored import Scored

    batch = object()
    assert fresh_rows(Scored(batch, [], [], {})) is None  # sync: every row is fresh
    stale = Scored(batch, [], [], {}, versions=torch.tensor([3, 4, 4, 3]), trainer_version=4)
    assert fresh_rows(stale).tolist() == [False, True, True, False]
