"""The hf generator's decode loop against `transformers`' `generate`: the same tokens, greedy and seeded sampling, while
finished rows leave the batch."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from rlhf.functional import logprobs_from_logits
from rlhf.generators.base import SamplingParams
from rlhf.generators.decode import decode, top_p_filter
from rlhf.generators.hf import left_pad
from rlhf.models.loading import load_causal_lm

PROMPTS = ["1+1=", "12+34=", "5", "9+9+9+9=", "3+4=", "0=", "77+", "8+8="]


def reference_generate(model, query_ids, query_mask, sampling: SamplingParams, stop_id: int, pad_id: int):
    """(tokens, logprobs) from `model.generate` with exactly the sampling asked for."""
    options = dict(do_sample=False) if sampling.greedy else dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
    config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, eos_token_id=stop_id, pad_token_id=pad_id,
                              output_logits=True, return_dict_in_generate=True, **options)
    model.generation_config = GenerationConfig()
    out = model.generate(input_ids=query_ids, attention_mask=query_mask, generation_config=config)
    tokens = out.sequences[:, query_ids.shape[1] :]
    temperature = 1.0 if sampling.greedy else sampling.temperature
    logps = torch.stack([logprobs_from_logits(s.float()[:, None] / temperature, tokens[:, t : t + 1])[:, 0] for t, s in enumerate(out.logits)], 1)
    return tokens, logps


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(12, greedy=True), SamplingParams(12, temperature=1.0), SamplingParams(12, temperature=1.3, top_p=0.8)],
    ids=["greedy", "t1.0", "t1.3-top_p0.8"],
)
def test_decode_samples_what_generate_samples(tiny_model_dir, tokenizer, sampling):
    model = load_causal_lm(tiny_model_dir, "float32", None, False, torch.device("cpu")).eval()
    query_ids, query_mask = left_pad([tokenizer(p)["input_ids"] for p in PROMPTS], tokenizer.pad_token_id)
    stop, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    torch.manual_seed(3)
    expected, expected_logp = reference_generate(model, query_ids, query_mask, sampling, stop, pad)
    torch.manual_seed(3)
    tokens, logp = decode(model, query_ids, query_mask, sampling, stop, pad)
    stopped = (tokens == stop).any(dim=1)
    assert stopped.any() and not stopped.all(), "the fixture should give rows that stop early and rows that run on"
    for row in range(len(PROMPTS)):  # generate pads after the stop token too; compare up to and including it
        length = int((tokens[row] == stop).float().argmax()) + 1 if stopped[row] else sampling.max_new_tokens
        assert tokens[row, :length].tolist() == expected[row, :length].tolist(), PROMPTS[row]
        assert (tokens[row, length:] == pad).all() and (logp[row, length:] == 0).all()
        torch.testing.assert_close(logp[row, :length], expected_logp[row, :length], rtol=0, atol=1e-5)


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.9, 0.03, 0.02]]))
    kept = top_p_filter(logits, 0.8).isfinite()
    assert kept.tolist() == [[True, True, False, False], [False, True, False, False]]
    assert top_p_filter(logits, 0.81).isfinite()[0].tolist() == [True, True, True, False]
    assert torch.equal(top_p_filter(logits, 1.0), logits)
