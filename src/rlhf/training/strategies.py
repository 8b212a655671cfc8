"""Training strategies: how one trained model computes gradients and steps, alone or sharded over ranks.

``single`` is one process. ``ddp``, ``fsdp2`` and ``deepspeed`` run one copy per rank of a torch.distributed
group (gloo on CPU, NCCL on GPU) that the caller has already initialised. Every strategy keeps float32 master
weights. With ``compute_dtype`` bfloat16 (`model.dtype`) and `train.mixed_precision=master` the model computes in
bf16 throughout: ``single`` holds bf16 weights and float32 masters in the optimiser (`MasterWeightsStrategy`),
``fsdp2`` casts its float32 shards to bf16 for compute and reduces gradients in float32 (`MixedPrecisionPolicy`),
``deepspeed`` runs its own bf16 mode. ``ddp``, and `train.mixed_precision=autocast`, keep float32 weights and run the
forwards under bf16 autocast.

Loss convention: a micro batch's loss is its share of the *global* mini-batch loss (the denominator counts every
rank's tokens). DDP, FSDP2 and DeepSpeed average gradients over ranks, so `backward` multiplies by the world size
to turn that average back into the sum. The same step therefore gives the same update at every world size.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from rlhf.collectives import world
from rlhf.errors import ConfigError, require
from rlhf.models.lora import adapter_state, has_adapters, to_model_names
from rlhf.parts import Part, PartConfig
from rlhf.registry import register
from rlhf.training.master_weights import MasterWeights
from rlhf.training.optim import clip_and_step, clip_gradients, load_trainable, make_optimizer, save_trainable, step_if_finite



@dataclass
class StrategyConfig(PartConfig):
    """A strategy's node (`policy.strategy`, `critic.strategy`): auto, single and ddp have no key but `name`. The class
    attributes below are not keys; they say what a strategy that declares none of them shards and offloads: nothing.
    The memory plan reads them from every strategy alike."""

    zero_stage = 0  # not a key here: deepspeed's ZeRO stage
    offload_optimizer = False  # not a key here: fsdp2's and deepspeed's
    offload_params = False  # not a key here: fsdp2's and deepspeed's


@dataclass
class FSDP2Config(StrategyConfig):
    offload_optimizer: bool = False  # optimiser state (and its step) on the CPU
    offload_params: bool = False  # parameters on the CPU between uses


@dataclass
class DeepSpeedConfig(StrategyConfig):
    zero_stage: int = 2  # ZeRO stage 1 (shards optimiser state), 2 (also gradients) or 3 (also parameters)
    offload_optimizer: bool = False  # optimiser state on the CPU (DeepSpeed's offload_optimizer)
    offload_params: bool = False  # parameters on the CPU between uses; zero_stage 3 only

    def check(self, at: str) -> None:
        require(1 <= self.zero_stage <= 3,
                f"{at}.zero_stage={self.zero_stage} must be 1, 2 or 3 (for plain data parallelism choose {at.replace('.', '/')}=ddp)")
        require(not self.offload_params or self.zero_stage == 3,
                f"{at}.offload_params needs {at}.zero_stage=3 (got {self.zero_stage}): only ZeRO-3 shards the parameters it offloads")


def strip_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Keys of ``state`` with ``prefix`` removed (the HF model's own names inside a wrapper module)."""
    return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items()}


@register("strategy", "single")
class SingleStrategy:
    """One process: plain AdamW on the module, optional bf16 autocast.

    ``model`` is the Hugging Face model (saved and exported); ``module`` is what forward passes call (the model
    itself, or a wrapper holding it as ``module.model`` such as the critic's per-token value head).
    """

    name = "single"
    config = StrategyConfig  # its node: `name` only
    single_device = True  # trains on one device: a role of one rank
    needs_process_group = False  # runs in the driver's process (cluster.backend local or ray)
    takes_compiled_blocks = True  # policy.compile: decoder blocks compiled before the strategy wraps the model
    takes_lora_critic = True  # critic.lora: adapters on the critic's backbone, its value head trained whole

    def __init__(self, model, module, train_cfg, lr: float, total_steps: int, compute_dtype: torch.dtype, strategy_cfg) -> None:
        self.model = model
        self.compute_dtype = compute_dtype
        self.max_grad_norm = train_cfg.max_grad_norm
        self.precision = train_cfg.mixed_precision
        self.rank, self.world_size = world()
        self._prefix = "" if module is model else "model."
        self.inner = module  # the unwrapped module (DDP and DeepSpeed wrap it; FSDP2 shards it in place)
        self.module = self.wrap(module, train_cfg, lr, total_steps, strategy_cfg)

    def wrap(self, module, train_cfg, lr: float, total_steps: int, strategy_cfg):
        """Build the optimiser (and any distributed wrapper); returns the module forwards call."""
        self.optimizer, self.scheduler = make_optimizer(module, train_cfg, lr, total_steps)
        return module

    def autocast(self):
        """The context forward passes run in: bf16 autocast, or nothing for float32."""
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=next(self.model.parameters()).device.type, dtype=self.compute_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of ``loss`` (a share of the global mini-batch loss)."""
        (loss * self.world_size if self.world_size > 1 else loss).backward()

    def optimizer_step(self) -> float:
        """Clip and apply the accumulated gradients, unless their norm is non-finite (then nothing changes).

        Clears the gradients either way; returns the pre-clip norm.
        """
        return clip_and_step(self.module, self.optimizer, self.scheduler, self.max_grad_norm)

    def zero_grad(self) -> None:
        """Drop accumulated gradients without stepping (a skipped step)."""
        self.optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full, unsharded weights under the HF model's names on rank 0 (None on other ranks): on the model's
        device for `single` and `ddp`, on the CPU for sharded strategies.

        A collective under sharded strategies: every rank must call it.
        """
        state = strip_prefix(self.inner.state_dict(), self._prefix)
        return {k: v.detach() for k, v in state.items()} if self.rank == 0 else None

    def save(self, path: Path) -> None:
        """Weights (HF folder) plus optimiser and schedule, in ``path``; every rank calls it."""
        if self.rank == 0:
            save_trainable(path, self.model, self.optimizer, self.scheduler)

    def load(self, path: Path) -> None:
        load_trainable(path, self.model, self.optimizer, self.scheduler)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @property
    def adapters_only(self) -> bool:
        """Whether the model trains LoRA adapters on frozen base weights: its checkpoints hold the adapters only."""
        return has_adapters(self.model)


class MasterWeightsStrategy(SingleStrategy):
    """`single` computing in bf16: bf16 weights, float32 masters that the (fused, on CUDA) AdamW updates, gradients
    accumulated in float32 (`rlhf.training.master_weights`). Checkpoints keep the masters, so a resumed run continues
    from the same float32 weights; `full_state_dict` (weight pushes, exports) gives the bf16 weights."""

    name = "single"

    def wrap(self, module, train_cfg, lr: float, total_steps: int, strategy_cfg):
        self.master = MasterWeights(module, self.compute_dtype)
        self.optimizer, self.scheduler = make_optimizer(self.master.masters, train_cfg, lr, total_steps)
        return module

    def autocast(self):
        return nullcontext()  # the weights are bf16 already

    def optimizer_step(self) -> float:
        norm = step_if_finite(clip_gradients(self.master.masters, self.max_grad_norm), self.optimizer, self.scheduler)
        if math.isfinite(norm):
            self.master.copy_to_weights()
        self.master.zero_grad()
        return norm

    def zero_grad(self) -> None:
        self.master.zero_grad()

    def save(self, path: Path) -> None:
        save_trainable(path, self.model, self.optimizer, self.scheduler, state_dict=self.master.state_dict(self.model))

    def load(self, path: Path) -> None:
        self.master.load(self.model, load_trainable(path, self.model, self.optimizer, self.scheduler))


@register("strategy", "ddp")
class DDPStrategy(SingleStrategy):
    """torch DistributedDataParallel: a full replica per rank, gradients all-reduced in every backward."""

    name = "ddp"
    single_device = False
    needs_process_group = True  # one process per rank (cluster.backend=ray)

    def wrap(self, module, train_cfg, lr, total_steps, strategy_cfg):
        device = next(module.parameters()).device
        ddp = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
        self.optimizer, self.scheduler = make_optimizer(module, train_cfg, lr, total_steps)
        return ddp


def shard_units(module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one: modules whose class HF lists in ``_no_split_modules``."""
    names = set(getattr(module, "_no_split_modules", None) or getattr(getattr(module, "model", None), "_no_split_modules", None) or [])
    return [m for m in module.modules() if type(m).__name__ in names]


@register("strategy", "fsdp2")
class FSDP2Strategy(SingleStrategy):
    """torch FSDP2 (`fully_shard`): parameters, gradients and optimiser state sharded over ranks per block."""

    name = "fsdp2"
    config = FSDP2Config
    single_device = False
    needs_process_group = True
    takes_lora_critic = False  # not built yet: the adapters' and the whole head's shards

    @property
    def computes_low(self) -> bool:
        """Whether FSDP2 itself casts to the compute dtype (`train.mixed_precision=master`), so no autocast."""
        return self.compute_dtype != torch.float32 and self.precision == "master"

    def autocast(self):
        return nullcontext() if self.computes_low else super().autocast()

    def wrap(self, module, train_cfg, lr, total_steps, strategy_cfg):
        wanted = strategy_cfg.offload_params or strategy_cfg.offload_optimizer
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if wanted else OffloadPolicy()
        mixed = MixedPrecisionPolicy() if not self.computes_low else MixedPrecisionPolicy(
            param_dtype=self.compute_dtype, reduce_dtype=torch.float32
        )
        for block in shard_units(module):
            fully_shard(block, offload_policy=offload, mp_policy=mixed)
        fully_shard(module, offload_policy=offload, mp_policy=mixed)
        self.optimizer, self.scheduler = make_optimizer(module, train_cfg, lr, total_steps)
        return module

    def _options(self, **kwargs):
        return StateDictOptions(full_state_dict=True, cpu_offload=True, **kwargs)

    def full_state_dict(self):
        state = strip_prefix(get_model_state_dict(self.module, options=self._options()), self._prefix)
        return state if self.rank == 0 else None

    def save(self, path: Path) -> None:
        """Full (unsharded) weights and optimiser state, so a run may resume at another world size."""
        weights = self.full_state_dict()
        optim = get_optimizer_state_dict(self.module, self.optimizer, options=self._options())
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(path / "model", state_dict=weights, safe_serialization=True)
            torch.save({"optimizer": optim, "scheduler": self.scheduler.state_dict()}, path / "optim.pt")

    def load(self, path: Path) -> None:
        weights = {}
        for shard in sorted((path / "model").glob("*.safetensors")):
            weights |= load_file(shard)
        if self.adapters_only:  # adapter tensors only, under peft's saved names
            weights = to_model_names(weights)
            expected = set(adapter_state(self.model.state_dict()))
            if set(weights) != expected:
                raise ConfigError(
                    f"checkpoint {path} does not match the model's LoRA adapters: {sorted(set(weights) ^ expected)[:3]}; "
                    f"resume with the LoRA settings it trained (<role>.lora.* as its config.yaml records)"
                )
        if self._prefix:
            weights = {self._prefix + k: v for k, v in weights.items()}
        set_model_state_dict(self.module, weights, options=self._options(strict=False))
        state = torch.load(path / "optim.pt", weights_only=True)
        set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"], options=self._options())
        self.scheduler.load_state_dict(state["scheduler"])


def deepspeed_config(strategy_cfg, train_cfg, compute_dtype: torch.dtype) -> dict:
    """The DeepSpeed config of `<model>.strategy.*`: ZeRO stage, offload, clipping, bf16; we own accumulation."""
    zero: dict = {"stage": strategy_cfg.zero_stage}
    if strategy_cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if strategy_cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": 1,  # unused: batches are cut by the orchestrator
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # backward() only accumulates; step() reduces and updates
        "gradient_clipping": train_cfg.max_grad_norm if train_cfg.max_grad_norm > 0 else 0.0,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,  # our torch AdamW, so every strategy runs the same optimiser
        "bf16": {"enabled": compute_dtype == torch.bfloat16},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


@register("strategy", "deepspeed")
class DeepSpeedStrategy(SingleStrategy):
    """DeepSpeed ZeRO 1-3 with optional optimiser/parameter offload; DeepSpeed clips and skips non-finite steps."""

    name = "deepspeed"
    config = DeepSpeedConfig
    single_device = False
    needs_process_group = True
    takes_compiled_blocks = False  # DeepSpeed wraps the blocks its own way
    takes_lora_critic = False  # not built yet

    def wrap(self, module, train_cfg, lr, total_steps, strategy_cfg):
        import deepspeed

        self.optimizer, self.scheduler = make_optimizer(module, train_cfg, lr, total_steps)
        self.stage = strategy_cfg.zero_stage
        engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=self.optimizer, lr_scheduler=self.scheduler,
            config=deepspeed_config(strategy_cfg, train_cfg, self.compute_dtype),
        )
        self.engine = engine
        return engine

    def autocast(self):
        return nullcontext()  # bf16 is DeepSpeed's own mode (see deepspeed_config)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def optimizer_step(self) -> float:
        self.engine.step()  # reduces, clips, steps; a non-finite gradient norm makes DeepSpeed skip the update
        norm = self.engine.get_global_grad_norm()
        self.zero_grad()
        return float(norm) if norm is not None else math.nan

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def full_state_dict(self):
        if self.stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()  # gathers to rank 0 (dtype as trained)
        else:
            state = self.engine.module.state_dict()
        if self.rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in strip_prefix(state, self._prefix).items()}

    def save(self, path: Path) -> None:
        """DeepSpeed's own sharded checkpoint (weights, optimiser, schedule); resuming needs the same world size."""
        self.engine.save_checkpoint(str(path / "deepspeed"), tag="state", exclude_frozen_parameters=self.adapters_only)
        weights = self.full_state_dict()
        if self.rank == 0:
            self.model.save_pretrained(path / "model", state_dict=weights, safe_serialization=True)

    def load(self, path: Path) -> None:
        loaded, _ = self.engine.load_checkpoint(str(path / "deepspeed"), tag="state", load_module_strict=not self.adapters_only)
        if loaded is None:
            raise ValueError(f"{path}: no DeepSpeed checkpoint there (saved by another strategy?)")


@register("strategy", "auto")
def auto(world_size: int) -> type[SingleStrategy]:
    """`policy/strategy=auto`: ddp inside a process group of several ranks, else single."""
    return DDPStrategy if world_size > 1 else SingleStrategy


auto.config = StrategyConfig  # its node: `name` only
auto.single_device = False  # either, by the role's ranks
auto.needs_process_group = False  # single where it runs alone
auto.takes_compiled_blocks = auto.takes_lora_critic = True  # as single and ddp


def build_strategy(model, module, train_cfg, lr: float, total_steps: int, compute_dtype, strategy: Part, gradient_checkpointing: bool):
    """The chosen strategy (``strategy``: the part of `policy.strategy` / `critic.strategy`, typed) around ``module``
    (which holds ``model``), in train mode."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module.train()  # dropout is already 0; train() only matters for modules such as gradient checkpointing
    cls = auto(world()[1]) if strategy.obj is auto else strategy.obj
    if cls is SingleStrategy and compute_dtype == torch.bfloat16 and train_cfg.mixed_precision == "master":
        cls = MasterWeightsStrategy
    return cls(model, module, train_cfg, lr, total_steps, compute_dtype, strategy.config)
