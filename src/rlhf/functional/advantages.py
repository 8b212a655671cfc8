"""Advantages for critic-free estimators: per sequence (GRPO, RLOO, REINFORCE, ReMax) and per token from returns
(REINFORCE++, REBN)."""

from __future__ import annotations

from typing import Union

import torch

from rlhf.functional.masked import masked_whiten


GroupSizes = Union[int, torch.Tensor]  # G (every group has G rows) or a (P,) long tensor of each group's size (ragged)


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """View (B,) scores as (B/G, G); samples of one prompt are contiguous."""
    if scores.dim() != 1 or scores.numel() % group_size != 0:
        raise ValueError(f"scores of shape {tuple(scores.shape)} cannot be split into groups of {group_size}")
    return scores.view(-1, group_size)


def _ragged(scores: torch.Tensor, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous groups of sizes ``sizes`` as a (P, M) matrix padded with zeros (M the largest group) and which of
    its entries are rows. Shapes: scores (B,), sizes (P,) summing to B -> (P, M), (P, M) bool."""
    if scores.dim() != 1 or int(sizes.sum()) != scores.numel() or bool((sizes < 1).any()):
        raise ValueError(f"scores of shape {tuple(scores.shape)} cannot be split into groups of sizes {sizes.tolist()}")
    sizes = sizes.to(scores.device)
    present = torch.arange(int(sizes.max()), device=scores.device)[None, :] < sizes[:, None]
    padded = scores.new_zeros(present.shape)
    padded[present] = scores  # row-major order of the present entries is the rows' order
    return padded, present


def _all_equal(grouped: torch.Tensor, present: torch.Tensor | None = None) -> torch.Tensor:
    """Whether each group's scores are all the same, exactly (ragged groups: over the ``present`` entries only).
    Shape: (P, G), (P, G) bool -> (P, 1) bool."""
    same = grouped == grouped[:, :1]
    return (same if present is None else same | ~present).all(dim=1, keepdim=True)


def _smallest(group_size: GroupSizes) -> int:
    return group_size if isinstance(group_size, int) else int(group_size.min())


def group_normalized_advantages(
    scores: torch.Tensor, group_size: GroupSizes, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: each score minus its group's mean, divided by the group's std unless ``norm_by_std`` is false.

    Shape: scores (B,) with B = prompts * G, groups contiguous -> (B,); or ragged groups (``group_size`` a (P,) tensor
    of sizes: what is left of groups that lost failed episodes). The std is the unbiased one.
    A group whose samples all scored the same gets advantage exactly 0: in floating point its mean can be an ulp
    off a value such as 0.1 and its std ~1e-7, which would turn "no signal" into same-signed advantages of up to
    ~0.1 that Adam scales into a full-size step.
    """
    if norm_by_std and _smallest(group_size) < 2:
        raise ValueError("GRPO with std normalisation needs at least 2 samples per prompt")
    if not isinstance(group_size, int):
        padded, present = _ragged(scores, group_size)
        counts = present.sum(dim=1, keepdim=True)
        centred = (padded - padded.sum(dim=1, keepdim=True) / counts) * present
        if norm_by_std:
            centred = centred / ((centred.square().sum(dim=1, keepdim=True) / (counts - 1)).sqrt() + eps)
        return torch.where(_all_equal(padded, present), torch.zeros_like(centred), centred)[present]
    grouped = _groups(scores, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return torch.where(_all_equal(grouped), torch.zeros_like(centred), centred).reshape(-1)


def rloo_advantages(scores: torch.Tensor, group_size: GroupSizes) -> torch.Tensor:
    """RLOO: each score minus the mean of the other G-1 scores of its prompt. Shape: (B,) -> (B,); ``group_size`` G
    or a (P,) tensor of ragged groups' sizes, as in `group_normalized_advantages`."""
    if _smallest(group_size) < 2:
        raise ValueError("RLOO needs at least 2 samples per prompt")
    if not isinstance(group_size, int):
        padded, present = _ragged(scores, group_size)
        counts = present.sum(dim=1, keepdim=True)
        others_mean = (padded.sum(dim=1, keepdim=True) - padded) / (counts - 1)
        return torch.where(_all_equal(padded, present), torch.zeros_like(padded), padded - others_mean)[present]
    grouped = _groups(scores, group_size)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    # a group that scored all the same gets exactly 0, as in `group_normalized_advantages`
    return torch.where(_all_equal(grouped), torch.zeros_like(grouped), grouped - others_mean).reshape(-1)


def group_means(scores: torch.Tensor, group_size: GroupSizes) -> torch.Tensor:
    """Each row's group mean score. Shape: (B,) -> (B,); ``group_size`` as in `group_normalized_advantages`."""
    if not isinstance(group_size, int):
        padded, present = _ragged(scores, group_size)
        return (padded.sum(dim=1) / present.sum(dim=1)).repeat_interleave(group_size.to(scores.device))
    return _groups(scores, group_size).mean(dim=1).repeat_interleave(group_size)


def best_and_worst(scores: torch.Tensor, group_size: GroupSizes) -> tuple[torch.Tensor, torch.Tensor]:
    """The row index of each group's highest and of its lowest score (the first on ties). Shape: (B,) -> (P,), (P,);
    ``group_size`` as in `group_normalized_advantages`."""
    if isinstance(group_size, int):
        grouped = _groups(scores, group_size)
        offsets = torch.arange(grouped.shape[0], device=scores.device) * group_size
        return offsets + grouped.argmax(dim=1), offsets + grouped.argmin(dim=1)
    padded, present = _ragged(scores, group_size)
    sizes = group_size.to(scores.device)
    offsets = sizes.cumsum(0) - sizes
    best = padded.masked_fill(~present, float("-inf")).argmax(dim=1)
    worst = padded.masked_fill(~present, float("inf")).argmin(dim=1)
    return offsets + best, offsets + worst


def baseline_advantages(scores: torch.Tensor) -> torch.Tensor:
    """REINFORCE with the batch-mean baseline. Shape: (B,) -> (B,). A batch whose scores are all equal gets exactly
    0 (its float mean can be an ulp off the value)."""
    return torch.where((scores == scores[:1]).all(), torch.zeros_like(scores), scores - scores.mean())


def greedy_baseline_advantages(scores: torch.Tensor, baselines: torch.Tensor) -> torch.Tensor:
    """ReMax (Li et al., 2023, arXiv:2310.10505): each reward minus the reward of its prompt's greedy response.

    Shape: scores (B,), baselines (B,) (the greedy response's reward, repeated for every sample of the prompt) -> (B,).
    """
    if scores.shape != baselines.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and baselines {tuple(baselines.shape)} must have one entry per row")
    return scores - baselines


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go per token: G_t = r_t + gamma * G_t', t' the next valid token. Shape: (B, T) -> (B, T).

    Tokens outside the mask (a multi-turn row's observations) are skipped, not ends of the episode; their rewards
    are dropped and their returns are 0.
    """
    valid = mask.bool()
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    returns = torch.zeros_like(rewards)
    following = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        following = torch.where(valid[:, t], rewards[:, t] + gamma * following, following)
        returns[:, t] = torch.where(valid[:, t], following, torch.zeros_like(following))
    return returns


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++ (Hu, 2025, arXiv:2501.03262): token returns whitened over every valid token of the batch.

    Shape: rewards (B, T) (per-token KL penalty plus the score at the last token), mask (B, T) -> (B, T), 0 outside
    the mask. The batch-wide whitening is the only baseline: no critic, no per-prompt group.
    """
    return masked_whiten(discounted_returns(rewards, mask, gamma), mask)


def to_token_level(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every valid response token its sequence's advantage. Shape: (B,), mask (B, T) -> (B, T)."""
    return advantages.unsqueeze(1) * mask


def turn_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Discounted return of each turn. Shape: rewards, mask (B, T) -> (per token (B, T), per turn (B, K), exists (B, K)).

    A turn is a run of consecutive valid tokens; its reward is the sum of ``rewards`` over its tokens (the
    environment's reward sits at the turn's last token). G_k = R_k + gamma * G_{k+1} over the row's turns.
    Every token of a turn gets the turn's return (0 outside the mask); K = the most turns in a row, and ``exists``
    marks the turn slots a row really has.
    """
    valid = mask.bool()
    starts = valid & ~torch.nn.functional.pad(valid[:, :-1], (1, 0), value=False)
    turn = torch.where(valid, starts.long().cumsum(dim=1) - 1, torch.zeros_like(starts, dtype=torch.long))
    count = int(starts.sum(dim=1).max().item()) if valid.any() else 0
    per_turn = torch.zeros(rewards.shape[0], max(count, 1), dtype=rewards.dtype, device=rewards.device)
    per_turn.scatter_add_(1, turn, torch.where(valid, rewards, torch.zeros_like(rewards)))
    exists = torch.arange(per_turn.shape[1], device=rewards.device) < starts.sum(dim=1, keepdim=True)
    returns = torch.zeros_like(per_turn)
    following = torch.zeros_like(per_turn[:, 0])
    for k in reversed(range(per_turn.shape[1])):
        following = torch.where(exists[:, k], per_turn[:, k] + gamma * following, following)
        returns[:, k] = following
    return torch.where(valid, returns.gather(1, turn), torch.zeros_like(rewards)), returns, exists


def rebn_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float, eps: float = 1e-6, unbiased: bool = False
) -> torch.Tensor:
    """Per-turn discounted returns with return batch normalisation (REBN), as token advantages.

    Shape: rewards, mask (B, T) -> (B, T). Each turn's return (`turn_returns`) is centred and scaled by the mean
    and std (+ ``eps``) over every turn of the batch, each turn counted once; the std is the biased one, or the
    Bessel-corrected one with ``unbiased`` (as GEM's example computes it: ``returns.std() + 1e-9``). A single-turn
    row's advantage is its whitened reward. Fewer than two turns: only centred. Every turn's return equal: exactly 0.
    """
    per_token, per_turn, exists = turn_returns(rewards, mask, gamma)
    turns = per_turn[exists]
    if turns.numel() == 0 or bool((turns == turns[0]).all()):  # no signal is exactly 0, not an ulp over a tiny std
        return torch.zeros_like(rewards)
    scale = turns.std(unbiased=unbiased) + eps if turns.numel() > 1 else torch.ones((), dtype=rewards.dtype)
    return (per_token - turns.mean()) / scale * mask
