"""Packed forwards (`rlhf.models.packing`): the layout of packed rows, when packing is declined, which models pack,
and that a packed model's other forwards (padded rows, generation) are SDPA's, unchanged."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from rlhf.models import lora, packing
from rlhf.models.logprobs import window_logprobs
from rlhf.trajectory import from_completions


def rows(prompts: list[int], responses: list[int], vocab: int = 40, seed: int = 0):
    """Random rows of the given prompt and response lengths, left- and right-padded."""
    g = torch.Generator().manual_seed(seed)
    lq, lr = max(prompts), max(responses)
    query_ids, query_mask = torch.zeros(len(prompts), lq, dtype=torch.long), torch.zeros(len(prompts), lq, dtype=torch.long)
    response_ids, response_mask = torch.zeros(len(prompts), lr, dtype=torch.long), torch.zeros(len(prompts), lr)
    for i, (q, r) in enumerate(zip(prompts, responses)):
        query_ids[i, lq - q :] = torch.randint(3, vocab, (q,), generator=g)
        query_mask[i, lq - q :] = 1
        response_ids[i, :r] = torch.randint(3, vocab, (r,), generator=g)
        response_mask[i, :r] = 1
    return from_completions(query_ids, query_mask, response_ids, response_mask, torch.zeros(len(prompts), lr), torch.ones(len(prompts), dtype=torch.bool))


def gqa_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A tiny Llama with grouped-query attention (4 query heads sharing 2 key/value heads)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, **overrides,
    )
    return LlamaForCausalLM(config).eval()


def test_rows_are_laid_end_to_end_and_each_window_token_is_predicted_from_its_own_row():
    batch = rows([3, 6, 2], [5, 1, 4])
    packed = packing.pack(batch)
    real = batch.attention_mask.bool()
    assert packed.input_ids[0].tolist() == torch.cat([batch.input_ids[i, real[i]] for i in range(3)]).tolist()
    assert packed.position_ids[0].tolist() == [*range(8), *range(7), *range(6)]
    assert packed.lengths.tolist() == [8, 7, 6] and packed.width == 8
    starts = [0, 8, 15, 21]
    for b in range(3):
        for t in range(batch.loss_mask.shape[1]):
            column = int(packed.predicts[b, t])
            assert starts[b] <= column < starts[b + 1]  # never another row's output
            if batch.loss_mask[b, t]:
                assert packed.input_ids[0, column + 1] == batch.window_ids[b, t]
    kwargs = packing.Packed.attention_kwargs(packed)
    assert kwargs["rows_index"].shape == (3, 8)
    # gathering each row's columns then scattering back by tokens_index is the identity on the packed tokens
    laid = torch.arange(21)[kwargs["rows_index"]].reshape(-1)
    assert laid[kwargs["tokens_index"]].tolist() == list(range(21))


@pytest.mark.parametrize("prompts,responses", [([3, 6, 2], [5, 1, 4]), ([1], [1]), ([4, 4], [2, 7]), ([7, 1, 3, 2], [1, 1, 6, 3])])
def test_host_spans_give_the_same_layout_without_reading_the_device(prompts, responses):
    """`host_spans` (read once per mini batch) lay out a micro batch, trimmed and packed, exactly as the device's
    own masks do; the smallest predicting column is known on the host in both ways."""
    batch = rows(prompts, responses)
    for micro in (batch, batch.select(torch.tensor([len(prompts) - 1, 0]))):
        plain, hosted = micro.trimmed(), micro.with_host_spans().trimmed()
        assert torch.equal(plain.input_ids, hosted.input_ids) and torch.equal(plain.loss_mask, hosted.loss_mask)
        assert torch.equal(hosted.host_spans, hosted.with_host_spans().host_spans)  # trimmed spans shifted with the columns
        a, b = packing.pack(plain), packing.pack(hosted)
        for name in ("input_ids", "position_ids", "lengths", "predicts", "tokens_index"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.width == b.width and a.first_predict == b.first_predict == int(a.predicts.min())


def test_packing_is_declined_only_where_a_row_has_a_hole():
    assert packing.pack(rows([3], [5])).input_ids.shape == (1, 8)  # one row: the same form as any other
    assert packing.pack(rows([3, 4, 2], [5, 4, 6])).lengths.tolist() == [8, 8, 8]  # rows of one length
    gap = rows([3, 6], [5, 1])
    gap.attention_mask[0, -4] = 0  # padding between real tokens: a packed row has no mask for it
    assert packing.pack(gap) is None


def test_packed_logprobs_and_gradients_equal_the_padded_rows_with_grouped_query_attention():
    model = gqa_llama()
    assert packing.enable(model) and packing.packs(model)
    batch = rows([3, 6, 2, 5], [9, 1, 4, 7])
    input_ids, attention_mask, position_ids = batch.model_inputs()
    weights = torch.rand(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))

    def loss_and_grads(logp):
        (-(logp * weights).sum()).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad()
        return logp.detach(), grads

    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    padded = torch.log_softmax(logits[:, batch.window_start - 1 : -1], -1).gather(-1, batch.window_ids.unsqueeze(-1)).squeeze(-1)
    want, want_grads = loss_and_grads(padded * batch.loss_mask)
    got, got_grads = loss_and_grads(window_logprobs(model, batch, 1.0)[0])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-5)


def test_a_packing_model_computes_padded_rows_and_generates_as_sdpa_does():
    plain, packed = gqa_llama(), gqa_llama()
    packing.enable(packed)
    batch = rows([3, 6, 2], [5, 1, 4])
    input_ids, attention_mask, position_ids = batch.model_inputs()
    with torch.no_grad():
        for kwargs in ({"attention_mask": attention_mask, "position_ids": position_ids}, {}):
            torch.testing.assert_close(packed(input_ids=input_ids, **kwargs).logits, plain(input_ids=input_ids, **kwargs).logits, rtol=0, atol=0)
        prompt = batch.input_ids[:, : batch.window_start]
        mask = batch.attention_mask[:, : batch.window_start]
        generate = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
        assert packed.generate(prompt, **generate).tolist() == plain.generate(prompt, **generate).tolist()


def test_models_whose_attention_cannot_take_packed_rows_are_left_alone():
    from transformers import GPT2Config, GPT2LMHeadModel

    eager = gqa_llama(attn_implementation="eager")
    assert not packing.enable(eager) and eager.config._attn_implementation == "eager"
    for overrides in ({"sliding_window": 4}, {"attention_chunk_size": 4}, {"layer_types": ["full_attention", "sliding_attention"]}):
        model = gqa_llama(**overrides)
        assert not packing.enable(model) and model.config._attn_implementation == "sdpa", overrides
    other = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=2))  # a family not checked for it
    assert not packing.enable(other) and other.config._attn_implementation == "sdpa"
    batch = rows([3, 6], [5, 1])
    with torch.no_grad():  # the justified layout, with the same numbers
        torch.testing.assert_close(window_logprobs(eager, batch, 1.0)[0], window_logprobs(packing_model(), batch, 1.0)[0], rtol=0, atol=1e-5)


def test_a_packing_model_continues_from_a_cache_as_sdpa_does():
    """Queries after cached tokens with no mask (a chunked prefill) get SDPA's own mask, not the packed path's none."""
    plain, packed = gqa_llama(), gqa_llama()
    packing.enable(packed)
    ids = torch.randint(3, 40, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = []
        for model in (plain, packed):
            cache = model(input_ids=ids[:, :5], use_cache=True).past_key_values
            out.append(model(input_ids=ids[:, 5:], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=0)


def test_the_packed_mask_is_skipped_only_for_a_fresh_unmasked_forward(monkeypatch):
    """`packed_mask` with transformers 5's arguments and with 4.x's (no ``q_length``: the queries are the
    ``cache_position`` entries): no mask for N queries over the same N keys; SDPA's own mask otherwise."""
    monkeypatch.setattr(packing, "sdpa_mask", lambda *args, **kwargs: "sdpa's mask")
    fresh_5 = {"q_length": 6, "kv_length": 6, "q_offset": 0, "kv_offset": 0}
    fresh_4 = {"cache_position": torch.arange(6), "kv_length": 6, "kv_offset": 0}
    assert packing.packed_mask(batch_size=1, **fresh_5) is None
    assert packing.packed_mask(batch_size=1, **fresh_4) is None
    cached_5 = {**fresh_5, "kv_length": 10, "q_offset": 4}
    cached_4 = {"cache_position": torch.arange(4, 10), "kv_length": 10, "kv_offset": 0}
    for kwargs in (cached_5, cached_4):
        assert packing.packed_mask(batch_size=1, **kwargs) == "sdpa's mask"
    assert packing.packed_mask(batch_size=1, attention_mask=torch.ones(1, 6), **fresh_4) == "sdpa's mask"


def test_attention_arguments_the_packed_path_cannot_honour_are_refused():
    model = packing_model()
    batch = packing.pack(rows([3, 6], [5, 1]))
    layer = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, batch.input_ids.shape[1], 16)
    kv = torch.zeros(1, 2, batch.input_ids.shape[1], 16)
    with pytest.raises(ValueError, match="sliding_window"):
        packing.packed_attention(layer, q, kv, kv, None, sliding_window=4, **batch.attention_kwargs())


def packing_model() -> LlamaForCausalLM:
    model = gqa_llama()
    packing.enable(model)
    return model


def test_a_lora_wrapped_model_packs_through_the_adapters():
    from omegaconf import OmegaConf

    from rlhf.config.schema import LoraConfig

    model = packing_model()
    plain = gqa_llama()
    cfg = OmegaConf.structured(LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    wrapped = lora.add_adapters(model, cfg)
    assert packing.packs(wrapped) and packing.pack(rows([3, 6], [5, 1])) is not None
    batch = rows([3, 6, 2], [5, 1, 4])
    with torch.no_grad():  # fresh adapters add zero: the base model's logprobs
        torch.testing.assert_close(window_logprobs(wrapped, batch, 1.0)[0], window_logprobs(plain, batch, 1.0)[0], rtol=0, atol=1e-5)


def test_packed_rows_under_a_compiled_model_give_the_eager_logprobs_from_one_graph():
    """`policy.compile` compiles each decoder block; packed rows pass their attention arguments through them, and
    micro batches of other row counts (one row included) and lengths reuse the first graph."""
    from rlhf.training.trainable import compile_blocks

    eager, compiled = packing_model(), packing_model()
    assert compile_blocks(compiled) == 2
    shapes = [([3, 6], [9, 1]), ([3, 6, 2, 5, 4], [9, 1, 4, 7, 2]), ([4], [6]), ([3, 4, 2], [5, 4, 6])]
    for i, (prompts, responses) in enumerate(shapes):
        batch = rows(prompts, responses, seed=i)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = window_logprobs(compiled, batch, 1.0)[0]
        torch.testing.assert_close(got, window_logprobs(eager, batch, 1.0)[0], rtol=0, atol=1e-5)


def family(name: str) -> torch.nn.Module:
    """A tiny random model of a family the presets use: Qwen2 (biased q/k/v), GPT-NeoX (Pythia: partial rotary)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    if name == "qwen2_moe":  # its config says "no window" with sliding_window=0, not None
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(
            vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32,
        )).eval()
    if name == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(
            vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
        )).eval()
    return GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        rotary_pct=0.25, max_position_embeddings=64,
    )).eval()


@pytest.mark.parametrize("name", ["qwen2", "qwen2_moe", "gpt_neox"])
def test_other_families_pack_with_the_padded_rows_logprobs(name):
    model = family(name)
    batch = rows([3, 6, 2, 5], [9, 1, 4, 7])
    with torch.no_grad():
        justified = window_logprobs(model, batch, 1.0)[0]
        assert packing.enable(model), name
        torch.testing.assert_close(window_logprobs(model, batch, 1.0)[0], justified, rtol=0, atol=1e-5)


def test_the_variable_length_kernel_runs_only_on_cuda_in_half_precision_with_heads_it_takes(monkeypatch):
    """`uses_varlen`: never on the CPU or in float32; with grouped-query heads only where the kernel takes them."""
    cpu = torch.zeros(1, 4, 3, 16, dtype=torch.bfloat16)
    assert not packing.uses_varlen(cpu, cpu[:, :2])

    class Cuda(torch.Tensor):  # a stand-in that reports CUDA, to reach the kernel checks on this CPU machine
        is_cuda = True

    query, grouped = cpu.as_subclass(Cuda), cpu[:, :2].as_subclass(Cuda)
    kernel = lambda *a, **k: None  # noqa: E731
    monkeypatch.setattr(packing, "varlen_kernel", lambda: (kernel, {"window_size": (-1, 0)}, False, True))
    assert packing.uses_varlen(query, query) and not packing.uses_varlen(query, grouped)
    assert not packing.uses_varlen(query.float(), query.float())
    monkeypatch.setattr(packing, "varlen_kernel", lambda: (kernel, {"window_size": (-1, 0)}, True, True))
    assert packing.uses_varlen(query, grouped)
    monkeypatch.setattr(packing, "VARLEN_ON_CUDA", False)
    assert not packing.uses_varlen(query, grouped)


class DeviceReads(TorchDispatchMode):
    """Counts the operators that read a tensor's values back to the host (a device sync on CUDA)."""

    READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero", "aten.equal", "aten.masked_select")

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.READS):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_packed_forward_reads_nothing_back_from_the_device():
    """Past `pack` (which reads host copies of the sizes), a packed forward runs without a host read: Hugging Face's
    packed-sequence detection (an `.all()` over the position ids each forward) is kept out by the unread 4-D mask."""
    model = packing_model()
    batch = packing.pack(rows([3, 6, 1, 4], [5, 1, 7, 2]))
    with DeviceReads() as mode:
        packed = model(**batch.forward_inputs(model.config), use_cache=False).logits
    assert mode.reads == []
    unmasked = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **batch.attention_kwargs())
    assert torch.equal(packed, unmasked.logits)  # the mask is never read: the same outputs without it


def test_packed_rows_that_lost_their_packing_arguments_are_refused_not_attended_across():
    model = packing_model()
    batch = packing.pack(rows([3, 6], [5, 1]))
    layer = model.model.layers[0].self_attn
    q, kv = torch.zeros(1, 4, batch.input_ids.shape[1], 16), torch.zeros(1, 2, batch.input_ids.shape[1], 16)
    with pytest.raises(ValueError, match="without their packing arguments"):
        packing.packed_attention(layer, q, kv, kv, packing.unread_mask(q.device))


def test_a_mixture_of_experts_balancing_its_router_packs_without_the_unread_mask():
    """A model that reads the mask itself (Mixtral's router balancing loss, `output_router_logits`) gets none: its
    packed logprobs are the padded rows' and its balancing loss is computed."""
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64, output_router_logits=True)
    model = MixtralForCausalLM(config).eval()
    batch = rows([3, 6, 1], [5, 1, 4])
    padded, _ = window_logprobs(model, batch, 1.0)
    packing.enable(model)
    packed = packing.pack(batch)
    assert "attention_mask" not in packed.forward_inputs(model.config)
    assert model(**packed.forward_inputs(model.config), use_cache=False).aux_loss is not None
    packed_logp, _ = window_logprobs(model, batch, 1.0)
    mask = batch.loss_mask.bool()
    assert torch.allclose(packed_logp[mask], padded[mask], atol=1e-5)
