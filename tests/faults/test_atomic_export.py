"""Exports are atomic: a save that fails half-way leaves no `final_model` (or the previous one untouched), never a
folder with config.json but no weights."""

from __future__ import annotations

import pytest
import torch
import transformers.modeling_utils
from safetensors.torch import load_file

from rlhf.models.hf_folder import atomic_folder
from rlhf.training.policy import TorchPolicy

CPU = torch.device("cpu")


@pytest.fixture
def policy(policy_cfg, model_cfg, train_cfg):
    return TorchPolicy(policy_cfg, model_cfg, train_cfg(), total_optimizer_steps=1, device=CPU)


def fail_weight_save(monkeypatch):
    """Make the weights write fail as a full disk would, after config.json is already written."""

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full)


def test_a_normal_export_is_a_complete_folder_and_leaves_nothing_else(policy, tokenizer, tmp_path):
    policy.export(tmp_path / "final_model", tokenizer)
    files = {p.name for p in (tmp_path / "final_model").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= files
    assert load_file(tmp_path / "final_model" / "model.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["final_model"]


def test_a_failed_export_leaves_no_folder(policy, tokenizer, tmp_path, monkeypatch):
    fail_weight_save(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        policy.export(tmp_path / "final_model", tokenizer)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_export_keeps_the_previous_folder_intact(policy, tokenizer, tmp_path, monkeypatch):
    target = tmp_path / "final_model"
    policy.export(target, tokenizer)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    fail_weight_save(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        policy.export(target, tokenizer)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["final_model"]


def test_a_second_export_replaces_the_first(tmp_path):
    target = tmp_path / "out"
    for version in ("first", "second"):
        with atomic_folder(target, owner="test") as tmp:
            (tmp / version).write_text(version)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and sorted(p.name for p in target.iterdir()) == [".rlhf-owner", "second"]


def test_a_folder_moved_aside_by_a_killed_save_is_put_back(tmp_path):
    """Killed between moving the old folder aside and renaming the new one in: the next save starts from the old."""
    aside = tmp_path / ".old-out-12345"
    aside.mkdir()
    (aside / "config.json").write_text("{}")
    (tmp_path / ".tmp-out-12345").mkdir()  # the killed save's half-written folder
    with pytest.raises(RuntimeError):
        with atomic_folder(tmp_path / "out", owner="test"):
            raise RuntimeError("this save fails too")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (tmp_path / "out" / "config.json").is_file()
