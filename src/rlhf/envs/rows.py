"""Played episodes as training rows: one row per trajectory, observations inside the action window masked out.

Row = prompt tokens, then every (action, observation) after them, as played. The action window starts at the first
action; `loss_mask` is 1 on action tokens only, `gen_logp` carries the generator's logprobs there, and
`turn_rewards` puts each turn's reward on its last action token (so GAE and per-turn returns see when it came).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rlhf.envs.base import REDUCTIONS
from rlhf.envs.loop import Episode
from rlhf.trajectory import Trajectories, concat



def episode_row(episode: Episode, reward_reduce: str) -> Trajectories:
    """One episode as a single row (B = 1). Turn rewards: every turn's (``sum``) or only the last turn's (``last``)."""
    prompt = episode.turns[0].observation_ids
    ids, mask, logp, rewards = [], [], [], []
    for k, turn in enumerate(episode.turns):
        if k > 0:
            ids += turn.observation_ids
            mask += [0.0] * len(turn.observation_ids)
            logp += [0.0] * len(turn.observation_ids)
            rewards += [0.0] * len(turn.observation_ids)
        ids += turn.action_ids
        mask += [1.0] * len(turn.action_ids)
        logp += turn.action_logp
        counted = reward_reduce == "sum" or k == len(episode.turns) - 1
        rewards += [0.0] * len(turn.action_ids)
        if turn.action_ids and counted:
            rewards[-1] = turn.reward
    input_ids = torch.tensor([prompt + ids], dtype=torch.long)
    turn_rewards = torch.tensor([rewards])
    return Trajectories(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        loss_mask=torch.tensor([mask]),
        gen_logp=torch.tensor([logp]),
        group_id=torch.tensor([episode.group]),
        stopped=torch.tensor([episode.stopped]),
        scores=turn_rewards.sum(dim=1),
        turn_rewards=turn_rewards,
    )


def episode_rows(episodes: list[Episode], reward_reduce: str, pad_id: int) -> Trajectories:
    """Every episode as a row (in order), contexts left-padded and windows right-padded to common widths."""
    if reward_reduce not in REDUCTIONS:
        raise ValueError(f"env.reward_reduce={reward_reduce!r}; choose one of {', '.join(REDUCTIONS)}")
    empty = [ep.seed for ep in episodes if not ep.turns or not any(t.action_ids for t in ep.turns)]
    if empty:
        raise ValueError(f"episodes with no action token cannot be trained on (reset seeds {empty[:5]})")
    rows = [episode_row(ep, reward_reduce) for ep in episodes]
    if all(turn.version is not None for ep in episodes for turn in ep.turns if turn.action_ids):
        rows = [replace(row, extras={"token_versions": token_versions(ep)}) for row, ep in zip(rows, episodes)]
    return concat(rows, pad_id)


def token_versions(episode: Episode) -> torch.Tensor:
    """The policy version of each window token: an action's the version that sampled it, an observation's the version
    of the action after it (it is not trained on). Shape: (1, window tokens) long."""
    versions: list[int] = []
    for k, turn in enumerate(episode.turns):
        tokens = len(turn.action_ids) + (len(turn.observation_ids) if k > 0 else 0)
        versions += [turn.version if turn.version is not None else 0] * tokens
    return torch.tensor([versions], dtype=torch.long)


def transcript(episode: Episode) -> str:
    """Everything after the prompt, one line per turn, marked by role (for sample tables and eval files)."""
    lines = []
    for k, turn in enumerate(episode.turns):
        if k > 0:
            lines.append(f"[user] {turn.observation}")
        lines.append(f"[assistant] {turn.action}  (reward {turn.reward:g})")
    return "\n".join(lines)


def episode_metrics(episodes: list[Episode], failed: int) -> dict[str, float]:
    """The batch's `env/*` metrics (names as in the Tinker cookbook's multi-turn GEM loop) over the episodes that did not fail."""
    n = max(len(episodes), 1)
    longer = [ep for ep in episodes if len(ep.turns) > 1]
    return {
        "env/episode_return": sum(ep.episode_return for ep in episodes) / n,
        "env/num_turns_per_episode": sum(len(ep.turns) for ep in episodes) / n,
        "env/action_num_tokens": sum(len(t.action_ids) for ep in episodes for t in ep.turns) / n,
        "env/num_episodes": float(len(episodes)),
        "env/failed_episodes": float(failed),
        "env/success_rate": sum(ep.success for ep in episodes) / n,
        "env/first_turn_success_rate": sum(ep.success and len(ep.turns) == 1 for ep in episodes) / n,
        "env/later_turn_success_rate": sum(ep.success for ep in longer) / max(len(longer), 1),  # of those that went on
        "env/max_tokens_rate": sum(ep.end == "max_tokens" for ep in episodes) / n,
        "env/max_turns_rate": sum(ep.end == "max_turns" for ep in episodes) / n,
    }
