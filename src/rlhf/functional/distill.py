"""On-policy distillation's per-token signal: the student samples, a frozen teacher scores every sampled token.

For a token y_t the student sampled after context c_t, the reverse KL KL(pi_student || pi_teacher) at that position
has the one-sample estimate log pi_student(y_t|c_t) - log pi_teacher(y_t|c_t). Its negative is the signal: positive
where the teacher likes the token more than the student did, negative where less. Used alone as the advantage
(`algorithm/advantage=opd`) or added to another estimator's advantages with a weight (`algorithm.distill_coef`).
The student's logprobs are the trainer's pre-update ones, computed as the teacher's are: the generator's differ from
them by float rounding, which would make a teacher equal to the student a signal of its own.
"""

from __future__ import annotations

import torch

from rlhf.functional.masked import masked_mean


def teacher_signal(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-(log p_student - log p_teacher) per action token, 0 outside ``mask`` (observations, padding).

    Shape: (B, T) each -> (B, T)."""
    return torch.where(mask.bool(), teacher_logp - student_logp, torch.zeros_like(teacher_logp))


def reverse_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sampled estimate of KL(student || teacher) per action token, averaged over ``mask``: the mean of
    log p_student - log p_teacher. Shape: (B, T) each -> scalar."""
    return masked_mean(student_logp - teacher_logp, mask)
