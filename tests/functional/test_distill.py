"""On-policy distillation's signal on hand values: -(log p_student - log p_teacher) per action token, zero outside
the mask (observations, padding); the reverse KL estimate is its negative mean over the mask."""

import pytest
import torch

from rlhf.functional import reverse_kl, teacher_signal


def test_the_signal_is_the_teacher_minus_the_student_logprob_inside_the_mask():
    teacher = torch.tensor([[-0.5, -2.0, -1.0], [-0.1, -9.0, -9.0]])
    student = torch.tensor([[-1.5, -0.5, -3.0], [-0.4, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # row 0's third token an observation, row 1 padded
    signal = teacher_signal(teacher, student, mask)
    torch.testing.assert_close(signal, torch.tensor([[1.0, -1.5, 0.0], [0.3, 0.0, 0.0]]))
    assert reverse_kl(teacher, student, mask).item() == pytest.approx((-1.0 + 1.5 - 0.3) / 3)


def test_a_student_equal_to_its_teacher_gets_no_signal_exactly():
    logp = torch.tensor([[-0.7, -1.3], [-0.1, -2.9]])
    mask = torch.ones(2, 2)
    assert teacher_signal(logp, logp.clone(), mask).eq(0).all()
    assert reverse_kl(logp, logp.clone(), mask).item() == 0.0
