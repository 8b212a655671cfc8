"""Reward-model training: `python -m rlhf.train_reward [hydra overrides]`.

Trains a sequence-classification head on a causal LM backbone with the Bradley-Terry loss
-log sigmoid(r_chosen - r_rejected), reports preference accuracy on a held-out split, and saves a normal
Hugging Face folder that `reward=model reward.path=<folder>` loads for PPO or online DPO.

    python -m rlhf.train_reward                      # built-in arith_prefs on the built-in tiny model
    python -m rlhf.train_reward train.num_epochs=5 save_dir=/tmp/rm
"""

from __future__ import annotations

import logging
import os
import random
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.utils.tensorboard import SummaryWriter

from rlhf import exits, registry
from rlhf.checks import hub
from rlhf.disk import REWARD_MODEL
from rlhf.run import preflight
from rlhf.config import ConfigError, register_schema
from rlhf.config.compose import check_command_line
from rlhf.config.schema import RewardTrainConfig
from rlhf.config.unknown_keys import check_unknown_keys
from rlhf.data.preferences import encode_pairs
from rlhf.models.hf_folder import save_hf_folder
from rlhf.models.loading import load_tokenizer, pick_device
from rlhf.training.optim import check_lr, clip_gradients, lr_lambda
from rlhf.models.value import load_value_model, sequence_scores
from rlhf.run.lock import folder_lock
from rlhf.seeding import check_seed, seed_everything

log = logging.getLogger("rlhf")

register_schema()


def pair_scores(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen scores (P,), rejected scores (P,)) from rows laid out chosen-first by `encode_pairs`."""
    scores = sequence_scores(model, ids, mask)
    half = ids.shape[0] // 2
    return scores[:half], scores[half:]


@torch.no_grad()
def evaluate(model, pairs, tokenizer, device, batch_size: int) -> dict[str, float]:
    """Preference accuracy, loss and mean margin over ``pairs``."""
    model.eval()
    correct = loss = margin = 0.0
    for start in range(0, len(pairs), batch_size):
        ids, mask = encode_pairs(pairs[start : start + batch_size], tokenizer)
        chosen, rejected = pair_scores(model, ids.to(device), mask.to(device))
        diff = chosen - rejected
        correct += (diff > 0).sum().item()
        loss += -torch.nn.functional.logsigmoid(diff).sum().item()
        margin += diff.sum().item()
    model.train()
    n = len(pairs)
    return {"eval/accuracy": correct / n, "eval/loss": loss / n, "eval/margin": margin / n}


def train(job: RewardTrainConfig, out: Path) -> dict[str, float]:
    """Train, evaluate, save; returns the final eval metrics. ``job``: the composed config, typed (`typed`)."""
    loop, model_cfg = job.train, job.model
    for key in ("num_epochs", "batch_size", "eval_every"):
        if getattr(loop, key) < 1:
            raise ConfigError(f"train.{key}={getattr(loop, key)} must be >= 1")
    check_lr("train.lr", loop.lr)
    check_seed(job.seed)
    if model_cfg.dtype != "float32":
        raise ConfigError(f"model.dtype={model_cfg.dtype}: reward-model training keeps float32 weights; set model.dtype=float32")
    builder = registry.resolve("preference_dataset", job.preferences.name, key="preferences.name")
    device = pick_device(job.cluster.device)
    seed_everything(job.seed)
    tokenizer = load_tokenizer(model_cfg.tokenizer or model_cfg.name_or_path, model_cfg.revision, model_cfg.trust_remote_code)
    try:
        splits = builder(cfg=OmegaConf.structured(job.preferences), tokenizer=tokenizer)  # a node, as rlhf.data.preferences documents
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if len(splits.train) < loop.batch_size:
        raise ConfigError(f"train.batch_size={loop.batch_size} exceeds the {len(splits.train)} training pairs")
    log.info("preferences %s: %d train pairs, %d eval pairs", job.preferences.name, len(splits.train), len(splits.eval))
    model = load_value_model(model_cfg.name_or_path, model_cfg.dtype, model_cfg.revision, model_cfg.trust_remote_code, device)
    model.train()
    steps = loop.num_epochs * (len(splits.train) // loop.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=loop.lr, weight_decay=loop.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda("linear", 0, steps))
    writer = None
    if job.tensorboard:
        writer = SummaryWriter(log_dir=str(out / "tensorboard"))
    rng = random.Random(job.seed)
    metrics = evaluate(model, splits.eval, tokenizer, device, loop.batch_size)
    log.info("step 0/%d | eval accuracy %.3f", steps, metrics["eval/accuracy"])
    step = 0
    for epoch in range(loop.num_epochs):
        order = list(splits.train)
        rng.shuffle(order)
        for start in range(0, len(order) - loop.batch_size + 1, loop.batch_size):
            ids, mask = encode_pairs(order[start : start + loop.batch_size], tokenizer)
            chosen, rejected = pair_scores(model, ids.to(device), mask.to(device))
            loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
            loss.backward()
            clip_gradients(model, loop.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            step_metrics = {"train/loss": loss.item(), "train/accuracy": (chosen > rejected).float().mean().item(), "epoch": epoch}
            if step % loop.eval_every == 0 or step == steps:
                step_metrics |= evaluate(model, splits.eval, tokenizer, device, loop.batch_size)
                log.info(
                    "step %d/%d | loss %.4f | train accuracy %.3f | eval accuracy %.3f",
                    step, steps, step_metrics["train/loss"], step_metrics["train/accuracy"], step_metrics["eval/accuracy"],
                )
            if writer is not None:
                for key, value in step_metrics.items():
                    writer.add_scalar(key, value, step)
            metrics = {k: v for k, v in step_metrics.items() if k.startswith("eval/")} or metrics
    if writer is not None:
        writer.close()
    save_dir = reward_model_dir(job, out)
    save_hf_folder(save_dir, model, tokenizer, owner=REWARD_MODEL)
    log.info("eval accuracy %.3f; reward model saved to %s (use: reward=model reward.path=%s)", metrics["eval/accuracy"], save_dir, save_dir)
    return metrics


def reward_model_dir(job: RewardTrainConfig, out: Path) -> Path:
    """Where the trained reward model goes: `save_dir` (made absolute: `save_dir=.` names the folder itself), or
    `<run folder>/reward_model`."""
    return Path(os.path.abspath(os.path.expanduser(job.save_dir))) if job.save_dir else out / "reward_model"


def typed(cfg: DictConfig) -> RewardTrainConfig:
    """The composed config ``cfg`` as its schema's object, read by everything after `check_unknown_keys` (a copy:
    changing it changes no config)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RewardTrainConfig), cfg))


def main() -> float:
    """`python -m rlhf.train_reward`: a key the schema lacks (`output_dir=`, a misspelt `train.lrr=`) is refused (exit
    2) with the key to use before Hydra composes, then `run`."""
    try:
        check_command_line(sys.argv[1:], "train_reward")
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(exits.CONFIG_ERROR) from None
    try:
        return run()
    except SystemExit as exit:  # `run` ends with this project's codes, Hydra with 1 for its own errors
        raise SystemExit(exits.of_hydra(exit.code)) from None


@hydra.main(config_path="pkg://rlhf.conf", config_name="train_reward", version_base="1.3")
def run(cfg: DictConfig) -> float:
    """Exit codes as `rlhf.train` (`rlhf.exits`): 2 config error or a folder in use, 6 an error while training."""
    out = Path(HydraConfig.get().runtime.output_dir)
    try:  # before any model loads: hub names are reachable (`rlhf.checks.hub`), the folders written are writable and have
        # room for the model (`rlhf.run.preflight`)
        check_unknown_keys(cfg, RewardTrainConfig)  # `+key=value` composes even into the typed schema
        job = typed(cfg)
        hub.check_sources(cfg)
        preflight.check_outputs(preflight.reward_outputs(job, out, reward_model_dir(job, out)))
        with folder_lock(out, "run folder (hydra.run.dir)"):
            with folder_lock(reward_model_dir(job, out), "save_dir", beside=True):
                return train(job, out)["eval/accuracy"]
    except ConfigError as err:
        log.error("config error: %s", err)
        raise SystemExit(exits.CONFIG_ERROR) from None
    except Exception as err:  # a user preference builder, a full disk, or a bug: a paragraph, not a traceback
        raise SystemExit(exits.report_run_error(err)) from None


if __name__ == "__main__":
    main()
