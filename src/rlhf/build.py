"""Builds every component of a run from its config, in an order that fails cheaply first.

Names are resolved, tokenizers compared and prompts prepared before any model weights load, so a typo
or a vocabulary mismatch costs a second, not a model load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf import registry
from rlhf.config.errors import ConfigError
from rlhf.config.validate import DerivedSizes
from rlhf.data.prompts import PromptExample, PromptStream
from rlhf.models.loading import check_vocab_match, load_tokenizer, looks_local, pick_device, resolve_model_path
from rlhf.rewards.combine import RewardSet
from rlhf.rewards.model import RewardModelScorer

log = logging.getLogger(__name__)


@dataclass
class Components:
    """The parts the schedules wire together."""

    device: torch.device
    tokenizer: Any
    prompts: PromptStream
    eval_examples: list[PromptExample]
    rewards: RewardSet
    estimator: Any
    generator: Any
    policy: Any
    reference: Any | None
    critic: Any | None = None
    shuffle: torch.Generator | None = None  # orders mini batches; its state is checkpointed
    data_report: dict | None = None  # what dataset loading kept and dropped, per source


def check_model_sources(cfg) -> None:
    """Local model folders exist and built-in names are shipped; hub names are left to `from_pretrained`."""
    for key, value in (
        ("model.name_or_path", cfg.model.name_or_path),
        ("model.tokenizer", cfg.model.tokenizer),
        ("reference.name_or_path", cfg.reference.name_or_path),
        ("reward.path", cfg.reward.path),
        ("critic.name_or_path", cfg.critic.name_or_path),
    ):
        if not value:
            continue
        try:
            path = resolve_model_path(value)
        except FileNotFoundError as err:
            raise ConfigError(f"{key}: {err}") from None
        if looks_local(path) and not (Path(path).expanduser() / "config.json").is_file() and key != "model.tokenizer":
            raise ConfigError(f"{key}={value} is not a model folder (no config.json there); give a hub name or a saved model folder")
        if looks_local(path) and not Path(path).expanduser().is_dir():
            raise ConfigError(f"{key}={value} is not a folder; give a hub name or a saved tokenizer folder")


def build_components(cfg, sizes: DerivedSizes) -> Components:
    device = pick_device(cfg.cluster.device)
    check_model_sources(cfg)
    # 1. names: every registry lookup, so an unknown component fails before anything loads
    factories = {
        "dataset": registry.resolve("dataset", cfg.dataset.name, key="dataset.name"),
        "estimator": registry.resolve("estimator", cfg.algorithm.estimator, key="algorithm.estimator"),
        "generator": registry.resolve("generator", cfg.generator.name, key="generator.name"),
        "policy": registry.resolve("policy", cfg.policy.name, key="policy.name"),
        "reference": registry.resolve("reference", cfg.reference.name, key="reference.name"),
        "critic": registry.resolve("critic", cfg.critic.name, key="critic.name"),
    }
    rewards = RewardSet(cfg.reward)
    estimator = factories["estimator"](cfg=cfg.algorithm, gen_cfg=cfg.generator)
    # 2. tokenizers and data (cheap); every other model must share the policy's vocabulary
    model = cfg.model
    tokenizer = load_tokenizer(model.tokenizer or model.name_or_path, model.revision, model.trust_remote_code)
    critic_path = cfg.critic.name_or_path or cfg.reward.path or model.name_or_path
    for key, path, used in (
        ("reference.name_or_path", cfg.reference.name_or_path, estimator.needs_reference),
        ("reward.path", cfg.reward.path, True),
        ("critic.name_or_path", cfg.critic.name_or_path, estimator.needs_critic),
    ):
        if path and used:
            try:
                check_vocab_match(tokenizer, load_tokenizer(path), f"policy `{model.name_or_path}`", f"`{path}`")
            except ValueError as err:
                raise ConfigError(f"{key}: {err}") from None
    try:
        splits = factories["dataset"](cfg=cfg.dataset, tokenizer=tokenizer, seed=cfg.seed)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    log.info("dataset %s: %d train prompts, %d eval prompts", cfg.dataset.name, len(splits.train), len(splits.eval))
    missing_truth = sum(ex.ground_truth is None for ex in splits.train + splits.eval)
    if rewards.verifiers and missing_truth:
        raise ConfigError(
            f"reward functions {rewards.verifiers} check answers against a ground truth, but {missing_truth} prompts "
            f"carry none; set dataset.ground_truth_key=<column> or choose other reward.functions"
        )
    # 3. models
    policy = factories["policy"](
        cfg=cfg.policy, model_cfg=model, train_cfg=cfg.train, total_optimizer_steps=sizes.optimizer_steps, device=device
    )
    if policy.model.get_output_embeddings().weight.shape[0] < len(tokenizer):
        raise ValueError(
            f"model `{model.name_or_path}` has {policy.model.get_output_embeddings().weight.shape[0]} output rows "
            f"but its tokenizer has {len(tokenizer)} tokens; model.tokenizer must match the model"
        )
    reference = None
    if estimator.needs_reference:
        reference = factories["reference"](cfg=cfg.reference, model_cfg=model, device=device)
    else:
        log.info("reference model not loaded: algorithm.beta=0 disables the KL term")
    critic = None
    if estimator.needs_critic:
        critic = factories["critic"](
            cfg=cfg.critic, model_cfg=model, init_path=critic_path, train_cfg=cfg.train,
            total_optimizer_steps=sizes.optimizer_steps, device=device,
        )
        log.info("critic initialised from %s", critic_path)
    if cfg.reward.path:
        rewards.model = RewardModelScorer(cfg.reward, model.dtype, device, cfg.train.micro_batch_size)
    generator = factories["generator"](cfg=cfg.generator, model_cfg=model, tokenizer=tokenizer, device=device)
    generator.update_weights(policy.state_dict())
    return Components(
        device=device,
        tokenizer=tokenizer,
        prompts=PromptStream(splits.train, seed=cfg.seed),
        eval_examples=splits.eval,
        rewards=rewards,
        estimator=estimator,
        generator=generator,
        policy=policy,
        reference=reference,
        critic=critic,
        shuffle=torch.Generator().manual_seed(cfg.seed),
        data_report=splits.report,
    )
