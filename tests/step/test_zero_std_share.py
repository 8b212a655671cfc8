"""`objective/frac_reward_zero_std`: the share of groups that give a group-relative advantage no signal."""

import torch

from rlhf.step.learner import zero_std_share


def share(scores: list[float], group_id: list[int]) -> dict[str, float]:
    return zero_std_share(torch.tensor(scores), torch.tensor(group_id))


def test_counts_the_groups_whose_samples_all_scored_the_same():
    # three groups: all 1 (no signal), mixed, all 0 (no signal)
    assert share([1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 2, 2]) == {"objective/frac_reward_zero_std": 2 / 3}


def test_every_group_with_a_signal_gives_zero():
    assert share([1, 0, 0.5, 0.25], [0, 0, 1, 1]) == {"objective/frac_reward_zero_std": 0.0}


def test_one_sample_per_prompt_logs_nothing():
    assert share([1, 1, 0], [0, 1, 2]) == {}
