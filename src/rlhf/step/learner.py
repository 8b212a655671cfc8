"""The Learner: a scored batch in, one policy update out.

`update` reads top to bottom as the step's second half:

1. `prepare`: the pre-update policy's logprobs (when a forward of their own computes them: `old_logprobs`), the
   reference's logprobs, the distillation teacher's, the critic's values, then the algorithm's batch (advantages,
   returns, correction weights).
2. `train`: `train.num_epochs` passes over the batch in shuffled mini batches; each trained model (the policy, and
   the critic for PPO) runs `accumulate` on every micro batch of a mini batch (forward, the algorithm's loss,
   backward), then takes one optimiser step.
3. the algorithm's `end_step`, then `weights`: what the generator loads next.

The Learner calls the algorithm only through `rlhf.algorithms.base.Algorithm`; each metric of a micro batch's loss
declares how it reduces over micro batches and ranks (`rlhf.algorithms.base.Metrics`).

On the Ray backend each training rank runs `accumulate` on its share of a mini batch (`shares`: SPMD, the ranks'
collectives inside the strategy); here it runs in this process.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import fields, replace
from functools import partial
from pathlib import Path

import torch

from rlhf.algorithms.base import Metrics, OldLogprobs, old_logprob_source, reduction
from rlhf.collectives import all_ranks_true
from rlhf.errors import ConfigError
from rlhf.functional import masked_mean, masked_sum
from rlhf.functional.kl import logprob_gap
from rlhf.models import shared_prefix
from rlhf.micro_batches import Budget, by_group, in_row_order, micro_units, padded_tokens, place, plan
from rlhf.step.scored import Scored, group_rows, groups_with_signal
from rlhf.trajectory import Forward, Trajectories

log = logging.getLogger(__name__)


class Learner:
    """Scored batches -> policy updates, for the policy and (PPO) the critic; ``reference`` is None without a KL term.

    ``train_cfg`` is the run's typed `train.*` (`RunSpec.train`): epochs, mini batches and the micro-batch budget.
    ``shuffle`` orders the mini batches (checkpointed); ``gap_watch`` observes each step's generator-trainer logprob
    gap (`rlhf.checks.parity`); ``policy_packs``: the policy's training forwards pack their micro batches (for
    `perf/padding_fraction`). ``updates`` counts the updates begun: a step whose count moved may have changed the
    models. ``old_logprobs``: where each step's pre-update logprobs come from, decided once (`old_logprob_source`).
    """

    def __init__(
        self, policy, reference, critic, algorithm, train_cfg, device: torch.device, shuffle: torch.Generator,
        gap_watch=None, policy_packs: bool = False, teacher=None,
    ) -> None:
        self.policy, self.reference, self.critic, self.algorithm = policy, reference, critic, algorithm
        self.teacher = teacher  # the distillation teacher (frozen, scores like the reference), or None
        self.train_cfg, self.device = train_cfg, device
        self.shuffle, self.gap_watch, self.policy_packs = shuffle, gap_watch, policy_packs
        self.budget = Budget.of(train_cfg)
        self.updates = 0
        self.fresh: torch.Tensor | None = None  # (B,) rows the trained weights generated (async); None = every row
        self.old_logprobs = old_logprob_source(algorithm, train_cfg)
        log.info("pre-update logprobs: %s", self.old_logprobs.value)

    @property
    def trained(self) -> list[tuple[str, object]]:
        """(name, model) of every model the run trains: the policy, and the critic when there is one."""
        return [("policy", self.policy)] + ([("critic", self.critic)] if self.critic is not None else [])

    def state_dict(self) -> dict:
        """What training changes besides the weights, to rewind a failed step or save a checkpoint: the algorithm's
        state (an adaptive KL coefficient; {} when it keeps none) and the mini-batch order's RNG."""
        stateful = hasattr(self.algorithm, "state_dict")
        return {"algorithm": self.algorithm.state_dict() if stateful else {}, "shuffle": self.shuffle.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Put back what `state_dict` recorded."""
        if hasattr(self.algorithm, "load_state_dict"):
            self.algorithm.load_state_dict(state["algorithm"])
        self.shuffle.set_state(state["shuffle"])

    def save_models(self, folder: Path) -> None:
        """Each trained model's checkpoint (weights, optimiser, schedule) into ``folder``/<name>."""
        for name, model in self.trained:
            model.save_checkpoint(folder / name)

    def load_models(self, folder: Path) -> None:
        """Each trained model as `save_models` left it in ``folder``; ConfigError when one has no state there."""
        for name, model in self.trained:
            if not (folder / name).is_dir():
                raise ConfigError(f"resume: {folder} has no {name} state, but this run trains a {name}")
            model.load_checkpoint(folder / name)

    def update(self, scored: Scored, guard) -> dict[str, float]:
        """One update on ``scored``: `prepare`, then `train`. ``guard`` (a `NonFiniteGuard`) counts skipped steps.
        Their seconds are `time/logprobs` and `time/training`."""
        start = time.perf_counter()
        batch, metrics = self.prepare(scored)
        prepared = time.perf_counter()
        self.updates += 1  # from here the models may differ from the last complete step
        metrics |= self.train(batch, guard)
        self.algorithm.end_step(metrics, len(batch))
        return metrics | {"time/logprobs": prepared - start, "time/training": time.perf_counter() - prepared}

    def prepare(self, scored: Scored) -> tuple[Trajectories, dict[str, float]]:
        """Pre-update policy logprobs, reference logprobs and critic values, then the algorithm's training batch;
        forwards in micro batches of the token budget. The pre-update logprobs get a pass of their own only when
        ``old_logprobs`` says so; from the training forward, `train` takes them."""
        batch = scored.batch.to(self.device)
        self.fresh = fresh_rows(scored)
        metrics = {
            "objective/scores": batch.scores.mean().item(),
            "val/sequence_lengths": batch.action_lengths.mean().item(),
            "val/num_stop_token_ids": batch.stopped.sum().item(),
            "val/stop_rate": batch.stopped.float().mean().item(),
        } | zero_std_share(scored.batch.scores, scored.batch.group_id)
        if self.old_logprobs is OldLogprobs.PASS:
            old_logp, entropy = self.policy.rollout_logprobs(batch, self.budget, with_entropy=True)
            batch = replace(batch, old_logp=old_logp)
            metrics |= self.old_logprob_metrics(batch, entropy)
        if self.reference is not None:
            batch = replace(batch, ref_logp=self.reference.rollout_logprobs(batch, self.budget))
        if self.teacher is not None:  # every sampled token scored by the teacher: on-policy distillation's signal
            batch = replace(batch, extras=dict(batch.extras, teacher_logp=self.teacher.rollout_logprobs(batch, self.budget)))
        if self.critic is not None:
            batch = replace(batch, values=self.critic.rollout_values(batch, self.budget))
        batch, algorithm_metrics = self.algorithm.prepare(batch)
        return batch, metrics | algorithm_metrics

    def train(self, batch: Trajectories, guard) -> dict[str, float]:
        """`train.num_epochs` passes over the batch in shuffled mini batches, accumulating micro batches.

        Micro batches hold at most `train.micro_batch_size` samples and `train.max_tokens_per_micro_batch` tokens
        (`rlhf.micro_batches`); for pairwise algorithms (DPO) they hold whole pairs. A non-finite loss in any trained
        model drops every model's gradients for that mini batch; a non-finite gradient norm skips that model's
        update. Either way ``guard`` counts the mini batch and stops the run after too many in a row. When
        ``old_logprobs`` is `OldLogprobs.TRAINING`, the policy's forward supplies them and the metrics they feed.
        Returns the algorithm's metrics averaged over mini batches, gradient norms, and `perf/total_num_tokens` (real
        tokens of the batch) and `perf/padding_fraction` (the share of padding in what the training forwards'
        token-wise layers computed, packed or not as the policy runs them: `micro_batches.padded_tokens`).
        """
        train, algorithm = self.train_cfg, self.algorithm
        units = batch.num_units
        mini_units = max(1, units // train.num_mini_batches)  # an environment batch may have lost failed groups
        micro = Budget(micro_units(mini_units, train.micro_batch_size, batch.rows_per_unit) * batch.rows_per_unit,
                       train.max_tokens_per_micro_batch)
        from_training = self.old_logprobs is OldLogprobs.TRAINING
        sums: dict[str, float] = {}
        late: dict[str, float] = {}
        count = 0
        computed = real = 0  # tokens the training forwards run on and the real ones among them, as one process cuts them
        for _ in range(train.num_epochs):
            for mini_ids in torch.randperm(units, generator=self.shuffle).split(mini_units):
                mini = batch.select_units(mini_ids)
                mini_computed, mini_real = padded_tokens(mini, micro, self.policy_packs)
                computed, real = computed + mini_computed, real + mini_real
                denominator = algorithm.denominator(mini)
                results = [
                    accumulate_mini(
                        model, mini, partial(algorithm.micro_loss, name), denominator, micro, algorithm.needs_entropy,
                        from_training and name == "policy",
                    )
                    for name, model in self.trained
                ]
                if not all(finite for finite, _, _ in results):
                    for _, model in self.trained:
                        model.zero_grad()
                    guard.record(True, "loss")
                    continue
                if from_training:
                    late = self.logprobs_from_training(batch, batch.rows_of(mini_ids), results[0][2])
                step = {key: value for _, metrics, _ in results for key, value in metrics.items()}
                for name, model in self.trained:
                    step[f"{name}/grad_norm"] = model.optimizer_step()
                finite = all(math.isfinite(step[f"{name}/grad_norm"]) for name, _ in self.trained)
                guard.record(not finite, "gradient")
                if finite:
                    for key, value in step.items():
                        sums[key] = sums.get(key, 0.0) + value
                    count += 1
        if not count:
            return late
        perf = {"perf/total_num_tokens": float(batch.attention_mask.sum()), "perf/padding_fraction": 1 - real / max(computed, 1)}
        if self.policy_packs and getattr(self.policy, "share", False) is not False:
            perf["perf/prefix_unshared_rows"] = float(shared_prefix.unshared_in(batch))
        return {key: value / count for key, value in sums.items()} | late | perf

    def weights(self):
        """The policy's weights for the generator: only the tensors a step changes (every weight under full
        fine-tuning; a LoRA policy's adapted layers, merged), as a dict or a Ray object reference."""
        return self.policy.state_dict(adapted_only=True)

    def old_logprob_metrics(self, batch: Trajectories, entropy: torch.Tensor) -> dict[str, float]:
        """What the pre-update logprobs tell (``batch.old_logp``, with their entropy (B, T)): `objective/entropy` and
        the generator-trainer gap, which the gap watch observes."""
        mask = batch.loss_mask
        metrics = {"objective/entropy": masked_sum(entropy, mask, dim=1).mean().item()}
        metrics |= sample_train_gap(batch.gen_logp, batch.old_logp, mask)
        if self.gap_watch is not None:
            self.observe_gap(batch, metrics["checks/logprob_gap_mean"])
        return metrics

    def observe_gap(self, batch: Trajectories, gap: float) -> None:
        """Hand the gap watch this step's generator-trainer gap, over the rows the trained weights generated: under
        the async schedule a stale row's gap is the policy's own change since, not a fault, so a batch of stale rows
        only is not observed (the start-up parity gate checks the numerics)."""
        if self.fresh is None:
            self.gap_watch.observe(gap)
        elif bool(self.fresh.any()):
            fresh = self.fresh.to(batch.loss_mask.device)
            mask = batch.loss_mask * fresh[:, None]
            self.gap_watch.observe(logprob_gap(batch.gen_logp, batch.old_logp, mask)["mean"])

    def logprobs_from_training(self, batch: Trajectories, rows: torch.Tensor, forward: Forward) -> dict[str, float]:
        """The metrics of the pre-update logprobs, from the training forward's (``forward``: detached, rows ``rows``
        of ``batch`` in that order), exactly as `prepare` computes them from a pass of their own."""
        width = batch.loss_mask.shape[1]
        device = batch.loss_mask.device
        old_logp, entropy = (place([t.to(device)], [rows], width) for t in (forward.logp, forward.entropy))
        filled = replace(batch, old_logp=old_logp)
        return self.old_logprob_metrics(filled, entropy) | self.algorithm.late_metrics(filled)


def accumulate_mini(
    model, mini: Trajectories, loss_fn, denominator: torch.Tensor, budget: Budget, with_entropy: bool = False,
    from_training: bool = False,
) -> tuple[bool, Metrics, Forward | None]:
    """`accumulate` on each rank's share of the mini batch ``mini`` (``model.shares``: all of it in one process),
    the ranks' results merged (`merge_shares`)."""
    return merge_shares(model.shares(accumulate, mini, loss_fn, denominator, budget, with_entropy, from_training))


def accumulate(
    model, mini: Trajectories, loss_fn, denominator: torch.Tensor, budget: Budget, with_entropy: bool,
    from_training: bool,
) -> tuple[bool, Metrics, Forward | None]:
    """Forward, loss and backward of each micro batch of ``mini`` (this rank's share of a mini batch: ``budget``'s
    rows and tokens each, longest units first, padding columns trimmed) on ``model``, gradients accumulating.

    ``loss_fn(micro, Forward, denominator) -> (loss share, Metrics)`` is the algorithm's loss for ``model``;
    ``with_entropy`` shapes the policy's forward. ``from_training``: the forward supplies the pre-update logprobs
    (`OldLogprobs.TRAINING`), detached into each micro batch's ``old_logp`` before the loss. Returns (finite, metrics,
    recorded): with ``from_training``, the forwards' outputs detached as one `Forward` of (B, T) tensors in ``mini``'s
    row order. As soon as a loss is non-finite on any rank, every rank returns False after the mini batch (the caller
    drops its gradients). Each metric reduces over micro batches as it declares (`Metrics`): a loss share summed,
    the rest averaged.

    No host sync between the micro batches: the layouts come from the mini batch's `host_spans` (read once), and the
    finite flag and the metrics stay on the device until one read after the last backward. (A micro batch the
    shared-prefix layout may pay on, `model.shared_prefix`, reads its tokens once to find the rows of one prompt.)
    """
    # a model's `model.shared_prefix` (`share`; none for a trainer without it) keeps groups in one micro batch
    micro_ids = plan(mini, budget, equal_count=True, by_group=by_group(mini, getattr(model, "share", False)))
    mini = mini.with_host_spans()  # micro batches trimmed and packed without reading the device
    kept: list[tuple[torch.Tensor, Forward]] = []
    sums: dict[str, torch.Tensor] = {}  # float64, as python floats would add them
    host: dict[str, float] = {}  # metrics given as python numbers
    declared: dict[str, str] = {}  # each metric's reduction
    finite = torch.ones((), dtype=torch.bool, device=mini.loss_mask.device)
    for ids in micro_ids:
        micro = mini.select_units(ids).trimmed()
        micro, forward, recorded = model.train_forward(micro, with_entropy, from_training)
        if from_training:
            micro = replace(micro, old_logp=forward.logp.detach())
        loss, micro_metrics = loss_fn(micro, forward, denominator)
        finite &= torch.isfinite(loss.detach())
        model.backward(loss)  # a non-finite loss's gradients are dropped below, with the whole mini batch's
        if recorded is not None:
            kept.append((mini.rows_of(ids), recorded))
        for key, value in micro_metrics.items():
            declared[key] = reduction(micro_metrics, key)
            weight = 1.0 if declared[key] == "sum" else 1.0 / len(micro_ids)
            if isinstance(value, torch.Tensor):
                sums[key] = sums.get(key, 0.0) + value.detach().double() * weight
            else:
                host[key] = host.get(key, 0.0) + float(value) * weight
    # the one read of the device per mini batch: the finite flag and every metric together
    values = torch.stack([finite.double(), *sums.values()]).tolist()
    if not all_ranks_true(values[0] == 1.0):
        return False, {}, None  # the caller drops the gradients: a NaN must not reach the weights
    metrics = Metrics.declared(dict(zip(sums, values[1:])) | host, declared)
    return True, metrics, in_row_order(kept, mini.loss_mask.shape[1]) if from_training else None


def merge_shares(results: list[tuple[bool, Metrics, Forward | None]]) -> tuple[bool, Metrics, Forward | None]:
    """The ranks' `accumulate` results (rank order, which is row order) as one: each metric reduces over the ranks
    as it declares (a loss share adds up, the rest average), recorded forwards are stacked."""
    ranks = len(results)
    if not all(finite for finite, _, _ in results):
        return False, {}, None
    first = results[0][1]
    declared = {key: reduction(first, key) for key in first}
    metrics = {key: sum(result[1][key] for result in results) for key in first}
    metrics = Metrics.declared(
        {key: value if declared[key] == "sum" else value / ranks for key, value in metrics.items()}, declared
    )
    recorded = None
    if results[0][2] is not None:
        recorded = Forward(**{
            f.name: None if getattr(results[0][2], f.name) is None else torch.cat([getattr(r[2], f.name) for r in results])
            for f in fields(Forward)
        })
    return True, metrics, recorded


def fresh_rows(scored: Scored) -> torch.Tensor | None:
    """(B,) bool: the rows the trainer's current weights generated, when the schedule says which version generated
    each row and which trains (async); None otherwise (every row is fresh)."""
    if scored.versions is None or scored.trainer_version is None:
        return None
    return scored.versions == scored.trainer_version


def sample_train_gap(gen_logp: torch.Tensor, train_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the generator's logprobs are from the trainer's on the same tokens (mean and largest |gen - train|
    per token and the k3 KL, as `rlhf.checks.parity` reports them; the v1/v2 estimators of the Tinker cookbook's
    sampler-trainer KL).

    Shapes: (B, T) each. v1 = mean(gen - train), v2 = mean((gen - train)^2) / 2, over action tokens.
    """
    diff = gen_logp - train_logp
    gap = logprob_gap(gen_logp, train_logp, mask)
    return {
        "val/generator_logprob_diff": gap["mean"],
        "checks/logprob_gap_mean": gap["mean"],
        "checks/logprob_gap_max": gap["max"],
        "checks/logprob_gap_k3": gap["k3"],
        "train/kl_sample_train_v1": masked_mean(diff, mask).item(),
        "train/kl_sample_train_v2": 0.5 * masked_mean(diff.square(), mask).item(),
    }


def zero_std_share(scores: torch.Tensor, group_id: torch.Tensor) -> dict[str, float]:
    """`objective/frac_reward_zero_std`: the share of the step's groups whose samples all scored the same, so that a
    group-relative advantage gives them no signal ({} when no group holds more than one sample). Shapes: (B,)."""
    groups = group_rows(group_id)
    if all(len(rows) == 1 for rows in groups):
        return {}
    return {"objective/frac_reward_zero_std": (len(groups) - len(groups_with_signal(scores, groups))) / len(groups)}
