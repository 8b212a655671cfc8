"""Grouped-query decoding without the per-head cache copy (`rlhf.models.grouped_attention`): the same attention as
transformers' SDPA path for one query token, bool or additive masks, any group count; everything else handed to that
path; and a generator of a grouped-query model decoding the same tokens and logprobs as with the copy."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlhf.config.schema import ModelConfig
from rlhf.generators.base import SamplingParams
from rlhf.models.grouped_attention import NAME, grouped_sdpa


class Layer(torch.nn.Module):
    """What transformers' SDPA function reads of an attention layer."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (14, 2), (8, 1)])
@pytest.mark.parametrize("additive", [False, True])
def test_one_query_token_attends_as_transformers_sdpa_does(heads, kv_heads, additive):
    torch.manual_seed(0)
    rows, columns, dim = 3, 11, 16
    query, key, value = torch.randn(rows, heads, 1, dim), torch.randn(rows, kv_heads, columns, dim), torch.randn(rows, kv_heads, columns, dim)
    attend = torch.rand(rows, 1, 1, columns) > 0.3
    attend[:, :, :, 0] = True
    mask = torch.zeros(attend.shape).masked_fill(~attend, torch.finfo(torch.float32).min) if additive else attend
    layer = Layer(heads // kv_heads)
    want, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.25)
    got, _ = grouped_sdpa(layer, query, key, value, mask, scaling=0.25)
    assert got.shape == (rows, 1, heads, dim)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_several_query_tokens_go_to_transformers_sdpa_unchanged():
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    layer = Layer(2)
    assert torch.equal(grouped_sdpa(layer, query, key, value, None)[0], sdpa_attention_forward(layer, query, key, value, None)[0])


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory, tokenizer) -> str:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    folder = tmp_path_factory.mktemp("gqa")
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_grouped_query_generator_decodes_what_the_copying_one_decodes(make_generator, gqa_model_dir, tiny_model_dir, decode):
    grouped, copying = make_generator(gqa_model_dir, decode=decode), make_generator(gqa_model_dir, decode=decode, grouped_decode=False)
    assert grouped.model.config._attn_implementation == NAME and copying.model.config._attn_implementation == "sdpa"
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [4]]  # left padding: the steps carry masks
    for sampling in (SamplingParams(12, greedy=True), SamplingParams(12)):
        torch.manual_seed(1)
        a = grouped.generate(prompts, sampling)
        torch.manual_seed(1)
        b = copying.generate(prompts, sampling)
        assert torch.equal(a.input_ids, b.input_ids)
        torch.testing.assert_close(a.gen_logp, b.gen_logp, atol=1e-5, rtol=0)
    # no grouped heads: the generator's attention too (its steps go to SDPA unchanged; its static prompt pass packs)
    assert make_generator(tiny_model_dir).model.config._attn_implementation == NAME
