"""Skipping non-finite optimiser steps: `clip_and_step` and `Learner.train` with a real tiny policy."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from algorithm_nodes import algorithm_cfg
from rlhf.config.schema import CriticConfig
from rlhf.algorithms import build_algorithm
from rlhf.generators.hf import left_pad
from rlhf.training.critic import TorchCritic
from rlhf.training.optim import clip_and_step, make_optimizer
from rlhf.training.policy import TorchPolicy
from rlhf.run.state import NonFiniteError, NonFiniteGuard
from rlhf.step.learner import Learner
from rlhf.trajectory import with_groups
from rlhf.trajectory import Trajectories, from_completions

CPU = torch.device("cpu")
NAN = float("nan")


# --- clip_and_step ------------------------------------------------------------------------------------


def linear_with_optimizer(train_cfg, max_grad_norm: float = 1.0):
    """A 3 -> 2 linear layer with the framework's AdamW (lr 0.1, beta1 0.9) and LR schedule."""
    model = torch.nn.Linear(3, 2)
    optimizer, scheduler = make_optimizer(model, train_cfg(lr=0.1, max_grad_norm=max_grad_norm), 0.1, total_optimizer_steps=10)
    return model, optimizer, scheduler


def backward_once(model: torch.nn.Module, scale: float = 1.0) -> float:
    """Backward a simple loss into the grads; returns their global norm."""
    (scale * model(torch.ones(4, 3)).pow(2).sum()).backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


def optimizer_snapshot(model, optimizer, scheduler) -> dict:
    """Weights, AdamW state, schedule position and LR, cloned."""
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "state": [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()],
        "last_epoch": scheduler.last_epoch,
        "step_count": scheduler._step_count,
        "lr": optimizer.param_groups[0]["lr"],
    }


def assert_snapshots_equal(a: dict, b: dict) -> None:
    """Two optimizer_snapshot results are identical."""
    assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))
    assert [s.keys() for s in a["state"]] == [s.keys() for s in b["state"]]
    assert all(torch.equal(sa[k], sb[k]) for sa, sb in zip(a["state"], b["state"]) for k in sa)
    assert (a["last_epoch"], a["step_count"], a["lr"]) == (b["last_epoch"], b["step_count"], b["lr"])


def test_clip_and_step_with_finite_grads_steps_and_returns_the_preclip_norm(train_cfg):
    """Finite grads: weights move, the schedule advances, grads are cleared, the pre-clip norm is returned."""
    model, optimizer, scheduler = linear_with_optimizer(train_cfg)
    before = optimizer_snapshot(model, optimizer, scheduler)
    norm = backward_once(model, scale=10.0)
    assert norm > 1.0  # so clipping applies
    assert clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0) == pytest.approx(norm, rel=1e-5)
    assert all(not torch.equal(p, w) for p, w in zip(model.parameters(), before["weights"]))
    assert scheduler.last_epoch == before["last_epoch"] + 1
    assert all(p.grad is None for p in model.parameters())
    # AdamW's first moment after one step is (1 - beta1) * the clipped gradient: global norm 0.1 * 1.0
    exp_avg_norm = torch.linalg.vector_norm(torch.stack([optimizer.state[p]["exp_avg"].norm() for p in model.parameters()]))
    assert exp_avg_norm.item() == pytest.approx(0.1, rel=1e-4)


def test_clip_and_step_with_max_grad_norm_zero_does_not_clip(train_cfg):
    """max_grad_norm <= 0 disables clipping: the first moment is (1 - beta1) * the raw gradient."""
    model, optimizer, scheduler = linear_with_optimizer(train_cfg, max_grad_norm=0.0)
    norm = backward_once(model, scale=10.0)
    assert clip_and_step(model, optimizer, scheduler, max_grad_norm=0.0) == pytest.approx(norm, rel=1e-5)
    exp_avg_norm = torch.linalg.vector_norm(torch.stack([optimizer.state[p]["exp_avg"].norm() for p in model.parameters()]))
    assert exp_avg_norm.item() == pytest.approx(0.1 * norm, rel=1e-4)


@pytest.mark.parametrize("bad", [NAN, math.inf], ids=["nan", "inf"])
def test_clip_and_step_with_non_finite_grads_changes_nothing(train_cfg, bad):
    """A NaN/inf gradient: weights, AdamW moments and schedule stay put, grads are cleared, the norm is returned."""
    model, optimizer, scheduler = linear_with_optimizer(train_cfg)
    backward_once(model)
    clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)  # a good step first, so AdamW has state
    before = optimizer_snapshot(model, optimizer, scheduler)
    backward_once(model)
    model.weight.grad[0, 0] = bad
    norm = clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0)
    assert not math.isfinite(norm)
    if bad != bad:  # NaN
        assert math.isnan(norm)
    assert_snapshots_equal(optimizer_snapshot(model, optimizer, scheduler), before)
    assert all(p.grad is None for p in model.parameters())
    # and the next finite step works normally
    backward_once(model)
    assert math.isfinite(clip_and_step(model, optimizer, scheduler, max_grad_norm=1.0))
    assert scheduler.last_epoch == before["last_epoch"] + 1


# --- Learner.train -------------------------------------------------------------------------------------


def make_rollout(tokenizer, pairs: list[tuple[str, str]]) -> Trajectories:
    """Single-turn trajectories of (prompt, response) texts; every response ends with EOS and is right-padded."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    query_ids, query_mask = left_pad([tokenizer(prompt)["input_ids"] for prompt, _ in pairs], pad)
    responses = [tokenizer.convert_tokens_to_ids(list(response)) + [eos] for _, response in pairs]
    width = max(len(r) for r in responses)
    response_ids = torch.tensor([r + [pad] * (width - len(r)) for r in responses])
    response_mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in responses])
    rows = len(pairs)
    return from_completions(
        query_ids, query_mask, response_ids, response_mask, torch.zeros(rows, width), torch.ones(rows, dtype=torch.bool)
    )


# Two prompts x two samples (GRPO groups of 2); scores make every row's advantage non-zero.
PAIRS = [("1+2=", "3"), ("1+2=", "12"), ("4+4=", "80"), ("4+4=", "8")]
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0])


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every weight."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    """Whether two weight copies are identical."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def grad_norm(module: torch.nn.Module) -> float:
    """Global norm of the gradients currently accumulated in ``module``."""
    grads = [p.grad.norm() for p in module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(grads)).item()


class Setup:
    """A real tiny TorchPolicy, a GRPO batch built from PAIRS, and an algorithm whose `policy_loss` can return NaN.

    ``nan_calls`` are 0-based indices of `policy_loss` calls (one per micro batch) that return a NaN policy loss.
    Each call records the policy's weights as they were at that call and, for good calls, its metrics; each
    backward records the global norm of the accumulated gradients (with one micro batch per mini batch, the
    norm `Learner.train` reports for that mini batch).
    """

    def __init__(self, policy_cfg, model_cfg, train, tokenizer, nan_calls=()) -> None:
        self.policy = TorchPolicy(policy_cfg, model_cfg, train, total_optimizer_steps=10, device=CPU)
        self.algorithm = build_algorithm(algorithm_cfg("grpo", num_samples_per_prompt=2, reuse_training_logprobs=False), max_new_tokens=8)  # old logprobs below
        rollout = with_groups(make_rollout(tokenizer, PAIRS), 2)
        with torch.no_grad():
            old_logp, _ = self.policy.logprobs(rollout)
        self.batch, _ = self.algorithm.prepare(replace(rollout, scores=SCORES, old_logp=old_logp))
        assert (self.batch.advantages.abs().sum(dim=1) > 0).all()
        self.nan_calls = set(nan_calls)
        self.weights_at_call: list[dict] = []
        self.good_metrics: list[dict[str, float]] = []
        self.grad_norms: list[float] = []
        self.poison_backward: set[int] = set()  # 0-based backward calls after which one gradient entry is set to NaN
        real_loss, real_backward = self.algorithm.policy_loss, self.policy.backward

        def loss(micro, out, denominator):
            """The real policy loss, multiplied by NaN on the chosen calls."""
            call = len(self.weights_at_call)
            self.weights_at_call.append(weights(self.policy.model))
            policy_loss, metrics = real_loss(micro, out, denominator)
            if call in self.nan_calls:
                return policy_loss * NAN, metrics
            self.good_metrics.append({k: float(v) for k, v in metrics.items()})
            return policy_loss, metrics

        def backward(loss):
            """The real backward (optionally poisoning a gradient), recording the accumulated gradient norm."""
            real_backward(loss)
            if len(self.grad_norms) in self.poison_backward:
                next(self.policy.model.parameters()).grad.view(-1)[0] = NAN
            self.grad_norms.append(grad_norm(self.policy.model))

        self.algorithm.policy_loss = loss
        self.policy.backward = backward
        self.learner = make_learner(self.policy, self.algorithm, train)


def make_learner(policy, algorithm, train, critic=None) -> Learner:
    """A real Learner of ``policy`` (and ``critic``) without a reference, sampling temperature 1, mini batches
    shuffled by seed 0."""
    return Learner(policy, None, critic, algorithm, train, CPU, torch.Generator().manual_seed(0),
                   policy_packs=policy.packs())


def test_nan_mini_batches_change_nothing_and_good_ones_train(policy_cfg, model_cfg, train_cfg, tokenizer):
    """Four one-sample mini batches, the 2nd and 3rd with a NaN loss: only the 1st and 4th move the weights."""
    train = train_cfg(lr=1e-2, num_mini_batches=4, micro_batch_size=1)
    s = Setup(policy_cfg, model_cfg, train, tokenizer, nan_calls={1, 2})
    guard = NonFiniteGuard(max_in_row=3)
    metrics = s.learner.train(s.batch, guard)

    after = [*s.weights_at_call[1:], weights(s.policy.model)]  # weights after each mini batch
    changed = [not same_weights(b, a) for b, a in zip(s.weights_at_call, after)]
    assert changed == [True, False, False, True]
    assert (guard.total, guard.in_row) == (2, 0)
    assert s.policy.scheduler.last_epoch == 2
    assert all(p.grad is None for p in s.policy.model.parameters())

    # every micro batch runs its backward (the finite check is read once per mini batch, with no host sync between
    # micro batches); the NaN mini batches' gradients were dropped, not stepped
    assert len(s.good_metrics) == 2 and len(s.grad_norms) == 4 and all(math.isnan(n) for n in s.grad_norms[1:3])
    expected = {k: sum(m[k] for m in s.good_metrics) / 2 for k in s.good_metrics[0]}
    expected["policy/grad_norm"] = (s.grad_norms[0] + s.grad_norms[3]) / 2
    perf = {k: metrics.pop(k) for k in ("perf/total_num_tokens", "perf/padding_fraction", "perf/prefix_unshared_rows")}
    assert metrics.keys() == expected.keys()
    assert metrics == pytest.approx(expected)
    assert perf["perf/total_num_tokens"] == s.batch.attention_mask.sum().item()
    assert perf["perf/padding_fraction"] == 0.0  # one-row micro batches, trimmed: no padding at all
    assert perf["perf/prefix_unshared_rows"] == 0  # each pair's rows begin with the same prompt


def test_nan_in_a_later_micro_batch_discards_the_earlier_gradients(policy_cfg, model_cfg, train_cfg, tokenizer):
    """One mini batch of two micro batches: a NaN in the 2nd drops the 1st's gradients; nothing moves."""
    train = train_cfg(lr=1e-2, num_mini_batches=1, micro_batch_size=2)
    s = Setup(policy_cfg, model_cfg, train, tokenizer, nan_calls={1})
    before = weights(s.policy.model)
    guard = NonFiniteGuard(max_in_row=3)
    assert s.learner.train(s.batch, guard) == {}
    assert len(s.weights_at_call) == 2 and len(s.grad_norms) == 2  # both ran backward; the check comes after the last
    assert same_weights(weights(s.policy.model), before)
    assert all(p.grad is None for p in s.policy.model.parameters())
    assert s.policy.optimizer.state == {} or all(not st for st in s.policy.optimizer.state.values())
    assert s.policy.scheduler.last_epoch == 0
    assert (guard.total, guard.in_row) == (1, 1)


def test_non_finite_gradient_with_finite_loss_is_skipped(policy_cfg, model_cfg, train_cfg, tokenizer):
    """A finite loss whose gradient turns NaN: the step is skipped, counted, and left out of the metrics."""
    train = train_cfg(lr=1e-2, num_mini_batches=2, micro_batch_size=2)
    s = Setup(policy_cfg, model_cfg, train, tokenizer)
    s.poison_backward = {0}  # the first mini batch's gradient turns NaN after a finite loss
    guard = NonFiniteGuard(max_in_row=3)
    metrics = s.learner.train(s.batch, guard)

    assert math.isnan(s.grad_norms[0]) and math.isfinite(s.grad_norms[1])
    assert same_weights(s.weights_at_call[0], s.weights_at_call[1])  # the poisoned mini batch moved nothing
    assert not same_weights(s.weights_at_call[1], weights(s.policy.model))
    assert (guard.total, guard.in_row) == (1, 0)
    assert s.policy.scheduler.last_epoch == 1
    assert metrics["policy/grad_norm"] == pytest.approx(s.grad_norms[1])
    assert metrics["loss/policy_avg"] == pytest.approx(s.good_metrics[1]["loss/policy_avg"])


def test_too_many_nan_mini_batches_in_a_row_stop_the_update(policy_cfg, model_cfg, train_cfg, tokenizer):
    """Three NaN mini batches in a row with a limit of 3 raise NonFiniteError before any weight moves."""
    train = train_cfg(lr=1e-2, num_mini_batches=4, micro_batch_size=1)
    s = Setup(policy_cfg, model_cfg, train, tokenizer, nan_calls={0, 1, 2})
    before = weights(s.policy.model)
    guard = NonFiniteGuard(max_in_row=3)
    with pytest.raises(NonFiniteError, match="train.max_skipped_steps_in_row=3"):
        s.learner.train(s.batch, guard)
    assert len(s.weights_at_call) == 3  # stopped before the 4th mini batch
    assert same_weights(weights(s.policy.model), before)
    assert guard.total == 3


def test_all_good_mini_batches_with_several_epochs(policy_cfg, model_cfg, train_cfg, tokenizer):
    """Without NaNs every mini batch of every epoch steps, and the guard stays at zero."""
    train = train_cfg(lr=1e-2, num_mini_batches=2, micro_batch_size=2, num_epochs=2)
    s = Setup(policy_cfg, model_cfg, train, tokenizer)
    guard = NonFiniteGuard(max_in_row=1)
    metrics = s.learner.train(s.batch, guard)
    assert len(s.grad_norms) == 4 and s.policy.scheduler.last_epoch == 4
    assert (guard.total, guard.in_row) == (0, 0)
    assert metrics["policy/grad_norm"] == pytest.approx(sum(s.grad_norms) / 4)


def ppo_setup(policy_cfg, model_cfg, train_cfg, tokenizer, tiny_model_dir):
    """(train config, policy, critic, PPO algorithm (GAE with a critic), batch) for one PPO mini batch of the tiny model."""
    train = train_cfg(lr=1e-2, num_mini_batches=1, micro_batch_size=4)
    policy = TorchPolicy(policy_cfg, model_cfg, train, total_optimizer_steps=10, device=CPU)
    critic = TorchCritic(OmegaConf.structured(CriticConfig()), model_cfg, tiny_model_dir, train, total_optimizer_steps=10, device=CPU)
    algorithm = build_algorithm(algorithm_cfg("gae", num_samples_per_prompt=1, reuse_training_logprobs=False), max_new_tokens=8)  # old logprobs: a pass of their own, below
    rollout = with_groups(make_rollout(tokenizer, PAIRS), 1)
    with torch.no_grad():
        old_logp, _ = policy.logprobs(rollout)
        values = critic.values(rollout)
    batch, _ = algorithm.prepare(replace(rollout, scores=SCORES, old_logp=old_logp, values=values))
    return train, policy, critic, algorithm, batch


@pytest.mark.parametrize("poisoned", ["critic", "policy"])
def test_ppo_non_finite_gradient_skips_only_that_model(policy_cfg, model_cfg, train_cfg, tokenizer, tiny_model_dir, poisoned):
    """PPO: a NaN gradient in the critic (or the policy) skips that model's update; the healthy one still steps.

    (Each model clips and steps on its own, as DeepSpeed does internally; a non-finite *loss* skips both, tested below.)"""
    train, policy, critic, algorithm, batch = ppo_setup(policy_cfg, model_cfg, train_cfg, tokenizer, tiny_model_dir)
    owner = critic if poisoned == "critic" else policy
    real_backward = owner.backward

    def poisoned_backward(loss):
        """The real backward, then one NaN gradient entry."""
        real_backward(loss)
        next(owner.model.parameters()).grad.view(-1)[0] = NAN

    owner.backward = poisoned_backward
    before = {"policy": weights(policy.model), "critic": weights(critic.model)}
    guard = NonFiniteGuard(max_in_row=3)
    assert make_learner(policy, algorithm, train, critic).train(batch, guard) == {}
    assert guard.total == 1
    healthy = "policy" if poisoned == "critic" else "critic"
    assert same_weights(weights(owner.model), before[poisoned])
    assert not same_weights(weights((policy if healthy == "policy" else critic).model), before[healthy])


def test_ppo_non_finite_critic_loss_moves_neither(policy_cfg, model_cfg, train_cfg, tokenizer, tiny_model_dir):
    """PPO: a NaN value loss drops the policy's gradients too (the policy accumulated first); neither model moves."""
    train, policy, critic, algorithm, batch = ppo_setup(policy_cfg, model_cfg, train_cfg, tokenizer, tiny_model_dir)
    real_value_loss = algorithm.value_loss
    algorithm.value_loss = lambda micro, out, d: (real_value_loss(micro, out, d)[0] * NAN, {})
    before = {"policy": weights(policy.model), "critic": weights(critic.model)}
    guard = NonFiniteGuard(max_in_row=3)
    assert make_learner(policy, algorithm, train, critic).train(batch, guard) == {}
    assert guard.total == 1
    assert same_weights(weights(policy.model), before["policy"])
    assert same_weights(weights(critic.model), before["critic"])
    assert all(p.grad is None for p in policy.model.parameters())
