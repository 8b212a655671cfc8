"""The critic: a value model trained alongside the policy (PPO).

A factory registered as kind ``critic`` is called as ``factory(cfg=<critic config>, model_cfg=...,
init_path=str, train_cfg=..., total_optimizer_steps=int, device=...)`` and returns an object with
``values(batch)``, ``rollout_values(batch, chunk)``, ``train_forward`` and the optimisation methods of
`TrainableModel`.
"""

from __future__ import annotations

import torch

from rlhf.models.dtypes import DTYPES
from rlhf.micro_batches import Budget, window_outputs
from rlhf.parts import choose
from rlhf.training.trainable import TrainableModel
from rlhf.models import lora, packing
from rlhf.models.value import ValueModule, load_value_model, score_head, window_values
from rlhf.registry import register
from rlhf.trajectory import Forward, Trajectories


def critic_init_path(cfg) -> str:
    """The critic's starting weights: `critic.name_or_path`, else the reward model, else the policy's model (``cfg``:
    the config, or the run's `RunSpec`, whose sections of those names are typed)."""
    return cfg.critic.name_or_path or cfg.reward.path or cfg.model.name_or_path


@register("critic", "torch")
class TorchCritic(TrainableModel):
    """A value model with its own AdamW optimiser and learning rate (`critic.lr`, default `train.lr`)."""

    def __init__(self, cfg, model_cfg, init_path: str, train_cfg, total_optimizer_steps: int, device: torch.device) -> None:
        self.cfg = cfg
        self.share = getattr(model_cfg, "shared_prefix", None)  # rows of one prompt laid out once: True, False, None = where it pays
        model = load_value_model(init_path, "float32", None, model_cfg.trust_remote_code, device)
        packing.enable(model)
        scorer = model
        if lora.enabled(cfg.lora):  # adapters on the backbone, the value head trained whole
            model = lora.add_adapters(model, cfg.lora, head=score_head(model)[0])
            scorer = model.get_base_model()  # the same modules, adapters inside
        lr = cfg.lr if cfg.lr is not None else train_cfg.lr
        super().__init__(
            model, train_cfg, lr, total_optimizer_steps, cfg.gradient_checkpointing, DTYPES[model_cfg.dtype],
            choose("strategy", cfg.strategy, "critic.strategy"), module=ValueModule(scorer),
        )

    def values(self, batch: Trajectories) -> torch.Tensor:
        """V(s_t) before each window token, with gradients, in float32. Shape: (B, T)."""
        with self.autocast():
            return window_values(self.module, batch, self.share)

    def rollout_values(self, batch: Trajectories, chunk: int | Budget) -> torch.Tensor:
        """`values` without gradients, micro batches of ``chunk`` rows (or a `Budget`). Shape: (B, T)."""
        return window_outputs(self.values, batch, chunk, equal_count=True, share=self.share)

    def train_forward(self, micro: Trajectories, with_entropy: bool, record: bool = False):
        """(micro, Forward(values) with gradients, the values detached when ``record`` or None): the training forward
        of `rlhf.step.learner.accumulate` (``with_entropy`` concerns the policy only)."""
        values = self.values(micro)
        return micro, Forward(values=values), Forward(values=values.detach()) if record else None
