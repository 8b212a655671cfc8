"""The tiny task's settings stay with the tiny models: a run that swaps another model into a tiny model's preset is
told which values it inherited from that preset, and how to start from the defaults made for real models."""

from __future__ import annotations

from importlib import resources

from omegaconf import OmegaConf

from rlhf.models.loading import BUILTIN_PREFIX

INHERITED = ("generator.max_new_tokens", "train.lr", "train.prompts_per_step", "train.micro_batch_size", "eval.max_prompts")


def has_task_settings(model_choice: str | None) -> bool:
    """Whether the model preset brings task settings of its own: conf/task/<choice>.yaml, which conf/config.yaml's
    `optional task: ${model}` applies (the tiny models')."""
    return bool(model_choice) and (resources.files("rlhf.conf") / "task" / f"{model_choice}.yaml").is_file()


def tiny_settings_warning(cfg, model_choice: str | None) -> str | None:
    """The warning for a run whose `model.name_or_path` is not a built-in model while ``model_choice`` (the `model=`
    group choice) is a tiny model's preset, whose tiny-task values the run would train with; None otherwise."""
    if not has_task_settings(model_choice) or OmegaConf.is_missing(cfg.model, "name_or_path"):
        return None
    name = cfg.model.name_or_path
    if name.startswith(BUILTIN_PREFIX):
        return None
    values = ", ".join(f"{key}={OmegaConf.select(cfg, key)}" for key in INHERITED)
    return (
        f"model.name_or_path={name} replaces the built-in model of model={model_choice}, but that preset's tiny-task "
        f"settings stay ({values}; conf/task/tiny.yaml), which suit an 83k-parameter model, not yours. Start from the "
        f"defaults made for real models with model=custom model.name_or_path={name} (or a preset of your model, "
        f"e.g. model=smollm2_135m_instruct), then set those keys for your task"
    )
