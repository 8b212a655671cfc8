"""A distillation teacher behind an OpenAI-compatible completions endpoint (`teacher.url`), e.g. vLLM's `vllm serve`.

Each row's real tokens (prompt, sampled actions, observations) are sent as a token-id prompt with
``prompt_logprobs: 0`` and ``max_tokens: 1``; the answer's ``choices[0].prompt_logprobs[k]`` holds the teacher's
logprob of token k given the tokens before it, keyed by that token's id. The action tokens' logprobs are read out in
the layout of the local teacher (`rlhf.models.reference.FrozenReference.rollout_logprobs`). The server's prompt
logprobs are its raw ones (temperature 1). Anything missing or non-finite stops the step with an error naming the
endpoint and the row: a silent zero would corrupt every token's signal.
"""

from __future__ import annotations

import concurrent.futures
import math

import httpx
import torch

from rlhf.trajectory import Trajectories


class RemoteTeacherError(RuntimeError):
    """The teacher endpoint could not be reached or answered something unusable."""


class RemoteTeacher:
    """`rollout_logprobs` from `teacher.url`, rows requested concurrently (`teacher.max_concurrency`)."""

    def __init__(self, cfg) -> None:
        self.url = cfg.url.rstrip("/") + "/completions"
        self.model = cfg.model or cfg.name_or_path
        self.timeout, self.concurrency = cfg.timeout_s, cfg.max_concurrency
        self.http = httpx.Client(timeout=self.timeout)

    def rollout_logprobs(self, batch: Trajectories, chunk=None) -> torch.Tensor:
        """The teacher's logprob of every action token (0 elsewhere). Shape: (B, T). ``chunk`` is unused."""
        batch = batch.to("cpu")
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            answers = list(pool.map(self._row, range(len(batch)), [batch] * len(batch)))
        for row, values in enumerate(answers):
            out[row] = values
        return out

    def _row(self, row: int, batch: Trajectories) -> torch.Tensor:
        real = batch.attention_mask[row].bool()
        ids = batch.input_ids[row][real].tolist()
        index = torch.cumsum(real.long(), 0) - 1  # column -> position among the real tokens
        found = self._prompt_logprobs(row, ids)
        values = torch.zeros(batch.loss_mask.shape[1])
        start = batch.window_start
        for col in torch.nonzero(batch.loss_mask[row], as_tuple=True)[0].tolist():
            k = int(index[start + col])
            token = ids[k]
            entry = found[k] if k < len(found) else None
            logprob = entry.get(str(token), {}).get("logprob") if isinstance(entry, dict) else None
            if not isinstance(logprob, (int, float)) or not math.isfinite(logprob):
                raise RemoteTeacherError(
                    f"teacher.url={self.url}: row {row}, token {k} (id {token}): the answer has no finite prompt "
                    f"logprob for it (got {entry!r:.120}); the endpoint must return prompt_logprobs for every token"
                )
            values[col] = float(logprob)
        return values

    def _prompt_logprobs(self, row: int, ids: list[int]) -> list:
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
        try:
            answer = self.http.post(self.url, json=body)
        except httpx.HTTPError as err:
            raise RemoteTeacherError(f"teacher.url={self.url} is unreachable ({type(err).__name__}: {err}); start the "
                                     f"teacher's server or fix teacher.url") from None
        if answer.status_code != 200:
            raise RemoteTeacherError(f"teacher.url={self.url} answered HTTP {answer.status_code} for row {row}: {answer.text[:200]}")
        try:
            found = answer.json()["choices"][0]["prompt_logprobs"]
        except (ValueError, KeyError, IndexError, TypeError):
            found = None
        if not isinstance(found, list) or len(found) < len(ids):
            got = "none" if not isinstance(found, list) else f"{len(found)}"
            raise RemoteTeacherError(
                f"teacher.url={self.url}: row {row} sent {len(ids)} tokens and got {got} prompt logprobs back; the "
                f"endpoint must support prompt_logprobs (vLLM's OpenAI server does)"
            )
        return found
