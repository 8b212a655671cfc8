"""The resolved run: what the composed config means, typed once.

`rlhf.config.validate` returns a `RunSpec`: each chosen part with its typed config (`rlhf.parts.Part`), the sections
the plan, the build and the Learner read, typed by their schema classes, and the sizes that follow (`DerivedSizes`),
each derived once. Those readers take the spec rather than the config's nodes, so a key is typed, defaulted and
checked in one place (an environment named by import path is read with its own keys and `EnvConfig`'s defaults
wherever it is read). The spec is never changed once made, and nothing in it is written back into the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf.algorithms import build_algorithm
from rlhf.config.schema import (
    AlgorithmConfig, CheckpointConfig, ChecksConfig, ClusterConfig, CriticConfig, EvalConfig, LoggingConfig, ModelConfig,
    PlanConfig, PolicyConfig, ReferenceConfig, RewardConfig, TeacherConfig, TrainConfig,
)
from rlhf.config.sizes import DerivedSizes, derive_sizes
from rlhf.envs.base import EnvConfig, env_config
from rlhf.parts import Part, choose


@dataclass(frozen=True)
class RunSpec:
    """What a run is: its parts, typed, and its derived sizes (from `validate`, or `resolve` without the checks)."""

    config: DictConfig  # the composed config as written: logged, checkpointed, and what each Ray worker builds its models from
    sizes: DerivedSizes  # batch sizes and the longest row (logged at start)
    generator: Part  # the generator backend and its typed `generator` node
    schedule: Part  # the schedule and its typed `schedule` node
    dataset: Part  # the dataset builder and its typed `dataset` node
    env: EnvConfig | None  # the `env` node typed by its environment's class (`env_config`); None for env=none
    algorithm: Any  # the algorithm `algorithm.*` composes, read for its traits (pairwise, needs_critic, ...); the Learner trains one built afresh
    model: ModelConfig  # `model.*`, typed (each section below likewise: a copy, so changing it changes no config)
    train: TrainConfig  # `train.*`
    policy: PolicyConfig  # `policy.*` (its `strategy` node as a dict, typed where chosen: `rlhf.parts.choose`)
    critic: CriticConfig  # `critic.*`
    reference: ReferenceConfig  # `reference.*`
    teacher: TeacherConfig  # `teacher.*`
    reward: RewardConfig  # `reward.*`
    plan: PlanConfig  # `plan.*`
    checks: ChecksConfig  # `checks.*`
    cluster: ClusterConfig  # `cluster.*`
    eval: EvalConfig  # `eval.*`
    logging: LoggingConfig  # `logging.*`
    checkpoint: CheckpointConfig  # `checkpoint.*`
    algorithm_keys: AlgorithmConfig  # `algorithm.*` (its part nodes as dicts, as written; the parts typed are `algorithm`'s)
    seed: int  # `seed`

    @property
    def max_new_tokens(self) -> int:
        """The response budget, `generator.max_new_tokens` (a key every generator declares)."""
        return int(self.generator.config.max_new_tokens)

    def describe(self) -> str:
        """The chosen parts in one line, for the log (the derived sizes are logged beside it)."""
        algorithm = self.config.algorithm
        return (
            f"generator={self.generator.name}, schedule={self.schedule.name}, dataset={self.dataset.name}, "
            f"env={'none' if self.env is None else self.env.name}, algorithm.advantage={algorithm.advantage.name}, "
            f"algorithm.policy_loss={algorithm.policy_loss.name}"
        )


@dataclass(frozen=True)
class ChosenParts:
    """The run's parts, each node typed and checked (`choose_parts`)."""

    generator: Part
    schedule: Part
    dataset: Part
    env: EnvConfig | None
    algorithm: Any


def choose_parts(cfg: DictConfig) -> ChosenParts:
    """Each part the config chooses, its node typed and checked, in the order the checks read them: the generator
    first (its response budget sizes the rest), the schedule, the dataset, the environment, then the algorithm."""
    generator = choose("generator", cfg.generator, "generator")
    schedule = choose("schedule", cfg.schedule, "schedule")
    dataset = choose("dataset", cfg.dataset, "dataset")
    env = env_config(cfg)
    algorithm = build_algorithm(cfg.algorithm, generator.config.max_new_tokens)
    return ChosenParts(generator, schedule, dataset, env, algorithm)


TYPED_SECTIONS = (  # typed by the schema
    "model", "train", "policy", "critic", "reference", "teacher", "reward", "plan", "checks", "cluster", "eval", "logging",
    "checkpoint",
)


def spec_of(cfg: DictConfig, parts: ChosenParts, sizes: DerivedSizes) -> RunSpec:
    """The `RunSpec` of ``cfg`` from its chosen ``parts`` and derived ``sizes``."""
    sections = {name: OmegaConf.to_object(cfg[name]) for name in TYPED_SECTIONS}
    return RunSpec(
        config=cfg, sizes=sizes, generator=parts.generator, schedule=parts.schedule, dataset=parts.dataset,
        env=parts.env, algorithm=parts.algorithm, algorithm_keys=OmegaConf.to_object(cfg.algorithm), seed=int(cfg.seed),
        **sections,
    )


def resolve(cfg: DictConfig) -> RunSpec:
    """The spec of ``cfg`` with its parts typed and its batch arithmetic checked, but none of `validate`'s other
    checks: for a changed copy of a validated config (the memory plan's advice tries many)."""
    parts = choose_parts(cfg)
    return spec_of(cfg, parts, derive_sizes(cfg, parts.env, parts.algorithm.pairwise))
