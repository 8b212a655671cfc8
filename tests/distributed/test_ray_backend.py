"""The Ray backend on a local cluster: placement, weight push, failures that end the run promptly, checkpoints."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest
import ray
import torch
from conftest import compose, max_weight_diff

from rlhf.run import checkpoint
from push_faults import inject_push_faults
from rlhf.algorithms import build_algorithm
from rlhf.run.build import build_components, build_model
from rlhf.errors import ConfigError
from rlhf.config.spec import resolve
from rlhf.config.validate import validate
from rlhf.distributed.cluster import start
from rlhf.distributed.remote import WorkerError
from rlhf.generators.hf import HFGenerator
from rlhf.models.loading import load_tokenizer
from rlhf.run.state import RunState
from rlhf.schedules.sync import train_step
from rlhf.checks.weight_sync import WeightSyncError

pytestmark = pytest.mark.slow


def algorithm_of(cfg):
    return build_algorithm(cfg.algorithm, cfg.generator.max_new_tokens)


def placements(run) -> dict[str, list[dict]]:
    """Each role's ranks' ping answers (placement group id, assigned resources)."""
    return {role: ray.get([actor.ping.remote() for actor in group.actors]) for role, group in run.groups.items()}


def test_colocated_roles_share_bundles_and_split_roles_do_not(ray_cluster):
    cfg = compose("algorithm=ppo", "algorithm.num_samples_per_prompt=4", "cluster.colocate=[[policy,reference],[critic]]")
    run, handles = start(resolve(cfg), algorithm_of(cfg), 0, build_model)
    try:
        where = placements(run)
        assert set(where) == {"policy", "reference", "critic", "generator"}
        for rank in range(2):
            actor, ref = where["policy"][rank], where["reference"][rank]
            assert actor["placement_group"] == ref["placement_group"]  # colocated: one placement group of 2 slots ...
            assert actor["resources"]["CPU"] == ref["resources"]["CPU"] == pytest.approx(0.5)  # ... each rank half a slot
        groups = {where[role][0]["placement_group"] for role in ("policy", "critic", "generator")}
        assert len(groups) == 3  # split roles: a placement group each
        assert where["critic"][0]["resources"]["CPU"] == pytest.approx(1.0)
        assert len({p["pid"] for ranks in where.values() for p in ranks}) == 7  # one process per rank and role
    finally:
        run.shutdown()
    assert ray.is_initialized()  # the session's cluster was not ours to stop


def test_infeasible_layout_fails_up_front_with_the_arithmetic(ray_cluster):
    cfg = compose("cluster.roles.policy.devices_per_node=4", "cluster.roles.reference.devices_per_node=4", "cluster.roles.generator.devices_per_node=5")
    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"needs 9 CPU .*policy\+reference: 1 node\(s\) x 4 = 4; generator: 1 node\(s\) x 5 = 5.* offers 8"):
        start(resolve(cfg), algorithm_of(cfg), 0, build_model)
    assert time.monotonic() - began < 10
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )


def test_killed_training_worker_fails_the_call_naming_role_and_rank(started):
    cfg = compose("cluster.timeout_s=60")
    trainer = started.trainer(cfg, 2)
    pid = ray.get(trainer.group.actors[1].ping.remote())["pid"]
    os.kill(pid, signal.SIGKILL)
    began = time.monotonic()
    with pytest.raises(WorkerError, match=r"policy rank 1 died"):
        trainer.optimizer_step()
    assert time.monotonic() - began < 30


def test_exception_inside_a_worker_names_role_rank_and_error(started):
    trainer = started.trainer(compose(), 2)
    with pytest.raises(WorkerError, match=r"policy rank \d failed in rollout_logprobs: AttributeError: 'NoneType' object"):
        trainer.group.call_all("rollout_logprobs", None, 1)  # no batch: the method itself raises on the rank


def test_a_hung_collective_fails_after_cluster_timeout_s(started):
    """Rank 0 alone enters FSDP2's all-gather, which rank 1 never joins: the call fails within the timeout, never hangs.
    Start-up and model load have their own generous budget, so a loaded machine does not trip the short one."""
    cfg = compose("cluster.timeout_s=4", "cluster.setup_timeout_s=600", "policy/strategy=fsdp2")
    trainer = started.trainer(cfg, 2)
    began = time.monotonic()
    with pytest.raises(WorkerError, match=r"policy rank\(?s?\)? \[?0"):
        trainer.group.call("state_dict", {0: ()})
    assert time.monotonic() - began < 30


def sync_components(*overrides: str):
    cfg = compose("algorithm.beta=0", "train.lr=5e-2", *overrides)
    return cfg, build_components(validate(cfg))


def test_generator_samples_from_the_pushed_weights_not_stale_ones(ray_cluster):
    """After each step the engines hold the trainer's new weights: greedy output equals a local generator loaded
    with the gathered weights, the generator's logprobs equal the trainer's, and both moved away from the start."""
    cfg, c = sync_components("policy/strategy=fsdp2")
    try:
        prompts = [list(ex.token_ids) for ex in c.eval_examples[:16]]
        greedy = replace(c.collector.sampling, greedy=True)
        before = c.collector.generator.generate(prompts, greedy)
        state = RunState()
        for _ in range(3):
            metrics, _ = train_step(c.collector, c.learner, state.guard)
        assert metrics["val/generator_logprob_diff"] < 1e-4  # sampled by the weights the trainer scored with
        assert c.learner.policy_packs and metrics["perf/padding_fraction"] == 0.0  # the remote policy said it packs
        after = c.collector.generator.generate(prompts, greedy)
        local = HFGenerator(cfg.generator, cfg.model, load_tokenizer(cfg.model.name_or_path), torch.device("cpu"))
        local.update_weights(ray.get(c.learner.policy.state_dict()))
        expected = local.generate(prompts, greedy)
        assert torch.equal(after.window_ids, expected.window_ids)
        assert not torch.equal(after.window_ids, before.window_ids)
    finally:
        c.close()


def test_two_remote_engines_continue_streamed_rows_and_a_stale_push_to_them_stops_the_run(ray_cluster, monkeypatch):
    """Two remote hf engines, started once for both checks:
    - schedule=stream's rows: each row returns to the engine holding its KV cache (key % engines), rows join and leave
      between calls, and every row ends as the one-call greedy decode of its prompt on a local generator with the
      same weights.
    - checks.weight_sync: both engine ranks report what they hold, rank 0 computes what they should hold from the
      pushed Ray reference, and a push that never reached them stops the run naming the step."""
    cfg, c = sync_components("cluster.roles.generator.devices_per_node=2")
    try:
        streamed_rows_end_as_one_call_decodes(cfg, c)
        inject_push_faults(monkeypatch, stale_push=2)
        state = RunState()
        train_step(c.collector, c.learner, state.guard)
        assert len(c.collector.generator.weight_fingerprints()) == 2  # verified on both ranks after step 1
        with pytest.raises(WeightSyncError, match=r"push after step 2: the generator \(engine worker 0 of 2\) holds a different"):
            train_step(c.collector, c.learner, state.guard)
    finally:
        c.close()


def streamed_rows_end_as_one_call_decodes(cfg, c) -> None:
    """Rows advanced through ``c``'s engines in chunks, rows 0 and 1 leaving and 4 and 5 joining between calls, end
    as a local generator's one-call greedy decodes of their prompts (the engines hold the starting weights)."""
    from rlhf.step.inflight import Row, advance

    prompts = [list(ex.token_ids) for ex in c.eval_examples[:6]]
    greedy = replace(c.collector.sampling, greedy=True, max_new_tokens=6)
    rows = [Row(tuple(p)) for p in prompts]
    advance(c.collector.generator, rows[:4], greedy, chunk=1, version=0)
    advance(c.collector.generator, rows[2:], greedy, chunk=2, version=0)  # rows 0 and 1 leave, 4 and 5 join
    while not all(row.done(6) for row in rows):
        advance(c.collector.generator, rows, greedy, chunk=1, version=0)
    local = HFGenerator(cfg.generator, cfg.model, load_tokenizer(cfg.model.name_or_path), torch.device("cpu"))
    alone = local.generate(prompts, greedy)
    for i, row in enumerate(rows):
        assert row.tokens == alone.window_ids[i, : int(alone.loss_mask[i].sum())].tolist()


ARITH_RETRY = ("env=arith_retry",)
OPENAI_AGENT = ("env=openai_agent", "env.path=examples/agents/arith_retry.py", "env.chat_template=plain", "env.max_turns=2", "env.max_tokens=32")


@pytest.mark.parametrize("env", [ARITH_RETRY, OPENAI_AGENT], ids=["arith_retry", "openai_agent"])
def test_episodes_play_on_ray_with_two_generator_ranks_on_the_trainers_weights(ray_cluster, env):
    """Multi-turn episodes on Ray, played by the agent loop (env=arith_retry) or by OpenAI-SDK agents through the
    endpoint in the driver (env=openai_agent): each turn's requests are split over two engines; the logprobs they
    sampled with are the trainer's (the weights pushed after every step reached both ranks)."""
    cfg, c = sync_components(*env, "model=tiny_arith_retry", "cluster.roles.generator.devices_per_node=2")
    try:
        state = RunState()
        for _ in range(2):
            metrics, scored = train_step(c.collector, c.learner, state.guard)
            assert metrics["env/num_episodes"] == 32 and metrics["env/failed_episodes"] == 0
            assert metrics["val/generator_logprob_diff"] < 1e-4
            if env is OPENAI_AGENT:
                assert metrics["env/generate_calls"] < metrics["env/generated_rows"]  # requests share generate calls
        assert 1.0 <= metrics["env/num_turns_per_episode"] <= 2.0 and any("[user]" in r for r in scored.responses)
    finally:
        c.close()


def test_a_distillation_teacher_runs_as_its_own_ray_role(ray_cluster):
    """experiment=opd_arith_tiny on Ray: the teacher is a role of its own (two replicas splitting the rows), its
    logprobs equal a local copy's, and the student's reverse KL to it is logged."""
    from rlhf.models.reference import FrozenReference

    cfg, c = sync_components("experiment=opd_arith_tiny", "cluster.roles.teacher.devices_per_node=2")
    try:
        assert c.backend.groups["teacher"] and len(c.backend.groups["teacher"].actors) == 2
        metrics, scored = train_step(c.collector, c.learner, RunState().guard)
        assert metrics["distill/reverse_kl"] > 0 and metrics["distill/teacher_logprob"] < 0
        local = FrozenReference(cfg.teacher, cfg.model, torch.device("cpu"), cfg.generator.temperature)
        batch = scored.batch
        torch.testing.assert_close(c.learner.teacher.rollout_logprobs(batch, 64), local.rollout_logprobs(batch, 64), atol=1e-5, rtol=0)
    finally:
        c.close()


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed"])
def test_checkpoint_round_trip_through_the_workers(ray_cluster, tmp_path, strategy):
    """Saving writes the gathered weights as a HF folder; loading restores the weights the trainer had then."""
    cfg, c = sync_components(f"policy/strategy={strategy}")
    try:
        state = RunState()
        train_step(c.collector, c.learner, state.guard)
        saved = ray.get(c.learner.policy.state_dict())
        path = checkpoint.save(c.collector, c.learner, tmp_path, 1, state.to_dict(), keep_last=0)
        assert (path / "policy" / "model" / "model.safetensors").is_file()
        train_step(c.collector, c.learner, state.guard)
        assert max_weight_diff(ray.get(c.learner.policy.state_dict()), saved) > 1e-4  # training moved on
        checkpoint.load(c.collector, c.learner, path)
        assert max_weight_diff(ray.get(c.learner.policy.state_dict()), saved) == 0.0
    finally:
        c.close()
