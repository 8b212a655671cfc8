"""The shared-prefix layout under DDP (gloo, two processes of one thread each): each rank lays its groups' prompts
out once, and the averaged gradients equal those of the unshared layout, and of one process over the whole batch."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_shared_prefix import grouped_rows, llama, packed_model  # noqa: E402

from rlhf.models.logprobs import window_logprobs  # noqa: E402

WORLD = 2


def batch_and_weights():
    """Four groups (two per rank) and the loss weights of their window tokens."""
    batch = grouped_rows([9, 5, 7, 6], [[4, 1, 6], [3, 7, 2], [5, 5, 1], [2, 6, 3]])
    return batch, torch.linspace(-1, 1, batch.loss_mask.numel()).view_as(batch.loss_mask)


def gradients(model, batch, weights, denominator, share) -> dict[str, torch.Tensor]:
    model.zero_grad()
    logp, _ = window_logprobs(model, batch.trimmed(), 1.0, share=share)
    (logp * weights[:, : logp.shape[1]]).sum().div(denominator).backward()
    inner = getattr(model, "module", model)  # DDP: the names of the model inside
    return {n: p.grad.clone() for n, p in inner.named_parameters() if p.grad is not None}


def rank_main(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model = torch.nn.parallel.DistributedDataParallel(packed_model(llama))
        batch, weights = batch_and_weights()
        rows = torch.arange(len(batch))[(batch.group_id % WORLD) == rank]  # whole groups per rank
        denominator = batch.loss_mask.sum()
        grads = {share: gradients(model, batch.select(rows), weights[rows], denominator, share) for share in (True, False)}
        torch.save(grads, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ddp_ranks_sharing_prompts_average_to_the_single_process_unshared_gradients(tmp_path):
    mp.start_processes(rank_main, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    batch, weights = batch_and_weights()
    single = gradients(packed_model(llama), batch, weights, batch.loss_mask.sum(), False)
    for grads in ranks:
        assert grads[True].keys() == single.keys()
        for name, grad in single.items():
            torch.testing.assert_close(grads[True][name], grads[False][name], rtol=1e-4, atol=1e-6, msg=name)
            torch.testing.assert_close(grads[True][name], grad / WORLD, rtol=1e-4, atol=1e-6, msg=name)  # DDP averages
