"""Composing an algorithm from registered parts: refused compositions, a user-registered loss, gspo on grpo."""

import math

import pytest
import torch
from torch.testing import assert_close

from algorithm_fixtures import make_algorithm, trajectories
from rlhf import registry
from rlhf.algorithms import PolicyGradient, PolicyLoss, policy_losses, register_policy_loss
from rlhf.config import ConfigError
from rlhf.trajectory import Forward

# --- refused compositions -----------------------------------------------------------------------------


def test_per_token_loss_on_pairs_is_refused():
    """gspo with best_vs_worst: the error names both keys and the pairwise losses to choose from."""
    with pytest.raises(ConfigError) as err:
        make_algorithm(advantage="best_vs_worst", policy_loss="gspo")
    message = str(err.value)
    assert "algorithm.policy_loss=gspo" in message and "algorithm.advantage=best_vs_worst" in message
    assert "algorithm/policy_loss=dpo or ipo" in message


def test_pairwise_loss_on_per_token_advantages_is_refused():
    """dpo with grpo: the error names both keys and the pair-making advantage to choose."""
    with pytest.raises(ConfigError) as err:
        make_algorithm(advantage="grpo", policy_loss="dpo")
    message = str(err.value)
    assert "algorithm.policy_loss=dpo" in message and "algorithm.advantage=grpo" in message
    assert "algorithm/advantage=best_vs_worst" in message


def test_unknown_advantage_lists_the_registered_names():
    with pytest.raises(ConfigError) as err:
        make_algorithm(advantage="nope")
    message = str(err.value)
    assert "'nope'" in message and "algorithm.advantage" in message
    registered = registry.names("advantage")
    assert {"grpo", "rloo", "reinforce", "gae", "rebn"} <= set(registered)
    assert f"Registered: {', '.join(registered)}" in message
    assert "best_vs_worst" not in registered and "pair_selector: best_vs_worst" in message  # a kind of its own, same node


# --- a new loss is one registered function ------------------------------------------------------------


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made in the test vanish after it (built-ins loaded first, so they stay)."""
    registry.names("policy_loss")
    monkeypatch.setattr(registry, "_REGISTRY", {kind: dict(parts) for kind, parts in registry._REGISTRY.items()})


def test_a_registered_loss_is_picked_by_config_and_aggregated(scratch_registry):
    """Reinforce advantages [-1, +1] (scores [1, 3]); the loss -3 * A * logp per token:
    row 0 A=-1, logp [-1, -2] -> [-3, -6]; row 1 A=+1, logp [-0.5] -> [1.5]; token_mean (-3 - 6 + 1.5) / 3 = -2.5."""

    @register_policy_loss("test_only_scaled_reinforce")
    def scaled_reinforce(logp, batch, cfg):
        loss = -3.0 * batch.advantages * logp
        return PolicyLoss(loss, torch.zeros_like(loss, dtype=torch.bool), (logp - batch.old_logp).detach())

    algo = make_algorithm(
        advantage="reinforce", policy_loss="test_only_scaled_reinforce", loss_agg="token_mean", whiten_advantages=False
    )
    assert isinstance(algo, PolicyGradient) and algo.surrogate.obj is scaled_reinforce
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    batch, _ = algo.prepare(trajectories(mask, scores=torch.tensor([1.0, 3.0]), old_logp=torch.zeros(2, 2)))
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 9.0]])
    loss, metrics = algo.policy_loss(batch, Forward(logp), algo.denominator(batch))
    assert_close(loss, torch.tensor(-2.5))
    assert_close(metrics["loss/policy_avg"], torch.tensor(-2.5))


def test_a_loss_that_reads_critic_values_needs_an_advantage_with_a_critic(scratch_registry):
    @register_policy_loss("test_only_value_baseline", needs_critic=True)
    def value_baseline(logp, batch, cfg):
        loss = -(batch.advantages - batch.values) * logp
        return PolicyLoss(loss, torch.zeros_like(loss, dtype=torch.bool), logp.detach() * 0)

    with pytest.raises(ConfigError) as err:
        make_algorithm(advantage="grpo", policy_loss="test_only_value_baseline")
    message = str(err.value)
    assert "algorithm.policy_loss=test_only_value_baseline reads a critic's values" in message
    assert "algorithm.advantage=grpo trains no critic; choose algorithm/advantage=gae" in message
    assert make_algorithm(advantage="gae", policy_loss="test_only_value_baseline").needs_critic


# --- gspo on grpo advantages --------------------------------------------------------------------------


def test_gspo_policy_loss_on_grpo_advantages():
    """G=2, scores [0, 2], no std: A = [-1, +1]. Clip 0.2.

    Row 0 (A=-1): log-ratios [0.1, -0.3], s = e^-0.1 = 0.9048374, loss 0.9048374 per token, unclipped.
    Row 1 (A=+1): log-ratio [0.4], s = e^0.4 = 1.4918247 > 1.2 -> loss -1.2, clipped.
    token_mean: (2 * 0.9048374 - 1.2) / 3 = 0.2032249; clipfrac 1/3; ratio (2 * 0.9048374 + 1.4918247) / 3 = 1.1004998.
    Gradient: -A * s / 3 = 0.3016125 on row 0's tokens, 0 on the clipped row.
    """
    algo = make_algorithm(
        advantage="grpo", policy_loss="gspo", num_samples_per_prompt=2, norm_adv_by_std=False, clip_eps_low=0.2, clip_eps_high=0.2
    )
    assert algo.surrogate.obj is policy_losses.gspo
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    old_logp = torch.tensor([[-1.0, -1.0, 9.0], [-2.0, 9.0, 9.0]])
    batch, _ = algo.prepare(trajectories(mask, 2, scores=torch.tensor([0.0, 2.0]), old_logp=old_logp))
    assert_close(batch.advantages, torch.tensor([[-1.0, -1.0, 0.0], [1.0, 0.0, 0.0]]))
    logp = (old_logp + torch.tensor([[0.1, -0.3, 0.0], [0.4, 0.0, 0.0]])).requires_grad_(True)
    loss, metrics = algo.policy_loss(batch, Forward(logp), algo.denominator(batch))
    assert_close(loss, torch.tensor(0.2032249))
    assert_close(metrics["policy/clipfrac_avg"], torch.tensor(1.0 / 3.0))
    assert_close(metrics["val/ratio"], torch.tensor(1.1004998))
    loss.backward()
    g = math.exp(-0.1) / 3
    assert_close(logp.grad, torch.tensor([[g, g, 0.0], [0.0, 0.0, 0.0]]))


# --- pair selectors and pairwise losses: kinds of their own at the same nodes ---------------------------


def test_pairwise_parts_are_kinds_of_their_own_chosen_at_the_same_nodes():
    assert "dpo" in registry.names("pairwise_loss") and "dpo" not in registry.names("policy_loss")
    assert "best_vs_worst" in registry.names("pair_selector")
    assert registry.kind_of("policy_loss", "dpo") == "pairwise_loss" and registry.kind_of("policy_loss", "gspo") == "policy_loss"
    assert registry.kind_of("advantage", "best_vs_worst") == "pair_selector"
    assert {"dpo", "ipo", "ppo_clip"} <= set(registry.node_names("policy_loss"))


def hinge_without_a_kind(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, cfg):
    """A pairwise loss by import path that does not declare its kind (read as a policy loss)."""
    chosen, rejected = chosen_logp - ref_chosen_logp, rejected_logp - ref_rejected_logp
    return torch.relu(1 - (chosen - rejected)), chosen.detach(), rejected.detach()


def hinge(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, cfg):
    return hinge_without_a_kind(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, cfg)


hinge.kind = "pairwise_loss"


def test_a_pairwise_loss_by_import_path_declares_its_kind():
    """Declared, it composes with a pair selector; undeclared, the refusal says how to declare it."""
    algo = make_algorithm(advantage="best_vs_worst", policy_loss="test_composition.hinge", num_samples_per_prompt=2,
                          reuse_training_logprobs=False)
    assert algo.pairwise and algo.pair_loss.obj is hinge
    with pytest.raises(ConfigError) as err:
        make_algorithm(advantage="best_vs_worst", policy_loss="test_composition.hinge_without_a_kind")
    assert 'declares its kind: `hinge_without_a_kind.kind = "pairwise_loss"`' in str(err.value)


def test_a_kind_the_node_cannot_choose_is_refused(monkeypatch):
    monkeypatch.setattr(hinge, "kind", "reward")
    with pytest.raises(registry.RegistryError, match=r"declares kind='reward'.*declare one of policy_loss, pairwise_loss"):
        registry.kind_of("policy_loss", "test_composition.hinge")
