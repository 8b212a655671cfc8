"""`policy.compile`: the policy's decoder blocks under torch.compile give the eager model's logprobs, gradients and
step, keep its weight names, and are refused under strategies they are not built for."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch._dynamo.utils import counters

from rlhf.config import ConfigError, compose_config, validate
from rlhf.training.policy import TorchPolicy

CPU = torch.device("cpu")
pytestmark = pytest.mark.slow  # compiling takes seconds


def accumulate(policy: TorchPolicy, parts) -> list[torch.Tensor]:
    """Forward and backward every part (-mean logprob of its response tokens); returns the logprobs, detached."""
    out = []
    for part in parts:
        logp, _ = policy.logprobs(part)
        policy.backward(-logp.sum() / part.loss_mask.sum())
        out.append(logp.detach())
    return out


@pytest.mark.parametrize("extra", [{}, {"gradient_checkpointing": True}], ids=["full", "checkpointing"])
def test_compiled_blocks_give_the_eager_logprobs_gradients_and_step(policy_cfg, model_cfg, train_cfg, rollout, extra):
    """Micro batches of three shapes (3 padded rows, 2 rows, 1 row, trimmed) through the eager and the compiled
    policy (float32; also with gradient checkpointing, whose backward reruns the compiled block):
    the same logprobs, gradients and weights after the step (1e-5), under the same weight names; a second round of
    other shapes reuses the graphs."""
    # a large epsilon keeps AdamW's first step Lipschitz in the gradient (with 1e-8 a near-zero gradient steps by
    # about lr times its sign, so float noise could decide the direction)
    train = train_cfg(lr=1e-2, adam_eps=1e-3)
    torch._dynamo.reset()  # a graph an earlier test compiled would be reused: this test compiles its own
    policy_cfg = OmegaConf.merge(policy_cfg, extra)
    eager = TorchPolicy(policy_cfg, model_cfg, train, total_optimizer_steps=10, device=CPU)
    graphs = counters["stats"]["unique_graphs"]
    compiled = TorchPolicy(OmegaConf.merge(policy_cfg, {"compile": True}), model_cfg, train, total_optimizer_steps=10, device=CPU)
    assert f"; {eager.model.config.num_hidden_layers} decoder blocks compiled (policy.compile)" in compiled.describe()
    parts = [rollout, rollout.select_units(torch.tensor([0, 1])).trimmed(), rollout.select_units(torch.tensor([2])).trimmed()]
    for want, got in zip(accumulate(eager, parts), accumulate(compiled, parts)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] > graphs, "nothing was compiled"
    compiled.zero_grad(), eager.zero_grad()
    again = [rollout.select_units(torch.tensor([0, 2])).trimmed(), rollout.select_units(torch.tensor([2, 1])).trimmed()]
    with torch._dynamo.config.patch(error_on_recompile=True):  # other rows and lengths: no new graph
        for want, got in zip(accumulate(eager, again + parts), accumulate(compiled, again + parts)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for (name, a), (other, b) in zip(eager.model.named_parameters(), compiled.model.named_parameters()):
        assert name == other
        if a.requires_grad:  # summed over five micro batches, in another order by the compiled kernels: within 1e-4 of
            # the gradient's norm (elementwise, an Intel AVX-512 host differed by 2e-5 on entries of 1e-3)
            assert (b.grad - a.grad).norm() <= 1e-4 * a.grad.norm() + 1e-7, name
    eager.optimizer_step(), compiled.optimizer_step()
    assert eager.model.state_dict().keys() == compiled.model.state_dict().keys()
    for name, tensor in eager.model.state_dict().items():
        torch.testing.assert_close(compiled.model.state_dict()[name], tensor, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the pre-update pass (no gradients) compiles its own graph and agrees too
        want, _ = eager.rollout_logprobs(rollout, chunk=2)
        got, _ = compiled.rollout_logprobs(rollout, chunk=2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_compiled_blocks_sharded_by_fsdp2_take_the_eager_single_process_step(policy_cfg, model_cfg, train_cfg, rollout, monkeypatch):
    """`policy.compile` with `policy/strategy=fsdp2`: each block compiled, then sharded (FSDP2's hooks outside
    the compiled code). In a process group of world size 1 (gloo, started here) the step equals the eager one."""
    import socket

    # an in-process vLLM engine (the shared fixture, run earlier in this worker) leaves its own world-size-1 gloo
    # group as the default one; FSDP2 shards over whatever default group there is, so reuse it and leave it be
    ours = not torch.distributed.is_initialized()
    if ours:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
            monkeypatch.setenv(key, value)
        torch.distributed.init_process_group("gloo")
    assert torch.distributed.get_world_size() == 1
    try:
        train = train_cfg(lr=1e-2, adam_eps=1e-3)
        torch._dynamo.reset()
        eager = TorchPolicy(policy_cfg, model_cfg, train, total_optimizer_steps=10, device=CPU)
        sharded = TorchPolicy(OmegaConf.merge(policy_cfg, {"compile": True, "strategy": {"name": "fsdp2"}}), model_cfg, train,
                              total_optimizer_steps=10, device=CPU)
        assert sharded.strategy.name == "fsdp2" and sharded.compiled_blocks == eager.model.config.num_hidden_layers
        for want, got in zip(accumulate(eager, [rollout]), accumulate(sharded, [rollout])):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert sharded.optimizer_step() == pytest.approx(eager.optimizer_step(), rel=1e-5)
        after = sharded.full_state_dict()
        for name, tensor in eager.full_state_dict().items():
            torch.testing.assert_close(after[name], tensor, atol=1e-5, rtol=1e-5)
    finally:
        if ours:
            torch.distributed.destroy_process_group()


def saved_bytes(policy: TorchPolicy, part) -> int:
    """Bytes the autograd graph of one training forward of ``part`` keeps for its backward (the backward runs)."""
    kept = []

    def pack(tensor):
        kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logp, _ = policy.logprobs(part)
    policy.backward(-logp.sum() / part.loss_mask.sum())
    return sum(kept)


def test_an_activation_memory_budget_keeps_less_for_the_backward_and_the_same_gradients(policy_cfg, model_cfg, train_cfg, rollout):
    """policy.activation_memory_budget: the compiled blocks keep fewer bytes for the backward, which recomputes the
    rest and gives the same gradients (float32); only the policy's own blocks see the budget (torch's global default
    is untouched)."""
    kept, grads = {}, {}
    for budget in (None, 0.2):
        torch._dynamo.reset()  # the blocks' forward is one code object for every policy: each budget compiles its own
        cfg = OmegaConf.merge(policy_cfg, {"compile": True, "activation_memory_budget": budget})
        policy = TorchPolicy(cfg, model_cfg, train_cfg(), total_optimizer_steps=10, device=CPU)
        saved_bytes(policy, rollout)  # compiles
        policy.zero_grad()
        kept[budget] = saved_bytes(policy, rollout)
        grads[budget] = {name: p.grad.clone() for name, p in policy.model.named_parameters() if p.requires_grad}
    assert kept[0.2] < kept[None], kept  # the blocks keep less; the rest of the model (embedding, output layer) as before
    for name, grad in grads[None].items():
        assert (grads[0.2][name] - grad).norm() <= 1e-4 * grad.norm() + 1e-7, name
    assert torch._functorch.config.activation_memory_budget == 1.0


def test_compile_under_deepspeed_or_with_lora_is_refused_before_any_model_loads():
    validate(compose_config(["policy.compile=true", "policy/strategy=fsdp2", "cluster=ray_local"]))
    with pytest.raises(ConfigError, match=r"policy\.compile with policy/strategy=deepspeed"):
        validate(compose_config(["policy.compile=true", "policy/strategy=deepspeed"]))
    with pytest.raises(ConfigError, match=r"policy\.compile with policy\.lora: .*policy\.lora\.rank=null"):
        validate(compose_config(["policy.compile=true", "policy.lora.rank=8"]))
    validate(compose_config(["policy.compile=true"]))  # single (auto on one process) is fine
    validate(compose_config(["policy.compile=true", "policy.activation_memory_budget=0.5"]))
    with pytest.raises(ConfigError, match=r"policy\.activation_memory_budget=0\.5 .* needs policy\.compile=true; set"):
        validate(compose_config(["policy.activation_memory_budget=0.5"]))
    for bad in ("1.5", "-1", "nan", "2"):  # out of range, compile on or off: the range is what is wrong
        for compile_ in ("true", "false"):
            with pytest.raises(ConfigError, match=r"activation_memory_budget=.*: a number from 0 \(recompute all\) to 1"):
                validate(compose_config([f"policy.compile={compile_}", f"policy.activation_memory_budget={bad}"]))


def test_a_model_naming_no_decoder_blocks_is_refused_before_its_weights_load(policy_cfg, model_cfg, monkeypatch):
    """`check_compilable` (run before any model loads) builds the model on the meta device from its config: a model
    class without `_no_split_modules` gives the ConfigError naming the key; the tiny Llama passes."""
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    from rlhf.training.trainable import check_compilable

    compiled = OmegaConf.merge(policy_cfg, {"compile": True})
    check_compilable(compiled, model_cfg)
    monkeypatch.setattr(LlamaPreTrainedModel, "_no_split_modules", None)
    check_compilable(policy_cfg, model_cfg)  # policy.compile=false: nothing to check
    with pytest.raises(ConfigError, match=r"policy\.compile: LlamaForCausalLM names no repeated decoder blocks .*policy\.compile=false"):
        check_compilable(compiled, model_cfg)
