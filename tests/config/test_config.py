"""Config composition and validation: presets, bad overrides, comments on every key, snapshots."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from rlhf.config import ConfigError, compose_config, validate
from rlhf import registry
from rlhf.config import schema
from rlhf.config.reference import comments
from algorithm_nodes import PRESET_NEEDS
from rlhf.parts import GROUPS

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
SNAPSHOTS = Path(__file__).parent / "snapshots"


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("experiment", group_options("experiment"))
def test_every_experiment_composes_validates_and_matches_snapshot(experiment):
    """Each preset composes, passes validation, and equals its checked-in composed config.

    Regenerate the snapshots after an intended change with RLHF_UPDATE_SNAPSHOTS=1.
    """
    cfg = compose_config([f"experiment={experiment}"])
    validate(cfg)
    text = OmegaConf.to_yaml(cfg)
    snapshot = SNAPSHOTS / f"{experiment}.yaml"
    if os.environ.get("RLHF_UPDATE_SNAPSHOTS"):
        snapshot.parent.mkdir(exist_ok=True)
        snapshot.write_text(text)
    assert snapshot.exists(), f"no snapshot for {experiment}; run with RLHF_UPDATE_SNAPSHOTS=1"
    assert text == snapshot.read_text(), f"composed config of {experiment} changed; review and regenerate the snapshot"


@pytest.mark.parametrize(
    "group", ["algorithm", "model", "dataset", "generator", "reward", "cluster", "schedule"]
)
def test_every_group_option_composes_and_validates(group):
    """Every option of every group composes with the defaults and validates."""
    needs = {  # options with a required value
        ("reward", "model"): ["reward.path=builtin:tiny_arith"],
        ("model", "custom"): ["model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct"],  # it leaves the model to the user
        ("dataset", "jsonl"): ["dataset.path=prompts.jsonl"],
        ("dataset", "code_jsonl"): ["dataset.path=tasks.jsonl"],
        ("dataset", "parquet"): ["dataset.path=prompts.parquet"],
        ("reward", "reasoning_gym"): ["dataset=reasoning_gym"],  # it scores that dataset's generated problems
        ("cluster", "8gpu_split"): ["train.prompts_per_step=14", "train.micro_batch_size=56"],  # 7 training ranks
        **{("algorithm", preset): overrides for preset, overrides in PRESET_NEEDS.items()},
    }
    for option in group_options(group):
        cfg = compose_config([f"{group}={option}", *needs.get((group, option), [])])
        validate(cfg)
        assert cfg[group] is not None


def test_default_is_grpo_on_the_builtin_task():
    cfg = compose_config()
    assert (cfg.algorithm.name, cfg.algorithm.advantage.name, cfg.algorithm.policy_loss.name) == ("grpo", "grpo", "ppo_clip")
    assert cfg.model.name_or_path == "builtin:tiny_arith"
    assert cfg.dataset.name == "arith"
    assert cfg.cluster.name == "local"


def test_overrides_reach_the_config():
    cfg = compose_config(["algorithm=grpo", "algorithm.num_samples_per_prompt=8", "train.lr=1e-4"])
    assert cfg.algorithm.num_samples_per_prompt == 8
    assert cfg.train.lr == pytest.approx(1e-4)


def test_unknown_key_names_the_key():
    with pytest.raises(ConfigError, match=r"^train.bogus_key is not a config key; remove it"):
        compose_config(["train.bogus_key=1"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["train.lr=fast"])
    cause = err.value.__cause__
    assert isinstance(cause, ValidationError)
    assert "lr" in str(cause)


def test_unknown_group_option_is_an_error_that_lists_the_options():
    with pytest.raises(ConfigCompositionException, match="algorithm") as err:
        compose_config(["algorithm=does_not_exist"])
    assert all(preset in str(err.value) for preset in group_options("algorithm"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.micro_batch_size=48"], r"mini batch \(128 samples per step / 1 train.num_mini_batches = 128\) is not divisible by train.micro_batch_size=48"),
        (["train.num_mini_batches=3"], r"\(16 train.prompts_per_step \* 8 algorithm.num_samples_per_prompt = 128\) is not divisible by train.num_mini_batches=3"),
        (["algorithm=rloo", "algorithm.num_samples_per_prompt=1"], r"algorithm.num_samples_per_prompt must be >= 2 \(got 1\)"),
        (["algorithm.kl_estimator=k7"], r"algorithm.kl_estimator='k7'"),
        (["algorithm.loss_agg=sum"], r"algorithm.loss_agg='sum'"),
        (["algorithm=dapo", "algorithm.filter_on=verdict"], r"algorithm.filter_on='verdict'; choose one of score, accuracy, auto"),
        (["algorithm=dapo", "algorithm.filter_on=accuracy", "reward.functions=[{name: integer_format}]"],
         r"algorithm.filter_on=accuracy keeps groups whose verifiers disagree, and this run has no verifier"),
        (["algorithm.filter_on=accuracy"], r"algorithm.filter_on=accuracy is read only with algorithm.filter_groups=true"),
        (["algorithm/advantage=rebn", "algorithm.advantage.eps=0"], r"algorithm.advantage.eps=0.0 must be > 0"),
        (["generator.temperature=0"], r"generator.temperature=0.0 must be > 0"),
        (["generator.top_p=1.5"], r"generator.top_p=1.5"),
        (["train.lr_schedule=cosine"], r"train.lr_schedule='cosine'"),
        (["seed=-1"], r"seed=-1 must be in \[0, 4294901760\) \(numpy takes no negative seed\)"),
        (["seed=4294967295"], r"seed=4294967295 must be in \[0, 4294901760\)"),
        (["train.warmup_steps=-5"], r"train.warmup_steps=-5 must be >= 0"),
        (["logging.sample_every=-1"], r"logging.sample_every=-1 must be >= 0"),
        (["train.lr=1e38"], r"train.lr=1e\+38 must be in \(0, 1\]: AdamW moves each weight by about lr per step"),
        (["train.lr=inf"], r"train.lr=inf must be in \(0, 1\]"),
        (["train.lr=nan"], r"train.lr=nan must be in \(0, 1\]"),
        (["train.lr=0"], r"train.lr=0.0 must be in \(0, 1\]"),
        (["algorithm=ppo", "critic.lr=-1e-5"], r"critic.lr=-1e-05 must be in \(0, 1\]"),
        (["train.prompts_per_step=0"], r"train.prompts_per_step=0 must be >= 1"),
        (["reward.functions=[]"], r"reward.functions is empty"),
        (["model.dtype=float8"], r"model.dtype='float8'"),
        (["algorithm/rollout_correction=token_tis", "algorithm.rollout_correction.clip=0"], r"algorithm.rollout_correction.clip=0.0 must be > 0"),
        (["algorithm/rollout_correction=icepop", "algorithm.rollout_correction.low=2", "algorithm.rollout_correction.high=2"],
         r"algorithm.rollout_correction.low=2.0 must be >= 0 and below algorithm.rollout_correction.high=2.0"),
        (["algorithm/rollout_correction=token_tis", "algorithm.rollout_correction.name=bogus"],
         r"unknown rollout_correction 'bogus' \(config key `algorithm.rollout_correction.name`\). Registered: geo_reject, icepop, seq_tis, token_tis"),
        (["algorithm/rollout_correction=token_tis", "+algorithm.rollout_correction.low=0.1"],
         r"algorithm.rollout_correction.low is not a key of rollout_correction token_tis.*key of algorithm/rollout_correction=geo_reject or icepop"),
        (["algorithm=online_dpo", "+algorithm/rollout_correction=token_tis"], r"algorithm.rollout_correction=.* is not read by this run's choice \(algorithm.advantage=best_vs_worst, a pairwise algorithm\)"),
        (["algorithm/advantage=remax", "env=arith_retry"], r"algorithm.advantage=remax baselines each prompt with the score of one greedy response"),
        (["algorithm.policy_loss.clip_eps_low=1.5"], r"algorithm.policy_loss.clip_eps_low=1.5 must be <= 1: the ratio is never below 0"),
        (["algorithm/policy_loss=cispo", "algorithm.policy_loss.clip_eps_high=0"], r"algorithm.policy_loss.clip_eps_high=0.0 must be > 0"),
        (["algorithm.policy_loss.clip_eps_high=wide"], r"algorithm.policy_loss.clip_eps_high: Value 'wide' of type 'str' could not be converted to Float \(policy_loss ppo_clip, config PpoClipConfig\)"),
        (["reward.overlong_buffer_len=4"], r"reward.overlong_buffer_len=4 must be >= 1 and below generator.max_new_tokens=4"),
        (["reward.overlong_buffer_len=0"], r"reward.overlong_buffer_len=0 must be >= 1"),
        (["reward.overlong_buffer_len=2", "reward.overlong_penalty_factor=-1"], r"reward.overlong_penalty_factor=-1.0 must be >= 0"),
        (["reward.overlong_penalty_factor=2"], r"reward.overlong_penalty_factor=2.0 is read only with overlong shaping on; set reward.overlong_buffer_len"),
        (["env=arith_retry", "reward.overlong_buffer_len=2"], r"reward.overlong_buffer_len shapes single-turn responses; environment 'arith_retry'"),
        (["algorithm=reinforce", "algorithm.num_samples_per_prompt=1", "algorithm.filter_groups=true"],
         r"algorithm.filter_groups .* algorithm.num_samples_per_prompt >= 2 \(got 1"),
        (["algorithm=online_dpo", "algorithm.filter_groups=true"], r"algorithm.filter_groups .* policy-gradient algorithm.*policy_loss=dpo"),
        (["algorithm.filter_groups=true", "algorithm.max_resample_rounds=-1"], r"algorithm.max_resample_rounds=-1 must be >= 0"),
        (["algorithm.max_resample_rounds=5"], r"algorithm.max_resample_rounds=5 is read only with algorithm.filter_groups=true"),
        (["dataset=reasoning_gym", "dataset.tasks=[bogus]"], r"dataset.tasks: unknown reasoning-gym task\(s\) \['bogus'\]; valid tasks: .*chain_sum"),
        (["dataset=gsm8k", "dataset.ground_truth_format=latex"], r"dataset.ground_truth_format='latex'; choose one of raw, gsm8k, boxed"),
        (["train.max_tokens_per_micro_batch=19"], r"train.max_tokens_per_micro_batch=19 is smaller than the longest row this run can produce \(20 tokens: "
         r"dataset.max_prompt_length \+ generator.max_new_tokens\); raise it to at least 20"),
        (["env=arith_retry", "train.max_tokens_per_micro_batch=31"], r"\(32 tokens: env.max_tokens\)"),
        (["train.max_tokens_per_micro_batch=0"], r"train.max_tokens_per_micro_batch=0 must be >= 1"),
    ],
)
def test_infeasible_config_fails_with_key_and_numbers(overrides, message):
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_derived_sizes_are_computed_not_written_back():
    cfg = compose_config(["train.prompts_per_step=8", "train.num_mini_batches=4", "train.micro_batch_size=8", "train.num_epochs=2"])
    before = OmegaConf.to_yaml(cfg)
    sizes = validate(cfg).sizes
    assert sizes.samples_per_step == 64
    assert sizes.mini_batch_size == 16
    assert sizes.grad_accum_steps == 2
    assert sizes.optimizer_steps == cfg.train.num_steps * 2 * 4
    assert sizes.total_episodes == cfg.train.num_steps * 64
    assert OmegaConf.to_yaml(cfg) == before


def _uncommented_fields(cls_or_module) -> list[str]:
    """Dataclass fields declared in the source of ``cls_or_module`` without a trailing comment (the comments the config
    reference prints, `rlhf.config.reference.comments`)."""
    return [f"{cls}.{name}" for (cls, name), text in comments(inspect.getsourcefile(cls_or_module)).items() if not text]


def test_every_schema_field_has_a_one_line_comment():
    """Each dataclass field in the schema carries a trailing comment (the key's documentation)."""
    missing = _uncommented_fields(schema)
    assert not missing, f"schema fields without a comment: {missing}"


def test_every_part_config_field_has_a_one_line_comment():
    """Each field of every registered part's config class (beside the part's code) carries a trailing comment."""
    modules = set()
    for kind in set(GROUPS.values()):
        for name in registry.names(kind):
            cls = registry.trait(registry.resolve(kind, name), "config", None)
            assert cls is not None, f"{kind} {name} registers no config class"
            modules |= {inspect.getmodule(base) for base in cls.__mro__ if base is not object}
    assert len(modules) >= 5  # parts (advantages, losses, corrections, KL controllers) and rlhf.parts
    missing = [field for module in modules for field in _uncommented_fields(module)]
    assert not missing, f"part config fields without a comment: {missing}"


def test_every_yaml_key_has_a_comment():
    """Each key line in conf/ YAML files carries a comment (on the line, or the line above for blocks)."""
    missing = []
    for path in sorted(CONF.rglob("*.yaml")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            if not stripped or stripped.startswith("#") or ":" not in stripped:
                continue
            if stripped.endswith(":"):
                continue  # a block opener: its children carry the comments
            if "#" not in line:
                missing.append(f"{path.relative_to(ROOT)}:{i + 1}: {stripped}")
    assert not missing, "YAML keys without a comment:\n" + "\n".join(missing)


def test_reward_training_config_composes_and_rejects_unknown_keys():
    cfg = compose_config(config_name="train_reward")
    assert cfg.preferences.name == "arith_prefs" and cfg.model.name_or_path == "builtin:tiny_arith"
    with pytest.raises(ConfigError, match=r"^train.bogus is not a config key"):
        compose_config(["train.bogus=1"], config_name="train_reward")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm=online_dpo", "train.num_mini_batches=3"], r"16 pairs per step \(train.prompts_per_step\) is not divisible by train.num_mini_batches=3"),
        (["algorithm=online_dpo", "train.micro_batch_size=3"], r"train.micro_batch_size=3 counts samples \(2 per pair\)"),
        (["algorithm=online_dpo", "algorithm.policy_loss.beta=0"], r"algorithm.policy_loss.beta=0.0 must be > 0 \(the pair loss's temperature"),
        (["algorithm=online_dpo", "algorithm.beta=0.1"], r"algorithm.beta=0.1 is not read by this run's choice \(algorithm.advantage=best_vs_worst, a pairwise algorithm\)"),
        (["algorithm=ppo", "algorithm.kl_ctl.name=pid"], r"unknown kl_controller 'pid' \(config key `algorithm.kl_ctl.name`\)"),
        (["algorithm=ppo", "+algorithm.policy_loss.dual_clip_c=0.5"], r"algorithm.policy_loss.dual_clip_c=0.5 must be > 1"),
        (["algorithm=ppo", "algorithm.advantage.lam=1.5"], r"algorithm.advantage.lam=1.5 must be in \[0, 1\]"),
        (["reward=model"], r"reward.functions is empty and reward.path is null"),
        (["model.dtype=float16"], r"model.dtype=float16 would train without loss scaling"),
        (["train.mixed_precision=fp8"], r"train.mixed_precision='fp8'; choose one of master, autocast"),
        (["model.logprob_chunk=-1"], r"model.logprob_chunk=-1 must be >= 0 \(0 = plain logits\)"),
        (["cluster.device_memory_gb=nan"], r"cluster.device_memory_gb=nan must be a positive number of GiB"),
        (["cluster.device_memory_gb=-8"], r"cluster.device_memory_gb=-8.0 must be a positive number of GiB"),
        (["cluster=ray_local", "cluster.num_cpus=-4"], r"cluster.num_cpus=-4 must be >= 1"),
        (["algorithm=ppo", "algorithm.advantage.cliprange_value=0"], r"algorithm.advantage.cliprange_value=0.0 must be > 0"),
        (["algorithm/kl_ctl=adaptive", "algorithm.beta=0"], r"algorithm.kl_ctl=adaptive starts from algorithm.beta"),
        (["algorithm/kl_ctl=adaptive", "algorithm.kl_ctl.horizon=0"], r"algorithm.kl_ctl.target=6.0 and algorithm.kl_ctl.horizon=0 must both be > 0"),
        (["train.adam_betas=[0.9,1.5]"], r"train.adam_betas=\[0.9, 1.5\] must hold two numbers in \[0, 1\)"),
        (
            ["algorithm=online_dpo", "algorithm.advantage.name=rlhf.algorithms.advantages.best_vs_worst",
             "algorithm.policy_loss.name=rlhf.algorithms.policy_losses.dpo", "train.num_mini_batches=3"],
            r"16 pairs per step",
        ),
    ],
)
def test_infeasible_algorithm_settings_fail_with_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(overrides))


def test_bf16_on_a_cpu_without_bf16_arithmetic_is_a_config_error(monkeypatch):
    import sys

    checks = sys.modules["rlhf.config.validate"]  # the module (the package re-exports its function `validate`)
    cfg = compose_config(["model.dtype=bfloat16", "cluster.device=cpu"])
    monkeypatch.setattr(checks, "cpu_computes_bf16", lambda: False)
    with pytest.raises(ConfigError, match=r"model.dtype=bfloat16 on cluster.device=cpu: this CPU has no bf16 arithmetic"):
        validate(cfg)
    monkeypatch.setattr(checks, "cpu_computes_bf16", lambda: True)
    validate(cfg)


def test_online_dpo_sizes_count_pairs():
    sizes = validate(compose_config(["algorithm=online_dpo", "train.num_mini_batches=2", "train.micro_batch_size=4"])).sizes
    assert sizes.samples_per_step == 16 * 4
    assert sizes.train_units_per_step == 16
    assert sizes.mini_batch_size == 8 and sizes.grad_accum_steps == 4


@pytest.mark.parametrize(("override", "message"), [
    ("cluster.roles.actor.devices_per_node=4",
     r"cluster\.roles\.actor\.devices_per_node moved to cluster\.roles\.policy\.devices_per_node .*write "
     r"cluster\.roles\.policy\.devices_per_node=4"),
    ("+cluster.roles.ref={num_nodes: 1, devices_per_node: 2}", r"cluster\.roles\.ref moved to cluster\.roles\.reference"),
])
def test_a_key_that_moved_names_its_new_place(override, message):
    with pytest.raises(ConfigError, match=message):
        compose_config(["cluster=ray_local", override])


def test_a_key_that_moved_is_refused_by_the_cli_before_hydra_composes():
    """The real CLI: exit 2 and the new key, not Hydra's "Key 'actor' is not in struct"."""
    done = subprocess.run(
        [sys.executable, "-m", "rlhf.train", "cluster=ray_local", "cluster.roles.actor.devices_per_node=4"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "config error: cluster.roles.actor.devices_per_node moved to cluster.roles.policy.devices_per_node" in done.stderr
    assert "not in struct" not in done.stderr


def test_colocating_a_role_by_its_old_name_says_its_new_one():
    cfg = compose_config(["cluster=ray_local", "cluster.colocate=[[actor,ref]]"])
    with pytest.raises(ConfigError, match=r"cluster\.colocate\[0\] names 'actor' \('actor' is now 'policy'\)"):
        validate(cfg)


@pytest.mark.parametrize("device", ["gpu", "tpu", "cuda:abc", "CUDA"])
def test_an_unknown_cluster_device_is_a_config_error_naming_the_choices(device):
    """Before, `gpu` reached torch.device at the memory plan: exit 6 naming no key (and a traceback from rlhf.plan)."""
    with pytest.raises(ConfigError, match=rf"cluster\.device='{device}'; choose auto .*, cpu, cuda or cuda:N"):
        validate(compose_config([f"cluster.device={device}"]))
    for fine in ("auto", "cpu", "cuda", "cuda:1"):
        validate(compose_config([f"cluster.device={fine}"]))


def test_an_algorithm_without_a_part_another_choice_overrides_is_a_config_error_saying_why():
    """Before, Hydra's "Could not override 'algorithm/rollout_correction'. No match in the defaults list" (and its
    advice to append with `+`, which the ownership check then refuses)."""
    from rlhf.config.compose import check_command_line

    with pytest.raises(ConfigError, match=r"^algorithm/rollout_correction: algorithm=online_dpo has no rollout_correction part "
                                          r".*experiment/stream_count_tiny\.yaml chooses one .* without experiment=stream_count_tiny$"):
        check_command_line(["experiment=stream_count_tiny", "algorithm=online_dpo"])
    with pytest.raises(ConfigError, match=r"remove the override algorithm/rollout_correction=\.\.\., or choose an algorithm"):
        compose_config(["algorithm=online_dpo", "algorithm/rollout_correction=token_tis"])
    check_command_line(["experiment=stream_count_tiny"])  # composes: nothing to say
    check_command_line(["algorithm=online_dpo,grpo", "algorithm/rollout_correction=token_tis"])  # a sweep: Hydra's per job
    with pytest.raises(ConfigError) as other:  # another group: no rollout-correction reason given for it
        compose_config(["algorithm=online_dpo", "algorithm/kl_ctl=adaptive"])
    assert str(other.value).startswith("algorithm/kl_ctl: algorithm=online_dpo has no kl_ctl part to choose")
    assert "rollout correction" not in str(other.value)
    check_command_line(["algorithm=rloo", "x=[1"])  # a malformed override: Hydra's own message when it composes


def test_the_checks_before_hydra_read_only_the_overrides_of_the_command_line():
    """`--cfg job` and the like are Hydra's flags, not overrides (before, `--cfg job generator.enable_sleep=true`
    ended in an OverrideParseException traceback); a flag choosing another primary config turns the checks off."""
    from rlhf.config.compose import command_line_overrides

    assert command_line_overrides(["--cfg", "job", "algorithm=rloo", "-m", "seed=1,2"]) == ["algorithm=rloo", "seed=1,2"]
    assert command_line_overrides(["-c", "all", "-p", "algorithm", "x=1"]) == ["x=1"]
    assert command_line_overrides(["--info", "defaults", "x=1"]) == ["x=1"]
    assert command_line_overrides(["--info", "x=1"]) == ["x=1"]  # --info's value is optional
    assert command_line_overrides(["--config-name", "train_reward", "x=1"]) == []
    assert command_line_overrides(["--config-dir=conf", "x=1"]) == []


def test_the_command_line_check_composes_once_and_names_the_part_for_either_failure(monkeypatch):
    """One composition before Hydra's, whichever checks the overrides call for (a key a part may lack, a part
    group chosen); none for overrides that need neither, or for a sweep. (Before, each check composed on its own.)"""
    import rlhf.config.compose as compose_module

    calls = []
    real = compose_module.compose_config
    monkeypatch.setattr(compose_module, "compose_config", lambda overrides, *rest: calls.append(list(overrides)) or real(overrides, *rest))
    check = compose_module.check_command_line
    check(["--cfg", "job", "algorithm=rloo", "generator.max_new_tokens=4"])  # both kinds of key, composes fine
    assert calls == [["algorithm=rloo", "generator.max_new_tokens=4"]]
    calls.clear()
    check(["train.lr=1e-4", "seed=3", "hydra.run.dir=runs/a"])  # nothing a part could lack, no part chosen, Hydra's own
    check(["-m", "algorithm=rloo,grpo", "generator.enable_sleep=true"])  # a sweep: Hydra's own per job
    assert calls == []
    with pytest.raises(ConfigError, match=r"^generator.enable_sleep is not a key of generator hf"):
        check(["--cfg", "job", "generator.enable_sleep=true"])
    with pytest.raises(ConfigError, match=r"^algorithm/rollout_correction: algorithm=online_dpo has no rollout_correction part"):
        check(["algorithm=online_dpo", "algorithm/rollout_correction=token_tis", "generator.enable_sleep=true"])


@pytest.mark.parametrize(("override", "closest"), [("checkpoint.evry=5", "checkpoint.every"), ("train.num_stepz=3", "train.num_steps"),
                                                   ("model.dtyp=bfloat16", "model.dtype")])
def test_a_misspelt_key_on_the_command_line_names_the_closest_key(override, closest):
    """Before, Hydra's "Key 'evry' is not in struct ... To append to your config use +checkpoint.evry=5", advice that
    the unknown-key check then refused."""
    from rlhf.config.compose import check_command_line

    key = override.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key} is not a config key; did you mean {closest}\?$"):
        check_command_line(["train.lr=1e-4", override])
    with pytest.raises(ConfigError, match=rf"did you mean {closest}\?"):
        compose_config([override])


@pytest.mark.parametrize(("override", "ours"), [
    ("output_dir=/tmp/run", r"hydra.run.dir \(the run's folder"), ("learning_rate=1e-5", "train.lr"),
    ("trainer.total_training_steps=5", "train.num_steps"), ("num_generations=4", "algorithm.num_samples_per_prompt"),
    ("algorithm.kl_coef=0.1", "algorithm.beta"),
    ("max_completion_length=64", "generator.max_new_tokens"),  # a key of the generator's own node
    ("critic.learning_rate=1e-5", "critic.lr"),  # the same name in the key's own section first
    ("eval.learning_rate=1e-5", "train.lr"),  # no lr in its own section: the table's key
])
def test_a_peer_librarys_key_name_is_translated(override, ours):
    """What TRL, OpenRLHF or verl call a key, on our command line: the message names our key. Before, a top-level key
    (`output_dir=...`) got Hydra's advice to add it with `+` (which the unknown-key check then refused), and a key
    under an unknown section (`trainer.total_training_steps`) Hydra's "Key 'trainer' not in 'RunConfig'"."""
    from rlhf.config.compose import check_command_line

    key = re.escape(override.partition("=")[0])
    with pytest.raises(ConfigError, match=rf"^{key} is not a config key; this project calls it {ours}"):
        check_command_line([override])
    with pytest.raises(ConfigError, match=rf"{key} is not a config key \(added with \+\?\); this project calls it {ours}"):
        validate(compose_config(["+" + override]))


@pytest.mark.parametrize("override", ["zzqx=1", "actor_rollout_ref.rollout.n=8"])
def test_an_unknown_key_without_a_likeness_is_named(override):
    """No key is made up: `actor_rollout_ref.rollout.n` once got "did you mean critic.lora.dropout.n?"."""
    from rlhf.config.compose import check_command_line

    key = re.escape(override.partition("=")[0])
    with pytest.raises(ConfigError, match=rf"^{key} is not a config key; remove it \(see `--cfg job` for the keys\)$"):
        check_command_line([override])


def test_keys_under_env_without_an_environment_are_refused():
    """`+env.max_turns=3` with env=none (the default) composed and was read by nothing."""
    with pytest.raises(ConfigError, match=r"^env.step_timeout_s is set but no environment is chosen .* choose one with env=<name>"):
        validate(compose_config(["+env.step_timeout_s=5"]))


def test_model_custom_asks_for_the_model_before_anything_loads():
    cfg = compose_config(["model=custom"])
    with pytest.raises(ConfigError, match=r"^model.name_or_path must be set .* add model.name_or_path=\.\.\. to the command line"):
        validate(cfg)
