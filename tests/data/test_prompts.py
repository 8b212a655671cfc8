"""The prompt stream (epochs, shuffling, reproducibility) and the built-in arithmetic dataset."""

from __future__ import annotations

import logging

import pytest

from omegaconf import OmegaConf

from rlhf import registry
from rlhf.data.arith import ArithDatasetConfig, arith_dataset
from rlhf.data.prompts import PromptExample, PromptStream
from rlhf.errors import ConfigError


def make_examples(n: int) -> list[PromptExample]:
    """``n`` distinct examples whose text is their index."""
    return [PromptExample(text=str(i), token_ids=(i,), ground_truth=i) for i in range(n)]


def texts(batch: list[PromptExample]) -> list[str]:
    """The texts of a batch, in order."""
    return [example.text for example in batch]


def dataset_cfg(**overrides):
    """A typed arith dataset config."""
    return OmegaConf.structured(ArithDatasetConfig(name="arith", **overrides))


# --- PromptStream -------------------------------------------------------------------------------------


def test_each_prompt_once_per_epoch():
    """Batches that exactly cover an epoch contain every prompt once, in shuffled order."""
    stream = PromptStream(make_examples(12), seed=3)
    epoch = [t for _ in range(4) for t in texts(stream.next_batch(3))]
    assert sorted(epoch, key=int) == [str(i) for i in range(12)]
    assert epoch != [str(i) for i in range(12)]


def test_new_epoch_reshuffles():
    """The second epoch covers every prompt again, in a different order."""
    stream = PromptStream(make_examples(20), seed=0)
    first = texts(stream.next_batch(20))
    second = texts(stream.next_batch(20))
    assert sorted(second) == sorted(first)
    assert second != first
    assert stream.epoch == 1


def test_batch_spans_epoch_boundary():
    """A batch crossing the end of an epoch finishes it, then starts the next epoch's order."""
    examples = make_examples(5)
    stream = PromptStream(examples, seed=7)
    reference = PromptStream(examples, seed=7)
    first_epoch = texts(reference.next_batch(5))
    second_epoch = texts(reference.next_batch(5))
    assert texts(stream.next_batch(3)) == first_epoch[:3]
    spanning = texts(stream.next_batch(4))
    assert spanning == first_epoch[3:] + second_epoch[:2]
    assert stream.epoch == 1
    assert texts(stream.next_batch(3)) == second_epoch[2:]


def test_batch_larger_than_dataset():
    """A batch bigger than the dataset covers whole epochs and continues into the next."""
    stream = PromptStream(make_examples(3), seed=1)
    batch = texts(stream.next_batch(7))
    assert len(batch) == 7
    assert sorted(batch[:3]) == sorted(batch[3:6]) == ["0", "1", "2"]
    assert stream.epochs_done == pytest.approx(2 + 1 / 3)


def test_epochs_done_is_fractional():
    """epochs_done counts whole epochs plus the fraction of the current one."""
    stream = PromptStream(make_examples(8), seed=0)
    assert stream.epochs_done == 0.0
    stream.next_batch(2)
    assert stream.epochs_done == pytest.approx(0.25)
    stream.next_batch(6)
    assert stream.epochs_done == pytest.approx(1.0)
    stream.next_batch(4)
    assert stream.epochs_done == pytest.approx(1.5)


def test_same_seed_same_order_different_seed_different_order():
    """The order is a function of the seed: equal seeds agree over several epochs, different seeds do not."""
    examples = make_examples(30)
    a, b, c = PromptStream(examples, seed=5), PromptStream(examples, seed=5), PromptStream(examples, seed=6)
    run_a = [texts(a.next_batch(7)) for _ in range(10)]
    run_b = [texts(b.next_batch(7)) for _ in range(10)]
    run_c = [texts(c.next_batch(7)) for _ in range(10)]
    assert run_a == run_b
    assert run_a != run_c


def test_empty_stream_is_an_error():
    """A stream needs at least one prompt."""
    with pytest.raises(ValueError, match="no prompts"):
        PromptStream([], seed=0)


# --- arith_dataset ------------------------------------------------------------------------------------


def test_arith_builds_every_problem_with_ground_truth(tokenizer):
    """max_operand=9 gives the 100 problems a+b= with their sums, tokenised, train = eval when eval_size=0."""
    splits = arith_dataset(dataset_cfg(max_operand=9), tokenizer)
    assert len(splits.train) == 100
    assert len({e.text for e in splits.train}) == 100
    for example in splits.train:
        a, b = example.text[:-1].split("+")
        assert example.text.endswith("=")
        assert example.ground_truth == str(int(a) + int(b))
        assert example.token_ids == tuple(tokenizer(example.text)["input_ids"])
    assert splits.eval == splits.train
    assert registry.resolve("dataset", "arith") is arith_dataset


def test_arith_max_operand_sets_problem_count(tokenizer):
    """max_operand=n gives (n+1)^2 problems, operands up to n."""
    splits = arith_dataset(dataset_cfg(max_operand=12), tokenizer)
    assert len(splits.train) == 169
    assert any(e.text == "12+12=" and e.ground_truth == "24" for e in splits.train)


def test_arith_eval_split_is_disjoint_and_reproducible(tokenizer):
    """eval_size holds out that many problems, disjoint from train, the same split each time."""
    splits = arith_dataset(dataset_cfg(max_operand=9, eval_size=10), tokenizer)
    train, held_out = {e.text for e in splits.train}, {e.text for e in splits.eval}
    assert len(held_out) == 10 and len(train) == 90
    assert not train & held_out
    assert len(train | held_out) == 100
    again = arith_dataset(dataset_cfg(max_operand=9, eval_size=10), tokenizer)
    assert [e.text for e in again.eval] == [e.text for e in splits.eval]


@pytest.mark.parametrize("max_operand", [-1, 100])
def test_arith_rejects_bad_max_operand(max_operand):
    """max_operand outside 0..99 is a ConfigError naming the key, from the dataset's own check (validate runs it)."""
    with pytest.raises(ConfigError, match=f"dataset.max_operand={max_operand} must satisfy"):
        ArithDatasetConfig(name="arith", max_operand=max_operand).check("dataset")


@pytest.mark.parametrize("eval_size", [-1, 100, 150])
def test_arith_rejects_bad_eval_size(tokenizer, eval_size):
    """eval_size must leave at least one training problem and be non-negative."""
    with pytest.raises(ValueError, match="dataset.eval_size"):
        arith_dataset(dataset_cfg(max_operand=9, eval_size=eval_size), tokenizer)


def test_arith_rejects_too_small_max_prompt_length(tokenizer):
    """A prompt longer than max_prompt_length tokens is a ValueError; exactly fitting is fine."""
    longest = max(len(tokenizer(f"{a}+{b}=")["input_ids"]) for a in range(10) for b in range(10))
    assert len(arith_dataset(dataset_cfg(max_operand=9, max_prompt_length=longest), tokenizer).train) == 100
    with pytest.raises(ValueError, match="dataset.max_prompt_length"):
        arith_dataset(dataset_cfg(max_operand=9, max_prompt_length=longest - 1), tokenizer)


def test_a_step_larger_than_the_split_warns_once(caplog):
    """9 prompts against 16 per step (a 10-row file less its hold-out): one warning names the key and the counts."""
    stream = PromptStream(make_examples(9), seed=1)
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        first = texts(stream.next_batch(16))
        stream.next_batch(16)
    assert len(first) == 16 and len(set(first)) == 9
    [record] = caplog.records
    assert record.getMessage() == (
        "the training split has 9 prompts, fewer than the 16 a step draws (train.prompts_per_step), so every step "
        "trains some prompts more than once; add prompts, or set train.prompts_per_step<=9"
    )


def test_a_step_that_fits_the_split_does_not_warn(caplog):
    stream = PromptStream(make_examples(16), seed=1)
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        for _ in range(5):
            stream.next_batch(16)
    assert not caplog.records


def test_a_run_warns_of_a_short_split_when_it_builds_whichever_schedule_draws(caplog):
    """The stream schedule draws one prompt at a time, so a warning at the draw never came: the run's build warns."""
    from rlhf.config import compose_config, validate
    from rlhf.run.build import build_components

    cfg = compose_config(["dataset.max_operand=2", "dataset.eval_size=1", "train.prompts_per_step=16"])
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        components = build_components(validate(cfg))
    components.close()
    assert "fewer than the 16 a step draws (train.prompts_per_step)" in caplog.text
