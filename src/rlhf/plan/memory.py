"""The memory arithmetic of the plan: pure functions from sizes to bytes, each testable by hand.

A run moves through phases, and a device's peak is the largest phase's sum: `generate` (the generator samples),
`score` (reference, reward model and critic score the rollouts without gradients) and `train` (the policy and
critic run forward and backward). Weights and optimiser state are resident in every phase; activations, KV caches
and scoring temporaries only in their own.
"""

from __future__ import annotations

from dataclasses import dataclass

GENERATE, SCORE, TRAIN = "generate", "score", "train"
PHASES = (GENERATE, SCORE, TRAIN)
FLOAT32 = 4  # bytes: trained weights, their gradients and AdamW's moments stay in float32 (`rlhf.training.trainable`)
ADAM_MOMENTS = 2  # AdamW keeps two float32 moments per trained parameter
CUDA_CONTEXT_BYTES = 600 * 2**20  # a process's CUDA context and kernels: outside the allocator, about 0.5-0.7 GiB


@dataclass(frozen=True)
class Item:
    """Bytes one role holds on a device (or on the host, when offloaded) during some phases."""

    role: str  # actor, ref, critic, reward, generator or runtime
    what: str  # weights, gradients, optimizer, activations, kv_cache, logits, ...
    bytes: int  # per device (one rank's share)
    phases: tuple[str, ...] = PHASES  # when it is resident
    on_host: bool = False  # offloaded to the CPU: counted apart from the device


@dataclass(frozen=True)
class Sharding:
    """How a trained role's state is spread over its ``ranks`` (from `policy.strategy` / `critic.strategy`)."""

    strategy: str  # single, ddp, fsdp2 or deepspeed (auto already resolved)
    ranks: int  # training ranks of the role
    zero_stage: int = 0  # deepspeed: 1 optimiser state, 2 also gradients, 3 also weights
    offload_optimizer: bool = False  # optimiser state on the host
    offload_params: bool = False  # weights on the host between uses


def trained_state(
    role: str, params: int, sharding: Sharding, bf16: bool, trainable: int | None = None, master: bool = False
) -> list[Item]:
    """Weights, gradients and AdamW state of a trained role on one of its devices; ``trainable`` parameters (default:
    all ``params``; fewer for LoRA adapters) have gradients and optimiser state.

    ``master`` (bf16 with `train.mixed_precision=master`): `single` holds bf16 weights, float32 masters and their
    float32 gradients (each bf16 gradient lives only until its hook adds it in); FSDP2 keeps its float32 shards (and
    gathers bf16 blocks, `rlhf.plan.roles`). Otherwise every strategy but DeepSpeed keeps float32 weights and gradients
    and runs bf16 under autocast; DDP also keeps a float32 gradient bucket per parameter. DeepSpeed keeps its weights and gradients in the compute dtype (bf16 or
    float32) and a float32 copy of its optimiser partition beside the moments; ZeRO shards the optimiser state (stage 1), gradients (2) and weights (3); FSDP2
    shards all three.
    """
    n, trained = sharding.ranks, params if trainable is None else trainable
    weights, grads, optimizer = FLOAT32 * params, FLOAT32 * trained, ADAM_MOMENTS * FLOAT32 * trained
    extra = []
    if master and sharding.strategy == "single":
        weights = 2 * params
        extra.append(Item(role, "master weights", FLOAT32 * trained))
    elif sharding.strategy == "ddp":
        extra.append(Item(role, "gradient buckets", FLOAT32 * trained))
    elif sharding.strategy == "fsdp2":
        weights, grads, optimizer = weights // n, grads // n, optimizer // n
    elif sharding.strategy == "deepspeed":
        if bf16:
            weights, grads = 2 * params, 2 * trained
        optimizer = (ADAM_MOMENTS + 1) * FLOAT32 * trained // n  # ZeRO keeps a float32 copy of its partition
        grads = grads // n if sharding.zero_stage >= 2 else grads
        weights = weights // n if sharding.zero_stage >= 3 else weights
    return [
        Item(role, "weights", weights, on_host=sharding.offload_params),
        Item(role, "gradients", grads, phases=(TRAIN,)),
        Item(role, "optimizer", optimizer, on_host=sharding.offload_optimizer),
        *[Item(e.role, e.what, e.bytes, phases=PHASES if e.what == "master weights" else (TRAIN,)) for e in extra],
    ]


def scoring_bytes(rows: int, window: int, vocab: int, layer_bytes: int, chunk: int = 0) -> int:
    """A no-grad forward's temporaries: the window's float32 logits and their log-softmax (``chunk`` > 0, the fused
    output layer: those of one chunk of tokens, `fused_chunk_bytes`), plus one layer's activations (``layer_bytes``),
    which are freed as the next layer runs."""
    if chunk > 0:  # no gradient: its logits, their log-softmax and one product for the entropy
        return fused_chunk_bytes(min(chunk, rows * window), vocab, copies=3) + layer_bytes
    return 2 * rows * window * vocab * FLOAT32 + layer_bytes


def fused_chunk_bytes(tokens: int, vocab: int, copies: int = 4) -> int:
    """The fused output layer's (`rlhf.functional.fused_logprobs`) temporaries for one chunk of ``tokens``: ``copies``
    float32 (tokens, vocab) tensors; in the backward its logits, their log-softmax, the gradient with respect to them
    and that gradient's cast for the matmuls."""
    return copies * tokens * vocab * FLOAT32


def peak(items: list[Item]) -> tuple[int, str]:
    """(bytes, phase) of the largest phase of the items resident on the device (host items excluded)."""
    totals = {phase: sum(i.bytes for i in items if phase in i.phases and not i.on_host) for phase in PHASES}
    phase = max(PHASES, key=lambda p: totals[p])
    return totals[phase], phase


def host_bytes(items: list[Item]) -> int:
    """Bytes the items keep on the host (offloaded state)."""
    return sum(i.bytes for i in items if i.on_host)


def gib(n: float) -> str:
    """Bytes as GiB for tables: 61.3 (two decimals below 10 GiB, three below 1 GiB)."""
    value = n / 2**30
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 10 else f"{value:.1f}"
