"""The long-tail counting task (`dataset=count`), its rewards, and the warm-started model that ships for it."""

from __future__ import annotations

import random
import statistics
from collections import Counter

import pytest
import torch

from rlhf import warmstart
from rlhf.config.compose import compose_config
from rlhf.config.validate import validate
from rlhf.data.count import CountDatasetConfig, count_answer, count_dataset, count_problems
from rlhf.errors import ConfigError
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.rewards.rules import count_closeness, exact_match


def test_answers_count_up_through_the_digits():
    assert count_answer(1) == "1" and count_answer(10) == "1234567890" and count_answer(12) == "123456789012"
    assert all(len(count_answer(n)) == n and count_answer(n)[-1] == str(n % 10) for n in range(1, 61))


def test_lengths_are_long_tailed():
    """39% of the prompts want 6 tokens or fewer, 11 want 50 or more, every count from 1 to 60 is asked for."""
    lengths = [len(answer) for _, answer in count_problems(60)]
    assert set(lengths) == set(range(1, 61))
    assert len(lengths) == 95 and sum(n <= 6 for n in lengths) == 37 and sum(n >= 50 for n in lengths) == 11
    assert statistics.median(lengths) == 13 and max(lengths) == 60
    assert Counter(lengths)[1] == 15 and Counter(lengths)[60] == 1


def test_dataset_evaluates_on_a_shuffled_sample_of_the_same_prompts():
    tokenizer = load_tokenizer("builtin:tiny_count")
    splits = count_dataset(CountDatasetConfig(name="count"), tokenizer)
    assert sorted(ex.text for ex in splits.eval) == sorted(ex.text for ex in splits.train)
    assert [ex.text for ex in splits.eval[:10]] != [ex.text for ex in splits.train[:10]]
    first = splits.train[0]
    assert first.text == "1=" and first.ground_truth == "1" and first.token_ids == tuple(tokenizer("1=")["input_ids"])


def test_rewards_score_exact_counts_and_near_misses():
    truths = ["12345", "12345", "12345", "12345", "1234567890"]
    responses = ["12345", "1234", "1234567", "12x45", ""]
    assert exact_match(None, responses, truths) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert count_closeness(None, responses, truths) == pytest.approx([1.0, 0.8, 0.6, 0.0, 0.0])
    assert count_closeness(None, ["1234567890123456789012"], ["12"]) == [0.0]  # 10 too long: clipped at 0


def test_max_count_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError, match=r"dataset.max_count=100 must be within 1..99"):
        validate(compose_config(["dataset=count", "dataset.max_count=100", "model=tiny_count", "reward=count"]))


def test_count_demonstrations_follow_the_advertised_mix():
    rng = random.Random(0)
    kinds = Counter()
    for _ in range(4000):
        reply = warmstart.count_demonstration(20, rng, 60)
        kinds["correct" if reply == count_answer(20) else "near" if reply in {count_answer(n) for n in range(16, 25)} else "other"] += 1
    assert abs(kinds["correct"] / 4000 - (0.35 + 0.2 / 60)) < 0.03
    assert abs(kinds["near"] / 4000 - (0.35 + 0.2 * 8 / 60)) < 0.03


def test_the_committed_counting_model_has_room_for_the_longest_count():
    model = load_causal_lm("builtin:tiny_count")
    assert model.config.max_position_embeddings >= 4 + 60 + 1  # <bos>60= then 60 digits and <eos>
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    assert head_dim >= 32, "vLLM's CPU backend needs head_dim >= 32"


def test_short_count_warm_start_saves_a_loadable_model(tmp_path):
    warmstart.main(["--count", "--output-dir", str(tmp_path), "--steps", "5", "--batch-size", "8"])
    assert load_causal_lm(str(tmp_path)).config.max_position_embeddings == 128


def test_the_counting_teachers_demonstrations_are_all_correct(tmp_path):
    """`--count --teacher` is supervised on correct counts only, and builds a loadable model of the student's shape."""
    tokenizer = load_tokenizer("builtin:tiny_count")
    examples = warmstart.build_count_examples(tokenizer, 60, per_problem=3, seed=0, mix=warmstart.CLEAN_MIX)
    for ids, trained in examples:
        prompt, reply = tokenizer.decode(ids[: trained.index(1)]), tokenizer.decode(ids[trained.index(1):], skip_special_tokens=True)
        assert reply == count_answer(int(prompt.removeprefix(tokenizer.bos_token).rstrip("="))), (prompt, reply)
    warmstart.main(["--count", "--teacher", "--output-dir", str(tmp_path), "--steps", "2", "--batch-size", "4"])
    assert load_causal_lm(str(tmp_path)).config.to_dict() | {"_name_or_path": ""} == (
        load_causal_lm("builtin:tiny_count").config.to_dict() | {"_name_or_path": ""})


def test_the_committed_counting_teacher_counts_every_prompt_greedily():
    """builtin:tiny_count_teacher (experiment=opd_count_tiny's teacher) shares the student's tokenizer and answers all
    60 counts exactly, so the distilled student has a target above its own 0.56."""
    teacher, student = load_tokenizer("builtin:tiny_count_teacher"), load_tokenizer("builtin:tiny_count")
    assert teacher.get_vocab() == student.get_vocab()
    model = load_causal_lm("builtin:tiny_count_teacher")
    batch = teacher([f"{n}=" for n in range(1, 61)], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=64, do_sample=False, pad_token_id=teacher.pad_token_id)
    answers = teacher.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answers == [count_answer(n) for n in range(1, 61)]
