"""`generator.decode=static`: the preallocated-cache decode gives the eager loop's greedy tokens on every model family
the presets use, samples from the same distribution, follows weight pushes and sleep/wake, and refuses what it cannot
serve, before any model loads where the config alone shows it. (CUDA graph recording needs a GPU: `bench/gpu_check.py`
checks it there; everything else of the path runs here.)"""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch

from rlhf.config import ConfigError, compose_config, validate
from rlhf.generators.base import SamplingParams
from rlhf.generators.decode import decode
from rlhf.generators.hf import left_pad
from rlhf.generators import static_decode
from rlhf.generators.static_decode import StaticDecoder, SlotState, fill_holes, move_pays, bucket_for, decode_step, race_sample
from rlhf.models.grouped_attention import NAME as GROUPED, use_generator_attention
from rlhf.models.logprobs import window_logprobs

STOP, PAD = 2, 0
POWERS = (1, 2, 4, 8, 16)


def family(name: str) -> torch.nn.Module:
    """A tiny random model of a family the presets use (Llama, Qwen2 with biased q/k/v and grouped heads, GPT-NeoX
    with partial rotary), weights redrawn wide so greedy picks are far from ties and rows stop at different steps."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=24, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=96)
    model = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**shape)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **shape)),
        "gpt_neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(rotary_pct=0.25, **shape)),
    }[name]()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" not in pname and param.dim() > 1:
                param.normal_(0.0, 0.3)
    return model.eval()


def prompts(count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` left-padded prompts of 1 to 9 tokens (no stop or pad token in them)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 10, (count,), generator=generator)
    return left_pad([torch.randint(3, 24, (int(n),), generator=generator).tolist() for n in lengths], PAD)


def assert_same(got, want) -> None:
    (tokens, logprobs), (want_tokens, want_logprobs) = got, want
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt_neox"])
def test_static_decode_gives_the_eager_loops_greedy_tokens(name):
    """Batches of 1, 5 and 13 rows (buckets 1, 8, 16; rows moving to smaller buckets as they stop; looks every step
    and every third), one decoder reused across calls of other prompt lengths: the eager loop's tokens exactly,
    logprobs within float rounding."""
    model = family(name)
    greedy = SamplingParams(20, greedy=True)
    for check_every in (1, 3):
        static = StaticDecoder(model, POWERS, check_every, compile=False, graphs=False)
        for count, seed in ((13, 0), (1, 1), (5, 2), (13, 3)):
            query_ids, query_mask = prompts(count, seed)
            want = decode(model, query_ids, query_mask, greedy, STOP, PAD)
            got = static.decode(query_ids, query_mask, greedy, STOP, PAD)
            assert_same(got, want)
    stopped = (want[0] == STOP).any(dim=1)
    assert stopped.any() and not stopped.all(), "rows should stop at different steps, some not at all"


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt_neox"])
def test_packed_prompts_give_the_eager_loops_greedy_tokens_and_compute_no_padding(name):
    """On the generator's attention the prompt pass runs the real prompt tokens only, packed end to end (the model's
    embedding sees one row of exactly those tokens), and greedy decoding gives the eager loop's tokens, logprobs within
    float rounding, on calls of 13, 1 and 5 rows of 1 to 9 tokens. NaNs left in the buffers (a call of a model whose
    weights went bad) do not reach the next call through the padding columns the packed pass never writes. A call
    with an empty prompt goes through the padded pass, the other row answering as in the eager loop."""
    model = family(name)
    assert use_generator_attention(model)
    static = StaticDecoder(model, POWERS, 2, compile=False, graphs=False)
    assert static.packs
    greedy = SamplingParams(20, greedy=True)
    for count, seed in ((13, 0), (1, 1), (5, 2)):
        query_ids, query_mask = prompts(count, seed)
        want = decode(model, query_ids, query_mask, greedy, STOP, PAD)
        if static.state is not None:
            for buffer in static.state.keys + static.state.values:
                buffer.fill_(float("nan"))
        seen = []
        hook = model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0].clone()))
        try:
            got = static.decode(query_ids, query_mask, greedy, STOP, PAD)
        finally:
            hook.remove()
        assert torch.equal(seen[0], query_ids[query_mask.bool()][None]) and (query_mask == 0).any() == (count > 1)
        assert_same(got, want)
    empty = left_pad([[5, 6, 7], []], PAD)  # a row with no prompt token: the padded pass (bucket 2 x 3 columns) serves it
    seen.clear()
    hook = model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0].clone()))
    try:
        got = static.decode(*empty, greedy, STOP, PAD)
    finally:
        hook.remove()
    want = decode(model, *empty, greedy, STOP, PAD)[0]
    width = min(got[0].shape[1], want.shape[1])  # the empty row's own answer is undefined (it attends to padding only)
    assert seen[0].shape == (2, 3) and torch.equal(got[0][0, :width], want[0, :width])


def test_buffers_grow_for_a_longer_call_and_serve_shorter_ones_after():
    """A later call with longer prompts and a larger budget than the buffers hold gets new, larger buffers (the graphs
    recorded on the old ones would be dropped); shorter calls after it reuse them; a row whose first token is its
    stop token ends at once. Every call gives the eager loop's tokens."""
    model = family("llama")
    static = StaticDecoder(model, POWERS, 3, compile=False, graphs=False)
    generator = torch.Generator().manual_seed(9)
    long_prompts = left_pad([torch.randint(3, 24, (n,), generator=generator).tolist() for n in (60, 3, 41)], PAD)
    calls = [(prompts(9, 4), 8), (long_prompts, 30), (prompts(5, 2), 6)]
    shapes = []
    for (query_ids, query_mask), budget in calls:
        greedy = SamplingParams(budget, greedy=True)
        want = decode(model, query_ids, query_mask, greedy, STOP, PAD)
        assert_same(static.decode(query_ids, query_mask, greedy, STOP, PAD), want)
        shapes.append((static.state.mask.shape, static.state.tokens.shape[1]))
    assert shapes[0] == ((16, 64), 8) and shapes[1] == ((16, 128), 30) and shapes[2] == shapes[1]
    first_stop, _ = decode(model, *calls[0][0], SamplingParams(8, greedy=True), STOP, PAD)
    assert (first_stop[:, 0] == STOP).any(), "the first call should hold a row that stops on its first token"


@pytest.mark.parametrize("buckets, check_every", [(POWERS, 2), (None, 2), ((8, 9), 1)], ids=["powers", "every-size", "moves-refused"])
def test_rows_move_to_smaller_buckets_and_keep_their_answers(buckets, check_every):
    """A batch of 9 whose rows stop over several steps runs at smaller buckets as they stop (each move fills stopped
    slots with the rows past the new bucket, with their cache), and each row's answer stays its own: with powers of 2
    from bucket 16 down to 8; with every batch size down to its rows still going; with buckets (8, 9) looking every
    step, a move that would copy the one row past slot 8 to drop only that slot does not pay, and the rows stay."""
    model = family("llama")
    query_ids, query_mask = prompts(9, 0)
    greedy = SamplingParams(30, greedy=True)
    static = StaticDecoder(model, buckets, check_every, compile=False, graphs=False)
    seen, looks, moves = [], [], []  # each step's bucket; (rows going, rows past them) at each look; rows each move copied
    step, move, holes = StaticDecoder._step, SlotState.move, static_decode.fill_holes
    static._step = lambda state, bucket, *rest: (seen.append(bucket), step(static, state, bucket, *rest))
    with patch.object(SlotState, "move", lambda state, sources, *rest: (moves.append(len(sources)), move(state, sources, *rest))), \
            patch.object(static_decode, "fill_holes", lambda going: (looks.append((len(going), len(holes(going)[0]))), holes(going))[1]):
        assert_same(static.decode(query_ids, query_mask, greedy, STOP, PAD), decode(model, query_ids, query_mask, greedy, STOP, PAD))
    assert seen == sorted(seen, reverse=True), seen
    if buckets == POWERS:
        assert seen[0] == 16 and min(seen) == 8 and len(moves) == 1, (seen, moves)
    elif buckets is None:
        assert seen[0] == 9 and len(set(seen)) == len(moves) + 1 and min(seen) < 8, (seen, moves)
    else:
        assert any(going <= 8 and past == 1 for going, past in looks), looks  # a look found slot 8 going and another stopped
        assert all(copied == 0 for copied in moves) and (8 in seen) == bool(moves), (seen, looks, moves)


def test_moved_rows_keep_their_answers_when_steps_attend_over_every_cache_column():
    """A recorded CUDA graph's step attends over every cache column, the mask alone hiding the ones not written yet:
    rows moved with only their written columns, into slots whose unwritten columns hold an earlier call's values, still
    give the eager loop's answers."""
    model = family("llama")
    static = StaticDecoder(model, POWERS, 1, compile=False, graphs=False)
    static.step_fn = lambda *args: decode_step(*args[:-1])  # no width: every column, as the graphs attend
    greedy = SamplingParams(30, greedy=True)
    static.decode(*prompts(16, 3), greedy, STOP, PAD)  # allocates the buffers
    for buffer in static.state.keys + static.state.values:
        buffer.normal_(0, 100)  # an earlier call's values, far from this call's
    moves = []
    move = SlotState.move
    query_ids, query_mask = prompts(9, 0)
    with patch.object(SlotState, "move", lambda state, sources, *rest: (moves.append(len(sources)), move(state, sources, *rest))):
        assert_same(static.decode(query_ids, query_mask, greedy, STOP, PAD), decode(model, query_ids, query_mask, greedy, STOP, PAD))
    assert any(moves), moves  # some move copied a row


def test_the_race_sampler_draws_each_token_with_its_probability():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    draws = 40_000
    torch.manual_seed(0)
    picks = race_sample(probs.expand(draws, -1), torch.empty(draws, 5).exponential_())
    freq = torch.bincount(picks, minlength=5).float() / draws
    assert freq[4] == 0
    assert (freq - probs).abs().max() < 4 * (0.25 / draws) ** 0.5


@pytest.mark.parametrize("sampling", [SamplingParams(6, greedy=True), SamplingParams(6), SamplingParams(6, 0.7, 0.8)],
                         ids=["greedy", "sample", "nucleus"])
def test_the_recorded_step_reads_nothing_on_the_host(sampling):
    """A CUDA graph cannot record a step that reads a tensor on the host (a Python branch on a tensor, `.item()`):
    the step as the graphs call it (attending over every cache column) traces as one graph in every sampling mode,
    the nucleus's 0-d top_p tensor included; with grouped-query attention as generators decode it."""
    model = family("qwen2")
    assert use_generator_attention(model)
    decoder = StaticDecoder(model, (1, 2, 4), check_every=2, compile=False, graphs=False)
    traced = torch.compile(decode_step, fullgraph=True, backend="eager")
    decoder._step = lambda state, bucket, mode, stop_id, pad_id, width: traced(
        model, state, *mode, decoder.temperature, decoder.top_p, stop_id, pad_id)
    ids, mask = torch.randint(3, 20, (3, 5)), torch.ones(3, 5, dtype=torch.long)
    tokens, _ = decoder.decode(ids, mask, sampling, STOP, PAD)
    assert tokens.shape[0] == 3 and 1 <= tokens.shape[1] <= 6


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (1.3, 0.8)])
def test_seeded_sampling_draws_from_the_eager_samplers_distribution(temperature, top_p):
    """One prompt, 3000 rows, three tokens each: the first token's frequencies match the model's (temperature-scaled,
    nucleus-renormalised) probabilities, and the third token's match the eager sampler's frequencies; every logprob is
    the temperature-scaled one the trainer scores."""
    model = family("llama")
    rows = 3000
    query_ids, query_mask = prompts(1, 5)
    query_ids, query_mask = query_ids.expand(rows, -1), query_mask.expand(rows, -1)
    sampling = SamplingParams(3, temperature=temperature, top_p=top_p)
    static = StaticDecoder(model, (rows,), 8, compile=False, graphs=False)
    torch.manual_seed(1)
    tokens, logprobs = static.decode(query_ids, query_mask, sampling, -1, PAD)
    torch.manual_seed(2)
    want_tokens, _ = decode(model, query_ids, query_mask, sampling, -1, PAD)

    with torch.no_grad():
        scaled = model(input_ids=query_ids[:1], attention_mask=query_mask[:1]).logits[0, -1] / temperature
    probs = scaled.softmax(-1)
    order = probs.sort(descending=True)
    kept = torch.zeros_like(probs, dtype=torch.bool)
    kept[order.indices[(order.values.cumsum(0) - order.values) < top_p]] = True
    nucleus = torch.where(kept, probs, 0.0) / probs[kept].sum()
    slack = 5 * (0.25 / rows) ** 0.5
    first = torch.bincount(tokens[:, 0], minlength=len(probs)).float() / rows
    assert (first - nucleus).abs().max() < slack
    assert (first[~kept] == 0).all()
    third, want_third = (torch.bincount(t[:, 2], minlength=len(probs)).float() / rows for t in (tokens, want_tokens))
    assert (third - want_third).abs().max() < slack * 2**0.5
    torch.testing.assert_close(logprobs[:, 0], scaled.log_softmax(-1)[tokens[:, 0]], atol=1e-5, rtol=0)


def test_the_static_generator_follows_pushes_and_sleep_and_scores_as_the_trainer(
    make_generator, tiny_model_dir, other_model_dir, encode
):
    """The hf generator with decode=static: the eager generator's greedy rollout; a weight push (in place) and a
    sleep/wake reach its decode; its logprobs are the trainer's within float rounding."""
    texts = ["1+1=", "12+34=", "5", "9+9+9+9=", "3+4=", "0=", "77+", "8+8=", "40+2="]
    greedy = SamplingParams(10, greedy=True)
    eager, static = make_generator(tiny_model_dir), make_generator(tiny_model_dir, decode="static", check_every=2)
    assert static.static is not None and eager.static is None
    assert static.model.config._attn_implementation == GROUPED, "the generator's attention takes the 4D masks built here"
    assert static.static.packs, "and its prompts run packed"
    first = static.generate(encode(texts), greedy)
    want = eager.generate(encode(texts), greedy)
    assert torch.equal(first.input_ids, want.input_ids) and torch.equal(first.loss_mask, want.loss_mask)
    expected, _ = window_logprobs(eager.model, first, 1.0)
    torch.testing.assert_close(first.gen_logp, expected, atol=1e-5, rtol=0)

    donor = make_generator(other_model_dir)
    static.update_weights(donor.model.state_dict())
    assert torch.equal(static.generate(encode(texts), greedy).input_ids, donor.generate(encode(texts), greedy).input_ids)
    static.sleep()
    assert static.static.state is None, "the sleep frees the static cache with the weights"
    static.update_weights(make_generator(tiny_model_dir).model.state_dict())
    assert torch.equal(static.generate(encode(texts), greedy).input_ids, first.input_ids)


@pytest.mark.slow
def test_the_compiled_static_step_gives_the_eager_tokens_and_a_push_compiles_nothing():
    """`generator.compile` with the static decode: the step under torch.compile gives the eager loop's greedy tokens
    on batches of several buckets; after a weight push the same batches compile nothing more."""
    torch._dynamo.reset()
    model = family("llama")
    greedy = SamplingParams(12, greedy=True)
    static = StaticDecoder(model, POWERS, 4, compile=True, graphs=False)
    batches = [prompts(count, seed) for count, seed in ((13, 0), (3, 1), (13, 2))]
    for query_ids, query_mask in batches:
        assert_same(static.decode(query_ids, query_mask, greedy, STOP, PAD), decode(model, query_ids, query_mask, greedy, STOP, PAD))
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.9)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for query_ids, query_mask in batches:
            assert_same(static.decode(query_ids, query_mask, greedy, STOP, PAD), decode(model, query_ids, query_mask, greedy, STOP, PAD))


def test_slot_state_moves_rows_into_stopped_slots_and_heads_share_the_buffers():
    state = SlotState(
        keys=[torch.arange(12.0).view(4, 1, 3, 1)], values=[torch.arange(12.0).view(4, 1, 3, 1) + 20],
        mask=torch.eye(4, dtype=torch.bool), token=torch.arange(4), position=torch.arange(4) + 5,
        done=torch.tensor([True, False, True, False]), length=torch.arange(4), column=torch.zeros(1, dtype=torch.long),
        step=torch.ones(1, dtype=torch.long), tokens=torch.arange(8).view(4, 2), logprobs=torch.zeros(4, 2),
    )
    sources, targets = fill_holes([1, 3])
    assert (sources, targets) == ([3], [0])  # slot 1 stays where it is; slot 3 fills the stopped slot 0
    state.move(torch.tensor(sources), torch.tensor(targets), columns=2)
    head = state.head(2)
    assert head.token.tolist() == [3, 1] and head.position.tolist() == [8, 6] and head.tokens.tolist() == [[6, 7], [2, 3]]
    # the cache's first two columns moved; the third (unwritten) kept slot 0's own
    assert head.keys[0].flatten().tolist() == [9.0, 10.0, 2.0, 3.0, 4.0, 5.0] and not head.done.any()
    assert head.values[0].flatten().tolist() == [29.0, 30.0, 22.0, 23.0, 24.0, 25.0]
    assert head.mask.tolist() == [[False, False, False, True], [False, True, False, False]]
    head.token.fill_(0)
    assert state.token[:2].tolist() == [0, 0] and head.column is state.column


def test_a_move_to_a_smaller_bucket_pays_when_it_copies_no_more_than_the_steps_before_the_next_look_stop_reading():
    assert move_pays(moved=0, dropped=1, steps=1)  # relabelling slots copies nothing
    assert move_pays(moved=4, dropped=8, steps=1) and not move_pays(moved=5, dropped=8, steps=1)
    assert move_pays(moved=16, dropped=4, steps=8) and not move_pays(moved=17, dropped=4, steps=8)


def test_default_buckets_are_the_powers_of_two_below_the_batch_size_and_itself_with_graphs_and_every_size_without():
    from rlhf.generators.hf import HfGeneratorConfig, buckets

    assert buckets(HfGeneratorConfig(name="hf", batch_size=64), graphs=True) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets(HfGeneratorConfig(name="hf", batch_size=600), graphs=True)[-3:] == (256, 512, 600)
    assert buckets(HfGeneratorConfig(name="hf", batch_size=1), graphs=True) == (1,)
    assert buckets(HfGeneratorConfig(name="hf"), graphs=False) is None and bucket_for(37, None) == 37
    assert buckets(HfGeneratorConfig(name="hf", batch_size=8, buckets=[8, 2]), graphs=False) == (2, 8)


def test_fill_holes_moves_only_the_rows_past_the_going_count():
    assert fill_holes([0, 1, 2]) == ([], [])
    assert fill_holes([2, 5, 6, 7]) == ([5, 6, 7], [0, 1, 3])
    assert fill_holes([]) == ([], [])


def test_a_batch_no_bucket_holds_and_a_sliding_window_model_are_refused():
    with pytest.raises(ValueError, match=r"17 rows do not fit generator.buckets=\[1, 2, 4, 8, 16\]: add a bucket of at least 17"):
        bucket_for(17, POWERS)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sliding = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=24, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        use_sliding_window=True, sliding_window=8, max_window_layers=1,
    ))
    with pytest.raises(ValueError, match="sliding-window layers.*generator.decode=eager"):
        StaticDecoder(sliding, POWERS, 8, compile=False, graphs=False)


def test_auto_decodes_static_on_cpu_when_compiled_and_eagerly_what_static_cannot_serve(make_generator, tiny_model_dir, tokenizer, tmp_path):
    """`generator.decode=auto` on the CPU: the eager loop by default; the static step when `generator.compile` is on
    (compiled, the faster of the two there); and for a model the static decode cannot serve (sliding-window layers)
    the compiled eager loop, where `decode=static` is refused naming the way out."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    plain, compiled = make_generator(tiny_model_dir), make_generator(tiny_model_dir, compile=True)
    assert plain.static is None and plain.step_model is None
    assert compiled.static is not None and compiled.step_model is None and not compiled.static.graphs
    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1,
    )).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    sliding = make_generator(str(tmp_path), compile=True)
    assert sliding.static is None and sliding.step_model is not None
    with pytest.raises(ValueError, match="sliding-window layers.*set generator.decode=eager"):
        make_generator(str(tmp_path), decode="static")


def test_a_windowed_model_decodes_statically_only_while_its_rows_fit_the_window(make_generator, tokenizer, encode, tmp_path):
    """A Mistral-style sliding window of 8 positions on every layer: the slot cache attends over every earlier column,
    so a call whose rows fit the window (5-token prompts + 3 tokens) decodes statically, and a longer one (+ 16) runs
    the eager loop, which applies the window. Both give the eager generator's greedy tokens; the static decode alone
    would not past the window."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, max_position_embeddings=64,
    ))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name and param.dim() > 1:
                param.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    eager, static = make_generator(str(tmp_path), decode="eager"), make_generator(str(tmp_path), decode="static")
    prompts = encode(["1+1=", "2+3=", "4+4=", "9+0="])
    assert {len(p) for p in prompts} == {5}
    decoded = []
    decode_statically = static.static.decode
    static.static.decode = lambda *args: decoded.append(args) or decode_statically(*args)
    for budget in (3, 16):
        greedy = SamplingParams(budget, greedy=True)
        decoded.clear()
        want = eager.generate(prompts, greedy).input_ids
        assert torch.equal(static.generate(prompts, greedy).input_ids, want)
        assert bool(decoded) == (budget == 3)
    query_ids, query_mask = left_pad(prompts, static.pad_id)
    alone, _ = decode_statically(query_ids, query_mask, greedy, static.stop_id, static.pad_id)
    response = want[:, query_ids.shape[1] :]
    width = min(response.shape[1], alone.shape[1])
    assert not torch.equal(alone[:, :width], response[:, :width]), "past the window the slot cache attends where the model does not"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["generator.decode=fast"], r"generator.decode=fast must be one of auto, eager, static"),
        (["generator.decode=static", "generator.batch_size=600", "generator.buckets=[1,2,512]"],
         r"generator.buckets=\[1, 2, 512\] do not cover generator.batch_size=600 \(the static decode runs here\): add a bucket of at least 600"),
        (["generator.buckets=[]"], r"generator.buckets=\[\] must list batch sizes >= 1"),
        (["generator.check_every=0"], r"generator.check_every=0 must be >= 1"),
        (["generator.decode=eager", "generator.graphs=true"], r"generator.graphs=true records the static decode's steps"),
        (["generator.graphs=true", "cluster.device=cpu"], r"generator.graphs=true records CUDA graphs, but this run's generator is on the CPU"),
    ],
)
def test_bad_static_decode_keys_are_refused_before_any_model_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(overrides))


@pytest.mark.parametrize("overrides", [
    ["generator.decode=static"], ["generator.compile=true"], ["cluster.device=cuda"],
], ids=["static", "auto_compiled", "auto_on_cuda"])
def test_buckets_are_refused_where_the_static_decode_reads_them(overrides):
    """The same `generator.buckets=[3,1]` is refused wherever the static decode runs (and reads it)..."""
    with pytest.raises(ConfigError, match=r"generator.buckets=\[3, 1\] do not cover generator.batch_size=512 \(the static decode runs here\)"):
        validate(compose_config(["generator.buckets=[3,1]", *overrides]))


@pytest.mark.parametrize("overrides", [["generator.decode=eager"], []], ids=["eager", "auto_on_cpu"])
def test_buckets_are_accepted_where_the_eager_loop_ignores_them(overrides):
    """...and accepted wherever the eager loop decodes, which never reads it (before, `decode=auto` on a CPU refused
    it, though it decodes eagerly)."""
    validate(compose_config(["generator.buckets=[3,1]", "cluster.device=cpu", *overrides]))



def test_the_memory_plan_counts_the_static_buffers_as_held_between_calls():
    """On CUDA (`decode=auto` is static there) the plan holds the cache of the whole bucket (rows padded up) and every
    column rounded up, through training unless the generator sleeps; on CPU the eager loop's estimate stays."""
    from rlhf.generators.hf import HFGenerator, HfGeneratorConfig
    from rlhf.generators.memory import GenerationWork, GeneratorShape, kv_cache_bytes

    shape = GeneratorShape(params=1000, layers=2, kv_heads=2, head_dim=16, vocab=50)
    work = lambda kind: GenerationWork(rows=100, seq_len=70, new_tokens=40, dtype_bytes=2, device_kind=kind, capacity=None)  # noqa: E731
    needs = {n.what: n for n in HFGenerator.plan_memory(HfGeneratorConfig(name="hf"), shape, work("cuda"))}
    assert needs["static_kv_cache"].bytes == kv_cache_bytes(2, 2, 16, 128 * 128, 2) and needs["static_kv_cache"].resident
    assert needs["decode_step"].bytes == 2 * 3 * 128 * 50 * 4  # every bucket recorded: about twice the largest's three float32 (rows, vocab)
    eager = {n.what for n in HFGenerator.plan_memory(HfGeneratorConfig(name="hf"), shape, work("cpu"))}
    assert eager == {"weights", "kv_cache", "logits"}
