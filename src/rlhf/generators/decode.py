"""The hf generator's sampling loop: a KV-cached decode in which each row leaves the batch the step it stops.

`transformers`' `generate` keeps a finished row in every later forward (padded); with responses of very different
lengths, as a young policy's are, that is most of the decoding work. Here the cache, mask and positions of finished
rows are dropped (`Cache.batch_select_indices`), so each forward runs only on rows still generating, and nothing
else runs per token (no logits processors, no stopping criteria objects).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from rlhf.generators.base import SamplingParams
from rlhf.generators.shared_prefill import PromptGroups, expand_cache
from rlhf.models.logprobs import keeps_logits
from rlhf.trajectory import real_positions


def top_p_filter(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """``logits`` with every token outside the nucleus set to -inf: the most probable tokens whose probabilities
    first reach ``top_p`` (the most probable one always stays). A 0-d tensor ``top_p`` (a recorded decode step's) is
    never read on the host: the filter always runs. Shape: (B, V) -> (B, V)."""
    if not torch.is_tensor(top_p) and top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop_sorted = probs.cumsum(dim=-1) - probs >= top_p  # the more probable tokens already hold top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def next_tokens(
    logits: torch.Tensor, live: torch.Tensor, rows: int, sampling: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, its logprob) of each live row from its last position's logits: argmax when greedy (logprob at
    temperature 1), else a sample from the nucleus at the temperature (logprob under the temperature-scaled
    distribution, the one the trainer scores).

    The sample is drawn for all ``rows`` rows of the batch at once, finished ones included (a dummy distribution),
    so the random stream is consumed as `transformers`' `generate` consumes it and a seeded run samples the tokens
    it sampled. Shapes: logits (R, V) for the live rows ``live`` (R,) -> (R,), (R,).
    """
    logits = logits.float()
    if sampling.greedy:
        token = logits.argmax(dim=-1)
        return token, torch.log_softmax(logits, dim=-1).gather(-1, token[:, None]).squeeze(-1)
    scaled = logits / sampling.temperature
    probs = torch.zeros(rows, logits.shape[-1], device=logits.device)
    probs[:, 0] = 1.0
    probs[live] = top_p_filter(scaled, sampling.top_p).softmax(dim=-1)
    token = torch.multinomial(probs, 1).squeeze(-1)[live]
    return token, torch.log_softmax(scaled, dim=-1).gather(-1, token[:, None]).squeeze(-1)


def contiguous_cache(cache: DynamicCache) -> None:
    """Make each layer's cached keys and values contiguous, in place (a compiled step would otherwise compile again
    for the first step's strides)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()


@torch.no_grad()
def decode(
    model,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    sampling: SamplingParams,
    stop_id: int,
    pad_id: int,
    step_model=None,
    groups: PromptGroups | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``sampling.max_new_tokens`` tokens after each left-padded prompt.

    ``model`` reads the prompts; ``step_model`` (default ``model``), the same weights, runs the one-token steps after
    it: `generator.compile` passes a `torch.compile`d one there, where a step's fixed cost is most of its time.
    ``groups`` (`rlhf.generators.shared_prefill`): the prompt pass runs on each distinct prompt's first row only, and
    its cache and logits are copied to the rows holding that prompt; the steps after it are the same.

    Returns (tokens (B, W), logprobs (B, W)), W the longest response: a row's tokens up to and including its stop
    token, then ``pad_id`` (logprob 0). Shapes: query_ids, query_mask (B, Lq).
    """
    rows, budget = query_ids.shape[0], sampling.max_new_tokens
    device = query_ids.device
    tokens = torch.full((rows, budget), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(rows, budget, device=device)
    cache = DynamicCache(config=model.config)
    positions = real_positions(query_mask)
    keep = {"logits_to_keep": 1} if keeps_logits(model) else {}
    read = slice(None) if groups is None else groups.firsts  # the rows the prompt pass reads
    out = model(
        input_ids=query_ids[read], attention_mask=query_mask[read], position_ids=positions[read], past_key_values=cache,
        use_cache=True, **keep
    )
    logits = out.logits[:, -1]
    if groups is not None:
        expand_cache(cache, groups.owner)
        logits = logits[groups.owner]
    if step_model is None:
        step_model = model
    else:  # the steps' graph expects contiguous cache tensors (the prompt pass leaves strided views)
        contiguous_cache(cache)
    live = torch.arange(rows, device=device)  # batch rows still generating, in the order the cache holds them
    mask, last = query_mask, positions[:, -1]
    width = 0
    for step in range(budget):
        token, logp = next_tokens(logits, live, rows, sampling)
        tokens[live, step], logprobs[live, step] = token, logp
        width = step + 1
        going = token != stop_id
        if step == budget - 1 or not going.any():
            break
        if not going.all():
            kept = going.nonzero().squeeze(1)
            cache.batch_select_indices(kept)
            live, mask, last, token = live[kept], mask[kept], last[kept], token[kept]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
        last = last + 1
        out = step_model(
            input_ids=token[:, None], attention_mask=mask, position_ids=last[:, None], past_key_values=cache, use_cache=True
        )
        logits = out.logits[:, -1]
    return tokens[:, :width], logprobs[:, :width]
