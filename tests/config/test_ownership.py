"""A config key belongs to the component that reads it: setting a key of a component the run did not choose is
refused before anything loads, naming the key and the choice that reads it."""

from __future__ import annotations

import pytest

from rlhf.config import ConfigError, compose_config, validate


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.vf_coef=0.5"], r"algorithm.vf_coef=0.5 is not read by this run's choice \(algorithm.advantage=grpo, "
         r"algorithm.policy_loss=ppo_clip\); it is read by algorithm.advantage=gae"),
        (["algorithm=ppo", "algorithm.norm_adv_by_std=false"], r"algorithm.norm_adv_by_std=False .* read by algorithm.advantage=grpo"),
        (["algorithm.policy_loss=gspo", "algorithm.dual_clip_c=3"], r"algorithm.dual_clip_c=3.0 .* read by algorithm.policy_loss=ppo_clip"),
        (["algorithm.target_kl=3"], r"algorithm.target_kl=3.0 .* read by algorithm.kl_ctl=adaptive"),
        (["algorithm=online_dpo", "algorithm.entropy_coef=0.01"], r"algorithm.entropy_coef=0.01 .* per-token \(policy-gradient\) algorithm"),
        (["generator.enable_sleep=true"], r"generator.enable_sleep=True is not read by this run's choice \(generator.name=hf\); "
         r"it is read by generator.name=vllm"),
        (["generator=vllm", "generator.batch_size=8"], r"generator.batch_size=8 .* read by generator.name=hf"),
        (["critic.lr=1e-4"], r"critic.lr=0.0001 .*\(algorithm.advantage=grpo trains no critic\).* algorithm.advantage=gae"),
        (["algorithm.beta=0", "reference.name_or_path=builtin:tiny_arith"], r"reference.name_or_path=.* algorithm.beta > 0"),
        (["reward.normalize=true"], r"reward.normalize=True .* a reward model \(reward.path\)"),
        (["schedule.max_staleness=2"], r"schedule.max_staleness=2 .* read by schedule.name=async"),
        (["schedule.offload_optimizer=true"], r"schedule.offload_optimizer=True .* read by schedule.name=hybrid"),
        (["dataset=jsonl", "dataset.path=x.jsonl", "dataset.max_operand=5"], r"dataset.max_operand=5 .* read by dataset.name=arith"),
        (["cluster.num_cpus=4"], r"cluster.num_cpus=4 .* cluster.backend=ray"),
    ],
)
def test_a_key_no_chosen_component_reads_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm=ppo", "algorithm.vf_coef=0.5", "critic.lr=1e-4"],
        ["algorithm.policy_loss=gspo", "algorithm.clip_eps_low=3e-4", "algorithm.clip_eps_high=4e-4"],
        ["algorithm.advantage=rebn", "algorithm.gamma=0.9"],
        ["algorithm.kl_ctl=adaptive", "algorithm.target_kl=3"],
        ["algorithm=online_dpo", "algorithm.policy_loss=ipo", "algorithm.reuse_training_logprobs=true"],
        ["algorithm.reuse_training_logprobs=false"],
        ["generator=vllm", "generator.enable_sleep=true", "schedule=hybrid"],
        ["schedule=async", "schedule.max_staleness=2"],
    ],
)
def test_keys_of_the_chosen_components_are_accepted(overrides):
    validate(compose_config(overrides))


def test_a_users_own_part_without_declared_keys_is_not_second_guessed():
    """An import-path part declares no `config_keys`: its section's keys cannot be judged, so none is refused."""
    validate(compose_config(["algorithm.advantage=tests.config.test_ownership.my_advantage", "algorithm.vf_coef=0.5"]))


def my_advantage(inputs, cfg):
    """A user's advantage estimator (never called here)."""
    return inputs.scores, None
