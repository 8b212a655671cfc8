"""Structured config: the typed schema every composed run config is validated against.

Each section lives next to nothing else so a reader sees every key at once; every field carries a
one-line comment (a test checks). Hydra merges `conf/` YAML onto these dataclasses, so an unknown key
or a wrong type fails at compose time, naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class ModelConfig:
    name_or_path: str = MISSING  # hub name, local folder, `builtin:<name>` for a model shipped in rlhf/assets, or a GGUF file (a path, package:<module>/<file>.gguf, or <org>/<repo>/<file>.gguf), converted once
    tokenizer: Optional[str] = None  # tokenizer hub name or folder; null = same as name_or_path
    revision: Optional[str] = None  # hub revision (branch, tag or commit); null = default branch
    dtype: str = "float32"  # weights and compute dtype: float32, bfloat16 or float16
    trust_remote_code: bool = False  # allow model code from the hub; off unless you trust the repository
    logprob_chunk: Optional[int] = None  # tokens per chunk of the fused output layer -> logprob (no (tokens, vocabulary) logits); 0 = plain logits; null = 1024 on CUDA, 0 on CPU
    shared_prefix: Optional[bool] = None  # training/reference/critic forwards lay a micro batch's rows of one prompt out once (the prompt, then each response); true = wherever rows share a prompt (a model that packs only), false = never, null = where it pays (docs/performance.md)


@dataclass
class AlgorithmConfig:
    """The algorithm's own keys; its parts are nodes chosen by group (`algorithm/policy_loss=gspo`), each typed by the
    config class beside the part's code (`rlhf.parts`)."""

    name: str = MISSING  # the preset's name, for the record; the parts below decide what runs
    advantage: Any = MISSING  # node: algorithm/advantage=grpo, rloo, reinforce, reinforce_pp(_baseline), remax, gae (critic), rebn, best_vs_worst (pairs), dr_grpo
    policy_loss: Any = MISSING  # node: algorithm/policy_loss=ppo_clip, clip_higher, gspo, cispo, importance_sampling; dpo or ipo (pairwise)
    rollout_correction: Any = None  # node: algorithm/rollout_correction=token_tis, seq_tis, icepop, geo_reject (generator/trainer mismatch); null = off
    kl_ctl: Any = None  # node: algorithm/kl_ctl=fixed (algorithm.beta throughout) or adaptive (moves beta toward a target KL); null = fixed
    num_samples_per_prompt: int = 4  # completions sampled per prompt (the group size for grpo/rloo)
    loss_agg: str = "token_mean"  # token_mean, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm (Dr.GRPO), token_sum (Tinker)
    loss_agg_norm: Optional[float] = None  # seq_mean_token_sum_norm's constant divisor; null = generator.max_new_tokens
    beta: float = 0.0  # KL coefficient to the reference (policy-gradient losses); 0 disables the reference
    kl_estimator: str = "k3"  # k1 (log ratio), k2 (squared log ratio / 2) or k3 (unbiased, non-negative)
    kl_in_reward: bool = False  # true: -beta*KL is added to the reward; false: beta*KL is a loss term
    entropy_coef: float = 0.0  # entropy bonus: loss -= entropy_coef * entropy
    reuse_training_logprobs: bool = True  # skip the pre-update forward where the training forward gives the same logprobs (one optimiser step per step; pairwise: always)
    filter_groups: bool = False  # dynamic sampling (DAPO): drop groups whose scores all tie, draw more prompts to fill the step
    max_resample_rounds: int = 3  # filter_groups: extra prompt draws per step before training on the groups kept so far
    filter_on: str = "score"  # filter_groups: what must differ within a kept group: score, accuracy (the verifiers' verdict), or auto (accuracy when reward.functions has a verifier, else score)
    distill_coef: float = 0.0  # on-policy distillation: weight of the teacher's per-token signal -(logp_student - logp_teacher), the student's pre-update logprobs, added to every advantage (needs teacher.name_or_path); algorithm/advantage=opd uses the signal alone


@dataclass
class RewardFunctionConfig:
    name: str = MISSING  # registered reward function or import path `pkg.module.fn`
    weight: float = 1.0  # weight of this function in the summed score
    args: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments passed to the function


@dataclass
class RewardConfig:
    functions: list[RewardFunctionConfig] = field(default_factory=list)  # scored and summed with weights
    path: Optional[str] = None  # reward model folder (sequence classification, one label); null = none
    model_weight: float = 1.0  # weight of the reward model's score in the sum
    normalize: bool = False  # reward model: scale scores by the running mean and std of all scores so far
    clip: Optional[float] = None  # reward model: clip scores to [-clip, clip] (after normalising); null = off
    non_stop_penalty: bool = True  # replace the score of responses that never stopped
    penalty_reward_value: float = -10.0  # the score given to a non-stop response
    overlong_buffer_len: Optional[int] = None  # overlong shaping (DAPO): reward falls over the budget's last this many tokens; null = off
    overlong_penalty_factor: float = 1.0  # overlong shaping: the reward lost by a response of generator.max_new_tokens tokens
    unscored_retries: int = 1  # a row a function could not score (Unscored: a sandbox or judge failure) is asked again this many times, those rows only
    max_unscored_share: float = 0.25  # past this share of a training batch's rows left unscored, the run stops (the last step saved), naming the function


@dataclass
class LoraConfig:
    rank: Optional[int] = None  # LoRA rank: train low-rank adapters (peft) instead of every weight; null = full fine-tuning
    alpha: float = 16.0  # LoRA scaling numerator: the adapter's update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input: must be 0 (RL logprobs must be deterministic given the weights); a PEFT habit of 0.05 is refused with the reason
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # module names (suffixes) that get adapters; all-linear = every attention and MLP linear layer


@dataclass
class PolicyConfig:
    name: str = "torch"  # training backend: torch (CPU or GPU, under `strategy`) or an import path
    gradient_checkpointing: bool = False  # trade compute for activation memory
    compile: bool = False  # torch.compile each decoder block (dynamic shapes: micro batches of new sizes reuse the graphs); the first steps pay the compile; strategy single, ddp or fsdp2, no policy.lora
    activation_memory_budget: Optional[float] = None  # policy.compile: the share (0-1) of the compiled blocks' activations kept for the backward, the rest recomputed there (torch's min-cut rematerialisation: cheap elementwise work first); null = torch's default (1.0). Less memory than full activations at less cost than gradient_checkpointing
    strategy: Any = field(default_factory=lambda: {"name": "auto"})  # node: policy/strategy=auto (single on one rank, else ddp), single, ddp, fsdp2 or deepspeed (all but auto/single need cluster.backend=ray), or your own; typed by its config class (rlhf.training.strategies)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters; the reference is then the base model with adapters off


@dataclass
class ReferenceConfig:
    name: str = "frozen"  # frozen copy of a model, used for the KL term
    name_or_path: Optional[str] = None  # reference weights; null = the policy's starting weights


@dataclass
class TeacherConfig:
    name_or_path: Optional[str] = None  # the frozen teacher of on-policy distillation (hub name, folder, builtin:<name>); null = none. Same tokenizer as the policy; model.dtype and revision rules as the reference's
    url: Optional[str] = None  # a remote teacher: an OpenAI-compatible completions endpoint returning prompt_logprobs (vLLM's `vllm serve`), e.g. http://host:8000/v1; null = load name_or_path here
    model: Optional[str] = None  # the model name sent to teacher.url; null = teacher.name_or_path
    timeout_s: float = 120.0  # teacher.url: seconds one request may take as a whole (connecting, sending, the whole answer)
    max_concurrency: int = 8  # teacher.url: requests in flight at once (one per row)


@dataclass
class CriticConfig:
    name: str = "torch"  # value-model backend (used by ppo): torch or an import path
    name_or_path: Optional[str] = None  # initial weights; null = reward.path when set, else the policy's model
    lr: Optional[float] = None  # critic learning rate, in (0, 1]; null = train.lr
    gradient_checkpointing: bool = False  # trade compute for activation memory
    strategy: Any = field(default_factory=lambda: {"name": "auto"})  # node: critic/strategy=auto, single, ddp, fsdp2 or deepspeed, as policy.strategy; how the critic's training spreads over its devices
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters on the critic's backbone (its value head trains whole); strategy single or ddp


@dataclass
class TrainConfig:
    num_steps: int = 100  # RL steps (generate -> score -> update) in the run
    prompts_per_step: int = 32  # distinct prompts per step; samples per step = this * num_samples_per_prompt
    num_epochs: int = 1  # optimisation passes over each step's samples (PPO epochs)
    num_mini_batches: int = 1  # optimiser steps per pass; samples per step must divide evenly
    micro_batch_size: int = 32  # samples per forward/backward; a mini batch must divide evenly
    max_tokens_per_micro_batch: Optional[int] = None  # also cap a forward at this many tokens, padding counted (rows sorted by length); null = rows only
    lr: float = 1e-4  # peak learning rate, in (0, 1]
    lr_schedule: str = "constant"  # constant or linear (decay to 0 over the run)
    warmup_steps: int = 0  # optimiser steps of linear warm-up
    weight_decay: float = 0.0  # AdamW weight decay
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    adam_eps: float = 1e-8  # AdamW epsilon
    max_grad_norm: float = 1.0  # gradient clipping by global norm; <= 0 disables
    mixed_precision: str = "master"  # model.dtype=bfloat16 training: master (bf16 weights and compute, float32 master weights in the optimiser; fsdp2: its MixedPrecisionPolicy) or autocast (float32 weights, bf16 autocast; ddp always)
    max_skipped_steps_in_row: int = 3  # optimiser steps skipped for a non-finite loss/gradient in a row before the run stops


@dataclass
class CheckpointConfig:
    every: int = 0  # save the full training state every N steps; 0 = only on SIGTERM/SIGINT
    keep_last: int = 2  # newest checkpoints kept; 0 keeps all
    dir: Optional[str] = None  # checkpoint folder; null = <run folder>/checkpoints
    save_final_model: bool = True  # export the final policy as a Hugging Face folder <run folder>/final_model
    allow_config_change: bool = False  # resume even when seed, batch sizes, algorithm.*, the models, LoRA settings or dataset.* differ from the checkpoint's config (no exact resume; another dataset starts the prompt stream over)


@dataclass
class RoleConfig:
    num_nodes: int = 1  # nodes the role spans (ray backend)
    devices_per_node: int = 1  # GPUs (device_type=gpu) or CPU slots (cpu) per node; ranks = num_nodes * devices_per_node


@dataclass
class RolesConfig:
    policy: RoleConfig = field(default_factory=RoleConfig)  # policy training ranks (policy.strategy spreads over them)
    reference: RoleConfig = field(default_factory=RoleConfig)  # reference-model replicas (rows split between them)
    critic: RoleConfig = field(default_factory=RoleConfig)  # critic training ranks (ppo; critic.strategy)
    reward: RoleConfig = field(default_factory=RoleConfig)  # reward-model replicas (reward.path set)
    teacher: RoleConfig = field(default_factory=RoleConfig)  # distillation-teacher replicas (teacher.name_or_path set)
    generator: RoleConfig = field(default_factory=RoleConfig)  # generation engines, one per device


@dataclass
class ClusterConfig:
    name: str = "local"  # the preset's name, for the record
    backend: str = "local"  # local: every role in this process; ray: every role a Ray actor, placed per `roles`
    device: str = "auto"  # local backend: auto (cuda if available, else cpu), cpu, cuda or cuda:N
    address: Optional[str] = None  # ray: null starts a private Ray cluster here; else join one (auto, host:port, ray://host:10001)
    device_type: str = "cpu"  # ray: what a role's devices are: gpu, or cpu (a CPU slot, for tests and CPU-only runs)
    num_cpus: Optional[int] = None  # ray, private cluster: logical CPUs it offers; null = this machine's count
    cpus_per_gpu: int = 1  # ray, device_type=gpu: CPUs reserved beside each GPU of a placement bundle
    object_store_memory: Optional[int] = None  # ray, private cluster: object-store bytes; null = Ray's default (30% of RAM)
    timeout_s: float = 600.0  # ray: seconds a remote call or a collective may take once workers are set up, before the run fails naming the role
    setup_timeout_s: float = 900.0  # ray: seconds each worker may take to start, join its process group and load its model (separate from timeout_s)
    heartbeat_timeout_s: float = 60.0  # ray: seconds a busy worker may leave the driver's pings unanswered (a frozen process) before the run fails naming it; 0 = off
    placement_timeout_s: float = 60.0  # ray: seconds to wait for the placement groups to be scheduled
    roles: RolesConfig = field(default_factory=RolesConfig)  # ray: nodes and devices of each role
    colocate: list[list[str]] = field(default_factory=list)  # ray: roles sharing the same devices, e.g. [[policy, reference], [critic, reward]]
    device_memory_gb: Optional[float] = None  # memory of one device in GiB for the memory plan; null = detected (the CUDA card, or this machine's RAM for CPU runs)
    num_nodes: Optional[int] = None  # ray: nodes the cluster has, for the plan's device count check; null = not checked before Ray starts
    devices_per_node: Optional[int] = None  # ray: devices (GPUs) per node, for the plan's device count check; null = not checked before Ray starts


@dataclass
class EvalConfig:
    every: int = 0  # evaluate every N steps (and before the first and after the last); 0 = start and end only
    num_evals: Optional[int] = None  # when set, replaces `every`: this many evaluations spread evenly over the run
    num_samples: int = 4  # sampled completions per eval prompt (at the training temperature)
    greedy: bool = True  # also evaluate greedy decoding
    max_prompts: Optional[int] = None  # evaluate on the first N eval prompts only; null = all
    save_generations: bool = True  # append every eval completion to <run folder>/eval_generations.jsonl


@dataclass
class LoggingConfig:
    log_every: int = 20  # a plain console line every N steps (and at the last step)
    progress_bar: str = "auto"  # live bar with step, ETA, score, KL, s/step: auto (only on a terminal), true or false
    tensorboard: bool = True  # write TensorBoard events to <run folder>/tensorboard
    sample_every: int = 20  # log a table of sample prompt/completion/reward texts every N steps
    num_sample_texts: int = 4  # rows in that table
    wandb: bool = False  # also log metrics, the composed config and sample tables to Weights & Biases (pip install wandb)
    wandb_project: str = "rlhf"  # the W&B project the run goes to
    wandb_name: Optional[str] = None  # the W&B run name; null = the run folder's name
    wandb_mode: Optional[str] = None  # null = from the environment (WANDB_MODE, default online); or online, offline


@dataclass
class ChecksConfig:
    weight_sync: str = "every"  # verify the generator holds what each weight push sent: every push, first, or off
    parity_prompts: int = 4  # prompts the generator samples (one response each) for the log-prob probe before step 1; 0 skips it
    max_logprob_gap: Optional[float] = None  # mean |Δ log p| above which the probe refuses the run; null: 0.01 float32, 0.1 bfloat16/float16
    gap_jump_factor: float = 10.0  # warn when a step's checks/logprob_gap_mean exceeds this many times its running level
    stop_on_gap: bool = False  # stop the run (not just warn) when checks/logprob_gap_mean jumps


@dataclass
class PlanConfig:
    enforce: bool = True  # refuse to start a run the memory plan says cannot fit (exit 2); false warns and starts anyway
    headroom: float = 0.1  # share of each device's memory the plan keeps free (allocator fragmentation, libraries, other users)


@dataclass
class RunConfig:
    seed: int = 1  # seeds python, numpy and torch; in [0, 2**32 - 2**16)
    resume: Optional[str] = None  # null = fresh; auto = newest complete checkpoint in checkpoint.dir (fresh if none); or a checkpoint folder
    preflight: bool = False  # rehearse one step on a tiny batch (every stage, a checkpoint round trip), print a report, exit
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy's starting model
    dataset: Any = MISSING  # node: dataset=arith, reasoning_gym, or a mix preset (gsm8k, math, tldr, jsonl, ...); typed by its builder's config class (rlhf.data)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # advantage estimator, policy loss, KL, entropy
    generator: Any = MISSING  # node: generator=hf or vllm (or a backend of your own), typed by its config class (rlhf.generators)
    reward: RewardConfig = field(default_factory=RewardConfig)  # how completions are scored
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # the trained model's backend
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)  # the KL anchor
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # the distillation teacher (algorithm/advantage=opd, algorithm.distill_coef)
    critic: CriticConfig = field(default_factory=CriticConfig)  # the value model (ppo)
    train: TrainConfig = field(default_factory=TrainConfig)  # batch sizes, optimiser, run length
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # placement and devices
    schedule: Any = MISSING  # node: schedule=sync, async (generation overlaps training), stream (rows decode continuously; weights load mid-response) or hybrid (generator sleeps while training), or your own; typed by its config class (rlhf.schedules)
    env: Any = MISSING  # node: env=none (single-turn prompts), arith_retry, gem, agent_func, single_turn, or your own; typed by its config class (rlhf.envs)
    eval: EvalConfig = field(default_factory=EvalConfig)  # periodic evaluation
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # console and TensorBoard
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # saving and pruning training state
    checks: ChecksConfig = field(default_factory=ChecksConfig)  # self-checks of the running run (weight sync)
    plan: PlanConfig = field(default_factory=PlanConfig)  # the memory plan checked before any model loads (python -m rlhf.plan prints it)


@dataclass
class PreferenceDataConfig:
    name: str = "arith_prefs"  # registered preference dataset (built-in: arith_prefs)
    max_operand: int = 9  # arith_prefs: operands are drawn from 0..max_operand
    pairs_per_problem: int = 8  # arith_prefs: (correct, wrong) pairs made for each problem
    eval_fraction: float = 0.2  # arith_prefs: share of each problem's wrong answers kept for the eval split only


@dataclass
class RewardTrainLoopConfig:
    num_epochs: int = 3  # passes over the training pairs
    batch_size: int = 64  # pairs per optimiser step
    lr: float = 1e-3  # peak learning rate (linear decay to 0), in (0, 1]
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping by global norm; <= 0 disables
    mixed_precision: str = "master"  # model.dtype=bfloat16 training: master (bf16 weights and compute, float32 master weights in the optimiser; fsdp2: its MixedPrecisionPolicy) or autocast (float32 weights, bf16 autocast; ddp always)
    eval_every: int = 50  # evaluate every N optimiser steps (and at the end)


@dataclass
class RewardTrainConfig:
    seed: int = 1  # seeds python, numpy and torch; in [0, 2**32 - 2**16)
    model: ModelConfig = field(default_factory=ModelConfig)  # backbone to start from (its tokenizer is kept)
    preferences: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)  # chosen/rejected pairs
    train: RewardTrainLoopConfig = field(default_factory=RewardTrainLoopConfig)  # optimisation
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # device
    save_dir: Optional[str] = None  # where the reward model goes (missing, empty, or an earlier one); null = <run folder>/reward_model
    tensorboard: bool = True  # write TensorBoard events to <run folder>/tensorboard
