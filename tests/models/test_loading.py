"""Loading tokenizers and models: builtin names, padding side, dropout off, vocabulary checks, devices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPTBigCodeConfig, GPTBigCodeForCausalLM

from rlhf.models import loading
from rlhf.models.loading import check_vocab_match, load_causal_lm, load_tokenizer, pick_device, resolve_model_path
from rlhf.models.tiny import build_char_tokenizer

ALPHABET = "0123456789+="


def dropout_config_values(model) -> dict[str, float]:
    """Every float config entry whose key mentions dropout."""
    return {k: v for k, v in vars(model.config).items() if "dropout" in k and isinstance(v, float)}


def assert_deterministic_in_train_mode(model) -> None:
    """Two forward passes in train mode give the same logits (no dropout anywhere)."""
    model.train()
    input_ids = torch.randint(4, 16, (2, 10))
    first = model(input_ids=input_ids).logits
    second = model(input_ids=input_ids).logits
    torch.testing.assert_close(first, second, atol=0, rtol=0)


# --- resolve_model_path -------------------------------------------------------------------------------


def test_resolve_builtin_name_gives_packaged_folder():
    """`builtin:tiny_arith` resolves to the model folder inside the installed rlhf package."""
    folder = Path(resolve_model_path("builtin:tiny_arith"))
    assert folder.name == "tiny_arith" and folder.parent.name == "assets"
    assert (folder / "config.json").is_file()


def test_resolve_leaves_other_names_alone(tmp_path):
    """Hub names and local folders pass through unchanged."""
    assert resolve_model_path("org/some-model") == "org/some-model"
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_resolve_missing_builtin_is_a_clear_error():
    """A builtin name without a model folder raises FileNotFoundError naming it and how to rebuild."""
    with pytest.raises(FileNotFoundError, match="no_such_model") as err:
        resolve_model_path("builtin:no_such_model")
    assert "rlhf.warmstart" in str(err.value)


def test_builtin_model_and_tokenizer_load():
    """The shipped tiny model loads with a tokenizer whose vocabulary fits its output layer."""
    tokenizer = load_tokenizer("builtin:tiny_arith")
    model = load_causal_lm("builtin:tiny_arith")
    assert model.get_output_embeddings().weight.shape[0] >= len(tokenizer)
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id is not None


# --- load_tokenizer -----------------------------------------------------------------------------------


def test_load_tokenizer_pads_left(tmp_path):
    """A tokenizer saved with right padding is loaded with left padding, keeping its own pad token."""
    tokenizer = build_char_tokenizer(ALPHABET)
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.padding_side == "left"
    assert loaded.pad_token == "<pad>" and loaded.pad_token_id != loaded.eos_token_id
    batch = loaded(["1+2=", "5"], padding=True)["input_ids"]
    assert batch[1][0] == loaded.pad_token_id and batch[1][-1] != loaded.pad_token_id


def test_load_tokenizer_uses_eos_as_pad_when_missing(tmp_path):
    """Without a pad token, EOS doubles as pad."""
    tokenizer = build_char_tokenizer(ALPHABET)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == "<eos>"
    assert loaded.pad_token_id == loaded.eos_token_id


def test_load_tokenizer_without_pad_or_eos_raises(tmp_path):
    """A tokenizer with neither pad nor EOS is a ValueError naming it."""
    tokenizer = build_char_tokenizer(ALPHABET)
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="neither a pad nor an EOS"):
        load_tokenizer(str(tmp_path))


# --- load_causal_lm -----------------------------------------------------------------------------------


def test_load_causal_lm_turns_off_llama_attention_dropout(tmp_path, save_llama):
    """A Llama saved with attention_dropout=0.3 loads with it 0 in the config and in every attention layer."""
    folder = save_llama(tmp_path, seed=0, attention_dropout=0.3)
    assert '"attention_dropout": 0.3' in (tmp_path / "config.json").read_text()
    model = load_causal_lm(folder)
    assert dropout_config_values(model) and all(v == 0.0 for v in dropout_config_values(model).values())
    for layer in model.model.layers:
        assert layer.self_attn.attention_dropout == 0.0
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert_deterministic_in_train_mode(model)


def test_load_causal_lm_zeroes_every_dropout_module(tmp_path):
    """A GPT-2 saved with 0.3 dropout everywhere loads with every nn.Dropout at p=0 and dropout keys 0."""
    config = GPT2Config(
        vocab_size=16, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        attn_pdrop=0.3, resid_pdrop=0.3, embd_pdrop=0.3, summary_first_dropout=0.3,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    model = load_causal_lm(str(tmp_path))
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0.0 for m in dropouts)
    assert all(v == 0.0 for v in dropout_config_values(model).values())
    assert_deterministic_in_train_mode(model)


def test_load_causal_lm_disables_dropout_named_pdrop_in_config(tmp_path):
    """A GPTBigCode (StarCoder) model, whose attention reads config `attn_pdrop`, is deterministic in train mode."""
    config = GPTBigCodeConfig(
        vocab_size=16, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        attn_pdrop=0.3, resid_pdrop=0.3, embd_pdrop=0.3, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    GPTBigCodeForCausalLM(config).save_pretrained(tmp_path)
    model = load_causal_lm(str(tmp_path))
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert_deterministic_in_train_mode(model)


def test_load_causal_lm_dtype(tiny_model_dir):
    """The dtype argument sets the parameters' dtype."""
    assert next(load_causal_lm(tiny_model_dir, dtype="bfloat16").parameters()).dtype == torch.bfloat16
    assert next(load_causal_lm(tiny_model_dir).parameters()).dtype == torch.float32


# --- check_vocab_match --------------------------------------------------------------------------------


def test_check_vocab_match_passes_for_equal_vocabularies():
    """Two tokenizers built from the same alphabet match."""
    check_vocab_match(build_char_tokenizer(ALPHABET), build_char_tokenizer(ALPHABET), "policy `a`", "reference `b`")


@pytest.mark.parametrize(
    "other_alphabet", ["0123456789+-", "=+0123456789", ALPHABET + "x"], ids=["different", "reordered", "extra"]
)
def test_check_vocab_match_raises_naming_both_models(other_alphabet):
    """Different tokens, different ids or extra tokens are a ValueError that names both models."""
    with pytest.raises(ValueError, match="vocabulary mismatch") as err:
        check_vocab_match(
            build_char_tokenizer(ALPHABET), build_char_tokenizer(other_alphabet), "policy `mine`", "reference `theirs`"
        )
    assert "policy `mine`" in str(err.value) and "reference `theirs`" in str(err.value)


# --- pick_device --------------------------------------------------------------------------------------


def test_pick_device_cuda_without_cuda_raises(monkeypatch):
    """Asking for CUDA where it is unavailable is a ValueError naming the config key."""
    monkeypatch.setattr(loading.torch.cuda, "is_available", lambda: False)
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="cluster.device"):
            pick_device(name)


def test_pick_device_auto_and_cpu(monkeypatch):
    """`auto` falls back to CPU without CUDA and picks CUDA with it; `cpu` is always CPU."""
    monkeypatch.setattr(loading.torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(loading.torch.cuda, "is_available", lambda: True)
    assert pick_device("auto").type == "cuda"
    assert pick_device("cuda:0") == torch.device("cuda:0")


# --- the output layer's input in low precision on the CPU ------------------------------------------------------


def largest_allocation(model, ids: torch.Tensor) -> int:
    """Bytes of the largest single allocation of a no-grad forward keeping the last position's logits."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return max(e.cpu_memory_usage for e in prof.events())


def test_a_bf16_output_layer_on_the_cpu_copies_no_weight_per_row(tmp_path):
    """A frozen model's prompt pass (the generator's, the reference's: weights without gradients, which torch's matmul
    does not fold) keeps one position per row: its strided slice reaches the bf16 output layer contiguous, so no
    allocation holds the layer's weight once per row (without the hook: rows copies of it), and the logits are those
    of the layer applied to the last hidden state of each row."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    model = load_causal_lm(str(tmp_path / "m"), "bfloat16").eval().requires_grad_(False)
    rows, weight = 8, model.lm_head.weight
    ids = torch.randint(0, 4096, (rows, 12))
    assert largest_allocation(model, ids) < 2 * weight.numel() * weight.element_size()
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[:, -1:]
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
    torch.testing.assert_close(logits, model.lm_head.weight.new_tensor(hidden.contiguous() @ weight.T), atol=0, rtol=0)
    bare = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16).eval().requires_grad_(False)
    assert largest_allocation(bare, ids) >= rows * weight.numel() * weight.element_size()
