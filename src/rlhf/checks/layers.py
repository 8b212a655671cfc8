"""The layers a run's training settings name exist in its models, asked before any weights load."""

from __future__ import annotations

from rlhf.models import lora, packing
from rlhf.training.critic import critic_init_path
from rlhf.training.trainable import check_compilable


def check_trained_layers(spec) -> None:
    """ConfigError before any weights load (each model built on the meta device from its config) when `policy.lora`,
    or a trained critic's `critic.lora`, targets layers the model lacks or a rank past their width, or `policy.compile`
    finds no decoder blocks, or `model.shared_prefix=true` meets a model that takes no packed rows: the run's build
    and `python -m rlhf.plan` ask the same (``spec``: the run, `rlhf.config.RunSpec`)."""
    lora.check_targets(spec.policy.lora, spec.model)
    check_compilable(spec.policy, spec.model)
    packing.check_shared_prefix(spec.model)
    if spec.algorithm.needs_critic:
        lora.check_targets(spec.critic.lora, spec.model, "critic.lora", critic_init_path(spec))
        packing.check_shared_prefix(spec.model, critic_init_path(spec))
