"""A part of the user's own brings its config: one module (`user_loss.py`) and one YAML node
(`conf/algorithm/policy_loss/scaled_clip.yaml`) add a policy loss with a key of its own, set from the command line like
any built-in key; bad nodes fail before any model loads, in one paragraph."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import user_loss
from rlhf.algorithms import build_algorithm
from rlhf.config import ConfigError, compose_config, validate
from rlhf.config.moved import check_overrides
from rlhf.train import train

HERE = Path(__file__).parent
SEARCHPATH = f"hydra.searchpath=[file://{HERE / 'conf'}]"  # where the user's YAML nodes are found
FAST = ["train.num_steps=2", "train.prompts_per_step=4", "algorithm.num_samples_per_prompt=4", "train.micro_batch_size=16",
        "eval.every=0", "eval.max_prompts=4", "eval.num_samples=1", "logging.tensorboard=false", "checkpoint.save_final_model=false"]


def test_a_users_loss_with_a_key_of_its_own_trains_two_steps(tmp_path):
    """algorithm/policy_loss=scaled_clip selects the user's node; algorithm.policy_loss.scale=0.25 sets its own key."""
    user_loss.CALLS.clear()
    cfg = compose_config([SEARCHPATH, "algorithm/policy_loss=scaled_clip", "algorithm.policy_loss.scale=0.25", *FAST])
    assert dict(cfg.algorithm.policy_loss) == {"name": "user_loss.scaled_clip", "scale": 0.25}  # clip_eps: its class's default
    train(cfg, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss/policy_avg" in r] == [1, 2]
    assert user_loss.CALLS and set(user_loss.CALLS) == {0.25}


def test_the_users_node_is_typed_and_checked_by_its_class():
    """The class's defaults fill the node; its check and its types speak before any model loads, naming the key."""
    cfg = compose_config([SEARCHPATH, "algorithm/policy_loss=scaled_clip"])
    loss = build_algorithm(cfg.algorithm, 8).surrogate
    assert (loss.config.scale, loss.config.clip_eps) == (0.5, 0.2)
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss.scale=-1.0 must be > 0"):
        validate(compose_config([SEARCHPATH, "algorithm/policy_loss=scaled_clip", "algorithm.policy_loss.scale=-1"]))
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss.clip_eps: Value 'wide' .* \(policy_loss user_loss.scaled_clip"):
        validate(compose_config([SEARCHPATH, "algorithm/policy_loss=scaled_clip", "+algorithm.policy_loss.clip_eps=wide"]))
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss.scael is not a key of policy_loss user_loss.scaled_clip "
                                          r"\(its config ScaledClipConfig has name, scale, clip_eps\); did you mean algorithm.policy_loss.scale\?"):
        validate(compose_config([SEARCHPATH, "algorithm/policy_loss=scaled_clip", "+algorithm.policy_loss.scael=2"]))


def test_a_config_attribute_that_is_not_a_config_class_is_one_paragraph():
    with pytest.raises(ConfigError) as err:
        validate(compose_config([SEARCHPATH, "algorithm/policy_loss=misdeclared"]))
    message = str(err.value)
    assert message.startswith("algorithm.policy_loss.name=user_loss.not_a_config_class: its `config` attribute is {")
    assert "extends rlhf.parts.PartConfig" in message and "\n" not in message


def test_a_check_that_raises_is_one_paragraph():
    with pytest.raises(ConfigError, match=r"^algorithm.policy_loss.name=user_loss.check_raises: CheckRaisesConfig.check raised KeyError: 'limit'$"):
        validate(compose_config([SEARCHPATH, "algorithm/policy_loss=check_raises"]))


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.clip_eps_high=0.28", "algorithm.clip_eps_high moved to algorithm.policy_loss.clip_eps_high (a part's keys sit in "
                                         "its own node); write algorithm.policy_loss.clip_eps_high=0.28"),
        ("algorithm.target_kl=3", "write algorithm.kl_ctl.target=3"),
        ("algorithm.rollout_corr_clip=3", "write algorithm.rollout_correction.clip=3"),
        ("algorithm.gamma=0.9", "write algorithm.advantage.gamma=0.9"),
        ("algorithm.policy_loss=gspo", "algorithm.policy_loss=gspo: a part is chosen as a node, with its own keys; write "
                                       "algorithm/policy_loss=gspo"),
        ("algorithm.kl_ctl=adaptive", "write algorithm/kl_ctl=adaptive"),
        ("algorithm/rollout_correction=null", "a part group is turned off by removing its choice; write ~algorithm/rollout_correction"),
    ],
)
def test_an_old_key_names_its_new_place(override, message):
    """Before Hydra composes: the CLI (`rlhf.train`) and `compose_config` both check the overrides first."""
    with pytest.raises(ConfigError) as err:
        check_overrides([override])
    assert message in str(err.value)
    with pytest.raises(ConfigError):
        compose_config([override])


def test_a_part_group_is_turned_off_by_removing_its_choice():
    cfg = compose_config(["experiment=ppo_tulu3_8b_ultrafeedback", "~algorithm/rollout_correction"])
    assert cfg.algorithm.rollout_correction is None


def test_a_part_a_pairwise_algorithm_does_not_read_is_refused():
    with pytest.raises(ConfigError, match=r"^algorithm.kl_ctl=.* is not read by this run's choice \(algorithm.advantage=best_vs_worst, a pairwise"):
        validate(compose_config(["algorithm=online_dpo", "+algorithm/kl_ctl=adaptive"]))


def test_an_old_key_in_a_yaml_file_names_its_new_place(tmp_path):
    """A user's own experiment file with a flat part key: composing it says where the key went."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "old.yaml").write_text("# @package _global_\nalgorithm:\n  clip_eps_high: 0.28  # old\n")
    with pytest.raises(ConfigError, match=r"^algorithm.clip_eps_high moved to algorithm.policy_loss.clip_eps_high \(a part's keys"):
        compose_config([f"hydra.searchpath=[file://{tmp_path}]", "experiment=old"])


def test_a_part_given_as_a_name_in_a_yaml_file_is_refused_with_the_override_to_write(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "old.yaml").write_text("# @package _global_\nalgorithm:\n  policy_loss: gspo  # old\n")
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss='gspo': a part is chosen as a node now; write algorithm/policy_loss=gspo"):
        validate(compose_config([f"hydra.searchpath=[file://{tmp_path}]", "experiment=old"]))


def test_a_users_strategy_with_a_key_of_its_own_trains_two_steps(tmp_path):
    """policy/strategy=counting selects the user's node (its class by import path); policy.strategy.tag sets its key;
    a key of another strategy is refused naming the ones that declare it."""
    import user_strategy

    user_strategy.STEPS.clear()
    cfg = compose_config([SEARCHPATH, "policy/strategy=counting", "policy.strategy.tag=ours", *FAST])
    assert dict(cfg.policy.strategy) == {"name": "user_strategy.CountingSingle", "tag": "ours"}
    train(cfg, tmp_path / "run")
    assert user_strategy.STEPS == ["ours", "ours"]  # one optimiser step per training step
    with pytest.raises(ConfigError, match=r"policy.strategy.tag must not be empty"):
        validate(compose_config([SEARCHPATH, "policy/strategy=counting", "policy.strategy.tag=''"]))
    with pytest.raises(ConfigError, match=r"policy.strategy.zero_stage is not a key of strategy user_strategy.CountingSingle "
                                          r"\(its config CountingConfig has name, tag\); it is a key of policy/strategy=deepspeed"):
        validate(compose_config([SEARCHPATH, "policy/strategy=counting", "+policy.strategy.zero_stage=3"]))


def test_a_users_strategy_is_planned_and_advised_by_its_class_and_its_keys():
    """The memory plan reads a user's subclass of FSDP2Strategy as fsdp2; the advice offers no key its node lacks."""
    import user_strategy
    from rlhf.parts import Part
    from rlhf.plan.advice import strategy_candidates, with_overrides
    from rlhf.plan.roles import sharding
    from rlhf.training.strategies import FSDP2Config, FSDP2Strategy

    class Sharded(FSDP2Strategy):
        config = FSDP2Config

    shard = sharding(Part(Sharded, FSDP2Config(name="mine.Sharded", offload_params=True), "policy.strategy"), ranks=2)
    assert (shard.strategy, shard.ranks, shard.offload_params, shard.zero_stage) == ("fsdp2", 2, True, 0)
    counting = Part(user_strategy.CountingSingle, user_strategy.CountingConfig(name="user_strategy.CountingSingle"), "policy.strategy")
    assert sharding(counting, ranks=1).strategy == "single"  # a subclass of single
    cfg = compose_config([SEARCHPATH, "policy/strategy=counting"])
    changes = [change for family in strategy_candidates(cfg.policy.strategy, "policy") for change in family]
    assert changes  # as single: shard it, or offload it under fsdp2
    for change in changes:  # a key of another strategy comes only with that strategy's choice
        assert any(o.startswith("policy/strategy=") for o in change) or not any(o.startswith("policy.strategy.") for o in change)
        with_overrides(cfg, change)


def test_a_key_the_users_yaml_node_lacks_gets_hydras_append_advice():
    """The chosen part declares `tag` but the user's YAML node does not hold it: Hydra's `+` advice, not a rename."""
    with pytest.raises(Exception, match=r"\+policy.strategy.tag=x") as caught:
        compose_config([SEARCHPATH, "policy/strategy=counting_bare", "policy.strategy.tag=x"])
    assert "renames" not in str(caught.value)
    assert compose_config([SEARCHPATH, "policy/strategy=counting_bare", "+policy.strategy.tag=x"]).policy.strategy.tag == "x"


def test_a_name_that_imports_something_not_callable_is_refused_naming_the_key():
    """Before, validation passed and step 1 failed with `'int' object is not callable`, exit 6, naming no key."""
    with pytest.raises(ConfigError, match=r"policy_loss 'user_loss.not_a_function' \(config key `algorithm.policy_loss.name`\) "
                                          r"is int 42, not a function or class"):
        validate(compose_config(["algorithm.policy_loss.name=user_loss.not_a_function"]))
    with pytest.raises(ConfigError, match=r"reward 'user_loss.not_a_function' \(config key `reward.functions\[0\].name`\) is int"):
        validate(compose_config(["reward.functions=[{name: user_loss.not_a_function}]"]))


def test_a_loss_without_a_config_class_reads_its_node_by_attribute_from_the_resolved_spec():
    """The spec's typed copy of `algorithm` holds part nodes as dicts; a part that declares no class still gets its
    node as a node (attribute reads), as documented."""
    user_loss.CALLS.clear()
    spec = validate(compose_config(["algorithm.policy_loss.name=user_loss.unclassed_clip", *FAST]))
    loss = build_algorithm(spec.algorithm_keys, 8).surrogate
    assert loss.name == "user_loss.unclassed_clip" and loss.config.clip_eps_low == 0.2
