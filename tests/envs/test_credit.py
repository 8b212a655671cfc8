"""Credit assignment over played episodes, against hand-computed values: per-trajectory groups (GRPO), per-turn
discounted returns with ReBN, and GAE whose rewards arrive at each turn's end."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rlhf.envs.loop import Episode, Turn
from rlhf.envs.rows import episode_rows
from rlhf.algorithms import build_algorithm
from algorithm_nodes import algorithm_cfg

PAD = 0


def make_algorithm(**overrides):
    """The composed algorithm for the default parts with ``overrides`` (`algorithm_cfg`)."""
    return build_algorithm(algorithm_cfg(**overrides), 8)


def episode(group: int, turns: list[tuple[int, int, float]]) -> Episode:
    """An episode from (observation tokens, action tokens, reward) per turn; ids are arbitrary non-pad tokens."""
    played = [
        Turn(observation=f"o{k}", observation_ids=[5] * n_obs, action_ids=[7] * n_act, action_logp=[-0.5] * n_act, reward=r,
             stopped=True)
        for k, (n_obs, n_act, r) in enumerate(turns)
    ]
    return Episode(group=group, seed=group, task=None, turns=played, end="terminated")


# two tasks x two episodes; task 0: one wins on the 2nd turn, one fails twice; task 1: a first-turn win, one 3-turn loss
EPISODES = [
    episode(0, [(3, 2, 0.0), (2, 1, 1.0)]),
    episode(0, [(3, 1, 0.0), (2, 2, 0.0)]),
    episode(1, [(4, 1, 1.0)]),
    episode(1, [(4, 1, 0.0), (1, 1, 0.0), (1, 2, 0.5)]),
]


def rows(reduce: str = "sum"):
    batch = episode_rows(EPISODES, reduce, PAD)
    return replace(batch, old_logp=batch.gen_logp.clone())


def per_turn_values(batch, advantages: torch.Tensor) -> list[list[float]]:
    """The advantage of each turn (each turn's action tokens share one value), row by row."""
    out = []
    for row in range(len(batch)):
        mask, values, turns, previous = batch.loss_mask[row], advantages[row], [], 0.0
        for j in range(mask.shape[0]):
            if mask[j] == 1 and previous == 0:
                turns.append(values[j].item())
            elif mask[j] == 1:
                assert values[j].item() == pytest.approx(turns[-1])  # constant within a turn
            previous = mask[j].item()
        out.append(turns)
    return out


def test_per_trajectory_groups_with_grpo():
    batch, _ = make_algorithm(advantage="grpo", num_samples_per_prompt=2, beta=0.0).prepare(rows())
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    assert batch.scores.tolist() == scores.tolist()
    expected = [(1 - 0.5) / (0.5**0.5 + 1e-6), (0 - 0.5) / (0.5**0.5 + 1e-6), (1 - 0.75) / (0.125**0.5 + 1e-6), (0.5 - 0.75) / (0.125**0.5 + 1e-6)]
    for row, turns in enumerate(per_turn_values(batch, batch.advantages)):
        assert turns == pytest.approx([expected[row]] * len(EPISODES[row].turns), abs=1e-5)
    # observation tokens inside the window carry no advantage and no loss
    assert (batch.advantages[batch.loss_mask == 0] == 0).all()


def test_per_turn_discounted_returns_with_rebn():
    gamma = 0.9
    batch, _ = make_algorithm(advantage="rebn", policy_loss="importance_sampling", gamma=gamma, beta=0.0).prepare(rows())
    # G_k = r_k + gamma * G_{k+1}, by hand, every turn of the batch counted once
    returns = [[gamma * 1.0, 1.0], [0.0, 0.0], [1.0], [gamma**2 * 0.5, gamma * 0.5, 0.5]]
    flat = torch.tensor([g for row in returns for g in row])
    mean, std = flat.mean(), flat.std(unbiased=False)
    expected = [[(g - mean.item()) / (std.item() + 1e-6) for g in row] for row in returns]
    got = per_turn_values(batch, batch.advantages)
    for row in range(len(EPISODES)):
        assert got[row] == pytest.approx(expected[row], abs=1e-5)


def test_reward_reduce_last_keeps_only_the_final_turn():
    batch = rows("last")
    assert batch.scores.tolist() == [1.0, 0.0, 1.0, 0.5]
    assert batch.turn_rewards.sum(dim=1).tolist() == [1.0, 0.0, 1.0, 0.5]
    assert (batch.turn_rewards != 0).sum().item() == 3


def test_gae_rewards_arrive_at_each_turn_end_and_bootstrap_across_observations():
    batch = rows()
    values = torch.zeros_like(batch.loss_mask)
    values[3] = torch.where(batch.loss_mask[3].bool(), torch.tensor(0.25), torch.tensor(0.0))
    algo = make_algorithm(advantage="gae", policy_loss="ppo_clip", gamma=1.0, lam=1.0, beta=0.0)
    out, _ = algo.prepare(replace(batch, values=values))
    # gamma = lam = 1: an action token's return is every reward from it on; the row's 3-turn loss earns 0.5 at its end
    row3 = out.returns[3][batch.loss_mask[3].bool()].tolist()
    assert row3 == pytest.approx([0.5] * 4)
    row0 = out.returns[0][batch.loss_mask[0].bool()].tolist()
    assert row0 == pytest.approx([1.0, 1.0, 1.0])
