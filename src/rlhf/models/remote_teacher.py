"""A distillation teacher behind an OpenAI-compatible completions endpoint (`teacher.url`), e.g. vLLM's `vllm serve`.

Each row's real tokens (prompt, sampled actions, observations) are sent as a token-id prompt with
``prompt_logprobs: 0`` and ``max_tokens: 1``; the answer's ``choices[0].prompt_logprobs[k]`` holds the teacher's
logprob of token k given the tokens before it, keyed by that token's id. The action tokens' logprobs are read out in
the layout of the local teacher (`rlhf.models.reference.FrozenReference.rollout_logprobs`). The server's prompt
logprobs are its raw ones (temperature 1). Anything missing, non-finite, or not a log probability (above 0, or below
`LOGPROB_FLOOR`) stops the step with an error naming the endpoint and the row: a silent zero, or a +50, would corrupt
every token's signal, and a -1e30 would make every optimiser step non-finite. `teacher.timeout_s` bounds each request
as a whole (`rlhf.web.post_json`), so a server that trickles its answer, or never gives one, ends the step too.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import math

import torch

from rlhf.trajectory import Trajectories
from rlhf.web import post_json

LOGPROB_TOLERANCE = 1e-4  # a logprob this far above 0 is a server's float rounding of 0, read as 0
LOGPROB_FLOOR = -1e4  # below this no float32 softmax goes: the answer is not a logprob


class RemoteTeacherError(RuntimeError):
    """The teacher endpoint could not be reached or answered something unusable."""


class RemoteTeacher:
    """`rollout_logprobs` from `teacher.url`, rows requested concurrently (`teacher.max_concurrency`)."""

    def __init__(self, cfg) -> None:
        self.url = cfg.url.rstrip("/") + "/completions"
        self.model = cfg.model or cfg.name_or_path
        self.timeout, self.concurrency = cfg.timeout_s, cfg.max_concurrency

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
            if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) or not math.isfinite(logprob):
                raise RemoteTeacherError(
                    f"teacher.url={self.url}: row {row}, token {k} (id {token}): the answer has no finite prompt "
                    f"logprob for it (got {entry!r:.120}); the endpoint must return prompt_logprobs for every token"
                )
            values[col] = self._checked(float(logprob), row, k, token)
        return values

    def _checked(self, logprob: float, row: int, k: int, token: int) -> float:
        """``logprob`` when it is a log probability (a rounding above 0 read as 0); RemoteTeacherError otherwise."""
        if LOGPROB_FLOOR <= logprob <= LOGPROB_TOLERANCE:
            return min(logprob, 0.0)
        raise RemoteTeacherError(
            f"teacher.url={self.url}: row {row}, token {k} (id {token}): logprob {logprob:g} is not a log probability "
            f"(it must lie in [{LOGPROB_FLOOR:g}, 0]); point teacher.url at a server that returns the raw prompt "
            f"logprobs of teacher.model (vLLM's OpenAI server does)"
        )

    def _prompt_logprobs(self, row: int, ids: list[int]) -> list:
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
        try:
            status, answer = post_json(self.url, json.dumps(body).encode(), self.timeout, "teacher.timeout_s")
        except TimeoutError:
            raise RemoteTeacherError(
                f"teacher.url={self.url} did not answer row {row} within teacher.timeout_s={self.timeout:g} s; check "
                f"that the teacher's server is not stuck, or raise teacher.timeout_s"
            ) from None
        except (OSError, http.client.HTTPException) as err:
            raise RemoteTeacherError(f"teacher.url={self.url} is unreachable ({type(err).__name__}: {err}); start the "
                                     f"teacher's server or fix teacher.url") from None
        if status != 200:
            raise RemoteTeacherError(f"teacher.url={self.url} answered HTTP {status} for row {row}: {answer[:200]!r}")
        try:
            found = json.loads(answer)["choices"][0]["prompt_logprobs"]
        except (ValueError, KeyError, IndexError, TypeError):
            found = None
        if not isinstance(found, list) or len(found) < len(ids):
            got = "none" if not isinstance(found, list) else f"{len(found)}"
            raise RemoteTeacherError(
                f"teacher.url={self.url}: row {row} sent {len(ids)} tokens and got {got} prompt logprobs back; the "
                f"endpoint must support prompt_logprobs (vLLM's OpenAI server does)"
            )
        return found
