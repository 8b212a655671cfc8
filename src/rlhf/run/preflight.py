"""Checks made before any model loads, so a run fails in seconds rather than after hours of training.

Every folder the run will write (run folder, `checkpoint.dir`, the exported model, `train_reward`'s `save_dir`)
must be writable, hold nothing the run did not write if the run replaces or prunes it (`rlhf.disk.check_own_output`),
and have room for what it receives: a checkpoint is estimated from the models' parameter counts
(read from their configs on the meta device, no weights) times the weights and AdamW's two moments, the run
folder's logs from the steps, the evaluations and the longest row. Too little
room warns; far too little refuses. A resumed run compares its config with the one its checkpoint recorded: the
changes are listed, and those that break exact resume are refused unless `checkpoint.allow_config_change`.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import torch
import yaml
from omegaconf import OmegaConf

from rlhf.disk import REWARD_MODEL, TRAIN_ADAPTER, TRAIN_CHECKPOINTS, TRAIN_EXPORT, check_own_output, free_bytes, megabytes
from rlhf.distributed.layout import role_ranks
from rlhf.config.spec import RunSpec
from rlhf.run.checkpoint import CONFIG_FILE, STATE_FILE, is_checkpoint_entry
from rlhf.errors import ConfigError
from rlhf.models import lora
from rlhf.models.dtypes import DTYPES
from rlhf.plan import architecture
from rlhf.plan.architecture import ModelSource
from rlhf.training.critic import critic_init_path

log = logging.getLogger("rlhf")

REFUSE_BELOW = 0.25  # free space under this share of the estimate refuses the run; under the whole estimate, a warning
LOG_BYTES_PER_STEP = 8 * 1024  # metrics.jsonl and TensorBoard scalars of one step (about 4 KB measured), with room
TEXT_BYTES_PER_TOKEN = 8  # a logged completion's text and its JSON, per token of prompt and response, with room
ROW_OVERHEAD = 200  # the JSON keys and numbers around one logged completion
EVAL_PROMPTS_IF_ALL = 1000  # eval.max_prompts=null: the split's size is unknown before the data loads; assumed
STATE_COPIES = 3  # a trained parameter's checkpoint: its weight and AdamW's two moments, each in the model's dtype
# keys whose change makes a resumed run diverge from the run it continues
EXACT_RESUME_KEYS = (  # what a resumed run must share with its checkpoint to continue the same training
    "seed", "train.*batch*", "train.prompts_per_step", "algorithm.*",  # the batches and the update
    "model.name_or_path", "model.tokenizer", "reference.name_or_path", "critic.name_or_path", "teacher.name_or_path",
    "policy.lora.*", "critic.lora.*",  # the models: another model, or adapters scaled or placed otherwise
    "dataset.*",  # the prompt stream
)
RESUME_FREE_KEYS = ("dataset.cache_dir", "dataset.strict", "dataset.eval")  # dataset keys that leave the training prompts as they were
NOT_COMPARED = ("resume",)  # keys expected to differ between a run and its resumption
ABSENT = "<absent>"


@dataclass(frozen=True)
class Output:
    """A folder the run writes: the key that names it, where a test file goes, and the bytes it must take in."""

    key: str  # the config key that chooses the folder, for messages
    path: Path  # the folder itself
    probe: Path  # where writing is tried: the folder, or the parent an atomic export is assembled in
    what: str = ""  # what it receives, for messages ("a checkpoint")
    needed: int | None = None  # bytes it must hold; None when unknown or small
    owner: str = ""  # the writer that replaces or prunes it (`rlhf.disk`'s names); "": the run only adds files to it
    fix: str = ""  # what to do when it holds another's files; "": choose another `key`
    whole: bool = False  # replaced whole by each save (an exported model), so no other output may lie inside it
    ours: Callable[[Path], bool] | None = None  # an entry its writer made before it marked its folders (a checkpoint)


def check_outputs(outputs: list[Output]) -> None:
    """Each output's folder is writable, holds only its writer's files, lies in no folder replaced whole, and has room
    for what it receives (ConfigError otherwise)."""
    check_apart(outputs)
    for output in outputs:
        check_writable(output.key, output.probe, output.path)
        if output.owner:
            check_own_output(output.path, output.key, output.owner, output.fix, output.ours)
        if output.needed:
            check_space(output)


def check_apart(outputs: list[Output]) -> None:
    """ConfigError when an output lies in (or is) a folder another output replaces whole: that save would delete it."""
    for whole in (o for o in outputs if o.whole):
        for other in outputs:
            inside = Path(os.path.abspath(other.path)).is_relative_to(os.path.abspath(whole.path))
            if other is not whole and inside:
                undo = whole.fix or f"choose another {whole.key}"
                raise ConfigError(
                    f"{other.key}={other.path} lies in {whole.key}={whole.path}, a folder replaced whole when saved, "
                    f"which would delete it; choose another {other.key}, or {undo}"
                )


def check_writable(key: str, folder: Path, shown: Path | None = None) -> None:
    """Create ``folder`` (if missing) and a temporary file in it, then remove both; ConfigError naming ``key`` and
    ``shown`` (the folder the key names, when the run writes into its parent first)."""
    folder = Path(folder)
    made = []  # folders this check creates, deepest first, removed again so it leaves no trace
    for path in (folder, *folder.parents):
        if path.exists():
            break
        made.append(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".rlhf-write-test-"):
            pass
    except OSError as err:
        reason = f"{err.filename} is a file, not a folder" if err.errno == errno.EEXIST else err.strerror or err
        raise ConfigError(
            f"{key}={shown or folder} is not writable: {reason}; choose a folder this user can write to"
        ) from None
    finally:
        for path in made:
            try:
                path.rmdir()
            except OSError:
                pass


def check_space(output: Output) -> None:
    """Warn when ``output.path`` has less room than ``output.needed``; ConfigError when far less (`REFUSE_BELOW`)."""
    free = free_bytes(output.path)
    if free >= output.needed:
        return
    text = (
        f"{output.key}={output.path}: no space for {output.what}: needs about {megabytes(output.needed)} MB, "
        f"{megabytes(free)} MB free"
    )
    if free < output.needed * REFUSE_BELOW:
        raise ConfigError(f"{text}; free some space there or point {output.key} at another disk")
    log.warning("%s; the run may fail when it saves", text)


def parameter_count(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False) -> int | None:
    """Parameters of the model ``name_or_path`` from its config alone (`rlhf.plan.architecture`: the meta device, no
    weights read); None when its config cannot be read here (a hub name offline: `rlhf.checks.hub` reports it)."""
    try:
        return architecture.parameter_count(ModelSource("model", name_or_path, revision, trust_remote_code))
    except Exception as err:  # noqa: BLE001 -- a size estimate must never be what stops a run
        log.info("no checkpoint size estimate for %s (%s); free space is not checked", name_or_path, err)
        return None


def dtype_bytes(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def checkpoint_bytes(spec: RunSpec) -> int | None:
    """About how many bytes one checkpoint of `rlhf.train` takes: policy (and critic) weights and AdamW moments
    (``spec``: the run, as `validate` resolved it)."""
    model = spec.model
    policy = parameter_count(model.name_or_path, model.revision, model.trust_remote_code)
    if policy is None:
        return None
    trained = policy
    if spec.algorithm.needs_critic:
        critic = parameter_count(critic_init_path(spec), None, model.trust_remote_code)
        trained += critic if critic is not None else policy
    return trained * STATE_COPIES * dtype_bytes(model.dtype)


def log_bytes(cfg, longest_row: int) -> int:
    """About how many bytes a whole run's logs take in its run folder: each step's metrics (JSON Lines, TensorBoard),
    the sample tables every `logging.sample_every` steps, and every evaluation's completions
    (`eval.save_generations`), each completion as long as ``longest_row``, the longest row the run can produce
    (`DerivedSizes.longest_row`)."""
    steps, ev, logging_cfg = cfg.train.num_steps, cfg.eval, cfg.logging
    row = ROW_OVERHEAD + TEXT_BYTES_PER_TOKEN * longest_row
    evals = 2 + (ev.num_evals if ev.num_evals else steps // ev.every if ev.every else 0)
    per_eval = (ev.max_prompts or EVAL_PROMPTS_IF_ALL) * (ev.num_samples + int(ev.greedy)) * row if ev.save_generations else 0
    tables = (steps // logging_cfg.sample_every if logging_cfg.sample_every else 0) * logging_cfg.num_sample_texts * row
    return steps * LOG_BYTES_PER_STEP + evals * per_eval + tables


def train_outputs(cfg, out: Path, root: Path, checkpoint_size: int | None, longest_row: int) -> list[Output]:
    """The folders `rlhf.train` writes: the run folder (its logs, rows of up to ``longest_row`` tokens), `checkpoint.dir`,
    and `<run folder>/final_model`."""
    outputs = [
        Output("hydra.run.dir", out, out, "the run's logs and evaluation completions", log_bytes(cfg, longest_row)),
        Output("checkpoint.dir", root, root, "a checkpoint", checkpoint_size, TRAIN_CHECKPOINTS, ours=is_checkpoint_entry),
    ]
    if cfg.checkpoint.save_final_model:
        export = checkpoint_size and checkpoint_size // STATE_COPIES  # the policy's weights (with a critic: over)
        fix = "choose another hydra.run.dir, or set checkpoint.save_final_model=false"
        outputs.append(
            Output("checkpoint.save_final_model", out / "final_model", out, "the exported model", export, TRAIN_EXPORT, fix, True)
        )
        if cfg.policy.lora.rank is not None:
            outputs.append(Output("policy.lora.rank", out / "final_adapter", out, owner=TRAIN_ADAPTER, fix=fix, whole=True))
    return outputs


def reward_outputs(cfg, out: Path, save_dir: Path) -> list[Output]:
    """The folders `rlhf.train_reward` writes: the run folder and `save_dir` (float32 weights)."""
    params = parameter_count(cfg.model.name_or_path, cfg.model.revision, cfg.model.trust_remote_code)
    needed = params * dtype_bytes("float32") if params is not None else None
    reward_model = Output("save_dir", save_dir, save_dir.parent, "the reward model", needed, REWARD_MODEL, whole=True)
    return [Output("hydra.run.dir", out, out), reward_model]


def resolved(cfg) -> dict:
    """The config as plain data, interpolations resolved: what a checkpoint records and resume compares."""
    return OmegaConf.to_container(cfg, resolve=True)


def config_text(cfg) -> str:
    """The resolved config as YAML, for a checkpoint's `config.yaml`."""
    return yaml.safe_dump(resolved(cfg), sort_keys=False)


def flatten(node, prefix: str = "") -> dict:
    """{"train.lr": 1e-3, ...}: nested mappings as dotted keys (lists stay whole values)."""
    if isinstance(node, dict) and node:
        return {key: value for name, child in node.items() for key, value in flatten(child, f"{prefix}{name}.").items()}
    return {prefix[:-1]: node}


def config_changes(recorded: dict, current: dict) -> dict[str, tuple]:
    """{dotted key: (recorded value, current value)} for every key that differs (`ABSENT` where one lacks it)."""
    old, new = flatten(recorded), flatten(current)
    keys = sorted((old.keys() | new.keys()) - set(NOT_COMPARED))
    return {k: (old.get(k, ABSENT), new.get(k, ABSENT)) for k in keys if old.get(k, ABSENT) != new.get(k, ABSENT)}


def breaks_exact_resume(key: str) -> bool:
    return key not in RESUME_FREE_KEYS and any(fnmatch.fnmatchcase(key, pattern) for pattern in EXACT_RESUME_KEYS)


def check_lora_resume(spec: RunSpec, path: Path) -> None:
    """The checkpoint's policy and critic trained what the run ``spec`` trains: LoRA adapters of the same rank, or
    every weight."""
    check_model_resume(path, "policy", spec.policy.lora.rank)
    if (path / "critic" / "model").is_dir():
        check_model_resume(path, "critic", spec.critic.lora.rank)


def check_model_resume(path: Path, role: str, rank: int | None) -> None:
    """`check_lora_resume` for one trained model (``role``: policy or critic, whose `<role>.lora.rank` is ``rank``)."""
    saved = path / role / "model"
    if lora.is_adapter_folder(saved):
        saved_rank = json.loads((saved / "adapter_config.json").read_text(encoding="utf-8")).get("r")
        if rank is None:
            raise ConfigError(
                f"resume from {path}: the checkpoint's {role} holds LoRA adapters (rank {saved_rank}) but this run trains "
                f"every weight ({role}.lora.rank=null); set {role}.lora.rank={saved_rank} to resume it, or start a new "
                f"run from its exported final_model"
            )
        if saved_rank != rank:
            raise ConfigError(f"resume from {path}: the checkpoint's LoRA rank is {saved_rank}, {role}.lora.rank={rank}; set {role}.lora.rank={saved_rank}")
    elif rank is not None and (saved / "config.json").is_file():
        raise ConfigError(
            f"resume from {path}: the checkpoint holds fully fine-tuned weights but this run trains LoRA adapters "
            f"({role}.lora.rank={rank}); set {role}.lora.rank=null to resume it, or start a LoRA run from its weights "
            f"(model.name_or_path=<its policy/model folder>, resume=null)"
        )


def check_strategy_resume(spec: RunSpec, path: Path, saved_cfg: dict) -> None:
    """The checkpoint's policy and critic can be read by this run's strategies: DeepSpeed's own sharded state
    (`<role>/deepspeed`) only by DeepSpeed at the same number of ranks and with ZeRO-3 or not as saved, full weights and
    optimiser state (single, ddp, fsdp2) by any strategy but DeepSpeed. ``saved_cfg``: the checkpoint's `config.yaml`
    (empty when it records none), for the strategies it names."""
    loaded = ("policy", "critic") if spec.algorithm.needs_critic else ("policy",)
    for role in loaded:  # a saved critic this run has none for is never read
        if (path / role).is_dir():
            check_role_strategy_resume(spec.config, path, role, saved_cfg.get(role, {}).get("strategy", {}))


def check_role_strategy_resume(cfg, path: Path, role: str, saved_strategy: dict) -> None:
    """`check_strategy_resume` for one trained model (``role``: policy or critic; ``saved_strategy``: its
    `<role>.strategy` node as the checkpoint's config.yaml recorded it, or empty)."""
    strategy = cfg[role].strategy
    shards = path / role / "deepspeed" / "state"
    new_run = f"start a new run from its weights in another hydra.run.dir (model.name_or_path={path / role / 'model'})"
    fix = f"resume with the strategy it was saved under, or {new_run}"
    if not shards.is_dir():
        if strategy.name == "deepspeed":
            was = saved_strategy.get("name", "single, ddp or fsdp2")
            raise ConfigError(
                f"resume from {path}: the checkpoint's {role} holds full weights and optimiser state (saved under "
                f"{role}/strategy={was}), which {role}/strategy=deepspeed cannot load; {fix}"
            )
        return
    if strategy.name != "deepspeed":
        raise ConfigError(
            f"resume from {path}: the checkpoint's {role} is DeepSpeed's own sharded state (saved under "
            f"{role}/strategy=deepspeed), which {role}/strategy={strategy.name} cannot read; {fix}"
        )
    saved_ranks = len(list(shards.glob("*zero_pp_rank_*_optim_states.pt")))
    ranks = role_ranks(cfg.cluster, role) if cfg.cluster.backend == "ray" else 1
    if saved_ranks != ranks:
        raise ConfigError(
            f"resume from {path}: the checkpoint's {role} is DeepSpeed's sharded state of {saved_ranks} ranks, this run "
            f"places {ranks} (cluster.roles.{role}: num_nodes x devices_per_node); DeepSpeed resumes only at the world "
            f"size it saved: set cluster.roles.{role} (and roles colocated with it) back to {saved_ranks} ranks, or "
            f"{new_run}"
        )
    saved_stage3 = any(shards.glob("*zero_pp_rank_*_model_states.pt"))  # ZeRO-3 saves each rank's parameter shard
    if saved_stage3 != (strategy.zero_stage == 3):
        was = "3" if saved_stage3 else "1 or 2"
        raise ConfigError(
            f"resume from {path}: the checkpoint's {role} was saved under ZeRO stage {was} and this run has "
            f"{role}.strategy.zero_stage={strategy.zero_stage}; DeepSpeed reads ZeRO-3 state only under ZeRO-3: set "
            f"{role}.strategy.zero_stage={saved_strategy.get('zero_stage', was)}"
        )


def check_resume(spec: RunSpec, path: Path, swept: set[str] = frozenset()) -> None:
    """A resume of the run ``spec`` from checkpoint ``path`` continues its training: `train.num_steps` reaches its
    step, and the keys that exact resume needs (`EXACT_RESUME_KEYS`) match its `config.yaml` unless
    `checkpoint.allow_config_change`. Every changed key is logged. In a `--multirun` job, a key the sweep varies
    (``swept``) must match too: a different value means the sweep's list changed since, and this job's folder holds
    another job's run."""
    cfg = spec.config  # compared key by key with the checkpoint's config.yaml
    step = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))["step"]
    recorded = path / CONFIG_FILE
    saved_cfg = yaml.safe_load(recorded.read_text(encoding="utf-8")) if recorded.is_file() else None
    check_lora_resume(spec, path)
    check_strategy_resume(spec, path, saved_cfg or {})
    if cfg.train.num_steps < step:
        raise ConfigError(
            f"train.num_steps={cfg.train.num_steps} is below step {step} of the checkpoint {path} this run resumes "
            f"from; set train.num_steps >= {step}, or resume from an earlier step_* folder"
        )
    if saved_cfg is None:
        log.warning("resume: %s records no config (an older checkpoint); changed keys are not checked", path)
        return
    changes = config_changes(saved_cfg, resolved(cfg))
    if not changes:
        return
    listed = "; ".join(f"{key}: {old} -> {new}" for key, (old, new) in changes.items())
    log.warning("resume: %d keys differ from the config step %d ran with (%s): %s",
                len(changes), step, recorded, listed)
    moved_jobs = [f"{key}: {changes[key][0]} -> {changes[key][1]}" for key in changes
                  if any(key == s or key.startswith(f"{s}.") for s in swept)]  # a swept group: the keys under it
    if moved_jobs:
        raise ConfigError(
            f"resume from {path} in a sweep: this job's swept {'; '.join(moved_jobs)} differs from the value its "
            f"checkpoint trained with, so the sweep's values changed since and the job folders no longer match their "
            f"runs; run the changed sweep in a new hydra.sweep.dir, or repeat the old values in their old order"
        )
    breaking = [f"{key}: {changes[key][0]} -> {changes[key][1]}" for key in changes if breaks_exact_resume(key)]
    if not breaking:
        return
    if not cfg.checkpoint.allow_config_change:
        raise ConfigError(
            f"resume from {path}: {'; '.join(breaking)} changed since step {step}; the resumed run would not continue "
            f"the same training (exact resume needs the same seed, batch sizes, algorithm, models, LoRA settings and "
            f"dataset). Put them back, or set "
            f"checkpoint.allow_config_change=true to go on with the new values"
        )
    log.warning("resume: checkpoint.allow_config_change=true: continuing with %s", "; ".join(breaking))


def check_ray_address(cluster, timeout_s: float = 10.0) -> None:
    """With `cluster.address` a `host:port` or `ray://host:port`, something answers a connection there within
    ``timeout_s``, else ConfigError before any model loads (Ray itself would retry for minutes without a word).
    `auto`, `local` and a private cluster (null) are Ray's to find."""
    address = cluster.address
    if cluster.backend != "ray" or address is None or address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    host = host.strip("[]")  # an IPv6 literal: [::1]:6379
    if not host or not port.isdigit():
        raise ConfigError(f"cluster.address={address!r}; give host:port (the head's GCS, 6379 by default), ray://host:10001, auto, local or null")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(
            f"cluster.address={address}: nothing answers there ({err}); start the head with `ray start --head` (it "
            f"prints the address), fix the address, or use cluster=ray_local for a private cluster on this machine"
        ) from None


WANDB_URL = "https://api.wandb.ai"  # where W&B runs log to unless WANDB_BASE_URL says otherwise


def check_wandb(settings, timeout_s: float = 5.0) -> None:
    """With `logging.wandb=true` in online mode, W&B's server answers a connection within ``timeout_s``, else
    ConfigError before any model loads (before, wandb retried for about 100 s after the models had loaded, then the
    run failed). Offline or disabled modes write locally and are not checked."""
    mode = settings.wandb_mode or os.environ.get("WANDB_MODE", "online")
    if not settings.wandb or mode in ("offline", "disabled", "dryrun"):
        return
    url = urlparse(os.environ.get("WANDB_BASE_URL", WANDB_URL))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(
            f"logging.wandb=true: the W&B server {url.geturl()} does not answer ({err}); set logging.wandb_mode=offline "
            f"to log locally (wandb sync later), or logging.wandb=false"
        ) from None
