"""The agent endpoint's fixtures: the real HF generator on the tiny model, and an endpoint on the loopback."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf.agents.endpoint import AgentRunner, OpenAIAgentConfig


@pytest.fixture(scope="module")
def generator(tiny_model_dir, tokenizer):
    from omegaconf import OmegaConf

    from rlhf.config.schema import ModelConfig
    from rlhf.generators.hf import HFGenerator, HfGeneratorConfig

    torch.manual_seed(0)
    return HFGenerator(HfGeneratorConfig(name="hf"), OmegaConf.structured(ModelConfig(name_or_path=tiny_model_dir)), tokenizer, torch.device("cpu"))


@pytest.fixture(scope="module")
def runner(tokenizer):
    cfg = OpenAIAgentConfig(name="openai_agent", chat_template="plain", max_tokens=40, max_turns=3, num_parallel=8,
                            step_timeout_s=60.0, batch_wait_s=5.0)
    runner = AgentRunner(SimpleNamespace(run=None), cfg, tokenizer, tokenizer.eos_token_id)
    yield runner
    runner.close()
