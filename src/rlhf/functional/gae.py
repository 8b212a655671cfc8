"""Per-token rewards and generalised advantage estimation for PPO with a critic."""

from __future__ import annotations

import torch


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last valid token (0 for an empty row). Shape: (B, T) -> (B,) long."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.zeros_like(positions)).max(dim=1).values


def token_level_rewards(scores: torch.Tensor, kl_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards: the (KL) reward at every token, plus the sequence score at the last valid token.

    Shape: scores (B,), kl_rewards (B, T) (e.g. -beta * KL, 0 outside the mask), mask (B, T) -> (B, T).
    """
    rewards = torch.where(mask.bool(), kl_rewards, torch.zeros_like(kl_rewards)).clone()
    rows = torch.arange(scores.shape[0], device=scores.device)
    rewards[rows, last_token_index(mask)] += scores
    return rewards


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over response tokens (Schulman et al., 2016). Shape: (B, T) each -> (advantages (B, T), returns (B, T)).

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, where t+1 is the next
    *valid* token: tokens outside the mask (a multi-turn row's observations) are skipped, not ends of the
    episode; V and A are 0 after the last valid token (the episode ends there). returns = A + V. Both are 0
    outside the mask.
    """
    valid = mask.bool()
    values = torch.where(valid, values, torch.zeros_like(values))
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        adv = torch.where(valid[:, t], adv, torch.zeros_like(adv))
        advantages[:, t] = adv
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_adv = torch.where(valid[:, t], adv, next_adv)
    return advantages, (advantages + values) * mask

