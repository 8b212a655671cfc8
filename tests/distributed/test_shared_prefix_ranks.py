"""The shared-prefix layout under DDP and under FSDP2 (torchrun, two gloo processes of one thread each; blocks sharded
as `policy/strategy=fsdp2` shards them): each rank lays its groups' prompts, and the turns its multi-turn episodes
agree on, out once, and each strategy's averaged gradients equal those of the unshared layout, and of one process
over the whole batch unshared. (One launch for both strategies: the two processes' start is most of the time.)

Run by the test through torchrun; run as a script, this file is one rank (it writes its gradients under argv[1])."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_shared_prefix import grouped_rows, llama, packed_model  # noqa: E402
from test_shared_prefix_multiturn import retry_groups  # noqa: E402

from rlhf.models.logprobs import window_logprobs  # noqa: E402

WORLD = 2


def batches() -> dict:
    """Single-turn groups (two per rank) and multi-turn episodes (one group per rank), with their loss weights."""
    out = {}
    for name, batch in {"single_turn": grouped_rows([9, 5, 7, 6], [[4, 1, 6], [3, 7, 2], [5, 5, 1], [2, 6, 3]]), "multi_turn": retry_groups()}.items():
        out[name] = batch, torch.linspace(-1, 1, batch.loss_mask.numel()).view_as(batch.loss_mask)
    return out


def gradients(model, batch, weights, denominator, share) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (an FSDP2 shard gathered), of a weighted sum of ``batch``'s logprobs."""
    model.zero_grad()
    logp, _ = window_logprobs(model, batch.trimmed(), 1.0, share=share)
    (logp * weights[:, : logp.shape[1]]).sum().div(denominator).backward()
    whole = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g
    inner = getattr(model, "module", model)  # DDP: the names of the model inside
    return {n: whole(p.grad).clone() for n, p in inner.named_parameters() if p.grad is not None}


def rank_main(out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from rlhf.training.strategies import shard_units

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        sharded = packed_model(llama)
        for block in shard_units(sharded):
            fully_shard(block)
        fully_shard(sharded)
        models = {"fsdp2": sharded, "ddp": torch.nn.parallel.DistributedDataParallel(packed_model(llama))}
        grads = {}
        for strategy, model in models.items():
            for name, (batch, weights) in batches().items():
                rows = torch.arange(len(batch))[(batch.group_id % WORLD) == rank]  # whole groups per rank
                denominator = batch.loss_mask.sum()
                grads[strategy, name] = {
                    share: gradients(model, batch.select(rows), weights[rows], denominator, share) for share in (True, False)
                }
        torch.save(grads, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ddp_and_fsdp2_ranks_sharing_prefixes_give_the_unshared_and_single_process_gradients(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    proc = subprocess.run(
        [*launcher, __file__, str(tmp_path)], capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    model = packed_model(llama)
    for name, (batch, weights) in batches().items():
        single = gradients(model, batch, weights, batch.loss_mask.sum(), False)
        for grads, strategy in itertools.product(ranks, ("fsdp2", "ddp")):
            shared, unshared = grads[strategy, name][True], grads[strategy, name][False]
            assert shared.keys() == single.keys() and single, strategy
            for param, grad in single.items():
                torch.testing.assert_close(shared[param], unshared[param], rtol=1e-4, atol=1e-6, msg=f"{strategy} {name}: {param}")
                # both average the ranks' gradients
                torch.testing.assert_close(shared[param], grad / WORLD, rtol=1e-4, atol=1e-6, msg=f"{strategy} {name}: {param}")


if __name__ == "__main__":
    rank_main(sys.argv[1])
