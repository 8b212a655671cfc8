"""The same RL step under every training strategy, at world size 1 and 2, on CPU (gloo).

AdamW runs with eps 1e-4 so near-zero gradients do not turn float noise into whole sign-sized updates.
One GRPO mini batch of 32 samples (2 micro batches per rank at world size 2) is computed once in this process;
then the single-process policy and each remote strategy take one optimiser step on it. Loss, gradient norm and
updated weights must agree: the framework's loss convention (shares of a global denominator, times the world
size under averaging all-reduce) makes sharded training the same optimisation as one process.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose, max_weight_diff

from rlhf.run.build import build_components
from rlhf.micro_batches import as_budget
from rlhf.step.learner import accumulate_mini
from rlhf.config.validate import validate
from rlhf.micro_batches import Budget, plan

STRATEGIES = [
    ("ddp", 1), ("ddp", 2), ("fsdp2", 1), ("fsdp2", 2),
    ("deepspeed-1", 2), ("deepspeed-2", 1), ("deepspeed-2", 2), ("deepspeed-3", 1), ("deepspeed-3", 2),
]


def strategy_overrides(name: str, ranks: int) -> list[str]:
    base, _, stage = name.partition("-")
    out = [f"policy/strategy={base}", f"cluster.roles.policy.devices_per_node={ranks}", f"cluster.roles.reference.devices_per_node={ranks}"]
    return out + ([f"policy.strategy.zero_stage={stage}"] if stage else [])


@pytest.fixture(scope="module")
def reference_step():
    """(batch, algorithm, denominator, metrics, grad norm, weights after) of one local single-process step."""
    cfg = compose("cluster=local", "train.lr=1e-2", "train.adam_eps=1e-4", "algorithm.beta=0.05", "algorithm.kl_in_reward=false", "algorithm.reuse_training_logprobs=false")
    spec = validate(cfg)
    c = build_components(spec)
    examples = c.collector.prompts.next_batch(cfg.train.prompts_per_step)
    scored = c.collector.collect(examples)
    batch, _ = c.learner.prepare(scored)
    denominator = c.learner.algorithm.denominator(batch)
    finite, metrics, _ = accumulate_mini(c.learner.policy, batch, c.learner.algorithm.policy_loss, denominator, as_budget(8))
    assert finite
    norm = c.learner.policy.optimizer_step()
    weights = {k: v.detach().clone() for k, v in c.learner.policy.state_dict().items()}
    return batch, c.learner.algorithm, denominator, metrics, norm, weights


@pytest.mark.slow
@pytest.mark.parametrize("name,ranks", STRATEGIES, ids=[f"{n}-ws{r}" for n, r in STRATEGIES])
def test_one_rl_step_agrees_with_single_process(started, reference_step, name, ranks):
    batch, algorithm, denominator, metrics, norm, weights = reference_step
    cfg = compose("train.lr=1e-2", "train.adam_eps=1e-4", "algorithm.beta=0.05", "algorithm.kl_in_reward=false", "algorithm.reuse_training_logprobs=false", *strategy_overrides(name, ranks))
    trainer = started.trainer(cfg, ranks)
    finite, remote_metrics, _ = accumulate_mini(trainer, batch, algorithm.policy_loss, denominator, as_budget(8))
    assert finite
    assert remote_metrics["loss/policy_avg"] == pytest.approx(metrics["loss/policy_avg"], abs=1e-6)
    assert remote_metrics["loss/kl_avg"] == pytest.approx(metrics["loss/kl_avg"], abs=1e-6)
    remote_norm = trainer.optimizer_step()
    assert math.isfinite(remote_norm) and remote_norm == pytest.approx(norm, rel=1e-4)
    import ray

    remote_weights = ray.get(trainer.state_dict())
    assert max_weight_diff(remote_weights, weights) < 1e-5
    # the step moved the weights by far more than that tolerance
    assert trainer.lr == pytest.approx(1e-2)


@pytest.mark.slow
def test_a_token_budget_gives_every_rank_as_many_micro_batches(started, reference_step):
    """FSDP2 at world size 2 with micro batches by a token budget under which the two ranks' own plans differ in
    length: the counts are made to agree (else the sharded forwards would wait on each other forever), and the step
    is the same one."""
    batch, algorithm, denominator, metrics, norm, weights = reference_step
    cfg = compose("train.lr=1e-2", "train.adam_eps=1e-4", "algorithm.beta=0.05", "algorithm.kl_in_reward=false", "algorithm.reuse_training_logprobs=false", *strategy_overrides("fsdp2", 2))
    trainer = started.trainer(cfg, 2)
    uneven = batch.select(torch.arange(len(batch) - 1))  # 31 rows: 16 on one rank, 15 on the other
    shares = [uneven.select(torch.arange(*span)) for span in ((0, 16), (16, 31))]
    budget = next(
        (Budget(8, tokens) for tokens in range(int(batch.attention_mask.sum(dim=1).max()), 200)
         if len(plan(shares[0], Budget(8, tokens))) != len(plan(shares[1], Budget(8, tokens)))),
        None,
    )
    assert budget is not None, "some budget should give the two ranks plans of different lengths"
    finite, remote_metrics, _ = accumulate_mini(trainer, batch, algorithm.policy_loss, denominator, as_budget(budget))
    assert finite
    assert remote_metrics["loss/policy_avg"] == pytest.approx(metrics["loss/policy_avg"], abs=1e-6)
    assert trainer.optimizer_step() == pytest.approx(norm, rel=1e-4)
    import ray

    assert max_weight_diff(ray.get(trainer.state_dict()), weights) < 1e-5
    finite, _, _ = accumulate_mini(trainer, uneven, algorithm.policy_loss, denominator, as_budget(budget))
    assert finite  # 16 and 15 rows, each rank's plan of its own length: no collective left waiting
    trainer.zero_grad()


@pytest.mark.slow
def test_deepspeed_offload_and_fsdp2_offload_step_too(started, reference_step):
    """ZeRO-3 with optimiser and parameter offload, and FSDP2 with CPU offload, still give the same step."""
    batch, algorithm, denominator, metrics, norm, weights = reference_step
    for extra in (
        ["policy/strategy=deepspeed", "policy.strategy.zero_stage=3", "policy.strategy.offload_optimizer=true", "policy.strategy.offload_params=true"],
        ["policy/strategy=fsdp2", "policy.strategy.offload_params=true"],
    ):
        cfg = compose("train.lr=1e-2", "train.adam_eps=1e-4", "algorithm.beta=0.05", "algorithm.kl_in_reward=false", "algorithm.reuse_training_logprobs=false", *extra)
        trainer = started.trainer(cfg, 2)
        assert accumulate_mini(trainer, batch, algorithm.policy_loss, denominator, as_budget(8))[0]
        assert trainer.optimizer_step() == pytest.approx(norm, rel=1e-4)
        import ray

        assert max_weight_diff(ray.get(trainer.state_dict()), weights) < 1e-5
