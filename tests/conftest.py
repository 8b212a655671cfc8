"""Shared fixtures: tiny local models and tokenizers (never the hub), typed configs, hand-made trajectories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.config.schema import ModelConfig, PolicyConfig, ReferenceConfig, TrainConfig
from rlhf.generators.hf import HfGeneratorConfig
from rlhf.generators.hf import HFGenerator, left_pad
from rlhf.models.loading import load_tokenizer
from rlhf.models.tiny import build_char_tokenizer, build_tiny_llama
from rlhf.trajectory import Trajectories, from_completions

ALPHABET = "0123456789+="


def pytest_configure(config):
    """With ``-n N`` (pytest-xdist), N test processes share the machine's cores: each of them, and every process a
    test starts, gets one intra-op thread (the workers inherit this environment), or torch's thread pools
    oversubscribe the cores and every test slows many times over. A thread count the caller set stays."""
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def save_tiny_llama(folder: Path, seed: int, weight_std: float = 0.3, **config_overrides) -> str:
    """Save a seeded random tiny Llama and its char tokenizer to ``folder``; returns the folder as a string.

    Weights are redrawn with a larger std than the default init so greedy decoding is varied (the default
    init just repeats the last prompt token) and sometimes emits EOS.
    """
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer(ALPHABET)
    model = build_tiny_llama(len(tokenizer))
    for key, value in config_overrides.items():
        setattr(model.config, key, value)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, weight_std)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(autouse=True)
def _seed_torch():
    """Every test starts from the same torch RNG state."""
    torch.manual_seed(0)


@pytest.fixture
def save_llama():
    """The `save_tiny_llama` helper, for tests that need a model folder with their own config."""
    return save_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """Folder with a random tiny Llama (seed 0) and its tokenizer."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), seed=0)


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory) -> str:
    """The seed-0 tiny Llama of `tiny_model_dir` with room for 300 positions (prompts longer than a vLLM KV block)."""
    return save_tiny_llama(tmp_path_factory.mktemp("long_tiny_llama"), seed=0, max_position_embeddings=300)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> str:
    """Folder with a second random tiny Llama (seed 1), same tokenizer, different weights."""
    return save_tiny_llama(tmp_path_factory.mktemp("other_llama"), seed=1)


@pytest.fixture(scope="session")
def reward_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A saved sequence-classification folder: the tiny Llama backbone with a seeded new score head."""
    from rlhf.models.value import load_value_model

    torch.manual_seed(123)
    folder = tmp_path_factory.mktemp("reward_model")
    load_value_model(tiny_model_dir).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    """The tiny model's tokenizer as the framework loads it (left padding, pad token set)."""
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def model_cfg(tiny_model_dir):
    """A typed model config pointing at the tiny model folder."""
    return OmegaConf.structured(ModelConfig(name_or_path=tiny_model_dir))


@pytest.fixture
def generator_cfg():
    """Factory: a typed hf generator config with the given overrides."""
    return lambda **overrides: HfGeneratorConfig(name="hf", **overrides)


@pytest.fixture
def train_cfg():
    """Factory: a typed train config with the given overrides."""
    return lambda **overrides: OmegaConf.structured(TrainConfig(**overrides))


@pytest.fixture
def policy_cfg():
    """A typed policy config with defaults."""
    return OmegaConf.structured(PolicyConfig())


@pytest.fixture
def reference_cfg():
    """Factory: a typed reference config with the given overrides."""
    return lambda **overrides: OmegaConf.structured(ReferenceConfig(**overrides))


@pytest.fixture
def make_generator(tokenizer, generator_cfg):
    """Factory: an HFGenerator on CPU for a model folder (default: the tiny model)."""

    def make(model_dir: str, **overrides) -> HFGenerator:
        """A generator for ``model_dir`` with generator-config ``overrides``."""
        model_cfg = OmegaConf.structured(ModelConfig(name_or_path=model_dir))
        return HFGenerator(generator_cfg(**overrides), model_cfg, tokenizer, torch.device("cpu"))

    return make


@pytest.fixture
def encode(tokenizer):
    """Factory: token ids (with <bos>) of each text."""
    return lambda texts: [tokenizer(text)["input_ids"] for text in texts]


@pytest.fixture
def rollout(tokenizer, encode) -> Trajectories:
    """Hand-made single-turn trajectories: three prompts of different lengths, responses of lengths 3, 2 and 4
    (non-stop); the action window is the 4 response columns."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    query_ids, query_mask = left_pad(encode(["1+2=", "12+30=", "7"]), pad)
    digit = lambda d: tokenizer.convert_tokens_to_ids(str(d))  # noqa: E731
    response_ids = torch.tensor(
        [
            [digit(3), digit(0), eos, pad],
            [digit(4), eos, pad, pad],
            [digit(1), digit(2), digit(3), digit(4)],
        ]
    )
    response_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    return from_completions(query_ids, query_mask, response_ids, response_mask, torch.zeros(3, 4), torch.tensor([True, True, False]))
