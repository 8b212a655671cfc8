"""Sequence-level advantages: GRPO group normalisation, RLOO, REINFORCE baseline, token broadcast."""

import pytest
import torch
from torch.testing import assert_close

from rlhf.functional import (
    baseline_advantages, best_and_worst, group_means, group_normalized_advantages, rloo_advantages, to_token_level,
)

# Three contiguous groups of G = 2.
SCORES = torch.tensor([0.0, 4.0, 1.0, 1.0, 3.0, -1.0])


def test_grpo_divides_by_unbiased_group_std():
    """Group [0, 4]: mean 2, centred [-2, 2], unbiased std sqrt(8/1) = 2.8284271 -> -+0.7071068.

    Group [1, 1] is constant -> 0; group [3, -1]: mean 1, centred [2, -2] -> +-0.7071068.
    """
    adv = group_normalized_advantages(SCORES, group_size=2)
    expected = torch.tensor([-0.7071068, 0.7071068, 0.0, 0.0, 0.7071068, -0.7071068])
    assert adv.shape == (6,)
    assert_close(adv, expected, atol=1e-5, rtol=0)


def test_grpo_without_std_only_centres():
    """norm_by_std=False (Dr.GRPO): score minus group mean -> [-2, 2, 0, 0, 2, -2]."""
    adv = group_normalized_advantages(SCORES, group_size=2, norm_by_std=False)
    assert_close(adv, torch.tensor([-2.0, 2.0, 0.0, 0.0, 2.0, -2.0]))


def test_grpo_group_of_three():
    """[1, 2, 3]: mean 2, centred [-1, 0, 1], unbiased std sqrt(2/2) = 1 -> [-1, 0, 1] (up to eps)."""
    adv = group_normalized_advantages(torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 10.0]), group_size=3)
    assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]), atol=1e-5, rtol=0)


def test_grpo_identical_scores_give_exactly_zero():
    """A group whose samples all scored the same gets advantage 0, not NaN, with or without std."""
    scores = torch.tensor([5.0, 5.0, 5.0, 5.0])
    for norm in (True, False):
        adv = group_normalized_advantages(scores, group_size=4, norm_by_std=norm)
        assert torch.equal(adv, torch.zeros(4))


@pytest.mark.parametrize("value", [0.1, 0.7, -1.3])
@pytest.mark.parametrize("group_size", range(2, 17))
def test_grpo_all_equal_groups_of_inexact_values_give_exactly_zero(value, group_size):
    """0.1, 0.7 and -1.3 are not representable in binary: a float32 mean can be an ulp off and the std ~1e-7, which
    without the exact-tie rule gives same-signed advantages up to ~0.1 (a full Adam step on no signal)."""
    scores = torch.tensor([value] * group_size + [0.0, 1.0] * (group_size // 2) + [0.5] * (group_size % 2))
    for norm in (True, False):
        adv = group_normalized_advantages(scores, group_size=group_size, norm_by_std=norm)
        assert torch.equal(adv[:group_size], torch.zeros(group_size))
        assert adv[group_size:].abs().sum() > 0  # a mixed group still gets its signal


def test_grpo_groups_are_contiguous_not_strided():
    """Samples 0,1 form a group, not samples 0,2: [0, 0, 10, 10] centres to all zeros."""
    adv = group_normalized_advantages(torch.tensor([0.0, 0.0, 10.0, 10.0]), group_size=2, norm_by_std=False)
    assert torch.equal(adv, torch.zeros(4))


def test_grpo_rejects_scores_that_do_not_split_into_groups():
    """B not divisible by G, or scores not 1-D, is an error."""
    with pytest.raises(ValueError, match="groups of 2"):
        group_normalized_advantages(torch.tensor([1.0, 2.0, 3.0]), group_size=2)
    with pytest.raises(ValueError):
        group_normalized_advantages(torch.ones(2, 2), group_size=2)


@pytest.mark.filterwarnings("ignore:std\\(\\)")
def test_grpo_group_of_one_is_rejected_not_nan():
    """G = 1 with std normalisation is rejected (like RLOO) instead of yielding NaN advantages."""
    with pytest.raises(ValueError, match="at least 2 samples"):
        group_normalized_advantages(torch.tensor([1.0, 2.0, 3.0]), group_size=1)


def test_rloo_leave_one_out_group_of_four():
    """[1, 2, 3, 6] (sum 12): 1 - 11/3 = -8/3, 2 - 10/3 = -4/3, 3 - 9/3 = 0, 6 - 6/3 = 4."""
    adv = rloo_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), group_size=4)
    assert_close(adv, torch.tensor([-8.0 / 3.0, -4.0 / 3.0, 0.0, 4.0]))


def test_rloo_group_of_two_per_prompt():
    """G = 2: the baseline is the other sample: [5, 1] -> [4, -4]; [2, 2] -> [0, 0]."""
    adv = rloo_advantages(torch.tensor([5.0, 1.0, 2.0, 2.0]), group_size=2)
    assert_close(adv, torch.tensor([4.0, -4.0, 0.0, 0.0]))


def test_rloo_needs_two_samples_and_whole_groups():
    """G < 2 has no 'others'; B not divisible by G cannot be grouped."""
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(torch.tensor([1.0, 2.0]), group_size=1)
    with pytest.raises(ValueError):
        rloo_advantages(torch.tensor([1.0, 2.0, 3.0]), group_size=2)


def test_reinforce_batch_mean_baseline():
    """[1, 2, 6]: batch mean 3 -> [-2, -1, 3], ignoring any grouping."""
    assert_close(baseline_advantages(torch.tensor([1.0, 2.0, 6.0])), torch.tensor([-2.0, -1.0, 3.0]))


def test_to_token_level_broadcasts_and_zeros_padding():
    """Each valid token gets its sequence's advantage; padding and a fully masked row get 0.

    Row 1 is a short sequence between two long ones.
    """
    adv = torch.tensor([2.0, -1.0, 0.5, 3.0])
    mask = torch.tensor(
        [
            [1.0, 1.0, 1.0],
            [1.0, 0.0, 0.0],
            [1.0, 1.0, 0.0],
            [0.0, 0.0, 0.0],
        ]
    )
    expected = torch.tensor(
        [
            [2.0, 2.0, 2.0],
            [-1.0, 0.0, 0.0],
            [0.5, 0.5, 0.0],
            [0.0, 0.0, 0.0],
        ]
    )
    out = to_token_level(adv, mask)
    assert out.shape == (4, 3)
    assert_close(out, expected)


NO_SIGNAL = [0.1, 0.7, 0.9, -1.3]  # non-dyadic: their float means are an ulp off the value


@pytest.mark.parametrize("value", NO_SIGNAL)
def test_no_signal_gives_exactly_zero_advantage_in_every_estimator(value):
    """All-equal scores or returns give advantage 0 to the bit (not an ulp divided by a tiny std, which Adam would
    turn into a full-size step), in every critic-free estimator and in the batch whitening some of them use."""
    from rlhf.functional.advantages import (
        baseline_advantages, group_normalized_advantages, rebn_advantages, reinforce_pp_advantages, rloo_advantages,
    )
    from rlhf.functional.masked import masked_whiten

    scores = torch.full((12,), value)
    for advantages in (group_normalized_advantages(scores, 4), group_normalized_advantages(scores, 4, norm_by_std=False),
                       rloo_advantages(scores, 6), baseline_advantages(scores)):
        assert torch.equal(advantages, torch.zeros(12)), advantages
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    values = torch.where(mask.bool(), torch.full_like(mask, value), torch.full_like(mask, 5.0))  # padding differs
    assert torch.equal(masked_whiten(values, mask), torch.zeros_like(mask))
    last = torch.zeros_like(mask)
    last[0, 3], last[1, 1], last[2, 4] = value, value, value  # the score at each row's last token
    assert torch.equal(reinforce_pp_advantages(last, mask, gamma=1.0), torch.zeros_like(mask))
    assert torch.equal(rebn_advantages(last, mask, gamma=1.0), torch.zeros_like(mask))
    turns = torch.tensor([[0, 1, 0, 1, 1]], dtype=torch.float32)  # two turns, each ending with the same reward
    assert torch.equal(rebn_advantages(turns * value * torch.tensor([[0, 1, 0, 0, 1.0]]), turns, gamma=0.0), torch.zeros_like(turns))


def test_a_signal_still_whitens_as_before():
    from rlhf.functional.masked import masked_whiten

    values, mask = torch.tensor([[0.9, 0.9, 0.7]]), torch.ones(1, 3)
    out = masked_whiten(values, mask)
    assert out[0, 0] == out[0, 1] > 0 > out[0, 2]
    torch.testing.assert_close(out.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)


RAGGED = torch.tensor([3, 2, 4])  # groups that lost failed episodes: 3, 2 and 4 rows left
RAGGED_SCORES = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 0.3, -1.0, 0.3, 4.0])


def per_group(fn, scores, sizes):
    """``fn`` (an equal-groups estimator) applied to each group on its own, concatenated."""
    return torch.cat([fn(part, len(part)) for part in scores.split(sizes.tolist())])


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_over_ragged_groups_is_grpo_of_each_group(norm_by_std):
    got = group_normalized_advantages(RAGGED_SCORES, RAGGED, norm_by_std)
    want = per_group(lambda s, g: group_normalized_advantages(s, g, norm_by_std), RAGGED_SCORES, RAGGED)
    assert_close(got, want)
    assert got[3:5].eq(0).all()  # the tied group of two gives exactly 0


def test_rloo_over_ragged_groups_is_rloo_of_each_group():
    assert_close(rloo_advantages(RAGGED_SCORES, RAGGED), per_group(rloo_advantages, RAGGED_SCORES, RAGGED))


def test_group_means_and_best_and_worst_over_ragged_groups():
    assert_close(group_means(RAGGED_SCORES, RAGGED), torch.tensor([0.5] * 3 + [2.0] * 2 + [0.9] * 4))
    best, worst = best_and_worst(RAGGED_SCORES, RAGGED)
    assert best.tolist() == [0, 3, 8] and worst.tolist() == [1, 3, 6]  # row indices; ties: the first
    equal = torch.tensor([3, 3, 3])  # sizes that happen to be equal give what the int form gives
    assert_close(group_means(RAGGED_SCORES, equal), group_means(RAGGED_SCORES, 3))
    assert [t.tolist() for t in best_and_worst(RAGGED_SCORES, equal)] == [t.tolist() for t in best_and_worst(RAGGED_SCORES, 3)]


def test_ragged_groups_that_do_not_add_up_or_are_too_small_are_rejected():
    with pytest.raises(ValueError, match="groups of sizes"):
        group_normalized_advantages(RAGGED_SCORES, torch.tensor([3, 2]))
    with pytest.raises(ValueError, match="at least 2 samples"):
        group_normalized_advantages(RAGGED_SCORES, torch.tensor([1, 4, 4]))
    with pytest.raises(ValueError, match="RLOO needs at least 2"):
        rloo_advantages(RAGGED_SCORES, torch.tensor([8, 1]))
