"""Scalar-head models on a causal LM backbone: reward models (score at the last token) and critics (every token).

Both load with `AutoModelForSequenceClassification` (num_labels=1), so a reward model saved here is a
normal Hugging Face folder, and a critic can start from a reward model (as open-instruct's PPO does) or from the
policy's causal LM (the head is then new).
"""

from __future__ import annotations

import logging
import math

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification
from transformers.utils import logging as hf_logging

from rlhf.functional import last_token_index
from rlhf.models.logprobs import forward_layout
from rlhf.trajectory import Trajectories, real_positions
from rlhf.models.dtypes import DTYPES
from rlhf.models.loading import check_weight_files, disable_dropout, resolve_model_path, zero_dropout_config

HEAD_NAMES = ("score", "classifier", "v_head")

log = logging.getLogger(__name__)


def score_head(model: torch.nn.Module) -> tuple[str, torch.nn.Linear]:
    """(attribute name, module) of the scalar head."""
    for name in HEAD_NAMES:
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear) or isinstance(getattr(head, "original_module", None), torch.nn.Linear):
            return name, head  # a peft LoRA critic trains its head whole: peft wraps it (modules_to_save)
    raise ValueError(f"{type(model).__name__} has no scalar head named one of {HEAD_NAMES}")


def init_score_head(head: torch.nn.Linear, hidden_size: int) -> None:
    """Normal init with std 1/sqrt(hidden + 1) and zero bias (Stiennon et al., 2020)."""
    torch.nn.init.normal_(head.weight, std=1.0 / math.sqrt(hidden_size + 1))
    if head.bias is not None:
        torch.nn.init.zeros_(head.bias)


def load_value_model(
    name_or_path: str,
    dtype: str = "float32",
    revision: str | None = None,
    trust_remote_code: bool = False,
    device: torch.device | str = "cpu",
    new_head_ok: bool = True,
    key: str | None = None,
) -> torch.nn.Module:
    """A sequence-classification model with one output, dropout off; a head absent from the checkpoint is
    initialised with std 1/sqrt(hidden + 1), or is an error when ``new_head_ok`` is false (a reward model).
    ``key`` (e.g. `reward.path`) is the config key errors about damaged weight files name."""
    check_weight_files(name_or_path, key)
    path = resolve_model_path(name_or_path)
    config = zero_dropout_config(AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code))
    config.num_labels = 1
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a missing head is expected when starting from a causal LM; we report it below
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, config=config, revision=revision, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    name, head = score_head(model)
    if any(key.startswith(name + ".") or key == name for key in info["missing_keys"]):
        if not new_head_ok:
            raise ValueError(
                f"{name_or_path} has no trained `{name}` head (checkpoint keys it did not use: "
                f"{sorted(info['unexpected_keys'])[:5]}); save the reward model with AutoModelForSequenceClassification "
                f"(num_labels=1), e.g. via `python -m rlhf.train_reward`"
            )
        init_score_head(head, model.config.hidden_size)
        log.info("%s: new scalar head `%s` initialised with std 1/sqrt(%d + 1)", name_or_path, name, model.config.hidden_size)
    if model.config.pad_token_id is None and getattr(model.config, "eos_token_id", None) is not None:
        eos = model.config.eos_token_id
        model.config.pad_token_id = eos[0] if isinstance(eos, list) else eos  # lets HF's own forward batch this model
    return disable_dropout(model).to(device)


def token_scores(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor, **attention
) -> torch.Tensor:
    """The scalar head at every position; ``attention``: packed rows' arguments (`rlhf.models.packing`), passed to
    the attention layers. Shape: (B, L) -> (B, L)."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **attention).last_hidden_state
    return score_head(model)[1](hidden).squeeze(-1).float()


class ValueModule(torch.nn.Module):
    """`token_scores` as a module, so a training strategy (DDP, FSDP2, DeepSpeed) can wrap the critic's forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **attention
    ) -> torch.Tensor:
        return token_scores(self.model, input_ids, attention_mask, position_ids, **attention)


def window_values(scorer: torch.nn.Module, batch: Trajectories, share: bool | None = False) -> torch.Tensor:
    """Critic values V(s_t) of the state before each window token. Shape: (B, T), 0 outside the loss mask.

    ``scorer`` maps keyword inputs (input_ids, position_ids, attention_mask or packed rows' arguments) to per-token
    scores: a `ValueModule`, possibly wrapped by a training strategy. The rows are laid out as for the policy's
    logprobs (`logprobs.forward_layout`, shared-prefix as ``share`` asks).
    """
    inputs, predicts, _, pick = forward_layout(scorer, batch, share)
    return pick(scorer(**inputs), predicts) * batch.loss_mask


def sequence_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The head at each sequence's last real token (prompt + response). Shape: (B, L) -> (B,)."""
    scores = token_scores(model, input_ids, attention_mask, real_positions(attention_mask))
    return scores[torch.arange(scores.shape[0], device=scores.device), last_token_index(attention_mask)]
