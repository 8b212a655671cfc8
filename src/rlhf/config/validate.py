"""Checks that need more than types; `validate` runs them all and returns the resolved run (`RunSpec`).

Everything here runs before any model or tokenizer loads, so a bad run fails in a second with the key
and the arithmetic in the message. Derived sizes are returned in the spec (and logged), never written back into the
config.
"""

from __future__ import annotations

import math
import re

from omegaconf import DictConfig, OmegaConf

from rlhf import registry
from rlhf.errors import require as _require
from rlhf.parts import choose
from rlhf.rewards.combine import check_args
from rlhf.config.env_checks import check_env
from rlhf.config.generation_checks import check_generation
from rlhf.config.ownership import check_ownership
from rlhf.config.schema import AlgorithmConfig, RewardConfig
from rlhf.config.sizes import check_token_budget, derive_sizes
from rlhf.config.spec import RunSpec, choose_parts, spec_of
from rlhf.config.unknown_keys import check_unknown_keys
from rlhf.data.reasoning_gym import check_reasoning_gym
from rlhf.distributed.layout import validate_cluster
from rlhf.functional.losses import LOSS_AGGREGATIONS
from rlhf.models.dtypes import DTYPES, cpu_computes_bf16
from rlhf.models.lora import check_values as check_lora_values
from rlhf.seeding import check_seed
from rlhf.tracking.checks import check_logging
from rlhf.training.optim import check_lr
from rlhf.checks.weight_sync import MODES as WEIGHT_SYNC_MODES
from rlhf.web import is_http_url

RAY_MIN_OBJECT_STORE = 75 * 1024 * 1024  # bytes: Ray refuses a smaller object store (ray_constants)

KL_ESTIMATORS = ("k1", "k2", "k3")
LR_SCHEDULES = ("constant", "linear")
MIXED_PRECISION = ("master", "autocast")  # train.mixed_precision


def check_self_checks(checks) -> None:
    """`checks.*`: a known weight-sync mode and thresholds in range."""
    _require(
        checks.weight_sync in WEIGHT_SYNC_MODES,
        f"checks.weight_sync={checks.weight_sync!r}; choose one of {', '.join(WEIGHT_SYNC_MODES)}",
    )
    _require(checks.parity_prompts >= 0, f"checks.parity_prompts={checks.parity_prompts} must be >= 0 (0 skips the gate)")
    _require(
        checks.max_logprob_gap is None or checks.max_logprob_gap > 0,
        f"checks.max_logprob_gap={checks.max_logprob_gap} must be > 0, or null for the default of model.dtype",
    )
    _require(
        checks.gap_jump_factor > 1,
        f"checks.gap_jump_factor={checks.gap_jump_factor} must be > 1 (a step's gap is compared with this many times "
        f"the running level)",
    )


FILTER_ON = ("score", "accuracy", "auto")  # `algorithm.filter_on`


def _is_verifier(name: str) -> bool:
    """Whether the reward function registered (or importable) as ``name`` is a verifier."""
    return bool(getattr(registry.resolve("reward", name, key="reward.functions"), "is_verifier", False))


def check_required_keys(cfg: DictConfig) -> None:
    """ConfigError naming every key a preset leaves for the user to set (`???`), e.g. model=custom's model.name_or_path."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    _require(not missing, f"{', '.join(missing)} must be set (the chosen presets leave {'them' if len(missing) > 1 else 'it'} to you): "
             f"add {' '.join(f'{key}=...' for key in missing)} to the command line")


def check_device(cluster) -> None:
    """`cluster.device`: auto, cpu, cuda or cuda:N."""
    _require(
        re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(cluster.device)) is not None,
        f"cluster.device={cluster.device!r}; choose auto (CUDA when present, else the CPU), cpu, cuda or cuda:N "
        f"(cluster.device_type, for the Ray backend's roles, is the key that takes gpu)",
    )


def check_algorithm(cfg: DictConfig, algorithm) -> None:
    """`algorithm.*` against the built algorithm: group sizes, estimators, aggregation, dynamic sampling, a teacher."""
    algo = cfg.algorithm
    min_samples = algorithm.min_samples_per_prompt
    _require(
        algo.num_samples_per_prompt >= min_samples,
        f"algorithm.advantage={algo.advantage.name} compares samples within a prompt's group, so "
        f"algorithm.num_samples_per_prompt must be >= {min_samples} (got {algo.num_samples_per_prompt})",
    )
    _require(
        not algorithm.needs_greedy_baseline or cfg.env.name is None,
        f"algorithm.advantage={algo.advantage.name} baselines each prompt with the score of one greedy response, which an "
        f"environment's episodes do not give (env.name={cfg.env.name}); use algorithm/advantage=rebn or grpo with an "
        f"environment, or env=none",
    )
    _require(
        algo.kl_estimator in KL_ESTIMATORS,
        f"algorithm.kl_estimator={algo.kl_estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}",
    )
    _require(
        algo.loss_agg in LOSS_AGGREGATIONS,
        f"algorithm.loss_agg={algo.loss_agg!r}; choose one of {', '.join(LOSS_AGGREGATIONS)}",
    )
    _require(algo.beta >= 0, f"algorithm.beta={algo.beta} must be >= 0")
    _require(algo.entropy_coef >= 0, f"algorithm.entropy_coef={algo.entropy_coef} must be >= 0")
    _require(
        algo.loss_agg_norm is None or algo.loss_agg_norm > 0, f"algorithm.loss_agg_norm={algo.loss_agg_norm} must be > 0 or null"
    )


def check_dynamic_sampling(cfg: DictConfig, algorithm) -> None:
    """`algorithm.filter_groups` and the keys it reads: a group estimator to filter, a verifier to filter on."""
    algo = cfg.algorithm
    _require(
        not algo.filter_groups or (algo.num_samples_per_prompt >= 2 and not algorithm.pairwise),
        f"algorithm.filter_groups drops groups whose samples all scored the same, so it needs a policy-gradient "
        f"algorithm with algorithm.num_samples_per_prompt >= 2 (got {algo.num_samples_per_prompt}, "
        f"algorithm.policy_loss={algo.policy_loss.name}); raise num_samples_per_prompt or set filter_groups=false",
    )
    _require(algo.max_resample_rounds >= 0, f"algorithm.max_resample_rounds={algo.max_resample_rounds} must be >= 0")
    _require(
        algo.filter_on in FILTER_ON, f"algorithm.filter_on={algo.filter_on!r}; choose one of {', '.join(FILTER_ON)}",
    )
    _require(
        algo.filter_on != "accuracy" or (cfg.env.name is None and any(_is_verifier(f.name) for f in cfg.reward.functions)),
        "algorithm.filter_on=accuracy keeps groups whose verifiers disagree, and this run has no verifier scoring "
        "single-turn responses (reward.functions, env=none); use filter_on=score, or auto (accuracy only where a "
        "verifier is)",
    )
    _require(
        algo.filter_groups or algo.filter_on == AlgorithmConfig.filter_on,
        f"algorithm.filter_on={algo.filter_on} is read only with algorithm.filter_groups=true; set filter_groups=true "
        f"or remove the override",
    )
    _require(
        algo.filter_groups or algo.max_resample_rounds == AlgorithmConfig.max_resample_rounds,
        f"algorithm.max_resample_rounds={algo.max_resample_rounds} is read only with algorithm.filter_groups=true; "
        f"set filter_groups=true or remove the override",
    )


def check_teacher(cfg: DictConfig, algorithm) -> None:
    """`teacher.*`: a served teacher has a tokenizer to compare, an http(s) URL and the sampling temperature its raw
    logprobs are at; an algorithm that learns from a teacher has one."""
    teacher, gen, algo = cfg.teacher, cfg.generator, cfg.algorithm
    _require(
        not teacher.url or teacher.name_or_path,
        f"teacher.url={teacher.url} needs teacher.name_or_path too: the teacher's tokenizer is checked against the "
        f"policy's (and it names the model sent to the endpoint unless teacher.model does)",
    )
    _require(
        not teacher.url or is_http_url(teacher.url),
        f"teacher.url={teacher.url!r} is not an http(s) URL with a host; give the server's address with its scheme, "
        f"e.g. teacher.url=http://127.0.0.1:8000/v1",
    )
    _require(
        not teacher.url or gen.temperature == 1.0,
        f"teacher.url={teacher.url} returns the server's raw logprobs (temperature 1), and generator.temperature="
        f"{gen.temperature} samples at another; use generator.temperature=1 or a local teacher (teacher.url=null)",
    )
    _require(teacher.timeout_s > 0 and teacher.max_concurrency >= 1,
             f"teacher.timeout_s={teacher.timeout_s} must be > 0 and teacher.max_concurrency={teacher.max_concurrency} >= 1")
    _require(
        not algorithm.needs_teacher or cfg.teacher.name_or_path,
        f"algorithm.advantage={algo.advantage.name} with algorithm.distill_coef={algo.distill_coef} learns from a teacher's "
        f"logprobs; set teacher.name_or_path to the teacher model (it must share the policy's tokenizer)",
    )


def check_trained_models(cfg: DictConfig) -> None:
    """`policy.*` and `critic.*`: LoRA values and the strategies that take them, compile and its memory budget."""
    check_lora_values(cfg.policy.lora)
    check_lora_values(cfg.critic.lora, "critic.lora")
    _require(
        cfg.critic.lora.rank is None or choose("strategy", cfg.critic.strategy, "critic.strategy").trait("takes_lora_critic"),
        f"critic.lora with critic/strategy={cfg.critic.strategy.name}: a LoRA critic trains under single or ddp "
        f"for now; choose critic/strategy=ddp, or set critic.lora.rank=null",
    )
    _require(
        not cfg.policy.compile or choose("strategy", cfg.policy.strategy, "policy.strategy").trait("takes_compiled_blocks"),
        f"policy.compile with policy/strategy={cfg.policy.strategy.name}: compiled decoder blocks train under "
        f"single, ddp or fsdp2 for now (DeepSpeed wraps the blocks its own way); choose policy/strategy=fsdp2, or set policy.compile=false",
    )
    budget = cfg.policy.activation_memory_budget
    _require(
        budget is None or 0.0 <= budget <= 1.0,
        f"policy.activation_memory_budget={budget} is the share of the compiled decoder blocks' activations kept for "
        f"the backward: a number from 0 (recompute all) to 1 (keep all), such as 0.5, or null (off)",
    )
    _require(
        budget is None or cfg.policy.compile,
        f"policy.activation_memory_budget={budget} steers what the compiled decoder blocks keep for the backward: it "
        f"needs policy.compile=true; set policy.compile=true, or policy.activation_memory_budget=null "
        f"(policy.gradient_checkpointing trades memory for compute without compile)",
    )
    _require(
        not cfg.policy.compile or cfg.policy.lora.rank is None,
        "policy.compile with policy.lora: torch.compile gives peft's adapters wrong gradients here (measured: the "
        "forward agrees, the adapters' gradients do not); set policy.compile=false, or policy.lora.rank=null",
    )


def check_optimiser(cfg: DictConfig) -> None:
    """`train.*` (and `critic.lr`): learning rates and their schedule, Adam's settings, mixed precision, warm-up and
    the non-finite guard."""
    train = cfg.train
    check_lr("train.lr", train.lr)
    if cfg.critic.lr is not None:
        check_lr("critic.lr", cfg.critic.lr)
    _require(
        train.lr_schedule in LR_SCHEDULES,
        f"train.lr_schedule={train.lr_schedule!r}; choose one of {', '.join(LR_SCHEDULES)}",
    )
    _require(
        len(train.adam_betas) == 2 and all(0 <= b < 1 for b in train.adam_betas),
        f"train.adam_betas={list(train.adam_betas)} must hold two numbers in [0, 1)",
    )
    _require(train.weight_decay >= 0 and train.adam_eps > 0, f"train.weight_decay={train.weight_decay} must be >= 0 and train.adam_eps={train.adam_eps} > 0")
    _require(
        train.mixed_precision in MIXED_PRECISION,
        f"train.mixed_precision={train.mixed_precision!r}; choose one of {', '.join(MIXED_PRECISION)}",
    )
    _require(
        train.max_skipped_steps_in_row >= 1,
        f"train.max_skipped_steps_in_row={train.max_skipped_steps_in_row} must be >= 1",
    )
    _require(train.warmup_steps >= 0, f"train.warmup_steps={train.warmup_steps} must be >= 0")


def check_model_numbers(cfg: DictConfig) -> None:
    """`model.dtype` and `model.logprob_chunk`: a known dtype that trains (never float16), bf16 only where this CPU
    computes it."""
    _require(cfg.model.dtype in DTYPES, f"model.dtype={cfg.model.dtype!r}; choose one of {', '.join(DTYPES)}")
    _require(
        cfg.model.logprob_chunk is None or cfg.model.logprob_chunk >= 0,
        f"model.logprob_chunk={cfg.model.logprob_chunk} must be >= 0 (0 = plain logits), or null for the device's default",
    )
    _require(
        cfg.model.dtype != "float16",
        "model.dtype=float16 would train without loss scaling and turn weights into NaN; use bfloat16 (or float32)",
    )
    _require(
        cfg.model.dtype != "bfloat16" or cfg.cluster.device != "cpu" or cpu_computes_bf16(),
        "model.dtype=bfloat16 on cluster.device=cpu: this CPU has no bf16 arithmetic (no AVX512-BF16/AMX; torch would "
        "emulate every product); use model.dtype=float32 here, or a GPU",
    )


def check_cluster_resources(cluster) -> None:
    """`cluster.*` sizes: device memory, CPUs, Ray's object store."""
    memory_gb = cluster.device_memory_gb
    _require(
        memory_gb is None or (math.isfinite(memory_gb) and memory_gb > 0),
        f"cluster.device_memory_gb={memory_gb} must be a positive number of GiB, or null to detect the device's",
    )
    _require(
        cluster.num_cpus is None or cluster.num_cpus >= 1,
        f"cluster.num_cpus={cluster.num_cpus} must be >= 1, or null for this machine's count",
    )
    _require(
        cluster.object_store_memory is None or cluster.object_store_memory >= RAY_MIN_OBJECT_STORE,
        f"cluster.object_store_memory={cluster.object_store_memory} is under Ray's minimum of {RAY_MIN_OBJECT_STORE} "
        f"bytes (75 MiB); raise it, or null for Ray's default",
    )


def check_plan_keys(cfg: DictConfig) -> None:
    """`plan.*` and the cluster and model keys the memory plan reads, in range; ConfigError naming the key. `validate`
    runs it, and `rlhf.plan.make_plan` for a config it was not run on."""
    _require(0 <= cfg.plan.headroom < 1,
             f"plan.headroom={cfg.plan.headroom} must be in [0, 1): the share of device memory kept free")
    memory_gb = cfg.cluster.device_memory_gb
    _require(memory_gb is None or memory_gb > 0,
             f"cluster.device_memory_gb={memory_gb} must be > 0 (GiB per device), or null to detect it")
    for key in ("num_nodes", "devices_per_node"):
        value = cfg.cluster[key]
        _require(value is None or value >= 1, f"cluster.{key}={value} must be >= 1, or null when unknown")
    _require(cfg.model.dtype in DTYPES, f"model.dtype={cfg.model.dtype!r}; choose one of {', '.join(DTYPES)}")


def check_reward(cfg: DictConfig) -> None:
    """`reward.*`: something scores, each function's args, overlong shaping, unscored rows' retries and limit."""
    gen = cfg.generator
    _require(
        len(cfg.reward.functions) >= 1 or cfg.reward.path,
        "reward.functions is empty and reward.path is null; name a reward function or a reward model folder",
    )
    _require(cfg.reward.clip is None or cfg.reward.clip > 0, f"reward.clip={cfg.reward.clip} must be > 0 or null")
    for i, function in enumerate(cfg.reward.functions):  # each function's args are its keyword parameters
        check_args(registry.resolve("reward", function.name, key=f"reward.functions[{i}].name"), dict(function.args),
                   f"reward.functions[{i}]", function.name)
    buffer = cfg.reward.overlong_buffer_len
    _require(
        buffer is None or 1 <= buffer < gen.max_new_tokens,
        f"reward.overlong_buffer_len={buffer} must be >= 1 and below generator.max_new_tokens={gen.max_new_tokens} "
        f"(the response budget it is the end of); lower it, or null to turn overlong shaping off",
    )
    _require(
        buffer is None or cfg.env.name is None,
        f"reward.overlong_buffer_len shapes single-turn responses; environment {cfg.env.name!r} scores its own episodes, "
        f"set it to null (or env=none)",
    )
    _require(
        cfg.reward.overlong_penalty_factor >= 0,
        f"reward.overlong_penalty_factor={cfg.reward.overlong_penalty_factor} must be >= 0 (the reward lost at the budget)",
    )
    _require(
        buffer is not None or cfg.reward.overlong_penalty_factor == RewardConfig.overlong_penalty_factor,
        f"reward.overlong_penalty_factor={cfg.reward.overlong_penalty_factor} is read only with overlong shaping on; "
        f"set reward.overlong_buffer_len (e.g. a quarter of generator.max_new_tokens) or remove the override",
    )
    _require(cfg.reward.unscored_retries >= 0, f"reward.unscored_retries={cfg.reward.unscored_retries} must be >= 0")
    _require(
        0 <= cfg.reward.max_unscored_share <= 1,
        f"reward.max_unscored_share={cfg.reward.max_unscored_share} is a share of a batch's rows: a number from 0 (stop "
        f"at the first unscored row) to 1 (never stop)",
    )


def check_outputs(cfg: DictConfig) -> None:
    """`eval.*`, `checkpoint.*`, `logging.*` and `seed`."""
    _require(cfg.eval.every >= 0, f"eval.every={cfg.eval.every} must be >= 0")
    _require(cfg.eval.num_evals is None or cfg.eval.num_evals >= 1, f"eval.num_evals={cfg.eval.num_evals} must be >= 1")
    _require(cfg.eval.max_prompts is None or cfg.eval.max_prompts >= 1, f"eval.max_prompts={cfg.eval.max_prompts} must be >= 1")
    check_reasoning_gym(cfg)
    _require(cfg.eval.num_samples >= 0, f"eval.num_samples={cfg.eval.num_samples} must be >= 0")
    _require(cfg.checkpoint.every >= 0, f"checkpoint.every={cfg.checkpoint.every} must be >= 0")
    _require(cfg.checkpoint.keep_last >= 0, f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 0")
    _require(cfg.logging.log_every >= 1, f"logging.log_every={cfg.logging.log_every} must be >= 1")
    check_seed(cfg.seed)
    check_logging(cfg.logging)


def validate(cfg: DictConfig) -> RunSpec:
    """Every check that needs no model: choices, ranges, batch arithmetic. Returns what the run is (`RunSpec`): its
    parts typed once, here, and its derived sizes."""
    check_unknown_keys(cfg)  # first: a `+typo=...` key would otherwise be silently ignored
    check_required_keys(cfg)
    check_device(cfg.cluster)
    parts = choose_parts(cfg)  # every part's node typed and checked first: the checks below read them
    algorithm = parts.algorithm
    check_algorithm(cfg, algorithm)
    check_dynamic_sampling(cfg, algorithm)
    check_teacher(cfg, algorithm)
    check_self_checks(cfg.checks)
    check_trained_models(cfg)
    check_optimiser(cfg)
    check_model_numbers(cfg)
    check_cluster_resources(cfg.cluster)
    check_plan_keys(cfg)
    check_reward(cfg)
    check_outputs(cfg)
    check_env(cfg)
    check_ownership(cfg, algorithm)
    sizes = derive_sizes(cfg, parts.env, algorithm.pairwise)
    check_token_budget(cfg, sizes, algorithm.pairwise)
    spec = spec_of(cfg, parts, sizes)
    ranks = validate_cluster(spec, algorithm, sizes.samples_per_step, sizes.mini_batch_size)
    check_generation(spec, ranks)
    return spec
