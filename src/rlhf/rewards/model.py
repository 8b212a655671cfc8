"""A learned reward model scoring prompt + response at its last token, with optional normalisation and clipping."""

from __future__ import annotations

import torch

from rlhf.models.logprobs import in_chunks
from rlhf.models.value import load_value_model, sequence_scores
from rlhf.rewards.combine import checked_scores
from rlhf.trajectory import Trajectories


class RunningMoments:
    """Mean and variance of every score seen so far (Chan et al.'s parallel update)."""

    def __init__(self) -> None:
        self.count, self.mean, self.var = 0, 0.0, 1.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.var = state["count"], state["mean"], state["var"]

    def update(self, values: torch.Tensor) -> None:
        n = values.numel()
        if n == 0:
            return
        batch_mean, batch_var = values.mean().item(), values.var(unbiased=False).item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total


class RewardModelScorer:
    """Loads `reward.path` (a sequence-classification folder) and scores trajectories with it.

    With ``remote_scores`` (a callable batch -> (B,) raw scores, such as reward-model replicas on Ray) nothing
    loads here; normalisation and clipping still happen here, so their statistics live with the run.
    """

    def __init__(self, cfg, dtype: str, device: torch.device, chunk: int, remote_scores=None) -> None:
        self.cfg = cfg
        self.chunk = chunk
        self.remote_scores = remote_scores
        if remote_scores is None:
            model = load_value_model(cfg.path, dtype, None, False, device, new_head_ok=False, key="reward.path")
            self.model = model.eval()
            self.model.requires_grad_(False)
        self.moments = RunningMoments()

    def raw_scores(self, batch: Trajectories) -> torch.Tensor:
        """The model's score of each whole row (prompt and everything after it), at its last token. Shape: (B,)."""
        if self.remote_scores is not None:
            return self.remote_scores(batch)
        return in_chunks(lambda part: sequence_scores(self.model, *part.model_inputs()[:2]), batch, self.chunk)

    def score(self, batch: Trajectories, update_stats: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
        """(scores (B,) after normalisation and clipping, metrics); evaluation passes ``update_stats=False``."""
        raw = self.raw_scores(batch).cpu()
        # checked before the running moments see it: they are checkpointed, and one NaN would stay in them for good
        checked_scores(f"the reward model reward.path={self.cfg.path}", raw, raw.shape[0])
        scores = raw
        if self.cfg.normalize:
            if update_stats:
                self.moments.update(raw)
            scores = (raw - self.moments.mean) / (self.moments.var**0.5 + 1e-8)
        if self.cfg.clip is not None:
            scores = scores.clamp(-self.cfg.clip, self.cfg.clip)
        return scores, {"reward/model": raw.mean().item(), "reward/model_std": raw.std().item() if raw.numel() > 1 else 0.0}
