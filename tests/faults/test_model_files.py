"""Damaged model folders and mismatched tokenizers are refused before training, naming the key, the file and the fix."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.run.build import check_model_sources
from rlhf.config.schema import ModelConfig, RewardConfig
from rlhf.errors import ConfigError
from rlhf.models.loading import check_model_tokenizer, load_causal_lm, load_tokenizer
from rlhf.models.tiny import build_char_tokenizer
from rlhf.models.value import load_value_model
from rlhf.rewards.model import RewardModelScorer

ALPHABET = "0123456789+="  # the alphabet of the conftest's tiny models


def truncated_copy(folder: str, destination: Path) -> Path:
    """A copy of a model folder whose model.safetensors lost its second half (an interrupted download or copy)."""
    shutil.copytree(folder, destination)
    weights = destination / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return destination


def model_sources(**keys) -> OmegaConf:
    """The config nodes `check_model_sources` reads, with the given dotted keys set and the others null."""
    cfg = OmegaConf.create({"model": {"name_or_path": None, "tokenizer": None}, "reference": {"name_or_path": None}, "teacher": {"name_or_path": None, "url": None},
                            "reward": {"path": None}, "critic": {"name_or_path": None}})
    for key, value in keys.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    return cfg


def assert_names_the_damage(message: str, key: str, folder: Path) -> None:
    """One paragraph naming the key, the file and that it is truncated, with the fix."""
    assert message.startswith(f"{key}={folder}: ") or message.startswith(f"model folder {folder}: ")
    assert f"{folder / 'model.safetensors'} is truncated or not a safetensors file" in message
    assert "download or copy the model folder again" in message
    assert "\n" not in message


# --- truncated weights ---------------------------------------------------------------------------------


def test_truncated_policy_weights_are_named_before_any_model_loads(tiny_model_dir, tmp_path):
    """model.name_or_path, reference.name_or_path and teacher.name_or_path with a truncated model.safetensors:
    ConfigError naming the key."""
    damaged = truncated_copy(tiny_model_dir, tmp_path / "policy")
    for key in ("model.name_or_path", "reference.name_or_path", "teacher.name_or_path"):
        with pytest.raises(ConfigError) as caught:
            sources = model_sources(**{"model__name_or_path": tiny_model_dir, key.replace(".", "__"): str(damaged)})
            check_model_sources(sources)
        assert_names_the_damage(str(caught.value), key, damaged)


def test_truncated_reward_and_critic_weights_are_named(reward_model_dir, tmp_path):
    """reward.path and critic.name_or_path: the same check, naming their own key."""
    damaged = truncated_copy(reward_model_dir, tmp_path / "reward")
    for key in ("reward.path", "critic.name_or_path"):
        with pytest.raises(ConfigError) as caught:
            check_model_sources(model_sources(**{key.replace(".", "__"): str(damaged)}))
        assert_names_the_damage(str(caught.value), key, damaged)


def test_the_loaders_refuse_truncated_weights_themselves(tiny_model_dir, reward_model_dir, tmp_path):
    """Entry points that skip `check_model_sources` (train_reward, a Ray worker) get the same paragraph from the loader:
    the reward-model scorer names reward.path, a loader called without a key names the folder."""
    policy = truncated_copy(tiny_model_dir, tmp_path / "policy")
    with pytest.raises(ConfigError) as caught:
        load_causal_lm(str(policy))
    assert_names_the_damage(str(caught.value), "", policy)
    reward = truncated_copy(reward_model_dir, tmp_path / "reward")
    with pytest.raises(ConfigError) as caught:
        RewardModelScorer(OmegaConf.structured(RewardConfig(path=str(reward))), "float32", torch.device("cpu"), 4)
    assert_names_the_damage(str(caught.value), "reward.path", reward)
    with pytest.raises(ConfigError, match=f"critic.name_or_path={reward}: "):
        load_value_model(str(reward), key="critic.name_or_path")


def test_intact_folders_still_load(tiny_model_dir, reward_model_dir):
    """The header check passes whole files: the sources are accepted and both loaders return models."""
    check_model_sources(model_sources(model__name_or_path=tiny_model_dir, reward__path=reward_model_dir))
    assert load_causal_lm(tiny_model_dir) is not None
    assert load_value_model(reward_model_dir, new_head_ok=False) is not None


# --- model.tokenizer ---------------------------------------------------------------------------------------


def saved_tokenizer(folder: Path, alphabet: str) -> str:
    """A char tokenizer over ``alphabet`` saved alone in ``folder``."""
    build_char_tokenizer(alphabet).save_pretrained(folder)
    return str(folder)


def model_cfg_with(name_or_path: str, tokenizer: str | None):
    return OmegaConf.structured(ModelConfig(name_or_path=name_or_path, tokenizer=tokenizer))


def test_a_permuted_tokenizer_of_the_same_size_is_refused(tiny_model_dir, tmp_path):
    """Same 16 tokens, digits in reverse order: the sizes agree, the ids do not, so the run is refused."""
    permuted = saved_tokenizer(tmp_path / "permuted", ALPHABET[9::-1] + "+=")
    model = model_cfg_with(tiny_model_dir, permuted)
    tokenizer = load_tokenizer(permuted)
    assert len(tokenizer) == len(load_tokenizer(tiny_model_dir))
    with pytest.raises(ConfigError) as caught:
        check_model_tokenizer(model, tokenizer)
    message = str(caught.value)
    assert message.startswith(f"model.tokenizer={permuted}: vocabulary mismatch")
    assert tiny_model_dir in message and "10 with different ids" in message
    assert "Set model.tokenizer=null" in message


def test_a_larger_vocabulary_is_refused(tiny_model_dir, tmp_path):
    """Extra tokens (a different size) are refused by the same comparison."""
    larger = saved_tokenizer(tmp_path / "larger", ALPHABET + "-*")
    with pytest.raises(ConfigError, match="2 only in model.tokenizer"):
        check_model_tokenizer(model_cfg_with(tiny_model_dir, larger), load_tokenizer(larger))


def test_another_tokenizer_with_the_same_vocabulary_is_a_warning(tiny_model_dir, tmp_path, caplog):
    """A second folder holding the same vocabulary: accepted, with a warning naming both."""
    same = saved_tokenizer(tmp_path / "same", ALPHABET)
    with caplog.at_level(logging.WARNING, logger="rlhf.models.loading"):
        check_model_tokenizer(model_cfg_with(tiny_model_dir, same), load_tokenizer(same))
    assert f"model.tokenizer={same} is not the tokenizer saved with model.name_or_path={tiny_model_dir}" in caplog.text


def test_a_model_saved_without_a_tokenizer_has_nothing_to_compare(tiny_model_dir, tmp_path, caplog):
    """model.tokenizer is the only tokenizer when the model folder has none: no error, no warning."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_model_dir) / name, bare / name)
    with caplog.at_level(logging.WARNING, logger="rlhf.models.loading"):
        check_model_tokenizer(model_cfg_with(str(bare), tiny_model_dir), load_tokenizer(tiny_model_dir))
    assert caplog.text == ""


@pytest.mark.parametrize("key", ["model.name_or_path", "critic.name_or_path", "reward.path"])
def test_a_folder_that_does_not_exist_is_named_as_such(key, tmp_path):
    """An absolute path to nothing: "no such folder" with the key, not transformers' "Repo id must be in the form"."""
    from rlhf.config import compose_config, validate
    from rlhf.plan import make_plan

    missing = tmp_path / "no" / "such" / "folder"
    cfg = compose_config(["algorithm=ppo", f"{key}={missing}"])
    with pytest.raises(ConfigError, match=rf"{key}={missing}: no such folder; give a folder holding the model"):
        validate(cfg)
        make_plan(cfg)


# --- the wrong kind of model ---------------------------------------------------------------------------


def test_a_reward_model_where_a_language_model_belongs_and_the_reverse_are_refused(tiny_model_dir, reward_model_dir):
    """By the folder's `architectures`, before any model loads: before, a reward model as the distillation teacher
    trained silently (the policy got worse), and a language model as reward.path failed once the models had loaded."""
    for key in ("model.name_or_path", "reference.name_or_path", "teacher.name_or_path"):
        with pytest.raises(ConfigError, match=rf"^{key}={reward_model_dir} is a \w+ForSequenceClassification \(a score "
                                              rf"head, as a reward model has\), not a causal language model; point {key}"):
            check_model_sources(model_sources(**{"model__name_or_path": tiny_model_dir, key.replace(".", "__"): reward_model_dir}))
    with pytest.raises(ConfigError, match=rf"^reward.path={tiny_model_dir} is a \w+ForCausalLM, a language model without a "
                                          r"trained score head; give a reward model"):
        check_model_sources(model_sources(reward__path=tiny_model_dir))
    check_model_sources(model_sources(model__name_or_path=tiny_model_dir, reward__path=reward_model_dir,
                                      critic__name_or_path=tiny_model_dir))  # each where it belongs; a critic from either


def test_a_missing_builtin_names_the_key_it_was_given_to():
    with pytest.raises(ConfigError, match=r"^teacher.name_or_path: built-in model 'nope' not found .* or give a model folder or a hub name$"):
        check_model_sources(model_sources(model__name_or_path="builtin:tiny_arith", teacher__name_or_path="builtin:nope"))
