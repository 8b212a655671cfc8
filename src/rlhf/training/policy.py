"""The trained policy: a causal LM under a training strategy (single process, or one rank of DDP/FSDP2/DeepSpeed).

A factory registered as kind ``policy`` is called as
``factory(cfg=<policy config>, model_cfg=..., train_cfg=..., total_optimizer_steps=int, device=..., temperature=float)`` and
returns an object with the methods of `TorchPolicy` used by `rlhf.step.learner` and `rlhf.checks.parity`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf.disk import TRAIN_ADAPTER, TRAIN_EXPORT
from rlhf.models.hf_folder import save_hf_folder
from rlhf.models import lora, packing
from rlhf.models.dtypes import DTYPES
from rlhf.models.loading import load_causal_lm
from rlhf.micro_batches import Budget, window_outputs
from rlhf.parts import choose
from rlhf.models.logprobs import logprob_chunk, window_logprobs
from rlhf.training.trainable import TrainableModel, compile_blocks
from rlhf.registry import register
from rlhf.trajectory import Forward, Trajectories


SHARING = {True: "wherever rows share it", None: "where it pays"}  # `describe`'s words for model.shared_prefix


@register("policy", "torch")
class TorchPolicy(TrainableModel):
    """A causal LM trained with AdamW under `policy.strategy`; see `TrainableModel` for the optimisation methods.
    Every logprob is taken at ``temperature``, the generator's sampling temperature (`generator.temperature`)."""

    def __init__(
        self, cfg, model_cfg, train_cfg, total_optimizer_steps: int, device: torch.device, temperature: float = 1.0
    ) -> None:
        self.cfg, self.train_cfg, self.temperature = cfg, train_cfg, temperature
        self.chunk = logprob_chunk(model_cfg, device)  # the fused output layer's chunk; 0 = plain logits
        self.share = getattr(model_cfg, "shared_prefix", None)  # rows of one prompt laid out once: True, False, None = where it pays
        model = load_causal_lm(model_cfg.name_or_path, "float32", model_cfg.revision, model_cfg.trust_remote_code, device)
        packing.enable(model)
        self.lora = cfg.lora if lora.enabled(cfg.lora) else None
        if self.lora is not None:
            model = lora.add_adapters(model, self.lora)
        self.compiled_blocks = compile_blocks(model, cfg.activation_memory_budget) if cfg.compile else 0
        super().__init__(
            model, train_cfg, train_cfg.lr, total_optimizer_steps, cfg.gradient_checkpointing, DTYPES[model_cfg.dtype],
            choose("strategy", cfg.strategy, "policy.strategy"),
        )

    def describe(self) -> str:
        """One log line: what trains (every weight, or LoRA adapters), and the optimiser state it needs."""
        counts = lora.trainable_summary(self.model)
        what = "every weight" if self.lora is None else f"LoRA adapters (rank {self.lora.rank}, alpha {self.lora.alpha:g})"
        sync = "every weight" if self.lora is None else (
            f"{counts['adapted'] * 4 / 2**20:.2f} of {(counts['total'] - counts['trainable']) * 4 / 2**20:.2f} MiB "
            f"(the adapted layers merged, with the layers beside them)"
        )
        return (
            f"policy trains {what}: {counts['trainable']:,} of {counts['total']:,} parameters "
            f"({100.0 * counts['trainable'] / max(1, counts['total']):.2f}%), AdamW state "
            f"{counts['optimizer_state_bytes'] / 2**20:.2f} MiB" + (" on this rank" if self.strategy.world_size > 1 else "")
            + f"; weight sync per step: {sync}"
            + (f"; {self.compiled_blocks} decoder blocks compiled (policy.compile)" if self.compiled_blocks else "")
            + ("; micro batches packed (no token-wise layer computes padding)" if self.packs() else
               "; rows padded per micro batch (this model's attention takes no packed rows)")
            + (f"; a group's prompt laid out once {SHARING[self.share]} (model.shared_prefix)" if self.packs() and self.share is not False else "")
        )

    def packs(self) -> bool:
        """Whether the training forwards pack each micro batch's rows end to end (`rlhf.models.packing`)."""
        return packing.packs(self.module)

    def logprobs(self, batch: Trajectories, with_entropy: bool = False, entropy_grad: bool = True):
        """(logprobs (B, T), entropy or None) of the action window, with gradients enabled, in float32."""
        with self.autocast():
            return window_logprobs(self.module, batch, self.temperature, with_entropy, entropy_grad, self.chunk, self.share)

    def rollout_logprobs(self, batch: Trajectories, chunk: int | Budget, with_entropy: bool = False):
        """`logprobs` without gradients, micro batches of ``chunk`` rows (or a `Budget`): (logprobs (B, T), entropy
        (B, T) or None)."""
        return window_outputs(lambda part: self.logprobs(part, with_entropy), batch, chunk, equal_count=True, share=self.share)

    def base_logprobs(self, batch: Trajectories, chunk: int | Budget) -> torch.Tensor:
        """The base model's logprobs (B, T), adapters switched off, no gradients: the reference of a LoRA policy."""
        if self.lora is None:
            raise RuntimeError("base_logprobs needs policy.lora: without adapters the policy has no separate base model")
        with self.model.disable_adapter():
            return self.rollout_logprobs(batch, chunk)[0]

    def train_forward(self, micro: Trajectories, with_entropy: bool, record: bool = False):
        """(micro, Forward(logp, entropy when ``with_entropy``) with gradients, the forward detached or None): the
        training forward of `rlhf.step.learner.accumulate`.

        ``record``: also return the forward's logprobs and entropy, detached (the entropy then computed outside the
        graph unless the loss uses it), for the pre-update logprobs' metrics (`OldLogprobs.TRAINING`).
        """
        logp, entropy = self.logprobs(micro, with_entropy or record, entropy_grad=with_entropy)
        recorded = Forward(logp=logp.detach(), entropy=entropy.detach()) if record else None
        return micro, Forward(logp=logp, entropy=entropy if with_entropy else None), recorded

    def export(self, path: Path, tokenizer) -> None:
        """The policy as a plain Hugging Face folder (safetensors, config, tokenizer), adapters merged in; with LoRA
        also the adapters alone as a PEFT folder, `final_adapter` beside ``path``. Every rank calls it."""
        weights = self.full_state_dict()
        if self.strategy.rank != 0:
            return
        if self.lora is None:
            save_hf_folder(path, self.model, tokenizer, owner=TRAIN_EXPORT, state_dict=weights, safe_serialization=True)
            return
        merged = lora.merged_weights(weights, lora.scaling(self.lora), adapted_only=False)
        save_hf_folder(path, self.model.get_base_model(), tokenizer, owner=TRAIN_EXPORT, state_dict=merged, safe_serialization=True)
        save_hf_folder(
            path.parent / "final_adapter", self.model, tokenizer, owner=TRAIN_ADAPTER, state_dict=weights,
            safe_serialization=True,
        )

    def state_dict(self, adapted_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The weights the generator loads (rank 0; None on other ranks), under the base model's names.

        Full fine-tuning: every weight. LoRA: the weights with the adapters merged in; ``adapted_only`` keeps just
        the adapted layers' (the only ones a step changes), for a generator that still holds the rest."""
        weights = self.full_state_dict()
        if self.lora is None or weights is None:
            return weights
        return lora.merged_weights(weights, lora.scaling(self.lora), adapted_only)
