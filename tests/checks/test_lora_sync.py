"""LoRA weight sync: after every push, the generator decodes greedily exactly what the trainer's adapters at that
push decode (the peft model itself, adapters unmerged), for hf and vLLM, under the sync and async schedules."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import compose_config
from rlhf.generators.base import SamplingParams
from rlhf.generators.hf import HFGenerator
from rlhf.models import lora
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.training.policy import TorchPolicy
from rlhf.train import train

PROMPTS = ["12+7=", "3+45=", "60+21=", "8+8=", "33+1=", "5+72="]
NEW_TOKENS = 6
RUN = ["policy.lora.rank=4", "policy.lora.alpha=32", "train.lr=3e-3", "train.num_steps=4", "eval.every=0",
       "logging.tensorboard=false", "checkpoint.save_final_model=false"]
VLLM = ["generator=vllm", "generator.kv_cache_memory_bytes=33554432", "generator.enforce_eager=true"]


def greedy_tokens(model, tokenizer, stop_id: int) -> list[list[int]]:
    """Each prompt's greedy continuation by ``model`` (HF generate, one prompt at a time), cut after the stop token."""
    out = []
    for text in PROMPTS:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    eos_token_id=stop_id, pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        out.append(tokens[: tokens.index(stop_id) + 1] if stop_id in tokens else tokens)
    return out


def generated_tokens(generator, tokenizer) -> list[list[int]]:
    """The generator's greedy responses to `PROMPTS` (its own batching), without padding."""
    batch = generator.generate([tokenizer(t)["input_ids"] for t in PROMPTS], SamplingParams(NEW_TOKENS, greedy=True))
    return [row[mask.bool()].tolist() for row, mask in zip(batch.window_ids, batch.loss_mask)]


def key(weights: dict[str, torch.Tensor]) -> tuple:
    """What tells one push from another (async hands the generator a copy of the pushed dict)."""
    return len(weights), sum(float(t.double().sum()) for t in weights.values())


@pytest.fixture
def recorder(monkeypatch):
    """Record, at every weight load of the generator, its greedy tokens and those of the trainer's adapters as they
    were when those weights were pushed (async loads a push a while later, once the trainer has moved on)."""
    pushed, seen = {}, []
    tokenizer = load_tokenizer("builtin:tiny_arith")

    def state_dict(self, adapted_only=False):
        weights = original_state_dict(self, adapted_only)
        pushed[key(weights)] = {k: v.clone() for k, v in lora.adapter_state(self.model.state_dict()).items()}
        return weights

    def wrap(cls):
        load = cls.update_weights

        def update_weights(self, state_dict, *args, **kwargs):
            load(self, state_dict, *args, **kwargs)
            if key(state_dict) in pushed:
                seen.append((pushed.pop(key(state_dict)), generated_tokens(self, tokenizer)))

        monkeypatch.setattr(cls, "update_weights", update_weights)

    original_state_dict = TorchPolicy.state_dict
    monkeypatch.setattr(TorchPolicy, "state_dict", state_dict)
    wrap(HFGenerator)
    try:
        from rlhf.generators.vllm import VLLMGenerator

        wrap(VLLMGenerator)
    except ImportError:
        pass
    return seen


@pytest.mark.parametrize("generator", [
    pytest.param(["generator=hf"], id="hf"),
    pytest.param(VLLM, marks=pytest.mark.slow, id="vllm"),
    pytest.param([*VLLM, "policy.lora.target_modules=[q_proj,down_proj]"], marks=pytest.mark.slow, id="vllm-some-layers"),
])
@pytest.mark.parametrize("schedule", ["sync", "async", "stream"])
def test_the_generator_decodes_what_the_trainers_adapters_decode_after_every_push(generator, schedule, recorder, tmp_path):
    cfg = compose_config([*RUN, *generator, f"schedule={schedule}"])
    train(cfg, tmp_path / "run")
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    stop_id = tokenizer.eos_token_id
    trainer = lora.add_adapters(load_causal_lm(cfg.model.name_or_path, "float32", None, False, torch.device("cpu")), cfg.policy.lora)
    assert len(recorder) >= cfg.train.num_steps  # every step's push (async: those loaded before the run ended)
    changed = 0
    first = None
    for adapters, generated in recorder:
        trainer.load_state_dict(adapters, strict=False)
        expected = greedy_tokens(trainer, tokenizer, stop_id)
        assert generated == expected
        first = generated if first is None else first
        changed += generated != first
    assert changed > 0  # the adapters did move the greedy outputs, so equality is not vacuous
