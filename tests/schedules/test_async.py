"""The async schedule: the staleness bound under a slow trainer and a slow generator, version tags, prompt
positions for checkpoints, shutdown, and learning on the built-in task.

Runs go through `rlhf.train.train` in this process with the real tiny model and HF generator; a test slows a
stage down by wrapping it with a sleep, to force one side of the overlap to wait.
"""

from __future__ import annotations

import json
import threading
from contextlib import nullcontext
import time
from pathlib import Path

import pytest
import torch

from rlhf.run import checkpoint
from rlhf.run.checkpoint import STATE_FILE
from rlhf.errors import StopNow
from rlhf.config.compose import compose_config
from rlhf.generators.hf import HFGenerator
from rlhf.schedules.asynchronous import THREAD_NAME, VersionedGenerator, staleness_metrics
from rlhf.step.collector import Collector
from rlhf.step.learner import Learner
from rlhf.train import train

FAST = ["train.prompts_per_step=4", "algorithm.num_samples_per_prompt=4", "train.micro_batch_size=16",
        "eval.max_prompts=8", "eval.num_samples=1", "logging.tensorboard=false", "checkpoint.save_final_model=false"]


def run(tmp_path: Path, *overrides: str) -> list[dict]:
    """Train in this process with schedule=async; returns the per-step metric records."""
    out = tmp_path / "run"
    train(compose_config(["schedule=async", *FAST, *overrides]), out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "async/staleness_max" in r]


def slow_down(monkeypatch, owner, name: str, seconds: float) -> None:
    original = getattr(owner, name)

    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, slowed)


def producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


# --- pure pieces ----------------------------------------------------------------------------------------------


def test_staleness_metrics_by_hand():
    """Trainer at version 5, samples from versions 4, 4, 5, 3: staleness 1, 1, 0, 2."""
    metrics = staleness_metrics(torch.tensor([4, 4, 5, 3]), trainer_version=5, bound=2)
    assert metrics == {"async/staleness_mean": 1.0, "async/staleness_max": 2.0, "async/policy_version": 5.0}
    with pytest.raises(RuntimeError, match="max_staleness=1"):
        staleness_metrics(torch.tensor([4, 3]), trainer_version=5, bound=1)
    with pytest.raises(RuntimeError, match="outside"):
        staleness_metrics(torch.tensor([6]), trainer_version=5, bound=1)  # from the future
    huge = 99999999999999999999  # schedule.max_staleness past int64 (before: OverflowError in step 1)
    assert staleness_metrics(torch.tensor([4, 3]), trainer_version=5, bound=huge)["async/staleness_max"] == 2.0


def test_versioned_generator_loads_published_weights_between_generate_calls(make_generator, tiny_model_dir, encode):
    """Publishing never waits for a running generate call; the next call loads the newest weights and reports them."""
    from rlhf.generators.base import SamplingParams

    inner = make_generator(tiny_model_dir)
    generator = VersionedGenerator(inner, version=3)
    prompts, greedy = encode(["1+1=", "7+8=", "3"]), SamplingParams(4, greedy=True)
    old = {k: v.clone() for k, v in inner.model.state_dict().items()}
    new = {k: v + 0.3 * torch.randn_like(v) for k, v in old.items()}
    before = inner.generate(prompts, greedy)
    started, finished = threading.Event(), threading.Event()
    original = inner.generate

    def slow_generate(*args):
        started.set()
        time.sleep(0.3)
        out = original(*args)
        finished.set()
        return out

    inner.generate = slow_generate
    result = {}
    worker = threading.Thread(target=lambda: result.update(zip(("rollout", "version"), generator.generate_versioned(prompts, greedy))))
    worker.start()
    started.wait()
    generator.update_weights(new)  # returns at once, while the old weights are still sampling
    assert not finished.is_set() and generator.published == 4 and generator.version == 3
    new[next(iter(new))].add_(100.0)  # the trainer keeps updating in place: the published copy must not change
    worker.join()
    assert result["version"] == 3 and torch.equal(result["rollout"].window_ids, before.window_ids)
    inner.generate = original
    rollout, version = generator.generate_versioned(prompts, greedy)
    assert version == 4 and generator.version == 4
    reference = make_generator(tiny_model_dir)
    reference.update_weights({k: v - (100.0 if i == 0 else 0.0) for i, (k, v) in enumerate(new.items())})
    assert torch.equal(rollout.window_ids, reference.generate(prompts, greedy).window_ids)
    generator.update_weights(old, version=9)
    assert generator.generate_versioned(prompts, greedy)[1] == 9


# --- runs -----------------------------------------------------------------------------------------------------


def test_slow_trainer_keeps_the_generator_exactly_the_bound_ahead(tmp_path, monkeypatch):
    """Training is slow: every batch after the first was generated one version behind, never more."""
    slow_down(monkeypatch, Learner, "update", 0.5)
    records = run(tmp_path, "train.num_steps=6")
    assert [r["async/staleness_max"] for r in records] == [0, 1, 1, 1, 1, 1]
    assert all(r["async/policy_version"] == r["step"] - 1 for r in records)
    assert all(r["time/wait_for_rollout"] < 0.3 for r in records[1:]), "the next batch should be ready"
    assert not producer_threads()


def test_larger_bound_is_reached_but_never_exceeded(tmp_path, monkeypatch):
    """max_staleness=2 with a slow trainer: the producer runs two versions ahead, and no further."""
    slow_down(monkeypatch, Learner, "update", 0.5)
    records = run(tmp_path, "train.num_steps=6", "schedule.max_staleness=2")
    staleness = [r["async/staleness_max"] for r in records]
    assert max(staleness) == 2 and staleness[:2] == [0, 1]


def test_slow_generator_makes_the_trainer_wait_within_the_bound(tmp_path, monkeypatch):
    """Generation is slow: the trainer waits for each batch; staleness still never exceeds 1."""
    slow_down(monkeypatch, HFGenerator, "generate", 1.0)  # far above a trainer step, even on a loaded machine
    records = run(tmp_path, "train.num_steps=5", "eval.greedy=false", "eval.num_samples=0")
    assert [r["async/staleness_max"] for r in records] == [0, 1, 1, 1, 1]
    assert all(r["time/wait_for_rollout"] > 0.1 for r in records[1:])
    assert all(r["time/weight_sync"] < 0.1 for r in records), "publishing must not wait for a generation"


def test_zero_staleness_is_on_policy(tmp_path, monkeypatch):
    slow_down(monkeypatch, Learner, "update", 0.1)
    records = run(tmp_path, "train.num_steps=4", "schedule.max_staleness=0")
    assert [r["async/staleness_max"] for r in records] == [0, 0, 0, 0]


def test_version_tags_are_the_weights_that_sampled(tmp_path, monkeypatch):
    """The tag on each batch equals the number of weight pushes the generator had received when it sampled."""
    pushes, seen = [], []
    original_update, original_generate = HFGenerator.update_weights, HFGenerator.generate

    def counting_update(self, state_dict):
        pushes.append(1)
        return original_update(self, state_dict)

    def recording_generate(self, prompts, sampling):
        if not sampling.greedy and len(prompts) == 16:  # training batches (4 prompts x 4 samples), not eval
            seen.append(len(pushes) - 1)  # the first push loads the starting weights: version 0
        return original_generate(self, prompts, sampling)

    monkeypatch.setattr(HFGenerator, "update_weights", counting_update)
    monkeypatch.setattr(HFGenerator, "generate", recording_generate)
    slow_down(monkeypatch, Learner, "update", 0.15)
    records = run(tmp_path, "train.num_steps=5", "eval.num_samples=0")
    tags = [r["async/policy_version"] - r["async/staleness_max"] for r in records]
    assert tags == seen[: len(tags)]


@pytest.fixture
def builtin_reward_model(tmp_path) -> str:
    """A reward model on the built-in policy's backbone and tokenizer (seeded new score head)."""
    from rlhf.models.loading import load_tokenizer, resolve_model_path
    from rlhf.models.value import load_value_model

    source = resolve_model_path("builtin:tiny_arith")
    torch.manual_seed(5)
    load_value_model(source).save_pretrained(tmp_path / "rm")
    load_tokenizer(source).save_pretrained(tmp_path / "rm")
    return str(tmp_path / "rm")


def test_checkpoint_records_the_prompts_and_reward_statistics_actually_trained(tmp_path, monkeypatch, builtin_reward_model):
    """The producer draws and scores ahead; a checkpoint after step 2 still points at the prompts of step 3, and its
    reward-normalisation statistics count the scores of steps 1 and 2 only (4 prompts x 4 samples each)."""
    slow_down(monkeypatch, Learner, "update", 0.5)
    records = run(tmp_path, "train.num_steps=4", "checkpoint.every=2", "checkpoint.keep_last=0", f"reward.path={builtin_reward_model}",
                  "reward.normalize=true")
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_00000002" / STATE_FILE).read_text())
    assert state["prompts"]["epoch"] * state["prompts"]["size"] + state["prompts"]["position"] == 2 * 4
    assert state["rewards"]["model_moments"]["count"] == 2 * 16
    assert [r["epoch"] for r in records] == [n * 4 / 100 for n in (1, 2, 3, 4)]  # the 100 arith problems


def eval_metrics(records: list[dict], step: int) -> dict:
    return {k: v for r in records if r["step"] == step for k, v in r.items() if k.startswith("eval/")}


def test_evaluation_is_not_disturbed_by_the_producer(tmp_path, monkeypatch):
    """A mid-run evaluation samples from its own seeded stream while the producer wants to sample the next batches
    (evaluation slowed so that it does): its metrics equal a standalone evaluation of the same step's checkpoint."""
    from rlhf.run.build import build_components
    from rlhf.config import validate
    from rlhf.schedules.loop import Loop, run_eval
    from rlhf.tracking.tracker import Tracker

    slow_down(monkeypatch, Collector, "evaluate", 0.3)
    overrides = ["schedule=async", *FAST, "train.num_steps=4", "eval.every=2", "checkpoint.every=2", "checkpoint.keep_last=0"]
    train(compose_config(overrides), tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    in_run = eval_metrics(records, 2)
    assert in_run

    cfg = compose_config(overrides)
    spec = validate(cfg)
    c = build_components(spec)
    checkpoint.load(c.collector, c.learner, tmp_path / "run" / "checkpoints" / "step_00000002")
    c.collector.generator.update_weights(c.learner.policy.state_dict())
    tracker = Tracker(tmp_path / "standalone", tensorboard=False)
    try:
        standalone = run_eval(c.collector, c.learner, Loop(spec, tracker, c.eval_examples, None, None), 2)
    finally:
        tracker.close()
    assert in_run == standalone


def test_a_failing_generator_stops_the_run_with_its_error_and_no_thread_left(tmp_path, monkeypatch):
    calls = []
    original = HFGenerator.generate

    def failing(self, prompts, sampling):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("engine exploded")
        return original(self, prompts, sampling)

    monkeypatch.setattr(HFGenerator, "generate", failing)
    with pytest.raises(ValueError, match="engine exploded"):
        run(tmp_path, "train.num_steps=6", "eval.greedy=false", "eval.num_samples=0")
    time.sleep(0.2)
    assert not producer_threads()


@pytest.mark.slow
def test_async_learns_the_builtin_task(tmp_path):
    """The default task under schedule=async with truncated IS: the greedy correct rate climbs well above the start."""
    out = tmp_path / "run"
    train(compose_config(["schedule=async", "algorithm/rollout_correction=token_tis", "train.num_steps=120", "logging.tensorboard=false",
                          "checkpoint.save_final_model=false"]), out)
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    greedy = [r["eval/greedy_correct_rate"] for r in evals if "eval/greedy_correct_rate" in r]
    staleness = [r["async/staleness_max"] for r in evals if "async/staleness_max" in r]
    assert greedy[-1] >= 0.7 and greedy[-1] > greedy[0] + 0.3, greedy
    assert max(staleness) == 1 and any(s == 1 for s in staleness)


def test_resumed_async_run_continues_from_the_checkpoint(tmp_path, monkeypatch):
    """Stop-and-resume under async: the resumed run starts at the checkpoint's step with its weights as version k,
    so its first batch is on-policy (staleness 0), and it trains to the end."""
    slow_down(monkeypatch, Learner, "update", 0.1)
    run(tmp_path, "train.num_steps=3", "checkpoint.every=3")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000003"
    out = tmp_path / "resumed"
    train(compose_config(["schedule=async", *FAST, "train.num_steps=6", f"resume={checkpoint}"]), out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "async/staleness_max" in r]
    assert [r["step"] for r in trained] == [4, 5, 6]
    assert trained[0]["async/staleness_max"] == 0 and trained[0]["async/policy_version"] == 3
    assert not producer_threads()


def test_resume_without_staleness_reproduces_the_uninterrupted_run(tmp_path, monkeypatch):
    """max_staleness=0: the producer samples batch 3 from the global RNGs while step 2's checkpoint is saved (a slow
    save makes sure); the checkpoint keeps the RNGs as batch 3 found them, so resumed steps 3 and 4 equal the
    uninterrupted run's bit for bit."""
    slow_down(monkeypatch, checkpoint, "_write_state", 0.5)
    overrides = ["train.num_steps=4", "schedule.max_staleness=0", "eval.greedy=false", "eval.num_samples=0"]
    uninterrupted = {r["step"]: r for r in run(tmp_path, *overrides, "checkpoint.every=2", "checkpoint.keep_last=0")}
    out = tmp_path / "resumed"
    train(compose_config(["schedule=async", *FAST, *overrides, f"resume={tmp_path / 'run' / 'checkpoints' / 'step_00000002'}"]), out)
    resumed = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "episode" in r}
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for key in ("objective/scores", "objective/entropy", "loss/policy_avg", "policy/grad_norm"):
            assert resumed[step][key] == uninterrupted[step][key], (step, key)


def test_remax_under_async_baselines_each_batch_on_the_version_that_sampled_it(tmp_path, monkeypatch):
    """ReMax's greedy responses are generated by the producer inside the batch's pinned version: every step logs its
    baseline and its cost, and the greedy call never sees weights newer than the samples'."""
    versions = []
    original = VersionedGenerator.pinned

    def recording(self):
        context = original(self)

        class Recorder:
            def __enter__(inner):
                generator, version = context.__enter__()
                versions.append(version)
                return generator, version

            def __exit__(inner, *exc):
                return context.__exit__(*exc)

        return Recorder()

    monkeypatch.setattr(VersionedGenerator, "pinned", recording)
    records = run(tmp_path, "algorithm=remax", "train.num_steps=3", "eval.greedy=false", "eval.num_samples=0")
    trained = [r for r in records if "async/staleness_max" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert all("time/greedy_baseline" in r and "objective/greedy_baseline_scores" in r for r in trained)
    assert len(versions) == 3  # one pinned version per batch: the samples and their greedy baselines share it


class RecordingProducer:
    """A producer that records how long it was told to wait for its thread when closed."""

    def __init__(self, generator) -> None:
        self.generator, self.waits = generator, []

    def close(self, timeout: float) -> None:
        self.waits.append(timeout)


@pytest.mark.parametrize(("raised", "wait"), [(None, 60.0), (RuntimeError("a step failed"), 60.0), (StopNow(143), 0.0)])
def test_a_producer_is_waited_for_unless_a_second_stop_signal_ends_the_run(raised, wait):
    """`producing` (the async and stream schedules): the producer's collector samples through a versioned generator
    inside the block while the run's collector keeps its own (it is passed, never swapped); the producer's thread is
    waited for on the way out, except after a second stop signal (`StopNow`), which must end the process at once."""
    from rlhf.schedules.asynchronous import producing

    from rlhf.config import validate
    from rlhf.run.build import build_components

    cfg = compose_config(["logging.tensorboard=false"])
    components = build_components(validate(cfg))
    collector = components.collector
    own = collector.generator
    made = []
    try:
        with pytest.raises(type(raised)) if raised is not None else nullcontext():
            with producing(collector, 3, lambda versioned: made.append(RecordingProducer(versioned.generator)) or made[-1]) as producer:
                assert isinstance(producer.generator, VersionedGenerator) and producer.generator.version == 3
                assert producer.generator.inner is own and collector.generator is own
                if raised is not None:
                    raise raised
        assert made[0].waits == [wait]
        assert collector.generator is own
    finally:
        components.close()
