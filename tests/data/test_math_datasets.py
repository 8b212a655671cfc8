"""dataset=gsm8k and dataset=math: answers extracted as each set writes them, read from files with the hub's columns."""

from __future__ import annotations

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.config import ConfigError, compose_config, validate
from rlhf.parts import typed_node
from rlhf.data.answers import gsm8k_answer, last_boxed, with_suffix
from rlhf.data.mix import mixed_dataset
from rlhf.models.loading import load_tokenizer

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
# openai/gsm8k (subset main): question / answer, the answer a worked solution ending in `#### <number>`.
GSM8K_TRAIN = [
    {"question": "Ann has 3 pens and buys 4 more. How many pens?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,000 eggs a day for 2 days.", "answer": "1,000 * 2 = <<1000*2=2000>>2,000\n#### 2,000"},
    {"question": "A debt of 5 grows by 3.", "answer": "-5 - 3 = -8\n#### -8"},
    {"question": "No final answer here.", "answer": "The solution forgot its mark."},
]
GSM8K_TEST = [{"question": "Bo has 2 cats and 2 dogs. How many pets?", "answer": "2 + 2 = 4\n#### 4"}]
# MATH (DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500): problem / solution, the answer in \boxed{}.
MATH_TRAIN = [
    {"problem": "What is $1/2 + 0$?", "solution": "Adding zero: $\\boxed{\\frac{1}{2}}$.", "level": "Level 1", "type": "Algebra"},
    {"problem": "Solve $x^2=4$, $x>0$.", "solution": "Try $\\boxed{1}$... no: $x = \\boxed{2}$.", "level": "Level 1", "type": "Algebra"},
    {"problem": "Give the set.", "solution": "It is $\\boxed{\\{1, \\{2\\}\\}}$.", "level": "Level 2", "type": "Prealgebra"},
    {"problem": "Unfinished.", "solution": "So $\\boxed{3$.", "level": "Level 2", "type": "Prealgebra"},
]
MATH_TEST = [{"problem": "What is $2+2$?", "solution": "$2+2=\\boxed{4}$", "answer": "4", "subject": "Prealgebra", "level": 1}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:tiny_arith")


@pytest.mark.parametrize(
    "text, answer",
    [
        ("3 + 4 = 7\n#### 7", "7"),
        ("#### 1,234", "1234"),
        ("worked\n####   -8 \n", "-8"),
        ("a #### 1 then #### 2", "2"),
        ("no mark", None),
        ("####   ", None),
    ],
)
def test_gsm8k_answer_is_the_number_after_the_last_mark_without_commas(text, answer):
    assert gsm8k_answer(text) == answer


@pytest.mark.parametrize(
    "text, answer",
    [
        ("$\\boxed{42}$", "42"),
        ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
        ("first \\boxed{1} then \\boxed{ 2 }", "2"),
        ("$\\boxed{\\{1, \\{2\\}\\}}$", "\\{1, \\{2\\}\\}"),
        ("\\boxed{3", None),
        ("\\boxed{}", None),
        ("no box", None),
    ],
)
def test_last_boxed_keeps_nested_braces(text, answer):
    assert last_boxed(text) == answer


def test_the_suffix_goes_after_the_last_message():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    assert with_suffix(messages, "Box it.") == [messages[0], {"role": "user", "content": "1+1? Box it."}]
    assert with_suffix(messages, None) == messages


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))


def preset(name: str, folder, tmp_path, *overrides: str):
    """The preset's dataset config, its sources pointed at the local folder ``folder`` (train and test files)."""
    cfg = compose_config([
        f"dataset={name}", f"dataset.train.0.path={folder}", f"dataset.eval.0.path={folder}",
        "dataset.chat_template=simple_concat_with_space", f"dataset.cache_dir={tmp_path / 'cache'}", *overrides,
    ])
    validate(cfg)
    return typed_node("dataset", cfg.dataset, "dataset")  # as the run builds it


def test_gsm8k_preset_hands_rewards_the_number(tmp_path, tokenizer):
    folder = tmp_path / "gsm8k"
    write_parquet(folder / "train-00000-of-00001.parquet", GSM8K_TRAIN)
    write_parquet(folder / "test-00000-of-00001.parquet", GSM8K_TEST)
    splits = mixed_dataset(cfg=preset("gsm8k", folder, tmp_path), tokenizer=tokenizer, seed=1)
    assert [e.ground_truth for e in splits.train] == ["7", "2000", "-8"]
    assert [e.ground_truth for e in splits.eval] == ["4"]
    assert splits.train[0].text == f"{GSM8K_TRAIN[0]['question']} {INSTRUCTION}"
    (train, _) = splits.report["sources"]
    bad = f"{folder}/train-00000-of-00001.parquet row 4: column 'answer': no gsm8k answer in it"  # the fourth row
    assert (train["bad_rows"], train["bad_examples"]) == (1, [bad])


def test_math_preset_hands_rewards_the_last_box(tmp_path, tokenizer):
    folder = tmp_path / "math"
    write_parquet(folder / "train.parquet", MATH_TRAIN)
    write_parquet(folder / "test.parquet", MATH_TEST)
    splits = mixed_dataset(cfg=preset("math", folder, tmp_path), tokenizer=tokenizer, seed=1)
    assert [e.ground_truth for e in splits.train] == ["\\frac{1}{2}", "2", "\\{1, \\{2\\}\\}"]
    assert [e.ground_truth for e in splits.eval] == ["4"]
    assert splits.train[0].text.endswith(INSTRUCTION)
    assert splits.report["sources"][0]["bad_examples"] == [f"{folder}/train.parquet row 4: column 'solution': no boxed answer in it"]


def test_gsm8k_reads_the_hub_with_its_subset(tmp_path, tokenizer, monkeypatch):
    """The hub path: load_dataset("openai/gsm8k", "main", split=...), as the preset names it."""
    calls = []

    def fake_hub(path, name=None, split=None, revision=None):
        calls.append((path, name, split, revision))
        return datasets.Dataset.from_list(GSM8K_TRAIN if split == "train" else GSM8K_TEST)

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    cfg = compose_config(["dataset=gsm8k", "dataset.chat_template=simple_concat_with_space", f"dataset.cache_dir={tmp_path}"])
    splits = mixed_dataset(cfg=typed_node("dataset", cfg.dataset, "dataset"), tokenizer=tokenizer, seed=1)
    assert calls == [("openai/gsm8k", "main", "train", None), ("openai/gsm8k", "main", "test", None)]
    assert [e.ground_truth for e in splits.train] == ["7", "2000", "-8"]


def test_the_format_is_part_of_the_cache_key(tmp_path, tokenizer):
    folder = tmp_path / "gsm8k"
    write_parquet(folder / "train.parquet", GSM8K_TRAIN[:3])
    write_parquet(folder / "test.parquet", GSM8K_TEST)
    extracted = mixed_dataset(cfg=preset("gsm8k", folder, tmp_path), tokenizer=tokenizer, seed=1)
    raw = mixed_dataset(cfg=preset("gsm8k", folder, tmp_path, "dataset.ground_truth_format=raw"), tokenizer=tokenizer, seed=1)
    assert raw.report["cache"] == "miss" and raw.train[0].ground_truth == GSM8K_TRAIN[0]["answer"]
    assert extracted.train[0].ground_truth == "7"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dataset.ground_truth_format=latex"], "dataset.ground_truth_format='latex'; choose one of raw, gsm8k, boxed"),
        (["dataset.ground_truth_key=null"], "dataset.ground_truth_format=gsm8k extracts from dataset.ground_truth_key, which is null"),
    ],
)
def test_bad_format_settings_fail_validation(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        validate(compose_config(["dataset=gsm8k", *overrides]))
