"""`algorithm/advantage=opd` and `algorithm.distill_coef`: the teacher's logprobs (``extras['teacher_logp']``, put
there by the Learner) become per-token advantages through `prepare`, on hand values; and every way to misconfigure
a teacher is refused before any model loads."""

from dataclasses import replace

import pytest
import torch

from algorithm_fixtures import KL_MASK, make_algorithm, trajectories
from rlhf.config.compose import compose_config
from rlhf.config.validate import validate
from rlhf.errors import ConfigError

GEN_LOGP = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
TEACHER_LOGP = torch.tensor([[-0.5, -3.0, -7.0], [-0.25, -7.0, -7.0]])  # signal [0.5, -1.0] and [0.25]


def batch_with_teacher(scores=(1.0, 0.0), group=2):
    batch = trajectories(KL_MASK, group, scores=torch.tensor(scores), old_logp=GEN_LOGP.clone(), gen_logp=GEN_LOGP.clone())
    return replace(batch, extras={"teacher_logp": TEACHER_LOGP})


def test_opd_advantages_are_the_teachers_signal_per_token_and_ignore_the_reward():
    algo = make_algorithm(advantage="opd", num_samples_per_prompt=1, beta=0.0)
    batch, metrics = algo.prepare(batch_with_teacher(scores=(5.0, -3.0), group=1))
    torch.testing.assert_close(batch.advantages, torch.tensor([[0.5, -1.0, 0.0], [0.25, 0.0, 0.0]]))
    assert metrics["distill/reverse_kl"] == pytest.approx((-0.5 + 1.0 - 0.25) / 3)
    assert metrics["distill/teacher_logprob"] == pytest.approx((-0.5 - 3.0 - 0.25) / 3)


def test_opd_with_gamma_one_sums_the_signal_of_the_tokens_that_follow():
    algo = make_algorithm(advantage={"name": "opd", "gamma": 1.0}, num_samples_per_prompt=1, beta=0.0)
    batch, _ = algo.prepare(batch_with_teacher(group=1))
    torch.testing.assert_close(batch.advantages, torch.tensor([[-0.5, -1.0, 0.0], [0.25, 0.0, 0.0]]))


def test_distill_coef_adds_the_weighted_signal_to_any_estimators_advantages():
    plain = make_algorithm(num_samples_per_prompt=2, beta=0.0)
    mixed = make_algorithm(num_samples_per_prompt=2, beta=0.0, distill_coef=0.5)
    grpo_only, _ = plain.prepare(batch_with_teacher())
    both, metrics = mixed.prepare(batch_with_teacher())
    signal = torch.tensor([[0.5, -1.0, 0.0], [0.25, 0.0, 0.0]])
    torch.testing.assert_close(both.advantages, grpo_only.advantages + 0.5 * signal)
    assert "distill/reverse_kl" in metrics and mixed.needs_teacher and not plain.needs_teacher


def test_opd_without_the_teachers_logprobs_says_what_to_set():
    algo = make_algorithm(advantage="opd", num_samples_per_prompt=1, beta=0.0)
    with pytest.raises(ValueError, match="teacher.name_or_path"):
        algo.prepare(trajectories(KL_MASK, 1, scores=torch.tensor([1.0, 0.0]), old_logp=GEN_LOGP, gen_logp=GEN_LOGP))


@pytest.mark.parametrize("overrides, message", [
    (["algorithm=opd"], r"algorithm.advantage=opd .* set teacher.name_or_path"),
    (["algorithm.distill_coef=0.5"], r"algorithm.distill_coef=0.5 learns from a teacher's logprobs; set teacher.name_or_path"),
    (["teacher.name_or_path=builtin:tiny_arith_teacher"], r"teacher.name_or_path=.* is not read by this run's choice .*algorithm/advantage=opd or algorithm.distill_coef"),
    (["algorithm=online_dpo", "algorithm.distill_coef=1", "teacher.name_or_path=builtin:tiny_arith_teacher"], r"algorithm.distill_coef=1.0 adds the teacher's signal to per-token advantages"),
    (["algorithm=opd", "teacher.url=http://127.0.0.1:9/v1"], r"teacher.url=http://127.0.0.1:9/v1 needs teacher.name_or_path too"),
    (["algorithm=opd", "teacher.name_or_path=builtin:tiny_arith_teacher", "teacher.url=http://127.0.0.1:9/v1", "generator.temperature=0.7"],
     r"teacher.url=.* returns the server's raw logprobs \(temperature 1\), and generator.temperature=0.7"),
])
def test_a_misconfigured_teacher_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(overrides))


def test_the_preset_validates_and_its_teacher_shares_the_students_tokenizer():
    cfg = compose_config(["experiment=opd_arith_tiny"])
    validate(cfg)
    assert cfg.teacher.name_or_path == "builtin:tiny_arith_teacher" and cfg.algorithm.advantage.name == "opd"


def test_a_teacher_with_a_permuted_tokenizer_of_the_same_size_is_refused_before_weights_load(tmp_path, monkeypatch):
    """Same 16 tokens, digits in reverse order: sizes agree, ids do not. Refused naming both models, from the
    tokenizers alone (no model may load before the check: any weight load fails this test)."""
    from rlhf.data.arith import ALPHABET
    from rlhf.models import reference
    from rlhf.models.tiny import build_char_tokenizer, build_tiny_llama
    from rlhf.run import build
    from rlhf.run.build import build_components

    tokenizer = build_char_tokenizer(ALPHABET[9::-1] + "+=")
    build_tiny_llama(len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    for module, name in ((reference, "load_causal_lm"), (build, "build_model")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("a model loaded before the tokenizer check"))
    cfg = compose_config(["experiment=opd_arith_tiny", f"teacher.name_or_path={tmp_path}"])
    with pytest.raises(ConfigError) as caught:
        build_components(validate(cfg))
    message = str(caught.value)
    assert message.startswith("teacher.name_or_path: vocabulary mismatch") and str(tmp_path) in message
    assert "builtin:tiny_arith" in message and "10 with different ids" in message
