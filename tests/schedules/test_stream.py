"""The streaming schedule: responses continued across weight pushes, per-token versions, the staleness bounds, the
checkpoint's replay of groups drawn ahead, dynamic sampling, failures, and the config it refuses.

Runs go through `rlhf.train.train` in this process with the built-in tiny model and the HF generator.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from rlhf.config.compose import compose_config
from rlhf.config.validate import validate
from rlhf.data.prompts import PromptExample, PromptStream, epochs_done
from rlhf.errors import ConfigError
from rlhf.functional.staleness import fresh_enough, oldest_version, token_staleness, versions_per_row
from rlhf.generators.base import SamplingParams
from rlhf.registry import register
from rlhf.rewards.failure import RewardUnavailable, Unscored
from rlhf.run import checkpoint
from rlhf.run.build import build_components
from rlhf.run.checkpoint import STATE_FILE
from rlhf.schedules.asynchronous import THREAD_NAME
from rlhf.step.inflight import Group, Row, advance, group_batch
from rlhf.step.learner import Learner
from rlhf.train import train
from rlhf.trajectory import concat, from_completions
from test_async import slow_down

FAST = ["schedule=stream", "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=4", "train.micro_batch_size=16",
        "eval.max_prompts=8", "eval.num_samples=1", "logging.tensorboard=false", "checkpoint.save_final_model=false"]


def run(tmp_path: Path, *overrides: str) -> list[dict]:
    """Train in this process with schedule=stream; the per-step metric records."""
    out = tmp_path / "run"
    train(compose_config([*FAST, *overrides]), out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "async/token_staleness_max" in r]


# --- pure pieces ----------------------------------------------------------------------------------------------


def test_token_versions_by_hand():
    """Trainer at version 5; row 0 sampled at 3, 4, 4 (one pad), row 1 at 5, 5 (two pads), row 2 nothing."""
    versions = torch.tensor([[3, 4, 4, 9], [5, 5, 9, 9], [9, 9, 9, 9]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert token_staleness(versions, 5)[0, :3].tolist() == [2, 1, 1]
    assert versions_per_row(versions, mask).tolist() == [2, 1, 0]
    assert oldest_version(versions, mask)[:2].tolist() == [3, 5]
    assert fresh_enough(versions, mask, 5, None) is mask
    assert fresh_enough(versions, mask, 5, 1).tolist() == [[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert fresh_enough(versions, mask, 5, 0).tolist() == [[0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]


def test_prompt_stream_replays_first_and_round_trips_it():
    examples = [PromptExample(text=str(i), token_ids=(i,), ground_truth=str(i)) for i in range(5)]
    stream = PromptStream(examples, seed=0)
    order = [ex.text for ex in stream.next_batch(3)]
    state = stream.state_dict() | {"replay": [int(order[2]), int(order[1])]}
    assert epochs_done(state) == pytest.approx(1 / 5), "prompts waiting to be replayed are not consumed yet"
    again = PromptStream(examples, seed=0)
    again.load_state_dict(state)
    assert [ex.text for ex in again.next_batch(3)] == [order[2], order[1], stream.next_batch(1)[0].text]
    assert "replay" not in again.state_dict()


def test_concat_pads_per_token_extras_to_the_widest_window(rollout):
    narrow = rollout.select(torch.tensor([0]))
    narrow = from_completions(narrow.input_ids[:, :-2], narrow.attention_mask[:, :-2], narrow.window_ids[:, :2],
                              narrow.loss_mask[:, :2], narrow.gen_logp[:, :2], narrow.stopped)
    wide = rollout.select(torch.tensor([1]))
    parts = [
        type(narrow)(**{**narrow.__dict__, "extras": {"token_versions": torch.tensor([[3, 4]]), "row": torch.tensor([1.0])}}),
        type(wide)(**{**wide.__dict__, "extras": {"token_versions": torch.tensor([[5, 5, 5, 5]]), "row": torch.tensor([2.0])}}),
    ]
    joined = concat(parts, pad_id=0)
    assert joined.extras["token_versions"].tolist() == [[3, 4, 0, 0], [5, 5, 5, 5]]
    assert joined.extras["row"].tolist() == [1.0, 2.0]


# --- responses continued across weight pushes ----------------------------------------------------------------


def teacher_forced_logp(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The model's logprob of each of ``tokens`` after ``prompt`` (and the tokens before it)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_chunked_greedy_decoding_equals_one_decode(make_generator, tiny_model_dir, encode):
    """Continuing each row from its sampled prefix, a token at a time, gives exactly the one-call decode."""
    generator = make_generator(tiny_model_dir)
    prompts = encode(["1+2=", "12+30=", "7"])
    greedy = SamplingParams(10, greedy=True)
    whole = generator.generate(prompts, greedy)
    rows = [Row(tuple(p)) for p in prompts]
    calls = 0
    while not all(row.done(10) for row in rows):
        advance(generator, rows, greedy, chunk=1, version=0)
        calls += 1
    assert calls == max(len(row.tokens) for row in rows) and calls > 1
    for i, row in enumerate(rows):
        n = int(whole.loss_mask[i].sum())
        assert row.tokens == whole.window_ids[i, :n].tolist()
        assert row.stopped == bool(whole.stopped[i])
        assert torch.allclose(torch.tensor(row.logprobs), whole.gen_logp[i, :n], atol=1e-5)


def test_rows_joining_and_leaving_the_batch_decode_as_they_would_alone(make_generator, tiny_model_dir, encode):
    """The hf generator's continuous batch: a row that joins a batch mid-decode (its prompt of another length), one
    left out of a call (its cache dropped, read again later) and one that goes on throughout each end exactly as the
    one-call greedy decode of their prompt alone."""
    generator = make_generator(tiny_model_dir)
    prompts = encode(["1+2=", "12+30=", "7", "45+5=9"])
    greedy = SamplingParams(12, greedy=True)
    alone = [generator.generate([p], greedy) for p in prompts]
    rows = [Row(tuple(p)) for p in prompts]
    advance(generator, rows[:2], greedy, chunk=2, version=0)
    advance(generator, [rows[0], rows[2]], greedy, chunk=3, version=0)  # row 1 left out, row 2 joins
    advance(generator, [rows[0], rows[1], rows[3]], greedy, chunk=1, version=0)  # row 2 left out, row 1 read again
    while not all(row.done(12) for row in rows):
        advance(generator, rows, greedy, chunk=4, version=0)
    for row, one in zip(rows, alone):
        n = int(one.loss_mask[0].sum())
        assert row.tokens == one.window_ids[0, :n].tolist() and row.stopped == bool(one.stopped[0])
        assert torch.allclose(torch.tensor(row.logprobs), one.gen_logp[0, :n], atol=1e-4)


def test_a_chunk_longer_than_any_rows_room_reserves_only_that_room(make_generator, tiny_model_dir, encode):
    """`schedule.chunk_tokens` far past `generator.max_new_tokens`: the slot cache holds the longest row plus the
    tokens its rows may still sample, not plus the chunk (before, 100000 reserved 100000 columns a row: 19.7 GB for
    the stream preset), and the rows decode as with a chunk of their room."""
    generator = make_generator(tiny_model_dir)
    prompts = encode(["1+2=", "12+30="])
    greedy = SamplingParams(6, greedy=True)
    rows = [Row(tuple(p)) for p in prompts]
    advance(generator, rows, greedy, chunk=100_000, version=0)
    columns = generator._continuous.cache_keys[0].shape[2] if generator._continuous.cache_keys else 0
    assert columns <= max(len(p) for p in prompts) + 6 + 64, columns  # the cache rounds its columns up a little
    alone = generator.generate(prompts, greedy)
    for i, row in enumerate(rows):
        assert row.done(6) and row.tokens == alone.window_ids[i, : int(alone.loss_mask[i].sum())].tolist()


def test_a_call_without_rows_lets_every_row_go(make_generator, tiny_model_dir, encode):
    """Asked for no rows, the continuous batch drops what it held; a row asked for later is read from scratch."""
    generator = make_generator(tiny_model_dir)
    row = Row(tuple(encode(["1+2="])[0]))
    advance(generator, [row], SamplingParams(6, greedy=True), chunk=1, version=0)
    assert generator.continue_rows([], SamplingParams(6), 1) == [] and generator._continuous.keys == []
    advance(generator, [row], SamplingParams(6, greedy=True), chunk=6, version=0)
    alone = generator.generate([list(row.prompt)], SamplingParams(6, greedy=True))
    assert row.tokens == alone.window_ids[0, : int(alone.loss_mask[0].sum())].tolist()


def test_the_slot_cache_keeps_its_buffers_across_a_push_and_reads_the_rows_again(make_generator, tiny_model_dir, encode):
    """A push drops the rows in flight but not the preallocated cache; the rows read again under the new weights
    continue as their one-call decode under those weights does."""
    generator = make_generator(tiny_model_dir)
    prompts = encode(["1+2=", "12+30=", "7"])
    greedy = SamplingParams(10, greedy=True)
    rows = [Row(tuple(p)) for p in prompts]
    advance(generator, rows, greedy, chunk=2, version=0)
    buffers = generator._continuous.cache_keys[0]
    generator.update_weights({k: v * 0.9 for k, v in generator.model.state_dict().items()})
    assert generator._continuous.keys == [] and generator._continuous.cache_keys[0] is buffers
    while not all(row.done(10) for row in rows):
        advance(generator, rows, greedy, chunk=3, version=1)
    assert generator._continuous.cache_keys[0] is buffers
    continued = [row for row in rows if len(row.tokens) > 2]
    assert continued, "every row stopped within the first chunk"
    for row in continued:  # the first two tokens are the old weights'; the rest follow from them under the new ones
        prefix = list(row.prompt) + row.tokens[:2]
        rest = generator.generate([prefix], SamplingParams(10 - 2, greedy=True))
        n = int(rest.loss_mask[0].sum())
        assert row.tokens[2:] == rest.window_ids[0, :n].tolist()


def test_a_sliding_window_model_continues_through_generate(make_generator, tokenizer, encode, tmp_path):
    """The slot cache attends over every earlier column, which a sliding-window layer must not: such a model
    continues its rows through `generate` instead, and chunked greedy decoding still equals one call."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    ))
    model.save_pretrained(tmp_path / "sliding")
    tokenizer.save_pretrained(tmp_path / "sliding")
    generator = make_generator(str(tmp_path / "sliding"))
    prompts = encode(["1+2=", "12+30="])
    greedy = SamplingParams(8, greedy=True)
    whole = generator.generate(prompts, greedy)
    rows = [Row(tuple(p)) for p in prompts]
    while not all(row.done(8) for row in rows):
        advance(generator, rows, greedy, chunk=3, version=0)
    assert generator._continuous is None
    for i, row in enumerate(rows):
        assert row.tokens == whole.window_ids[i, : int(whole.loss_mask[i].sum())].tolist()


def test_a_push_between_chunks_samples_the_rest_of_each_response_with_the_new_weights(make_generator, tiny_model_dir, encode):
    """Rows half-sampled by version 0 go on under version 1: the new tokens carry version 1 and the new weights'
    logprobs (teacher-forced on the row's own prefix), the old ones keep version 0 and the old logprobs."""
    generator = make_generator(tiny_model_dir)
    old_model = make_generator(tiny_model_dir).model
    prompts = encode(["1+2=", "12+30=", "7", "5+5="])
    sampling = SamplingParams(12, temperature=1.0)
    rows = [Row(tuple(p)) for p in prompts]
    advance(generator, rows, sampling, chunk=3, version=0)
    first = [len(row.tokens) for row in rows]
    assert all(1 <= n <= 3 for n in first)
    new = {k: v + 0.2 * torch.randn_like(v) for k, v in generator.model.state_dict().items()}
    generator.update_weights(new)
    while not all(row.done(12) for row in rows):
        advance(generator, rows, sampling, chunk=3, version=1)
    continued = [row for row, n in zip(rows, first) if len(row.tokens) > n]
    assert continued, "no row outlived the first chunk"
    for row, n in zip(rows, first):
        assert row.versions == [0] * n + [1] * (len(row.tokens) - n)
        assert len(row.tokens) <= 12
        old = teacher_forced_logp(old_model, list(row.prompt), row.tokens)
        fresh = teacher_forced_logp(generator.model, list(row.prompt), row.tokens)
        sampled = torch.tensor(row.logprobs)
        assert torch.allclose(sampled[:n], old[:n], atol=1e-4)
        assert torch.allclose(sampled[n:], fresh[n:], atol=1e-4)
        if len(row.tokens) > n:
            assert not torch.allclose(sampled[n:], old[n:], atol=1e-3), "the continuation must be the new weights'"


def test_a_row_keeps_only_what_fits_its_limit(make_generator, tiny_model_dir, encode):
    """A chunk larger than a row's room: the row ends at `max_new_tokens`, not stopped."""
    generator = make_generator(tiny_model_dir)
    row = Row(tuple(encode(["1+2="])[0]), tokens=[3] * 9, logprobs=[0.0] * 9, versions=[0] * 9)
    advance(generator, [row], SamplingParams(10, greedy=True), chunk=5, version=2)
    assert len(row.tokens) == 10 and row.versions[-1] == 2
    assert row.done(10)


def test_group_batch_carries_each_tokens_version(encode):
    group = Group.of(7, PromptExample("1+2=", tuple(encode(["1+2="])[0]), "3"), 2)
    group.rows[0].tokens, group.rows[0].logprobs, group.rows[0].versions = [5, 2], [-0.5, -0.1], [4, 5]
    group.rows[1].tokens, group.rows[1].logprobs, group.rows[1].versions = [6], [-1.0], [5]
    group.rows[0].stopped = True
    batch = group_batch(group, pad_id=0)
    assert batch.window_ids.tolist() == [[5, 2], [6, 0]]
    assert batch.loss_mask.tolist() == [[1, 1], [1, 0]]
    assert batch.extras["token_versions"][:, :1].tolist() == [[4], [5]] and batch.extras["token_versions"][0, 1] == 5
    assert batch.stopped.tolist() == [True, False] and batch.group_id.tolist() == [0, 0]


# --- runs -----------------------------------------------------------------------------------------------------


def test_slow_trainer_bounds_every_token_and_tags_its_version(tmp_path, monkeypatch):
    """The generator runs ahead of a slow trainer, one version at most; every token's staleness is within it."""
    slow_down(monkeypatch, Learner, "update", 0.3)
    records = run(tmp_path, "train.num_steps=5", "schedule.chunk_tokens=1")
    assert [r["async/staleness_max"] for r in records][0] == 0
    assert max(r["async/staleness_max"] for r in records) == 1
    assert all(r["async/token_staleness_max"] <= 1 and r["async/policy_version"] == r["step"] - 1 for r in records)
    assert all(0 <= r["stream/occupancy"] <= 1 for r in records)  # 0: nothing left to decode since the last step
    assert any(r["stream/occupancy"] > 0 for r in records)
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]


def test_zero_staleness_is_on_policy(tmp_path, monkeypatch):
    slow_down(monkeypatch, Learner, "update", 0.1)
    records = run(tmp_path, "train.num_steps=4", "schedule.max_staleness=0", "schedule.chunk_tokens=1")
    assert [r["async/token_staleness_max"] for r in records] == [0, 0, 0, 0]
    assert [r["async/versions_per_row"] for r in records] == [1, 1, 1, 1]


def test_token_gap_masks_exactly_the_stale_tokens(tmp_path, monkeypatch):
    """max_token_version_gap=0 with max_staleness=1: each token is 0 or 1 version old, so the masked share is the
    mean token staleness."""
    slow_down(monkeypatch, Learner, "update", 0.3)
    records = run(tmp_path, "train.num_steps=4", "schedule.max_token_version_gap=0", "schedule.chunk_tokens=1")
    assert any(r["async/stale_token_share"] > 0 for r in records)
    for r in records:
        assert r["async/stale_token_share"] == pytest.approx(r["async/token_staleness_mean"])


def test_checkpoint_replays_the_groups_drawn_ahead(tmp_path, monkeypatch):
    """With the trainer slow, the producer has drawn step 3's groups when step 2 is saved: the checkpoint lists
    them to be drawn again, and they are exactly the prompts the uninterrupted run trains at step 3."""
    slow_down(monkeypatch, Learner, "update", 0.4)
    out = tmp_path / "run"
    train(compose_config([*FAST, "train.num_steps=3", "checkpoint.every=2", "checkpoint.keep_last=0"]), out)
    state = json.loads((out / "checkpoints" / "step_00000002" / STATE_FILE).read_text())
    trained = {json.loads(line)["step"]: json.loads(line)["prompts"] for line in (out / "prompts.jsonl").read_text().splitlines()}
    assert state["prompts"]["replay"][:4] == trained[3]


def test_learns_the_builtin_task(tmp_path):
    records_dir = tmp_path / "run"
    train(compose_config(["schedule=stream", "algorithm/rollout_correction=token_tis", "train.num_steps=60",
                          "eval.every=60", "logging.tensorboard=false", "checkpoint.save_final_model=false"]), records_dir)
    rows = {}
    for line in (records_dir / "metrics.jsonl").read_text().splitlines():
        rows.setdefault(json.loads(line)["step"], {}).update(json.loads(line))
    assert rows[60]["eval/greedy_correct_rate"] > rows[0]["eval/greedy_correct_rate"] + 0.2


def test_dynamic_sampling_passes_over_groups_without_a_signal(tmp_path):
    records = run(tmp_path, "algorithm=dapo", "train.num_steps=3", "algorithm.max_resample_rounds=2")
    assert all(0 < r["dynamic_sampling/kept_share"] <= 1 for r in records)
    assert all(r["dynamic_sampling/kept_groups"] <= 4 for r in records)


def test_a_failing_reward_stops_the_run_with_its_error_and_no_thread_left(tmp_path, monkeypatch):
    """Scoring runs in the producer thread: its error reaches the trainer, which stops, and the thread is gone."""
    from rlhf.step.collector import Collector

    original, calls = Collector.score, []

    def breaking(self, repeated, batch, training=True):
        calls.append(1)
        if training and len(calls) > 6:
            raise ValueError("the reward broke")
        return original(self, repeated, batch, training)

    monkeypatch.setattr(Collector, "score", breaking)
    with pytest.raises(ValueError, match="the reward broke"):
        run(tmp_path, "train.num_steps=4", "eval.every=0")
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]


MULTI_TURN = ["env=arith_retry", "model=tiny_arith_retry"]


def test_episodes_go_on_under_new_weights_from_their_next_turn(tmp_path, monkeypatch):
    """Multi-turn under schedule=stream: pushed weights load before each turn's generate call, so a retry is sampled
    by a newer policy than the first answer when a push lands between them. Made sure of by a handshake, event-driven:
    the push ending step v waits until play v + 1 (step v + 1's groups) has sampled its first answers, and that play's
    retries wait for the push. Every token is tagged and bounded, and the run trains."""
    import rlhf.schedules.streaming as streaming
    from rlhf.envs.loop import EpisodeRunner

    act, play, push = EpisodeRunner._act, EpisodeRunner.run, streaming.push_to_generator
    answered = {n: threading.Event() for n in range(1, 7)}  # play n (step n's groups) sampled its first answers
    plays = []

    def producing() -> bool:
        return threading.current_thread().name == THREAD_NAME  # not the probe's or an evaluation's play

    def counted(self, *args, **kwargs):
        if producing():
            plays.append(len(plays) + 1)
        return play(self, *args, **kwargs)

    def retry_after_the_push(self, generator, episodes, live, sampling):
        n = plays[-1] if producing() else 0
        if n > 1 and len(episodes[live[0]].turns) > 1:  # a retry of step n's groups: after the push ending step n - 1
            deadline = time.monotonic() + 60
            while generator.published < n - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        act(self, generator, episodes, live, sampling)
        if n:
            answered[n].set()

    def push_after_the_next_answers(collector, learner, version):
        if version < 5:
            answered[version + 1].wait(timeout=60)
        return push(collector, learner, version=version)

    monkeypatch.setattr(EpisodeRunner, "run", counted)
    monkeypatch.setattr(EpisodeRunner, "_act", retry_after_the_push)
    monkeypatch.setattr(streaming, "push_to_generator", push_after_the_next_answers)
    records = run(tmp_path, *MULTI_TURN, "train.num_steps=5", "eval.every=0")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[0]["async/token_staleness_max"] == 0 and records[0]["async/versions_per_row"] == 1
    assert all(r["async/versions_per_row"] > 1 for r in records[1:])  # every later step: episodes spanning two versions
    assert all(r["async/token_staleness_max"] <= 1 and r["async/policy_version"] == r["step"] - 1 for r in records)
    assert all(r["env/success_rate"] >= 0 and r["stream/tokens_per_s"] >= 0 for r in records)  # env and producer figures
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]


def test_multi_turn_checkpoint_replays_the_groups_played_ahead(tmp_path, monkeypatch):
    """The producer plays step 3's episodes while step 2 trains and saves: the checkpoint lists those tasks to be
    played again on resume, and they are the ones the uninterrupted run trains at step 3."""
    slow_down(monkeypatch, Learner, "update", 0.4)
    out = tmp_path / "run"
    train(compose_config([*FAST, *MULTI_TURN, "train.num_steps=3", "checkpoint.every=2", "checkpoint.keep_last=0", "eval.every=0"]), out)
    state = json.loads((out / "checkpoints" / "step_00000002" / STATE_FILE).read_text())
    trained = {json.loads(line)["step"]: json.loads(line)["prompts"] for line in (out / "prompts.jsonl").read_text().splitlines()}
    assert state["prompts"]["replay"][:4] == trained[3]


def test_episode_rows_carry_each_turns_version():
    """A played episode's window tokens carry the version of the turn they belong to (an observation: the version of
    the action after it); episodes with no versions carry none."""
    from rlhf.envs.loop import Episode, Turn
    from rlhf.envs.rows import episode_rows

    def episode(*versions):
        turns = [Turn("q", [1, 5], [6, 2], [-0.1, -0.2], version=versions[0]),
                 Turn("again", [5, 5, 5], [7, 2], [-0.3, -0.4], version=versions[1])]
        return Episode(group=0, seed=0, task=None, turns=turns)

    batch = episode_rows([episode(3, 4), episode(4, 4)], "sum", pad_id=0)
    assert batch.extras["token_versions"].tolist() == [[3, 3, 4, 4, 4, 4, 4], [4, 4, 4, 4, 4, 4, 4]]
    assert versions_per_row(batch.extras["token_versions"], batch.loss_mask).tolist() == [2, 1]
    assert "token_versions" not in episode_rows([episode(None, None)], "sum", pad_id=0).extras


# --- bad config -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["schedule.max_token_version_gap=-1"], r"schedule.max_token_version_gap=-1 must be >= 0"),
    (["schedule.in_flight=8"], r"schedule.in_flight=8 rows cannot hold one step's groups .* raise it to at least 64"),
    (["schedule.chunk_tokens=0"], r"schedule.chunk_tokens=0 must be >= 1"),
    (["schedule.max_staleness=-1"], r"schedule.max_staleness=-1 must be >= 0"),
    (["env=openai_agent", "env.path=examples/agents/arith_retry.py", "env.chat_template=plain"],
     r"env=openai_agent plays its episodes through an agent loop of its own.*use schedule=async"),
    (["algorithm=remax"], r"algorithm.advantage=remax scores a greedy response"),
    (["algorithm/policy_loss=importance_sampling"], r"unclipped ratio.*rollout_correction=token_tis"),
    (["generator.name=test_stream.PlainGenerator"], r"does not say it continues a response"),
])
def test_bad_config_is_refused_before_any_model_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(["schedule=stream", "train.prompts_per_step=16", "algorithm.num_samples_per_prompt=4", *overrides]))


class PlainGenerator:
    """A generator that says nothing about continuing responses (a user's own)."""

    from rlhf.generators.hf import HfGeneratorConfig as config


def test_importance_sampling_is_accepted_with_a_correction_or_on_policy():
    base = ["schedule=stream", "algorithm/policy_loss=importance_sampling"]
    validate(compose_config([*base, "algorithm/rollout_correction=token_tis"]))
    validate(compose_config([*base, "schedule.max_staleness=0"]))


def test_the_stream_warnings_give_fixes_that_apply_to_the_run():
    """A pairwise algorithm is told to stream on-policy (its node has no rollout correction to add: before, the
    advice was `algorithm/rollout_correction=token_tis`, which Hydra refuses there); a token gap below the staleness
    bound is flagged (before, the stream preset with gap 0 trained on almost no tokens, silently)."""
    from rlhf.schedules.streaming import stream_warnings

    def warnings(*overrides: str, pairwise: bool = False) -> list[str]:
        spec = validate(compose_config(["schedule=stream", *overrides]))
        assert spec.algorithm.pairwise == pairwise
        return stream_warnings(spec)

    (pairs,) = warnings("algorithm=online_dpo", pairwise=True)
    assert "pairwise algorithm (algorithm=online_dpo)" in pairs and "set schedule.max_staleness=0" in pairs
    assert "rollout_correction" not in pairs
    assert warnings("algorithm=online_dpo", "schedule.max_staleness=0", pairwise=True) == []
    (uncorrected,) = warnings()
    assert "add algorithm/rollout_correction=token_tis" in uncorrected
    assert warnings("algorithm/rollout_correction=token_tis") == []
    (gap,) = warnings("algorithm/rollout_correction=token_tis", "schedule.max_staleness=2", "schedule.max_token_version_gap=0")
    assert gap.startswith("schedule.max_token_version_gap=0 is below schedule.max_staleness=2") and "raise the gap to 2" in gap
    assert warnings("algorithm/rollout_correction=token_tis", "schedule.max_staleness=2", "schedule.max_token_version_gap=2") == []


BAD_PROMPTS: set[str] = set()  # prompts whose every row `test_stream_unscored` cannot score


@register("reward", "test_stream_unscored")
def stream_unscored(prompts, responses, ground_truths, **_):
    """`Unscored` for every row of a prompt in BAD_PROMPTS (retries too), else 0.5."""
    return [Unscored("the judge timed out") if prompt in BAD_PROMPTS else 0.5 for prompt in prompts]


def trained_prompts(out: Path) -> dict[int, list[int]]:
    lines = (out / "prompts.jsonl").read_text().splitlines()
    return {json.loads(line)["step"]: json.loads(line)["prompts"] for line in lines}


def test_the_unscored_share_is_a_steps_not_a_groups(tmp_path):
    """A group whose 4 rows are all unscored is a quarter of its step (16 rows): under reward.max_unscored_share=0.25
    the step trains without it (it stopped the run when the share was read per group); two such groups in a step
    (half of it) stop the run, naming the function, with the last complete step saved."""
    unscoring = ["reward.functions=[{name: arith_correct}, {name: test_stream_unscored}]", "reward.unscored_retries=0",
                 "reward.max_unscored_share=0.25", "eval.every=0", "eval.greedy=false", "eval.num_samples=0",
                 "checkpoint.every=1"]
    cfg = compose_config([*FAST, *unscoring])
    c = build_components(validate(cfg))
    try:  # the stream draws one group's prompt at a time, 4 a step
        texts = [c.collector.prompts.next_batch(1)[0].text for _ in range(8)]
        ids = c.collector.prompts.ids_of(texts)
    finally:
        c.close()
    drawn = {1: texts[:4], 2: texts[4:]}
    BAD_PROMPTS.clear()
    BAD_PROMPTS.update(drawn[1][:1])
    records = run(tmp_path / "one_group", *unscoring, "train.num_steps=2")
    first = next(r for r in records if r["step"] == 1)
    assert (first["reward/unscored_rows"], first["reward/unscored_share"], first["reward/unscored_dropped_groups"]) == (4, 0.25, 1)
    assert trained_prompts(tmp_path / "one_group" / "run")[1] == ids[1:4]  # the bad group left its step

    BAD_PROMPTS.clear()
    BAD_PROMPTS.update(drawn[2][:2])
    out = tmp_path / "two_groups" / "run"
    with pytest.raises(RewardUnavailable, match=r"8 of the batch's 16 rows could not be scored, past "
                       r"reward.max_unscored_share=0.25 \(reward function 'test_stream_unscored': 8 rows, first reason: "
                       r"the judge timed out\)"):
        run(tmp_path / "two_groups", *unscoring, "train.num_steps=3")
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_00000001"]
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]
