"""rlhf.trajectory: the single-turn layout of from_completions, concat of batches of different widths, group_size."""

import pytest
import torch
from torch.testing import assert_close

from rlhf.trajectory import concat, from_completions, group_size

PAD = 0


def test_from_completions_layout():
    """Left-padded prompt then right-padded response; the response is the window, each row its own group."""
    query_ids, query_mask = torch.tensor([[PAD, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    response_ids, response_mask = torch.tensor([[11, 12], [13, PAD]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    logprobs, stopped = torch.tensor([[-0.1, -0.2], [-0.3, 0.0]]), torch.tensor([True, False])
    batch = from_completions(query_ids, query_mask, response_ids, response_mask, logprobs, stopped)
    assert batch.input_ids.tolist() == [[PAD, 5, 6, 11, 12], [7, 8, 9, 13, PAD]]
    assert batch.attention_mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch.loss_mask.dtype == torch.float32 and torch.equal(batch.loss_mask, response_mask)
    assert batch.window_start == 3 and torch.equal(batch.window_ids, response_ids)
    assert batch.action_lengths.tolist() == [2.0, 1.0]
    assert batch.group_id.tolist() == [0, 1] and batch.gen_logp is logprobs and batch.stopped is stopped
    assert batch.old_logp is None and batch.scores is None and batch.extras == {} and batch.rows_per_unit == 1
    _, _, positions = batch.model_inputs()
    assert positions.tolist() == [[0, 0, 1, 2, 3], [0, 1, 2, 3, 3]]  # real tokens count from 0


def _part(query_ids, query_mask, response_ids, response_mask, group, scores):
    batch = from_completions(
        torch.tensor(query_ids), torch.tensor(query_mask), torch.tensor(response_ids), torch.tensor(response_mask),
        -torch.tensor(response_mask) * 0.5, torch.ones(len(query_ids), dtype=torch.bool),
    )
    batch.group_id = torch.tensor(group)
    batch.scores = torch.tensor(scores)
    batch.extras = {"w": torch.tensor(scores) * 10}
    return batch


def test_concat_pads_context_left_and_window_right():
    """Context 2 + window 3 with context 4 + window 2 -> context 4 + window 3; rows intact, windows aligned."""
    a = _part([[1, 2]], [[1, 1]], [[3, 4, PAD]], [[1.0, 1.0, 0.0]], [0], [1.0])
    b = _part([[PAD, 21, 22, 23], [24, 25, 26, 27]], [[0, 1, 1, 1], [1, 1, 1, 1]], [[31, 32], [33, PAD]],
              [[1.0, 1.0], [1.0, 0.0]], [1, 1], [2.0, 3.0])
    out = concat([a, b], PAD)
    assert out.input_ids.tolist() == [
        [PAD, PAD, 1, 2, 3, 4, PAD],
        [PAD, 21, 22, 23, 31, 32, PAD],
        [24, 25, 26, 27, 33, PAD, PAD],
    ]
    assert out.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]]
    assert out.window_start == 4 and out.loss_mask.tolist() == [[1, 1, 0], [1, 1, 0], [1, 0, 0]]
    assert_close(out.gen_logp, torch.tensor([[-0.5, -0.5, 0.0], [-0.5, -0.5, 0.0], [-0.5, 0.0, 0.0]]))
    # every row's real tokens, and their positions, are the part's; window tokens sit under the same columns
    for rows, part in ((slice(0, 1), a), (slice(1, 3), b)):
        got, want = out.select(rows), part
        for i in range(len(part)):
            real, want_real = got.attention_mask[i].bool(), want.attention_mask[i].bool()
            assert torch.equal(got.input_ids[i][real], want.input_ids[i][want_real])
            got_pos, want_pos = got.model_inputs()[2][i], want.model_inputs()[2][i]
            assert torch.equal(got_pos[real], want_pos[want_real])
        width = part.loss_mask.shape[1]
        assert torch.equal(got.window_ids[:, :width], part.window_ids)
        assert torch.equal(got.loss_mask[:, :width], part.loss_mask)
    assert out.group_id.tolist() == [0, 1, 1] and out.scores.tolist() == [1.0, 2.0, 3.0]
    assert out.extras["w"].tolist() == [10.0, 20.0, 30.0] and out.old_logp is None and out.stopped.all()


def test_group_size_accepts_contiguous_equal_groups():
    assert group_size(torch.tensor([3, 3, 7, 7, 5, 5])) == 2
    assert group_size(torch.tensor([4, 1, 2])) == 1


def test_groups_of_different_sizes_give_each_size():  # groups that lost failed episodes
    assert group_size(torch.tensor([0, 0, 1, 2, 2, 2])).tolist() == [2, 1, 3]


@pytest.mark.parametrize(
    "ids",
    [
        [0, 1, 0, 1],  # interleaved samples of two prompts
        [0, 0, 1, 1, 0, 0],  # a group split in two
    ],
)
def test_group_size_rejects_non_contiguous_ids(ids):
    with pytest.raises(ValueError, match="contiguous groups"):
        group_size(torch.tensor(ids))
