"""Builds every component of a run from its config, in an order that fails cheaply first.

Names are resolved, tokenizers compared and prompts prepared before any model weights load, so a typo
or a vocabulary mismatch costs a second, not a model load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from transformers import AutoConfig

from rlhf import registry
from rlhf.algorithms import build_algorithm
from rlhf.errors import ConfigError
from rlhf.config.schema import ModelConfig
from rlhf.config.spec import RunSpec
from rlhf.data.context import check_episode_budget, check_prompt_budget, check_teacher_context, model_context
from rlhf.data.prompts import PromptExample, PromptStream, origin
from rlhf.distributed.cluster import start
from rlhf.distributed.layout import reference_is_base, used_roles
from rlhf.models.remote_teacher import RemoteTeacher
from rlhf.disk import looks_local
from rlhf.envs.base import EnvConfig, check_prompt_room, seed_tasks
from rlhf.envs.loop import EpisodeRunner
from rlhf.generators.base import SamplingParams
from rlhf.envs.templates import check as check_template
from rlhf.generators.hf import stop_token_id
from rlhf.models.gguf import ModelSourceError
from rlhf.models.lora import AdaptersOff, check_not_adapter
from rlhf.models.loading import (
    check_model_kind, check_model_tokenizer, check_vocab_match, check_weight_files, load_tokenizer, pick_device, resolve_model_path,
)
from rlhf.checks.layers import check_trained_layers
from rlhf.checks.parity import GapWatch
from rlhf.rewards.combine import RewardSet
from rlhf.rewards.model import RewardModelScorer
from rlhf.training.critic import critic_init_path
from rlhf.step.collector import Collector
from rlhf.step.learner import Learner
from rlhf.checks.weight_sync import verified

log = logging.getLogger(__name__)


@dataclass
class Components:
    """What a run is made of: the step's two pieces (`Collector`, `Learner`), the evaluation prompts, and what
    checkpoints and exports reach through them."""

    device: torch.device
    tokenizer: Any
    collector: Collector  # prompts, generator, rewards, environment
    learner: Learner  # policy, reference, critic, algorithm, mini-batch order
    eval_examples: list[PromptExample]
    data_report: dict | None = None  # what dataset loading kept and dropped, per source
    backend: Any | None = None  # the Ray backend's actors and placement groups (cluster.backend=ray)

    def close(self) -> None:
        """Release remote workers and placement groups (a no-op for the local backend), stop an environment's
        endpoint (env=openai_agent) and shut down a local generator engine that asks to be (vLLM)."""
        close_env = getattr(self.collector.env, "close", None)
        if callable(close_env):
            close_env()
        close_generator = getattr(self.collector.generator, "close", None) if self.backend is None else None
        if callable(close_generator):
            close_generator()
        if self.backend is not None:
            self.backend.shutdown()
            self.backend = None


def check_output_rows(model: ModelConfig, tokenizer) -> None:
    """The policy's output layer covers the tokenizer (from the model config, before any weights load; ``model``: the
    typed `model` section, `RunSpec.model`)."""
    config = AutoConfig.from_pretrained(resolve_model_path(model.name_or_path), revision=model.revision, trust_remote_code=model.trust_remote_code)
    rows = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
    if rows is not None and rows < len(tokenizer):
        raise ConfigError(
            f"model.name_or_path={model.name_or_path} has {rows} output rows but its tokenizer has {len(tokenizer)} "
            f"tokens; model.tokenizer must match the model"
        )


KIND_CHECKED = ("model.name_or_path", "reference.name_or_path", "teacher.name_or_path", "reward.path")  # a critic starts from either kind


def check_model_sources(run) -> None:
    """Local model folders exist and built-in names are shipped; hub names were checked by `rlhf.checks.hub`.
    ``run``: the `RunSpec` (or a config), read for its `model`, `reference`, `teacher`, `reward` and `critic` sections."""
    model, teacher = run.model, run.teacher
    for key, value in (
        ("model.name_or_path", model.name_or_path),
        ("model.tokenizer", model.tokenizer),
        ("reference.name_or_path", run.reference.name_or_path),
        ("teacher.name_or_path", None if teacher.url else teacher.name_or_path),  # remote: its tokenizer only
        ("reward.path", run.reward.path),
        ("critic.name_or_path", run.critic.name_or_path),
    ):
        if not value:
            continue
        try:
            path = resolve_model_path(value)
        except (FileNotFoundError, ModelSourceError) as err:
            raise ConfigError(f"{key}: {err}") from None
        if looks_local(path) and key != "model.tokenizer":
            check_not_adapter(key, value, path)
        if looks_local(path) and not (Path(path).expanduser() / "config.json").is_file() and key != "model.tokenizer":
            raise ConfigError(f"{key}={value} is not a model folder (no config.json there); give a hub name or a saved model folder")
        if looks_local(path) and not Path(path).expanduser().is_dir():
            raise ConfigError(f"{key}={value} is not a folder; give a hub name or a saved tokenizer folder")
        if looks_local(path) and key in KIND_CHECKED:
            check_model_kind(key, value, Path(path).expanduser())
        if key != "model.tokenizer":
            check_weight_files(value, key)  # a truncated weights file: named now, not as a loader traceback later


def build_components(spec: RunSpec, push: bool = True) -> Components:
    """Every component the run ``spec`` describes, models placed and loaded. ``push``: hand the policy's starting
    weights to the generator (the verified first push); a resumed run leaves that to the checkpoint's weights, loaded
    after this, so the generator never reloads weights it is about to replace."""
    sizes, env, teacher = spec.sizes, spec.env, spec.teacher
    device = pick_device(spec.cluster.device) if spec.cluster.backend == "local" else torch.device("cpu")  # ray: the driver only does the RL math
    check_model_sources(spec)
    # 1. names: every registry lookup, so an unknown component fails before anything loads
    roles = {"policy": spec.policy, "reference": spec.reference, "critic": spec.critic}  # the spec's parts (dataset, generator, environment) resolved theirs
    for role, section in roles.items():
        registry.resolve(role, section.name, key=f"{role}.name")
    env_factory = registry.resolve("env", env.name, key="env.name") if env is not None else None
    rewards = RewardSet(spec.reward, spec.max_new_tokens)
    algorithm = build_algorithm(spec.algorithm_keys, spec.max_new_tokens)  # the Learner's own: it keeps state as it trains (an adaptive KL)
    # 2. tokenizers and data (cheap); every other model must share the policy's vocabulary
    model, gen = spec.model, spec.generator.config
    tokenizer = load_tokenizer(model.tokenizer or model.name_or_path, model.revision, model.trust_remote_code)
    check_model_tokenizer(model, tokenizer)
    stop_token_id(tokenizer, gen.stop_token)  # the generator's stop token is one of the vocabulary's
    for key, path, used in (
        ("reference.name_or_path", spec.reference.name_or_path, algorithm.needs_reference),
        ("teacher.name_or_path", teacher.name_or_path, True),
        ("reward.path", spec.reward.path, True),
        ("critic.name_or_path", spec.critic.name_or_path, algorithm.needs_critic),
    ):
        if path and used:
            try:
                check_vocab_match(tokenizer, load_tokenizer(path), f"policy `{model.name_or_path}`", f"`{path}`")
            except ValueError as err:
                raise ConfigError(f"{key}: {err}") from None
    runner = build_env(env_factory, env, gen.stop_token, tokenizer, rewards) if env_factory is not None else None
    try:
        if runner is not None and not runner.maker.uses_dataset:
            splits = seed_tasks(getattr(runner.maker, "env_id", env.name), env.eval_size)  # reset seeds replace the dataset
        else:
            dataset = OmegaConf.structured(spec.dataset.config)  # typed by the builder's class, defaults filled
            splits = spec.dataset.obj(cfg=dataset, tokenizer=tokenizer, seed=spec.seed)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    log.info("dataset %s: %d train prompts, %d eval prompts", spec.dataset.name, len(splits.train), len(splits.eval))
    if not splits.train:
        raise ConfigError(
            f"dataset={spec.dataset.name}: no training prompts are left ({len(splits.eval)} went to evaluation; the log "
            f"above counts the rows dropped as bad or too long); add rows, or lower dataset.eval_holdout / "
            f"dataset.eval_size"
        )
    missing_truth = sum(ex.ground_truth is None for ex in splits.train + splits.eval)
    if rewards.verifiers and missing_truth and (runner is None or runner.maker.uses_dataset):
        raise ConfigError(
            f"reward functions {rewards.verifiers} check answers against a ground truth, but {missing_truth} prompts "
            f"carry none; set dataset.ground_truth_key=<column> or choose other reward.functions"
        )
    if runner is None or runner.maker.uses_dataset:
        examples = splits.train + splits.eval
        rewards.check_truths([ex.ground_truth for ex in examples], [origin(ex, i) for i, ex in enumerate(examples)])
    check_output_rows(model, tokenizer)
    check_trained_layers(spec)
    context = model_context(model)
    if runner is None or runner.maker.uses_dataset:  # a prompt plus its response must fit the model's context
        check_prompt_budget(spec.dataset.config.max_prompt_length, spec.max_new_tokens, context, model.name_or_path)
    if runner is not None:  # so must a whole episode
        check_episode_budget(env.max_tokens, context, model.name_or_path)
    if teacher.name_or_path:  # and the teacher must have room for every row it scores
        check_teacher_context(sizes.longest_row, model_context(model, teacher.name_or_path), teacher.name_or_path,
                              sizes.longest_row_keys)
    if runner is not None and runner.maker.uses_dataset and (full := check_prompt_room(splits.train, env.max_tokens)):
        log.warning("%d of %d training prompts fill env.max_tokens=%d: their episodes will fail; raise env.max_tokens",
                    full, len(splits.train), env.max_tokens)
    # 3. models
    if spec.cluster.backend == "ray":
        models, backend = build_remote_models(spec, algorithm, tokenizer)
        log.info("placed on Ray: %s", ", ".join(f"{role} x{len(group)}" for role, group in backend.groups.items()))
    else:
        models, backend = build_local_models(spec, algorithm, tokenizer, device), None
    if teacher.url:  # a remote teacher: no weights here, its logprobs asked of teacher.url
        models["teacher"] = RemoteTeacher(teacher)
    if models["reward"] is not None:
        rewards.model = models["reward"]
    policy, generator = models["policy"], verified(models["generator"], spec.checks.weight_sync)
    if callable(describe := getattr(policy, "describe", None)):
        log.info("%s", describe())
    packs = getattr(policy, "packs", None)  # a registered policy of the user's may not say: counted as padded
    if push:
        generator.update_weights(policy.state_dict())
    prompts = PromptStream(splits.train, seed=spec.seed)
    prompts.warn_if_short(spec.train.prompts_per_step)  # at the start, whichever schedule draws
    keys = spec.algorithm_keys
    collector = Collector(
        generator, tokenizer, rewards, prompts, SamplingParams.of(gen),
        prompts_per_step=spec.train.prompts_per_step, samples_per_prompt=keys.num_samples_per_prompt,
        max_resample_rounds=keys.max_resample_rounds if keys.filter_groups else None,
        greedy_baseline=algorithm.needs_greedy_baseline, env=runner, filter_on=filter_on(spec, rewards),
        min_group=getattr(algorithm, "min_samples_per_prompt", 1), max_unscored_share=spec.reward.max_unscored_share,
    )
    learner = Learner(
        policy, models["reference"], models["critic"], algorithm, spec.train, device, torch.Generator().manual_seed(spec.seed), GapWatch.of(spec), bool(packs()) if callable(packs) else False,
        teacher=models["teacher"],
    )
    return Components(device, tokenizer, collector, learner, splits.eval, splits.report, backend)


def filter_on(spec: RunSpec, rewards: RewardSet) -> str:
    """What dynamic sampling compares within a group: `algorithm.filter_on`, auto resolved (accuracy when a verifier
    scores single-turn responses, else score)."""
    chosen = spec.algorithm_keys.filter_on
    if chosen == "auto":
        chosen = "accuracy" if rewards.has_verifier and spec.env is None else "score"
    return chosen


def build_model(role: str, spec: RunSpec, device: torch.device, tokenizer=None):
    """The component of ``role`` (policy, reference, teacher, critic, reward, generator) on ``device``, from the run's
    typed sections (``spec``): each local model, and what every Ray worker builds for its rank (the spec is shipped
    to it). ``tokenizer`` (the generator's) is loaded when not given."""
    model, train, steps = spec.model, spec.train, spec.sizes.optimizer_steps
    temperature = spec.generator.config.temperature
    if role == "policy":
        return registry.build(
            "policy", spec.policy.name, key="policy.name", cfg=spec.policy, model_cfg=model, train_cfg=train,
            total_optimizer_steps=steps, device=device, temperature=temperature,
        )
    if role == "critic":
        return registry.build(
            "critic", spec.critic.name, key="critic.name", cfg=spec.critic, model_cfg=model,
            init_path=critic_init_path(spec), train_cfg=train, total_optimizer_steps=steps, device=device,
        )
    if role == "reference":
        return registry.build(
            "reference", spec.reference.name, key="reference.name", cfg=spec.reference, model_cfg=model, device=device,
            temperature=temperature,
        )
    if role == "teacher":  # frozen, scores like the reference: its own weights, the policy's dtype
        return registry.build("reference", "frozen", key="teacher", cfg=spec.teacher, model_cfg=model, device=device,
                              temperature=temperature)
    if role == "reward":
        return RewardModelScorer(spec.reward, model.dtype, device, train.micro_batch_size)
    if role == "generator":
        if tokenizer is None:
            tokenizer = load_tokenizer(model.tokenizer or model.name_or_path, model.revision, model.trust_remote_code)
        return spec.generator.obj(cfg=spec.generator.config, model_cfg=model, tokenizer=tokenizer, device=device)
    raise ValueError(f"unknown role {role!r}")


def build_env(factory, env: EnvConfig, stop_token: str, tokenizer, rewards: RewardSet) -> EpisodeRunner:
    """The environment maker and its agent loop (``env``: the typed `env` node, `RunSpec.env`; ``stop_token``:
    `generator.stop_token`); the maker checks its own keys (ids, files) before any model loads."""
    maker = factory(cfg=env, tokenizer=tokenizer, rewards=rewards)
    stop_id = stop_token_id(tokenizer, stop_token)
    check_template(env.template, tokenizer, tokenizer.convert_ids_to_tokens(stop_id))
    runner = getattr(maker, "runner", EpisodeRunner)  # an environment may bring its own loop (openai_agent: an endpoint)
    return runner(maker, env, tokenizer, stop_id)


def build_local_models(spec: RunSpec, algorithm, tokenizer, device) -> dict[str, Any]:
    """Every model the run ``spec`` uses, in this process, on ``device``."""
    built = {role: build_model(role, spec, device, tokenizer) for role in used_roles(spec, algorithm)}
    if "reference" not in built and algorithm.needs_reference:
        built["reference"] = AdaptersOff(built["policy"])
    elif "reference" not in built:
        log.info("reference model not loaded: algorithm.beta=0 disables the KL term")
    if "critic" in built:
        log.info("critic initialised from %s", critic_init_path(spec))
    return {
        "policy": built["policy"], "reference": built.get("reference"), "critic": built.get("critic"),
        "reward": built.get("reward"), "generator": built["generator"], "teacher": built.get("teacher"),
    }


def build_remote_models(spec: RunSpec, algorithm, tokenizer) -> tuple[dict[str, Any], Any]:
    """Every model as Ray workers placed per `cluster.roles` / `cluster.colocate` (rlhf.distributed.cluster)."""
    backend, handles = start(spec, algorithm, int(tokenizer.pad_token_id), build_model)
    reward = None
    if handles["reward"] is not None:
        reward = RewardModelScorer(spec.reward, spec.model.dtype, torch.device("cpu"), spec.train.micro_batch_size, handles["reward"].raw_scores)
    reference = AdaptersOff(handles["policy"]) if algorithm.needs_reference and reference_is_base(spec) else handles["reference"]
    models = {"policy": handles["policy"], "reference": reference, "critic": handles["critic"], "reward": reward,
              "generator": handles["generator"], "teacher": handles["teacher"]}
    return models, backend
