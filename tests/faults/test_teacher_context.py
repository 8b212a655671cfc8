"""A distillation teacher scores every row whole: one whose context is shorter than the longest row the run can
produce is refused before any model loads, naming the teacher and the keys that bound the row."""

from __future__ import annotations

import pytest

from rlhf.config import ConfigError, compose_config, validate
from rlhf.run.build import build_components


def test_a_teacher_shorter_than_the_rows_is_refused_before_any_model_loads(monkeypatch):
    cfg = compose_config(["experiment=opd_count_tiny", "teacher.name_or_path=builtin:tiny_arith_teacher"])  # 64 positions
    loaded = []
    monkeypatch.setattr("rlhf.models.loading.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loaded.append(a))
    longest = cfg.dataset.max_prompt_length + cfg.generator.max_new_tokens
    with pytest.raises(ConfigError, match=rf"^teacher.name_or_path=builtin:tiny_arith_teacher has a 64-token context, "
                                          rf"shorter than the longest row this run can produce \({longest} tokens: "
                                          rf"dataset.max_prompt_length \+ generator.max_new_tokens\)"):
        build_components(validate(cfg))
    assert not loaded


def test_the_preset_teacher_fits_its_rows():
    from rlhf.data.context import check_teacher_context, model_context

    cfg = compose_config(["experiment=opd_count_tiny"])
    longest = cfg.dataset.max_prompt_length + cfg.generator.max_new_tokens
    assert longest <= model_context(cfg.model, cfg.teacher.name_or_path) == 128
    check_teacher_context(longest, 128, cfg.teacher.name_or_path, "dataset.max_prompt_length + generator.max_new_tokens")
