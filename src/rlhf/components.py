"""What each role builds: the component of one role (actor, critic, ref, reward, generator) on one device.

The local backend calls it for every role in this process; each Ray worker calls it for its own rank.
"""

from __future__ import annotations

import torch

from rlhf import registry
from rlhf.models.loading import load_tokenizer
from rlhf.rewards.model import RewardModelScorer


def critic_init_path(cfg) -> str:
    """The critic's starting weights: `critic.name_or_path`, else the reward model, else the policy's model."""
    return cfg.critic.name_or_path or cfg.reward.path or cfg.model.name_or_path


def build_model(role: str, cfg, device: torch.device, total_optimizer_steps: int, tokenizer=None):
    """The component of ``role`` (actor, ref, critic, reward, generator) on ``device``: each local model, and what
    every Ray worker builds for its rank. ``tokenizer`` (the generator's) is loaded when not given."""
    model = cfg.model
    if role == "actor":
        return registry.build(
            "policy", cfg.policy.name, key="policy.name", cfg=cfg.policy, model_cfg=model, train_cfg=cfg.train,
            total_optimizer_steps=total_optimizer_steps, device=device, temperature=cfg.generator.temperature,
        )
    if role == "critic":
        return registry.build(
            "critic", cfg.critic.name, key="critic.name", cfg=cfg.critic, model_cfg=model, init_path=critic_init_path(cfg),
            train_cfg=cfg.train, total_optimizer_steps=total_optimizer_steps, device=device,
        )
    if role == "ref":
        return registry.build(
            "reference", cfg.reference.name, key="reference.name", cfg=cfg.reference, model_cfg=model, device=device,
            temperature=cfg.generator.temperature,
        )
    if role == "reward":
        return RewardModelScorer(cfg.reward, model.dtype, device, cfg.train.micro_batch_size)
    if role == "generator":
        if tokenizer is None:
            tokenizer = load_tokenizer(model.tokenizer or model.name_or_path, model.revision, model.trust_remote_code)
        return registry.build("generator", cfg.generator.name, key="generator.name", cfg=cfg.generator, model_cfg=model, tokenizer=tokenizer, device=device)
    raise ValueError(f"unknown role {role!r}")
