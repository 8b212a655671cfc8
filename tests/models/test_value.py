"""Value models: loading and head init, per-token and last-token scores, the critic, frozen reward models."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch.testing import assert_close
from transformers import LlamaForSequenceClassification

from rlhf import registry
from rlhf.config.schema import CriticConfig, RewardConfig
from rlhf.functional import masked_mean
from rlhf.training.critic import TorchCritic
from rlhf.models.loading import load_causal_lm
from rlhf.training.policy import TorchPolicy
from rlhf.models.value import ValueModule, init_score_head, load_value_model, score_head, sequence_scores, token_scores, window_values
from rlhf.rewards.model import RewardModelScorer

CPU = torch.device("cpu")


def unpadded(rollout, row: int) -> tuple[torch.Tensor, int]:
    """(prompt + response ids of one row without any padding, shape (1, L); the prompt's length)."""
    start = rollout.window_start  # single-turn rows: the prompt columns, then the response (the window)
    query = rollout.input_ids[row, :start][rollout.attention_mask[row, :start].bool()]
    response = rollout.window_ids[row][rollout.loss_mask[row].bool()]
    return torch.cat([query, response]).unsqueeze(0), len(query)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> list[str]:
    """Names of parameters that differ from the snapshot."""
    return [name for name, p in model.named_parameters() if not torch.equal(before[name], p.detach())]


# --- head init and loading ----------------------------------------------------------------------------


def test_init_score_head_draws_with_std_one_over_sqrt_hidden_plus_one():
    """init_score_head draws weights with std 1 / sqrt(hidden + 1) and zeroes the bias."""
    # A seeded Linear with 99 * 4000 weights and hidden 99: empirical std 1 / sqrt(100) = 0.1 within 1%,
    # mean ~0, bias all zeros.
    torch.manual_seed(0)
    head = torch.nn.Linear(99, 4000)
    torch.nn.init.constant_(head.bias, 5.0)
    init_score_head(head, hidden_size=99)
    assert head.weight.std().item() == pytest.approx(0.1, rel=0.01)
    assert abs(head.weight.mean().item()) < 1e-3
    assert torch.equal(head.bias, torch.zeros(4000))


def test_load_value_model_from_causal_lm_adds_a_new_head(tiny_model_dir):
    """From a causal-LM folder: a one-output classifier, new head std ~ 1/sqrt(hidden + 1), same backbone."""
    # From a causal-LM folder: a one-output sequence classifier whose new head has std ~ 1 / sqrt(64 + 1) = 0.124
    # (HF's own init would give 0.02) and whose backbone equals the causal LM's.
    model = load_value_model(tiny_model_dir)
    assert isinstance(model, LlamaForSequenceClassification) and model.config.num_labels == 1
    name, head = score_head(model)
    assert name == "score" and head.weight.shape == (1, 64)
    assert 0.09 < head.weight.std().item() < 0.16  # 64 draws: the sample std is within ~25% of 0.124
    assert head.bias is None or torch.equal(head.bias, torch.zeros(1))
    backbone = load_causal_lm(tiny_model_dir).model.state_dict()
    for key, value in model.model.state_dict().items():
        assert torch.equal(value, backbone[key]), key


def test_load_value_model_turns_dropout_off(save_llama, tmp_path):
    """Dropout in the checkpoint's config is zeroed: train-mode forwards repeat exactly."""
    # A checkpoint with attention_dropout 0.5 loads with 0 in the config, no active Dropout, and repeatable
    # forward passes in train mode.
    folder = save_llama(tmp_path, seed=0, attention_dropout=0.5)
    model = load_value_model(folder)
    assert model.config.attention_dropout == 0.0
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    model.train()
    ids = torch.randint(4, 16, (2, 6))
    first = token_scores(model, ids, torch.ones_like(ids), torch.arange(6).expand(2, 6))
    second = token_scores(model, ids, torch.ones_like(ids), torch.arange(6).expand(2, 6))
    assert torch.equal(first, second)


def test_load_value_model_keeps_a_saved_head(tiny_model_dir, tmp_path):
    """A saved sequence-classification folder loads its own head, whatever the RNG state: not re-initialised."""
    model = load_value_model(tiny_model_dir)
    with torch.no_grad():
        score_head(model)[1].weight.copy_(torch.linspace(-1.0, 1.0, 64).unsqueeze(0))
    model.save_pretrained(tmp_path)
    for seed in (0, 1):
        torch.manual_seed(seed)
        loaded = load_value_model(str(tmp_path))
        assert torch.equal(score_head(loaded)[1].weight, torch.linspace(-1.0, 1.0, 64).unsqueeze(0))


def test_score_head_without_a_head_is_an_error():
    """A module with none of the known head names is a ValueError listing them."""
    with pytest.raises(ValueError, match="score"):
        score_head(torch.nn.Module())


# --- scores -------------------------------------------------------------------------------------------


def test_token_scores_shape(reward_model_dir, rollout):
    """One float score per position of prompt + response."""
    model = load_value_model(reward_model_dir)
    input_ids, attention_mask, position_ids = rollout.model_inputs()
    scores = token_scores(model, input_ids, attention_mask, position_ids)
    assert scores.shape == input_ids.shape and scores.dtype == torch.float32


def test_sequence_scores_pick_the_last_real_token(reward_model_dir, rollout):
    """With left-padded prompts and right-padded responses, each row's score equals scoring it alone, unpadded."""
    model = load_value_model(reward_model_dir)
    input_ids, attention_mask, _ = rollout.model_inputs()
    with torch.no_grad():
        batched = sequence_scores(model, input_ids, attention_mask)
        alone = [sequence_scores(model, ids, torch.ones_like(ids)) for ids, _ in (unpadded(rollout, i) for i in range(3))]
    assert batched.shape == (3,)
    assert_close(batched, torch.cat(alone), atol=1e-5, rtol=0)
    assert (batched[1:] - batched[:-1]).abs().min() > 1e-4  # distinct rows, so a wrong index would show


def test_window_values_align_with_response_tokens(reward_model_dir, rollout):
    """values[:, t] is the head at the token before response token t; 0 outside the mask."""
    # values[:, t] is the head at the token before response token t (alone: position len(prompt) - 1 + t);
    # exactly 0 outside the response mask.
    model = load_value_model(reward_model_dir)
    with torch.no_grad():
        values = window_values(ValueModule(model), rollout)
        assert values.shape == rollout.window_ids.shape
        for i in range(3):
            ids, prompt_len = unpadded(rollout, i)
            alone = token_scores(model, ids, torch.ones_like(ids), torch.arange(ids.shape[1]).unsqueeze(0))[0]
            length = int(rollout.loss_mask[i].sum())
            assert_close(values[i, :length], alone[prompt_len - 1 : prompt_len - 1 + length], atol=1e-5, rtol=0)
    assert torch.equal(values[rollout.loss_mask == 0], torch.zeros(int((rollout.loss_mask == 0).sum())))


# --- critic and frozen reward model -------------------------------------------------------------------


def make_critic(model_cfg, train_cfg, init_path: str, **critic_overrides) -> TorchCritic:
    """A CPU TorchCritic with AdamW at lr 1e-2 (unless the critic config says otherwise)."""
    cfg = OmegaConf.structured(CriticConfig(**critic_overrides))
    return TorchCritic(cfg, model_cfg, init_path, train_cfg(lr=1e-2), total_optimizer_steps=10, device=CPU)


def critic_step(critic: TorchCritic, rollout) -> None:
    """One backward + optimizer step pulling every value towards 1."""
    values = critic.values(rollout)
    critic.backward(masked_mean((values - 1.0) ** 2, rollout.loss_mask))
    critic.optimizer_step()


def test_critic_is_registered_and_its_values_carry_gradients(model_cfg, train_cfg, tiny_model_dir, rollout):
    """`torch` builds TorchCritic; values are (B, T), differentiable, 0 outside the mask, in train mode."""
    assert registry.resolve("critic", "torch") is TorchCritic
    critic = make_critic(model_cfg, train_cfg, tiny_model_dir)
    values = critic.values(rollout)
    assert critic.model.training
    assert values.shape == rollout.window_ids.shape and values.requires_grad
    assert values[rollout.loss_mask == 0].eq(0).all()


def test_critic_learning_rate(model_cfg, train_cfg, tiny_model_dir):
    """critic.lr null uses train.lr (1e-2 here); a set critic.lr wins."""
    assert make_critic(model_cfg, train_cfg, tiny_model_dir).optimizer.param_groups[0]["lr"] == 1e-2
    assert make_critic(model_cfg, train_cfg, tiny_model_dir, lr=3e-3).optimizer.param_groups[0]["lr"] == 3e-3


def test_critic_step_changes_critic_weights_only(policy_cfg, model_cfg, train_cfg, reward_model_dir, rollout):
    """Critic and policy steps move only their own weights; the frozen reward model never moves."""
    # A critic step moves critic weights, leaves the policy (weights and pending grads) alone; a policy step
    # leaves the critic alone; the frozen reward model's scores never move.
    policy = TorchPolicy(policy_cfg, model_cfg, train_cfg(lr=1e-2), total_optimizer_steps=10, device=CPU)
    critic = make_critic(model_cfg, train_cfg, reward_model_dir)  # initialised from the reward model, as open-instruct's PPO does
    scorer = RewardModelScorer(OmegaConf.structured(RewardConfig(path=reward_model_dir)), "float32", CPU, 8)
    assert not any(p.requires_grad for p in scorer.model.parameters())
    reward_before = scorer.raw_scores(rollout)
    policy_before, critic_before = snapshot(policy.model), snapshot(critic.model)

    logp, _ = policy.logprobs(rollout)
    policy.backward(-logp.sum())
    policy_grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    critic_step(critic, rollout)
    assert changed(critic_before, critic.model)
    assert changed(policy_before, policy.model) == []
    assert all(torch.equal(p.grad, policy_grads[n]) for n, p in policy.model.named_parameters() if n in policy_grads)
    assert all(p.grad is None for p in critic.model.parameters())

    critic_after = snapshot(critic.model)
    policy.optimizer_step()
    assert changed(policy_before, policy.model)
    assert changed(critic_after, critic.model) == []
    assert_close(scorer.raw_scores(rollout), reward_before, atol=0, rtol=0)
    assert all(p.grad is None for p in scorer.model.parameters())


def test_critic_training_moves_values_towards_the_target(model_cfg, train_cfg, tiny_model_dir, rollout):
    """A few steps on (V - 1)^2 lower that loss: the critic learns."""
    critic = make_critic(model_cfg, train_cfg, tiny_model_dir)

    def loss() -> float:
        with torch.no_grad():
            return masked_mean((critic.values(rollout) - 1.0) ** 2, rollout.loss_mask).item()

    start = loss()
    for _ in range(3):
        critic_step(critic, rollout)
    assert loss() < start
    assert math.isfinite(loss())


def test_a_reward_model_without_a_trained_head_is_refused(tiny_model_dir):
    """Scoring with a freshly initialised head would be silent nonsense: a reward model must bring its head."""
    with pytest.raises(ValueError, match="has no trained `score` head"):
        load_value_model(tiny_model_dir, new_head_ok=False)
