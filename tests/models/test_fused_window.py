"""The fused output layer in a model's forward (`model.logprob_chunk`): the same logprobs, entropies and gradients
as the plain logits, packed or justified, and declined where the head is not a plain linear layer of its own."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from transformers import GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM

from rlhf.config.schema import ModelConfig
from rlhf.models import packing
from rlhf.models.logprobs import FUSED_CHUNK_ON_CUDA, fuses, logprob_chunk, window_logprobs
from test_packing import rows


def llama(tied: bool, packs: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    if packs:
        assert packing.enable(model)
    return model


def outputs_and_grads(model, batch, temperature, chunk):
    logp, entropy = window_logprobs(model, batch, temperature, with_entropy=True, chunk=chunk)
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(3))
    (logp * weights).sum().add(entropy.sum() * 0.3).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logp.detach(), entropy.detach(), grads


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("packs", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_fused_logprobs_entropy_and_gradients_equal_the_plain_logits(tied, packs, chunk):
    model = llama(tied, packs)
    assert fuses(model)
    batch = rows([3, 6, 2], [5, 1, 4])
    for temperature in (1.0, 0.7):
        plain = outputs_and_grads(model, batch, temperature, chunk=0)
        fused = outputs_and_grads(model, batch, temperature, chunk=chunk)
        torch.testing.assert_close(fused[0], plain[0], rtol=0, atol=2e-6)
        torch.testing.assert_close(fused[1], plain[1], rtol=0, atol=2e-6)
        for name, grad in plain[2].items():
            torch.testing.assert_close(fused[2][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_no_vocabulary_sized_logits_exist_in_a_fused_forward():
    """The output layer computes nothing (its input is handed over empty): no (tokens, V) tensor is made."""
    model = llama(tied=True, packs=True)
    batch = rows([3, 6, 2], [5, 1, 4])
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    window_logprobs(model, batch, 1.0, chunk=4)
    hook.remove()
    assert seen == [torch.Size([1, 0, 40])]


def test_heads_the_fused_path_cannot_honour_keep_the_plain_logits():
    granite = GraniteForCausalLM(GraniteConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=2, logits_scaling=4.0))
    assert not fuses(granite)  # it divides its logits after the layer
    wrapped = llama(tied=False, packs=True)
    wrapped.lm_head = torch.nn.Sequential(wrapped.lm_head)
    assert not fuses(wrapped)
    batch = rows([3, 2], [2, 4])
    torch.testing.assert_close(window_logprobs(granite, batch, 1.0, chunk=4)[0], window_logprobs(granite, batch, 1.0)[0])


def test_the_chunk_defaults_to_fused_on_cuda_and_plain_logits_on_the_cpu():
    default = OmegaConf.structured(ModelConfig(name_or_path="x"))
    assert logprob_chunk(default, torch.device("cpu")) == 0  # the CPU float32 path, bitwise as before
    assert logprob_chunk(default, torch.device("cuda")) == FUSED_CHUNK_ON_CUDA
    assert logprob_chunk(OmegaConf.structured(ModelConfig(name_or_path="x", logprob_chunk=64)), torch.device("cpu")) == 64
