"""The prompt budget a model leaves: its context (positions) minus the response budget `generator.max_new_tokens`."""

from __future__ import annotations

from transformers import AutoConfig

from rlhf.errors import ConfigError
from rlhf.models.loading import resolve_model_path

POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(model_config) -> int | None:
    """The positions a model config declares (its own, or its text model's); None when it declares none."""
    for config in (model_config, getattr(model_config, "text_config", None)):
        for name in POSITION_KEYS:
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def model_context(model_cfg, name_or_path: str | None = None) -> int | None:
    """The context length of `model.name_or_path` (or of ``name_or_path``, another model of the run, e.g. the teacher),
    read from its config.json alone (no weights load)."""
    path = resolve_model_path(name_or_path or model_cfg.name_or_path)
    config = AutoConfig.from_pretrained(path, revision=None if name_or_path else model_cfg.revision,
                                        trust_remote_code=model_cfg.trust_remote_code)
    return context_length(config)


def check_teacher_context(longest: int, context: int | None, teacher_name: str, longest_from: str) -> None:
    """ConfigError unless the teacher, which scores every row whole, has room for the longest row (``longest`` tokens,
    bounded by the keys ``longest_from`` names)."""
    if context is not None and longest > context:
        raise ConfigError(
            f"teacher.name_or_path={teacher_name} has a {context}-token context, shorter than the longest row this run "
            f"can produce ({longest} tokens: {longest_from}), which the teacher scores whole; give a teacher with a "
            f"longer context, or lower {longest_from.split(' + ')[-1]}"
        )


def check_prompt_budget(max_prompt_length: int, max_new_tokens: int, context: int | None, model_name: str) -> None:
    """ConfigError unless a prompt of `dataset.max_prompt_length` tokens plus the response fits the model's context."""
    if context is None:
        return
    budget = context - max_new_tokens
    if budget < 1:
        raise ConfigError(
            f"generator.max_new_tokens={max_new_tokens} leaves no room for a prompt in "
            f"model.name_or_path={model_name}, whose context is {context} tokens; lower generator.max_new_tokens "
            f"below {context}"
        )
    if max_prompt_length > budget:
        raise ConfigError(
            f"dataset.max_prompt_length={max_prompt_length} + generator.max_new_tokens={max_new_tokens} = "
            f"{max_prompt_length + max_new_tokens} tokens exceeds the {context}-token context of "
            f"model.name_or_path={model_name} (max_position_embeddings); set dataset.max_prompt_length<={budget} "
            f"(longer prompts are then dropped and counted) or lower generator.max_new_tokens"
        )


def check_episode_budget(max_tokens: int, context: int | None, model_name: str) -> None:
    """ConfigError unless an episode of `env.max_tokens` tokens (prompt, actions and observations) fits the model's
    context: longer rows would train on positions the model never had."""
    if context is not None and max_tokens > context:
        raise ConfigError(
            f"env.max_tokens={max_tokens} is longer than the {context}-token context of model.name_or_path={model_name}; "
            f"set env.max_tokens<={context} (an episode that reaches it ends as truncated), or use a model with a "
            f"longer context"
        )
