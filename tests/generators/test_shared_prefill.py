"""Shared prompt prefill (`rlhf.generators.shared_prefill`): rows holding one prompt run its prompt pass once, and
decode as they did unshared: the same greedy tokens, seeded samples the same tokens, logprobs within float rounding,
in the eager loop and the static decode (packed and padded prompt passes; its step compiled too), on Llama, Qwen2
and GPT-NeoX shapes."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import ConfigError, compose_config, validate
from rlhf.generators.base import SamplingParams
from rlhf.generators.decode import decode
from rlhf.generators.hf import left_pad
from rlhf.generators.shared_prefill import AUTO_SAVED_WORK_PER_ROW, prompt_groups, saved_tokens, shares
from rlhf.generators.static_decode import StaticDecoder
from rlhf.models.grouped_attention import use_generator_attention
from test_static_decode import PAD, POWERS, STOP, assert_same, family

SAMPLED = SamplingParams(16, temperature=1.0, top_p=0.9)
GREEDY = SamplingParams(16, greedy=True)


def grouped_prompts(seed: int = 0) -> list[list[int]]:
    """Four prompts of 3 to 9 tokens, three of them repeated (4, 3 and 2 times, one group's rows scattered over the
    list), one alone, and one that differs from another only by a leading token."""
    generator = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randint(3, 24, (n,), generator=generator).tolist() for n in (9, 5, 3))
    return [a, a, a, a, b, c, b, [7] + c, b, c]


def counting_rows(model, runs):
    """(what ``runs()`` returns, the rows of the first forward's input ids), read by a hook on the embedding."""
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0].clone()))
    try:
        out = runs()
    finally:
        hook.remove()
    return out, seen[0]


def test_prompt_groups_match_rows_token_for_token_wherever_they_sit():
    prompts = grouped_prompts()
    groups = prompt_groups(prompts)
    assert groups.firsts.tolist() == [0, 4, 5, 7]
    assert groups.owner.tolist() == [0, 0, 0, 0, 1, 2, 1, 3, 1, 2]
    assert groups.alone() == 1  # the [7] + c row
    assert saved_tokens(prompts, groups) == 3 * 9 + 2 * 5 + 3
    assert prompt_groups([[5, 6], [6], [5, 6, 0]]).distinct == 3  # a prefix or a trailing token is another prompt


def test_auto_shares_when_the_saved_prompt_work_per_row_reaches_the_threshold():
    """`true` shares any repeated prompt, `false` none, `auto` from `AUTO_SAVED_WORK_PER_ROW` saved prompt tokens x
    parameters a row; a batch with no repeated prompt never shares. The built-in task's shape (83k parameters,
    5-token prompts, 8 samples) stays unshared; SmolLM2's (135M, 45-token prompts) and 6-token prompts on a 3M model
    share."""
    def group(length: int, samples: int, prompts: int = 4) -> list[list[int]]:
        return [[p + 3] * length for p in range(prompts) for _ in range(samples)]

    cases = ((group(5, 8), 83_000, False), (group(45, 8), 135_000_000, True), (group(6, 8), 3_000_000, True),
             (group(512, 8), 3_000_000, True), (group(45, 1), 135_000_000, False))
    for prompts, params, auto in cases:
        groups = prompt_groups(prompts)
        assert shares("auto", prompts, groups, params) is auto
        assert shares("true", prompts, groups, params) is (groups.distinct < groups.rows)
        assert shares("false", prompts, groups, params) is False
    pairs = group(10, 2)  # 5 prompt tokens saved a row
    params = AUTO_SAVED_WORK_PER_ROW // 5
    assert shares("auto", pairs, prompt_groups(pairs), params) and not shares("auto", pairs, prompt_groups(pairs), params - 1)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt_neox"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_eager_loop_prefills_each_prompt_once_and_decodes_as_unshared(name, sampling):
    """The prompt pass sees the 4 distinct prompts only; greedy gives the same tokens, and seeded sampling (the random
    stream drawn as unshared: one draw over every row a step) the same tokens, logprobs within float rounding."""
    model = family(name)
    prompts = grouped_prompts()
    groups = prompt_groups(prompts)
    query_ids, query_mask = left_pad(prompts, PAD)
    torch.manual_seed(1)
    want, unshared_rows = counting_rows(model, lambda: decode(model, query_ids, query_mask, sampling, STOP, PAD))
    torch.manual_seed(1)
    got, shared_rows = counting_rows(model, lambda: decode(model, query_ids, query_mask, sampling, STOP, PAD, groups=groups))
    assert unshared_rows.shape == (10, 9) and torch.equal(shared_rows, query_ids[groups.firsts])
    assert_same(got, want)
    if sampling is SAMPLED:  # samples of one prompt differ (each row draws its own)
        tokens = got[0]
        assert len({tuple(row) for row in tokens[:4].tolist()}) > 1


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt_neox"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_static_decode_prefills_each_prompt_once_and_decodes_as_unshared(name, packed, sampling):
    """Packed (the generator's attention) and padded prompt passes over the distinct prompts only, the cache
    copied to each row's slot, slots past the batch (bucket 16 for 10 rows) zeroed: the same tokens, greedy and
    seeded, as the unshared static decode, logprobs within float rounding; NaNs left in the buffers by an earlier
    call do not reach the shared rows."""
    model = family(name)
    if packed:
        assert use_generator_attention(model)
    static = StaticDecoder(model, POWERS, 2, compile=False, graphs=False)
    assert static.packs is packed
    prompts = grouped_prompts(3)
    groups = prompt_groups(prompts)
    query_ids, query_mask = left_pad(prompts, PAD)
    torch.manual_seed(2)
    want = static.decode(query_ids, query_mask, sampling, STOP, PAD)
    for buffer in static.state.keys + static.state.values:
        buffer.fill_(float("nan"))
    torch.manual_seed(2)
    got, seen = counting_rows(model, lambda: static.decode(query_ids, query_mask, sampling, STOP, PAD, groups))
    real = query_ids[groups.firsts][query_mask[groups.firsts].bool()]
    assert torch.equal(seen, real[None] if packed else query_ids[groups.firsts])
    assert_same(got, want)
    if sampling is GREEDY:
        assert_same(got, decode(model, query_ids, query_mask, sampling, STOP, PAD))


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_compiled_static_decode_prefills_each_prompt_once_and_decodes_as_unshared(sampling):
    """`generator.compile`'s static decode (its step compiled and, on CUDA, recorded as a graph; the prompt pass runs
    outside both): the distinct prompts' pass only, and the unshared compiled decode's tokens, greedy and seeded,
    logprobs within float rounding; the shared call compiles nothing the unshared one did not."""
    torch._dynamo.reset()
    cuda = torch.cuda.is_available()
    model = family("qwen2").to("cuda" if cuda else "cpu")
    assert use_generator_attention(model)
    static = StaticDecoder(model, POWERS, 2, compile=True, graphs=cuda)
    prompts = grouped_prompts(4)
    groups = prompt_groups(prompts).to(model.device)
    query_ids, query_mask = (t.to(model.device) for t in left_pad(prompts, PAD))
    torch.manual_seed(3)
    want = static.decode(query_ids, query_mask, sampling, STOP, PAD)
    torch.manual_seed(3)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got, seen = counting_rows(model, lambda: static.decode(query_ids, query_mask, sampling, STOP, PAD, groups))
    firsts = groups.firsts
    assert torch.equal(seen, query_ids[firsts][query_mask[firsts].bool()][None])  # packed: the distinct prompts' tokens
    assert_same(got, want)


def test_the_generator_shares_by_its_key_and_counts_rows_prefilled_alone(make_generator, tiny_model_dir, encode):
    """`generator.share_prompt_prefill=true` gives the unshared generator's trajectories (seeded sampling: the same
    tokens and masks, logprobs within float rounding), in one chunk and in chunks of 3 rows; `last_metrics` counts
    the prompt passes run and the rows prefilled alone (the row whose prompt no other row holds, and, in chunks,
    the rows of groups a chunk boundary split)."""
    prompts = encode(["12+34=", "12+34=", "5", "12+34=", "7+8=", "7+8=", "12+34=", "7+8="])
    sampling = SamplingParams(8, temperature=1.0)
    for batch_size, passes, alone in ((8, 3, 1), (3, 5, 2)):
        off, on = (make_generator(tiny_model_dir, share_prompt_prefill=mode, batch_size=batch_size) for mode in ("false", "true"))
        torch.manual_seed(3)
        want = off.generate(prompts, sampling)
        assert off.last_metrics == {"generator/prefilled_prompts": 8.0, "generator/alone_rows": 0.0}
        torch.manual_seed(3)
        got = on.generate(prompts, sampling)
        assert on.last_metrics == {"generator/prefilled_prompts": float(passes), "generator/alone_rows": float(alone)}
        if batch_size == 8:  # chunked, rows are ordered by prompt then: the random stream meets them in another order
            for key in ("input_ids", "attention_mask", "loss_mask", "stopped"):
                assert torch.equal(getattr(got, key), getattr(want, key)), key
            torch.testing.assert_close(got.gen_logp, want.gen_logp, atol=1e-5, rtol=0)
        else:
            torch.testing.assert_close(got.input_ids[:, : got.window_start], want.input_ids[:, : want.window_start])
    greedy = [make_generator(tiny_model_dir, share_prompt_prefill=mode, batch_size=3).generate(prompts, GREEDY) for mode in ("false", "true")]
    assert torch.equal(greedy[0].input_ids, greedy[1].input_ids)


@pytest.mark.parametrize("value", ["maybe", "1"])
def test_a_bad_share_prompt_prefill_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=f"generator.share_prompt_prefill={value} must be one of auto, true, false"):
        validate(compose_config([f"generator.share_prompt_prefill={value}"]))
