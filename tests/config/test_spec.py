"""The resolved run (`rlhf.config.RunSpec`): what `validate` returns, typed once and never changed, and read by the
memory plan and the build instead of the config's nodes."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from rlhf import plan
from rlhf.config import RunSpec, compose_config, resolve, validate
from rlhf.config.schema import AlgorithmConfig, CheckpointConfig, ClusterConfig, EvalConfig, LoggingConfig, TrainConfig
from rlhf.envs import base as env_base
from rlhf.envs.base import EnvConfig
from rlhf.run.build import build_components

SMALL = ["train.prompts_per_step=2", "algorithm.num_samples_per_prompt=2", "checks.parity_prompts=0"]


def test_validate_returns_the_parts_typed_and_the_sizes_derived():
    cfg = compose_config([*SMALL, "env=arith_retry", "env.max_tokens=48", "train.micro_batch_size=2"])
    spec = validate(cfg)
    assert isinstance(spec, RunSpec) and spec.config is cfg
    assert type(spec.env).__name__ == "ArithRetryConfig" and isinstance(spec.env, EnvConfig)
    assert spec.env.max_tokens == 48 and spec.env.max_turns == cfg.env.max_turns
    assert spec.sizes.longest_row == 48 and spec.sizes.longest_row_keys == "env.max_tokens"
    assert spec.sizes.samples_per_step == 4
    assert isinstance(spec.train, TrainConfig) and spec.train.micro_batch_size == 2
    assert spec.generator.name == cfg.generator.name and spec.max_new_tokens == cfg.generator.max_new_tokens
    assert spec.schedule.name == "sync" and spec.dataset.name == cfg.dataset.name
    assert "env=arith_retry" in spec.describe() and "generator=hf" in spec.describe()


def test_env_none_is_no_env_and_resolve_derives_the_same_sizes():
    cfg = compose_config(SMALL)
    spec = validate(cfg)
    assert spec.env is None
    assert spec.sizes.longest_row == cfg.dataset.max_prompt_length + cfg.generator.max_new_tokens
    assert resolve(cfg).sizes == spec.sizes


def test_what_the_schedules_read_is_typed_and_the_spec_travels_to_ray_workers():
    """The loop's settings (`eval`, `logging`, `checkpoint`, `seed`), `cluster` and `algorithm.*` are typed copies of
    the config's values; the spec pickles whole (Ray ships it to each worker, which builds its models from it)."""
    cfg = compose_config([
        *SMALL, "eval.every=3", "logging.sample_every=5", "checkpoint.keep_last=4", "seed=7", "cluster.device=cpu",
        "algorithm/rollout_correction=token_tis",
    ])
    spec = validate(cfg)
    assert isinstance(spec.eval, EvalConfig) and spec.eval.every == 3
    assert isinstance(spec.logging, LoggingConfig) and spec.logging.sample_every == 5
    assert isinstance(spec.checkpoint, CheckpointConfig) and spec.checkpoint.keep_last == 4
    assert isinstance(spec.cluster, ClusterConfig) and spec.cluster.device == "cpu" and spec.seed == 7
    assert isinstance(spec.algorithm_keys, AlgorithmConfig) and spec.algorithm_keys.rollout_correction["name"] == "token_tis"
    assert spec.algorithm_keys.num_samples_per_prompt == cfg.algorithm.num_samples_per_prompt
    shipped = pickle.loads(pickle.dumps(spec))
    assert shipped.config == cfg and shipped.sizes == spec.sizes and shipped.cluster == spec.cluster
    assert shipped.generator.name == spec.generator.name and shipped.generator.config == spec.generator.config
    assert type(shipped.algorithm) is type(spec.algorithm) and shipped.algorithm.needs_reference == spec.algorithm.needs_reference


def test_the_spec_is_never_changed_and_changes_no_config():
    cfg = compose_config(SMALL)
    spec = validate(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.sizes = None
    spec.train.micro_batch_size = 1  # a typed copy: the composed config keeps its value
    assert cfg.train.micro_batch_size != 1


def test_the_env_node_is_typed_once_for_validation_the_plan_and_the_build(monkeypatch):
    """The environment's node is read through `env_config` by `validate` alone; the plan and the build read the spec."""
    typed = []
    choose = env_base.choose

    def counting(kind, node, at, base=None):
        typed.append(at)
        return choose(kind, node, at, base)

    monkeypatch.setattr(env_base, "choose", counting)
    spec = validate(compose_config([*SMALL, "env=arith_retry", "env.max_tokens=48", "env.num_parallel=3"]))
    work = plan.check(spec).workload
    assert (work.seq_len, work.generate_rows) == (48, 3)  # the spec's env, as typed
    components = build_components(spec)
    try:
        assert components.collector.env.cfg is spec.env
    finally:
        components.close()
    assert typed == ["env"]


def test_the_algorithm_is_built_once_for_the_checks_and_once_for_the_learner(tmp_path, monkeypatch):
    """`validate` builds the algorithm the checks read (the spec's); the preflight checks (checkpoint size, resume)
    read that one; the Learner trains one of its own (it keeps state as it trains). Fresh or resumed: two builds."""
    from rlhf.algorithms import PolicyGradient
    from rlhf.train import train

    builds = []
    init = PolicyGradient.__init__

    def counted(self, *args, **kwargs):
        builds.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(PolicyGradient, "__init__", counted)
    run = [*SMALL, "eval.every=0", "eval.greedy=false", "eval.num_samples=0", "checkpoint.every=1",
           "checkpoint.save_final_model=false"]
    train(compose_config([*run, "train.num_steps=1"]), tmp_path)
    assert len(builds) == 2
    builds.clear()
    state = train(compose_config([*run, "train.num_steps=2", "resume=auto"]), tmp_path)
    assert state.step == 2 and len(builds) == 2
