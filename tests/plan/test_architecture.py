"""Parameter counts and activation traces from config.json alone (rlhf.plan.architecture)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from published_configs import CONFIGS, PUBLISHED_PARAMETERS, write_config
from rlhf.errors import ConfigError
from rlhf.functional import entropy_from_logits, logprobs_from_logits
from rlhf.plan.architecture import ModelSource, _trace, activations, parameter_count, with_layers


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_counts_match_the_published_numbers(tmp_path, name):
    folder = write_config(tmp_path / name, CONFIGS[name])
    assert parameter_count(ModelSource("model.name_or_path", str(folder))) == PUBLISHED_PARAMETERS[name]


def test_a_value_head_replaces_the_output_layer(tmp_path):
    """Critics and reward models: the untied output layer (vocab x hidden) gives way to one scalar row."""
    folder = write_config(tmp_path / "llama", CONFIGS["llama_3_1_8b"])
    source = ModelSource("critic.name_or_path", str(folder))
    assert parameter_count(source, "value") == PUBLISHED_PARAMETERS["llama_3_1_8b"] - 128256 * 4096 + 4096


def test_a_config_without_the_fields_the_plan_needs_names_the_key_and_the_field(tmp_path):
    config = dict(CONFIGS["qwen2_5_0_5b"])
    del config["num_hidden_layers"]
    folder = write_config(tmp_path / "broken", config)
    with pytest.raises(ConfigError, match=r"reward\.path=.*broken.*num_hidden_layers"):
        parameter_count(ModelSource("reward.path", str(folder)))


def test_a_folder_without_config_json_names_the_key(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="reference.name_or_path="):
        parameter_count(ModelSource("reference.name_or_path", str(tmp_path / "empty")))


def small_llama(tmp_path, layers: int = 4):
    config = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=320, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    folder = tmp_path / "small"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder, config


def test_extrapolating_from_one_row_and_two_layers_matches_tracing_everything(tmp_path):
    folder, config = small_llama(tmp_path, layers=4)
    """One row of one and of two layers, traced and scaled to 3 rows and 4 layers: within 1% of tracing them all."""
    act = activations(ModelSource("model.name_or_path", str(folder)), 3, 20, 9, False)
    full = _trace(config, 3, 20, 9, False, "lm", False)["total"]
    assert act.total(4, checkpointing=False) == pytest.approx(full, rel=0.01)


def test_the_trace_counts_what_real_autograd_keeps(tmp_path):
    """The same forward on real tensors (a left-padded batch, as rollouts are), every kept tensor's storage counted
    once: the fake trace agrees within 5%."""
    folder, _ = small_llama(tmp_path, layers=2)
    model = AutoModelForCausalLM.from_pretrained(folder).train()
    params = {p.data_ptr() for p in model.parameters()}
    kept = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, 1024, (4, 48))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=17).logits
        logprobs_from_logits(logits, ids[:, -17:])
        entropy_from_logits(logits)
    traced = activations(ModelSource("model.name_or_path", str(folder)), 4, 48, 17, False).total(2, False)
    assert traced == pytest.approx(sum(kept.values()), rel=0.05)


def test_checkpointing_keeps_layer_inputs_and_one_layer(tmp_path):
    folder, _ = small_llama(tmp_path, layers=4)
    act = activations(ModelSource("model.name_or_path", str(folder)), 2, 16, 5, False)
    assert act.layer_input == 2 * 16 * 128 * 4
    assert act.total(4, checkpointing=True) == 4 * act.layer_input + act.per_layer + act.outside_layers
    assert act.total(4, checkpointing=True) < act.total(4, checkpointing=False)


def test_with_layers_cuts_per_layer_lists(tmp_path):
    folder = write_config(tmp_path / "qwen", CONFIGS["qwen2_5_0_5b"])
    from rlhf.plan.architecture import read_config

    small = with_layers(read_config(ModelSource("model.name_or_path", str(folder))), 2)
    assert small.num_hidden_layers == 2
    assert len(getattr(small, "layer_types", None) or [0, 0]) == 2
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 24  # the file is untouched
