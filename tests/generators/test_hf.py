"""The transformers generator and the trajectories it returns: padding, stop handling, logprobs, weight sync."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import ConfigError, compose_config
from rlhf.generators.base import SamplingParams
from rlhf.generators.hf import left_pad, stop_token_id, truncate_at_stop
from rlhf.models.logprobs import window_logprobs
from rlhf.train import train

PROMPTS = ["1+1=", "12+34=", "5", "9+9+9+9=", "3+4=", "0=", "77+", "8+8=", "40+2=", "6", "123=", "2+2+2="]
GREEDY = SamplingParams(max_new_tokens=6, greedy=True)


def query(batch):
    """(ids, mask) of the prompt columns of single-turn trajectories (everything before the action window)."""
    return batch.input_ids[:, : batch.window_start], batch.attention_mask[:, : batch.window_start]


def assert_same_rollout(a, b, atol: float = 1e-5) -> None:
    """Equal token tensors (prompts and responses), masks and stop flags, logprobs equal within ``atol``."""
    assert a.window_start == b.window_start
    for name in ("input_ids", "attention_mask", "loss_mask", "stopped"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.gen_logp, b.gen_logp, atol=atol, rtol=0)


# --- pure helpers -------------------------------------------------------------------------------------


def test_left_pad_puts_padding_before_each_prompt():
    """Shorter prompts are right-aligned with pad ids and a zero mask on the left."""
    ids, mask = left_pad([[5, 6], [7], [1, 2, 3]], pad_id=0)
    assert ids.tolist() == [[0, 5, 6], [0, 0, 7], [1, 2, 3]]
    assert mask.tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_truncate_at_stop_keeps_first_stop_and_pads_the_rest():
    """The first stop token stays (mask 1); later tokens become pad (mask 0); no stop means not stopped."""
    tokens = torch.tensor([[4, 2, 5, 2], [4, 5, 6, 7], [2, 9, 9, 9], [3, 3, 3, 2]])
    ids, mask, stopped = truncate_at_stop(tokens, stop_id=2, pad_id=0)
    assert ids.tolist() == [[4, 2, 0, 0], [4, 5, 6, 7], [2, 0, 0, 0], [3, 3, 3, 2]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert stopped.tolist() == [True, False, True, True]


def test_stop_token_id_eos_literal_and_unknown(tokenizer):
    """`eos` maps to the EOS id, a literal token to its id, and a non-token is a ConfigError naming the key."""
    assert stop_token_id(tokenizer, "eos") == tokenizer.eos_token_id
    assert stop_token_id(tokenizer, "=") == tokenizer.convert_tokens_to_ids("=")
    with pytest.raises(ConfigError, match="^generator.stop_token=.xyz. is not a single token"):
        stop_token_id(tokenizer, "xyz")


def test_a_stop_token_outside_the_vocabulary_is_refused_before_any_weights_load(tmp_path, monkeypatch):
    """Before, `generator.stop_token=banana` (no environment) failed after the policy and reference loaded, as "the
    run raised ValueError", exit 6."""
    loaded = []
    monkeypatch.setattr("rlhf.training.policy.load_causal_lm", lambda *a, **k: loaded.append(a) or pytest.fail("loaded"))
    with pytest.raises(ConfigError, match=r"^generator.stop_token='banana' is not a single token of this tokenizer; set a token of its vocabulary"):
        train(compose_config(["generator.stop_token=banana", "train.num_steps=2", "logging.tensorboard=false"]), tmp_path / "run")
    assert not loaded


# --- Trajectories -------------------------------------------------------------------------------------


def test_model_inputs_positions_count_real_tokens_only(rollout, encode, tokenizer):
    """Position ids of real tokens run 0..n-1 whatever the left padding; inputs are prompt then response."""
    input_ids, attention_mask, position_ids = rollout.model_inputs()
    query_ids, query_mask = left_pad(encode(["1+2=", "12+30=", "7"]), tokenizer.pad_token_id)  # the fixture's prompts
    assert torch.equal(input_ids, torch.cat([query_ids, rollout.window_ids], dim=1))
    assert torch.equal(attention_mask, torch.cat([query_mask, rollout.loss_mask.long()], dim=1))
    for row in range(len(rollout)):
        real = attention_mask[row].bool()
        assert position_ids[row][real].tolist() == list(range(int(real.sum())))
    assert position_ids.min() >= 0


def test_rollout_select_takes_rows_of_every_field(rollout):
    """`select` with an index tensor or a slice picks the same rows from every tensor."""
    picked = rollout.select(torch.tensor([2, 0]))
    assert len(picked) == 2
    assert torch.equal(query(picked)[0], query(rollout)[0][[2, 0]])
    assert torch.equal(picked.loss_mask, rollout.loss_mask[[2, 0]])
    assert picked.stopped.tolist() == [False, True]
    assert picked.action_lengths.tolist() == [4.0, 3.0]
    sliced = rollout.select(slice(1, 3))
    assert len(sliced) == 2 and torch.equal(sliced.window_ids, rollout.window_ids[1:3])


# --- HFGenerator --------------------------------------------------------------------------------------


@pytest.fixture
def generator(make_generator, tiny_model_dir):
    """An HFGenerator on the seed-0 tiny model."""
    return make_generator(tiny_model_dir)


def test_generate_left_pads_prompts_of_different_lengths(generator, encode, tokenizer):
    """The rollout's queries are the prompts left-padded with the tokenizer's pad id."""
    prompts = encode(PROMPTS)
    rollout = generator.generate(prompts, GREEDY)
    expected_ids, expected_mask = left_pad(prompts, tokenizer.pad_token_id)
    assert torch.equal(query(rollout)[0], expected_ids)
    assert torch.equal(query(rollout)[1], expected_mask)
    assert len(rollout) == len(PROMPTS)


def test_generate_stops_at_eos_and_flags_non_stop(generator, encode, tokenizer):
    """Nothing follows the first EOS; `stopped` is false exactly for responses that ran to max_new_tokens."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rollout = generator.generate(encode(PROMPTS), GREEDY)
    assert rollout.window_ids.shape[1] <= GREEDY.max_new_tokens
    assert rollout.stopped.any() and not rollout.stopped.all(), "fixture should give both kinds of response"
    for ids, mask, stopped in zip(rollout.window_ids, rollout.loss_mask, rollout.stopped):
        length = int(mask.sum())
        assert mask[:length].eq(1).all() and mask[length:].eq(0).all()
        assert ids[length:].eq(pad).all()
        real = ids[:length].tolist()
        if stopped:
            assert real[-1] == eos and eos not in real[:-1]
        else:
            assert eos not in real and length == GREEDY.max_new_tokens
    assert rollout.gen_logp[rollout.loss_mask == 0].eq(0).all()


def test_greedy_is_deterministic(generator, encode):
    """Two greedy calls on the same prompts return the same rollout."""
    prompts = encode(PROMPTS)
    assert_same_rollout(generator.generate(prompts, GREEDY), generator.generate(prompts, GREEDY), atol=0)


def test_greedy_response_does_not_depend_on_batch_padding(generator, encode):
    """A short prompt alone and inside a batch of longer (so more padded) prompts gets the same greedy answer."""
    prompts = encode(PROMPTS)
    batch = generator.generate(prompts, GREEDY)
    for row, prompt in enumerate(prompts):
        alone = generator.generate([prompt], GREEDY)
        width = alone.window_ids.shape[1]
        assert torch.equal(alone.window_ids[0], batch.window_ids[row, :width]), PROMPTS[row]
        assert batch.loss_mask[row, width:].eq(0).all()
        assert alone.stopped[0] == batch.stopped[row]
        torch.testing.assert_close(alone.gen_logp[0], batch.gen_logp[row, :width], atol=1e-4, rtol=0)


def test_chunked_generation_equals_one_batch(make_generator, tiny_model_dir, encode):
    """generator.batch_size smaller than the number of prompts gives the same greedy rollout as one call."""
    prompts = encode(PROMPTS)
    whole = make_generator(tiny_model_dir, batch_size=256).generate(prompts, GREEDY)
    chunked = make_generator(tiny_model_dir, batch_size=5).generate(prompts, GREEDY)
    assert_same_rollout(chunked, whole, atol=1e-4)


@pytest.mark.parametrize(
    "sampling",
    [
        GREEDY,
        SamplingParams(max_new_tokens=6, temperature=1.0),
        SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9),
        SamplingParams(max_new_tokens=6, temperature=1.6),
    ],
    ids=["greedy", "t1.0", "t0.7-top_p0.9", "t1.6"],
)
def test_generator_logprobs_match_teacher_forced(generator, encode, sampling):
    """The generator's logprobs equal the trainer's teacher-forced logprobs at the same temperature."""
    rollout = generator.generate(encode(PROMPTS) * 2, sampling)
    temperature = 1.0 if sampling.greedy else sampling.temperature
    expected, _ = window_logprobs(generator.model, rollout, temperature)
    torch.testing.assert_close(rollout.gen_logp, expected, atol=1e-4, rtol=0)
    assert rollout.gen_logp.le(0).all() and rollout.gen_logp[rollout.loss_mask.bool()].lt(0).any()


def test_literal_stop_token_ends_responses(make_generator, tiny_model_dir, encode, tokenizer):
    """With stop_token='=', a response ends at its first '=' and is flagged stopped."""
    stop = tokenizer.convert_tokens_to_ids("=")
    rollout = make_generator(tiny_model_dir, stop_token="=").generate(encode(PROMPTS), GREEDY)
    for ids, mask, stopped in zip(rollout.window_ids, rollout.loss_mask, rollout.stopped):
        real = ids[: int(mask.sum())].tolist()
        assert bool(stopped) == (stop in real)
        if stopped:
            assert real.index(stop) == len(real) - 1


@pytest.mark.parametrize("source", ["other_model", "perturbed"])
def test_update_weights_switches_to_new_weights(make_generator, tiny_model_dir, other_model_dir, encode, source):
    """After update_weights(new weights), greedy samples and logprobs are those of the new weights' model."""
    prompts = encode(PROMPTS)
    generator = make_generator(tiny_model_dir)
    if source == "other_model":
        donor = make_generator(other_model_dir)
    else:
        donor = make_generator(tiny_model_dir)
        with torch.no_grad():
            for param in donor.model.parameters():
                param.add_(0.2 * torch.randn_like(param))
    before = generator.generate(prompts, GREEDY)
    target = donor.generate(prompts, GREEDY)
    assert not torch.equal(before.window_ids, target.window_ids), "the new weights should answer differently"

    generator.update_weights(donor.model.state_dict())
    after = generator.generate(prompts, GREEDY)
    assert_same_rollout(after, target, atol=1e-6)
    expected, _ = window_logprobs(donor.model, after, 1.0)
    torch.testing.assert_close(after.gen_logp, expected, atol=1e-4, rtol=0)


def test_the_models_own_generation_config_never_changes_sampling(make_generator, tiny_model_dir, encode, tmp_path):
    """A hub model's generation_config.json (repetition penalty, minimum length) must not alter rollouts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.min_new_tokens = 3
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path)
    prompts = encode(["1+2=", "3+4=", "9+9=", "0+0=", "5+5="])
    plain = make_generator(tiny_model_dir).generate(prompts, SamplingParams(max_new_tokens=6, greedy=True))
    configured = make_generator(str(tmp_path)).generate(prompts, SamplingParams(max_new_tokens=6, greedy=True))
    assert torch.equal(plain.window_ids, configured.window_ids)


def test_sleep_frees_the_weights_and_wake_up_brings_new_ones(make_generator, tiny_model_dir, other_model_dir, encode):
    """Asleep: 0 weight bytes and generating is refused; update_weights wakes it with exactly the new weights."""
    prompts = encode(PROMPTS)
    generator, donor = make_generator(tiny_model_dir), make_generator(other_model_dir)
    held = generator.resident_bytes()
    generator.sleep()
    assert generator.asleep and generator.resident_bytes() == 0 and generator.freed_bytes == held
    with pytest.raises(RuntimeError, match="asleep"):
        generator.generate(prompts, GREEDY)
    generator.update_weights(donor.model.state_dict())
    assert not generator.asleep and generator.resident_bytes() == held
    assert_same_rollout(generator.generate(prompts, GREEDY), donor.generate(prompts, GREEDY), atol=1e-6)
    with pytest.raises(RuntimeError, match="without sleep"):
        generator.wake_up(donor.model.state_dict())


def test_generation_ends_as_soon_as_every_row_has_stopped(make_generator, tiny_model_dir, encode, tokenizer):
    """The model runs once per generated column and no more: when every row has emitted its stop token, generation
    ends instead of running to max_new_tokens."""
    sampling = SamplingParams(max_new_tokens=48, temperature=3.0)
    generator = make_generator(tiny_model_dir)
    calls = []
    hook = generator.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        for seed in range(20):  # the first seed whose samples all stop early (hot sampling reaches EOS quickly)
            torch.manual_seed(seed)
            calls.clear()
            rollout = generator.generate(encode(PROMPTS[:3]), sampling)
            if rollout.stopped.all():
                break
    finally:
        hook.remove()
    assert rollout.stopped.all(), "some seed should stop every row within 48 tokens"
    width = rollout.window_ids.shape[1]
    assert width == int(rollout.action_lengths.max()) < sampling.max_new_tokens
    assert len(calls) == width
