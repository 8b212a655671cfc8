"""math_verify (symbolic answer check, no-answer metric, off-main-thread scoring) and boxed_format."""

from __future__ import annotations

import logging
import threading
from importlib.util import find_spec

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.config.schema import RewardConfig, RewardFunctionConfig
from rlhf.errors import ConfigError
from rlhf.rewards.combine import RewardSet
from rlhf.rewards.math import boxed_contents, boxed_format, math_verify
from rlhf.trajectory import from_completions

TOWER = "\\boxed{2^{2^{2^{100}}}}"  # SymPy would compute this integer for ever: only the timeout stops it
needs_math_verify = pytest.mark.skipif(find_spec("math_verify") is None, reason="pip install 'rlhf[math]'")


def score(responses: list[str], truths: list[str], **args) -> list[float]:
    """math_verify's scores for parallel lists."""
    return list(math_verify(prompts=[""] * len(responses), responses=responses, ground_truths=truths, **args))


@needs_math_verify
@pytest.mark.parametrize("truth", ["0.5", "\\frac{1}{2}", "1/2", "$\\frac{1}{2}$"])
@pytest.mark.parametrize(
    "response", ["\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "so it is 1/2", "The answer is $\\frac12$."]
)
def test_equivalent_forms_of_one_half_match(truth, response):
    assert score([response], [truth]) == [1.0]


@needs_math_verify
def test_integers_roots_and_wrong_answers():
    responses = ["\\boxed{42}", "\\boxed{41}", "$\\sqrt{2}$ it is: \\boxed{\\sqrt{2}}", "\\boxed{2}"]
    assert score(responses, ["42", "42", "$\\sqrt{2}$", "\\sqrt{2}"]) == [1.0, 0.0, 1.0, 0.0]


@needs_math_verify
def test_boxed_answer_beats_the_last_number_and_the_last_number_is_the_fallback():
    assert score(["First 7, then \\boxed{12}. Check: 3 times 4 is 12, not 9"], ["12"]) == [1.0]
    assert score(["First 7, then \\boxed{12}. Finally 9"], ["9"]) == [0.0]
    assert score(["2 apples and 3 pears make 5."], ["5"]) == [1.0]


@needs_math_verify
def test_no_answer_scores_zero_and_is_counted():
    responses = ["I do not know", "", "\\boxed{3}", "\\boxed{}"]
    result = math_verify(prompts=[""] * 4, responses=responses, ground_truths=["3"] * 4)
    assert list(result) == [0.0, 0.0, 1.0, 0.0]
    assert result.metrics == {"no_answer_rate": pytest.approx(0.75), "timeouts": 0.0}


@needs_math_verify
def test_reward_set_logs_the_no_answer_rate_and_the_correct_rate():
    cfg = OmegaConf.structured(RewardConfig(functions=[RewardFunctionConfig(name="math_verify")]))
    batch = from_completions(
        query_ids=torch.ones(2, 1, dtype=torch.long),
        query_mask=torch.ones(2, 1, dtype=torch.long),
        response_ids=torch.ones(2, 1, dtype=torch.long),
        response_mask=torch.ones(2, 1),
        logprobs=torch.zeros(2, 1),
        stopped=torch.tensor([True, True]),
    )
    total, metrics = RewardSet(cfg).score(["", ""], ["\\boxed{1/2}", "no idea"], ["0.5", "0.5"], batch)
    assert total.tolist() == [1.0, 0.0]
    assert metrics["reward/math_verify"] == 0.5
    assert metrics["reward/math_verify_no_answer_rate"] == 0.5
    assert metrics["objective/verifiable_correct_rate"] == 0.5


def score_in_thread(responses: list[str], truths: list[str], **args) -> list[float]:
    """`score` called from a thread other than the main one, as the async schedule's producer does."""
    results = {}
    thread = threading.Thread(target=lambda: results.update(scores=score(responses, truths, **args)))
    thread.start()
    thread.join(timeout=30)
    return results["scores"]


@needs_math_verify
def test_scores_off_the_main_thread():
    """Signal timeouts cannot run off the main thread: a worker process scores there (started here, ~1 s)."""
    assert score_in_thread(["\\boxed{\\frac{2}{4}}", "x"], ["0.5", "1"]) == [1.0, 0.0]


@needs_math_verify
def test_pathological_expression_is_bounded_by_the_timeout():
    assert score([TOWER], ["5"], timeout_s=1) == [0.0]


@needs_math_verify
def test_a_slow_comparison_is_paid_once_per_distinct_answer(monkeypatch):
    """A group of samples giving the same pathological answer costs one comparison (one timeout), not one each; a
    different answer to the same truth is compared on its own."""
    import rlhf.rewards.math as math_module

    parse, verify, targets = math_module._math_verify_api()
    calls = []
    counting = lambda gold, answer, **kw: calls.append(str(answer)) or verify(gold, answer, **kw)  # noqa: E731
    monkeypatch.setattr(math_module, "_math_verify_api", lambda: (parse, counting, targets))
    scores, answered, timeouts = math_module.score_answers([TOWER] * 6 + ["\\boxed{5}", "\\boxed{5}"], ["5"] * 8, timeout_s=1)
    assert scores == [0.0] * 6 + [1.0, 1.0] and all(answered) and timeouts == 1
    assert len(calls) == 2, calls


SLOW_TRUTH = "9^{9^{9}}"  # reads at once, but SymPy compares any answer with it for ever: each comparison times out


@needs_math_verify
def test_a_ground_truth_slow_to_compare_is_bounded_counted_and_said_once_naming_the_key(caplog):
    """Before: each comparison printed math-verify's bare "Timeout during comparison" warning, and nothing counted
    them or named the key that bounds them."""
    caplog.set_level(logging.DEBUG)
    responses = ["\\boxed{3}", "\\boxed{5}", "\\boxed{5}", "\\boxed{7}"]
    result = math_verify(prompts=[""] * 4, responses=responses, ground_truths=[SLOW_TRUTH] * 4, timeout_s=1)
    assert list(result) == [0.0] * 4
    assert result.metrics["timeouts"] == 3.0  # one per distinct answer
    assert not [r for r in caplog.records if r.name.startswith("math_verify")], caplog.text
    said = [r.getMessage() for r in caplog.records if "args.timeout_s=1 s" in r.getMessage()]
    assert len(said) == 1 and "3 parses or comparisons" in said[0], caplog.text


@needs_math_verify
def test_pathological_expression_is_bounded_off_the_main_thread_too():
    assert score_in_thread([TOWER, "\\boxed{5}"], ["5", "5"], timeout_s=1) == [0.0, 1.0]


@needs_math_verify
def test_missing_ground_truth_and_bad_timeout_name_the_fix():
    with pytest.raises(ConfigError, match="dataset.ground_truth_key"):
        score(["\\boxed{1}"], [None])
    with pytest.raises(ConfigError, match="args.timeout_s"):
        score(["\\boxed{1}"], ["1"], timeout_s=0.5)


def test_boxed_contents_keeps_nested_braces_and_marks_unclosed_boxes():
    assert boxed_contents("a \\boxed{\\frac{1}{2}} b \\boxed{x}") == ["\\frac{1}{2}", "x"]
    assert boxed_contents("\\boxed{1 + {2") == [None]
    assert boxed_contents("no box") == []


def test_boxed_format_wants_exactly_one_non_empty_box():
    responses = [
        "\\boxed{3}", "\\boxed{3} or \\boxed{4}", "\\boxed{ }", "3", "\\boxed{\\frac{1}{2}",
        "x \\boxed{\\sqrt{2}}.",
    ]
    assert boxed_format(prompts=[], responses=responses, ground_truths=[]) == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_unreadable_ground_truths_are_refused_before_any_model_loads(tmp_path, monkeypatch):
    """A dataset row whose truth math-verify cannot read stops the run at start, naming its file and line (before: at
    the step that first drew it; then as "row 18", its place among the shuffled prompts); plain numbers are taken as
    read without asking math-verify."""
    from rlhf.config import compose_config
    from rlhf.rewards.math import check_truths
    from rlhf.train import train

    check_truths(["42", "-3.5", "1,000", "\\frac{1}{2}"], ["a"] * 4)  # readable
    with pytest.raises(ConfigError, match=r"the ground truth at t.jsonl line 3 \(''\) holds no answer math-verify can read"):
        check_truths(["1", "2", "", "3", ""], [f"t.jsonl line {n}" for n in range(1, 6)])
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": "{a}+{a}=", "answer": "{2 * a if a != 5 else ""}"}}\n' for a in range(12)))
    loaded = []
    monkeypatch.setattr("rlhf.run.build.build_local_models", lambda *a, **k: loaded.append(1))
    cfg = compose_config([
        "dataset=jsonl", f"dataset.path={rows}", "dataset.ground_truth_key=answer", "dataset.max_prompt_length=16",
        "dataset.chat_template='{{ messages[0].content }}'", "reward.functions=[{name: math_verify}]",
    ])
    with pytest.raises(ConfigError, match=r"reward function math_verify: the ground truth at \S*rows.jsonl line 6 \(''\)"):
        train(cfg, tmp_path / "run")
    assert not loaded
