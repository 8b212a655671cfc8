"""The trained policy: single-process torch on CPU or one GPU.

A factory registered as kind ``policy`` is called as
``factory(cfg=<policy config>, model_cfg=..., train_cfg=..., total_optimizer_steps=int, device=...)`` and
returns an object with the methods of `TorchPolicy` used by `rlhf.stages`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf.generators.base import Rollout
from rlhf.models.dtypes import DTYPES
from rlhf.models.loading import load_causal_lm
from rlhf.models.logprobs import response_logprobs
from rlhf.models.trainable import TrainableModel, clip_and_step, lr_lambda, make_optimizer  # noqa: F401 (re-exported)
from rlhf.registry import register


@register("policy", "torch")
class TorchPolicy(TrainableModel):
    """A causal LM trained with AdamW; see `TrainableModel` for the optimisation methods."""

    def __init__(self, cfg, model_cfg, train_cfg, total_optimizer_steps: int, device: torch.device) -> None:
        self.cfg, self.train_cfg = cfg, train_cfg
        model = load_causal_lm(model_cfg.name_or_path, "float32", model_cfg.revision, model_cfg.trust_remote_code, device)
        super().__init__(
            model, train_cfg, train_cfg.lr, total_optimizer_steps, cfg.gradient_checkpointing, DTYPES[model_cfg.dtype]
        )

    def logprobs(self, rollout: Rollout, temperature: float, with_entropy: bool = False):
        """(logprobs (B, Lr), entropy or None) with gradients enabled, in float32."""
        with self.autocast():
            return response_logprobs(self.model, rollout, temperature, with_entropy)

    def export(self, path: Path, tokenizer) -> None:
        """The policy as a plain Hugging Face folder (safetensors, config, tokenizer)."""
        self.model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model weights, as the generator loads them."""
        return self.model.state_dict()
