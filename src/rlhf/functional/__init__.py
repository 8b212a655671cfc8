"""The RL math as pure tensor functions: no models, no config, each testable on hand-made tensors.

Shapes: B = sequences in a batch, T = response tokens, V = vocabulary, G = samples per prompt.
"""

from rlhf.functional.advantages import (
    baseline_advantages,
    group_normalized_advantages,
    rloo_advantages,
    to_token_level,
)
from rlhf.functional.kl import kl_per_token
from rlhf.functional.logprobs import entropy_from_logits, logprobs_from_logits
from rlhf.functional.losses import aggregate_loss, clipped_policy_loss, loss_denominator
from rlhf.functional.masked import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "baseline_advantages",
    "group_normalized_advantages",
    "rloo_advantages",
    "to_token_level",
    "kl_per_token",
    "entropy_from_logits",
    "logprobs_from_logits",
    "aggregate_loss",
    "clipped_policy_loss",
    "loss_denominator",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]
