"""A config key belongs to the component that reads it: setting a key of a component the run did not choose is
refused before anything loads, naming the key and the choice that reads it."""

from __future__ import annotations

import pytest

from rlhf.config import ConfigError, compose_config, validate


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+algorithm.advantage.vf_coef=0.5"], r"algorithm.advantage.vf_coef is not a key of advantage grpo \(its config "
         r"GroupConfig has name, norm_adv_by_std\); it is a key of algorithm/advantage=gae"),
        (["algorithm=ppo", "+algorithm.advantage.norm_adv_by_std=false"], r"algorithm.advantage.norm_adv_by_std .* key of algorithm/advantage=grpo"),
        (["algorithm/policy_loss=gspo", "+algorithm.policy_loss.dual_clip_c=3"], r"algorithm.policy_loss.dual_clip_c .* key of algorithm/policy_loss=ppo_clip"),
        (["+algorithm.kl_ctl.target=3"], r"algorithm.kl_ctl.target .* key of algorithm/kl_ctl=adaptive"),
        (["+algorithm.policy_loss.clip_eps_hihg=0.3"], r"algorithm.policy_loss.clip_eps_hihg .* did you mean algorithm.policy_loss.clip_eps_high\?"),
        (["algorithm=online_dpo", "algorithm.entropy_coef=0.01"], r"algorithm.entropy_coef=0.01 .* per-token \(policy-gradient\) algorithm"),
        (["generator.enable_sleep=true"], r"generator.enable_sleep is not a key of generator hf \(its config HfGeneratorConfig has "
         r"name, max_new_tokens, temperature, top_p, stop_token, batch_size, compile, decode, buckets, graphs, grouped_decode, check_every, share_prompt_prefill\); it is a key of generator=vllm"),
        (["generator=vllm", "generator.batch_size=8"], r"generator.batch_size is not a key of generator vllm .* key of generator=hf"),
        (["generator=vllm", "+generator.compile=true"], r"generator.compile is not a key of generator vllm .* key of generator=hf"),
        (["critic.lr=1e-4"], r"critic.lr=0.0001 .*\(algorithm.advantage=grpo trains no critic\).* algorithm.advantage=gae"),
        (["algorithm.beta=0", "reference.name_or_path=builtin:tiny_arith"], r"reference.name_or_path=.* algorithm.beta > 0"),
        (["reward.normalize=true"], r"reward.normalize=True .* a reward model \(reward.path\)"),
        (["schedule.max_staleness=2"], r"schedule.max_staleness is not a key of schedule sync .* it is a key of schedule=async"),
        (["schedule.offload_optimizer=true"], r"schedule.offload_optimizer is not a key of schedule sync .* key of schedule=hybrid"),
        (["schedule=async", "+schedule.offload_optimizer=true"], r"schedule.offload_optimizer is not a key of schedule async .* key of schedule=hybrid"),
        (["dataset=jsonl", "dataset.path=x.jsonl", "dataset.max_operand=5"], r"dataset.max_operand is not a key of dataset mix .* key of dataset=arith"),
        (["cluster.num_cpus=4"], r"cluster.num_cpus=4 .* cluster.backend=ray"),
        (["policy.lora.alpha=32"], r"^policy.lora.alpha=32.0 is not read by this run's choice \(policy.lora.rank=null trains "
         r"every weight\); it is read by LoRA adapters \(policy.lora.rank set"),  # before: silently ignored
        (["algorithm=ppo", "critic.lora.target_modules=[q_proj]"], r"^critic.lora.target_modules=\['q_proj'\] is not read .*critic.lora.rank set"),
    ],
)
def test_a_key_no_chosen_component_reads_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm=ppo", "algorithm.advantage.vf_coef=0.5", "critic.lr=1e-4"],
        ["algorithm/policy_loss=gspo", "algorithm.policy_loss.clip_eps_low=3e-4", "algorithm.policy_loss.clip_eps_high=4e-4"],
        ["algorithm/advantage=rebn", "algorithm.advantage.gamma=0.9"],
        ["algorithm/kl_ctl=adaptive", "algorithm.kl_ctl.target=3"],
        ["algorithm=online_dpo", "algorithm/policy_loss=ipo", "algorithm.reuse_training_logprobs=true"],
        ["algorithm.reuse_training_logprobs=false"],
        ["generator=vllm", "generator.enable_sleep=true", "schedule=hybrid"],
        ["schedule=async", "schedule.max_staleness=2"],
    ],
)
def test_keys_of_the_chosen_components_are_accepted(overrides):
    validate(compose_config(overrides))


def test_a_users_own_part_without_a_config_class_is_not_second_guessed():
    """An import-path part declares no config class: its node's keys cannot be judged, so none is refused."""
    validate(compose_config(["algorithm.advantage.name=tests.config.test_ownership.my_advantage", "+algorithm.advantage.vf_coef=0.5"]))


def my_advantage(inputs, cfg):
    """A user's advantage estimator (never called here)."""
    return inputs.scores, None
