"""The FLOPs `bench/real_model_speed.py` counts for a training step, against a count by hand."""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from real_model_speed import step_flops  # noqa: E402


def test_a_step_counts_the_decoder_on_every_token_the_output_layer_on_response_tokens_and_causal_attention():
    config = LlamaConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, tie_word_embeddings=True)
    # per layer: q, k, v, o (8x8 each) + gate, up, down (8x16 each) + two norms (8 each); a final norm; tied embeddings
    body = 2 * (4 * 64 + 3 * 128 + 16) + 8
    rows, prompt, response = 4, 6, 4  # 4 rows of 6 prompt and 4 response tokens
    record = {"perf/total_num_tokens": rows * (prompt + response), "val/sequence_lengths": response}
    expected = 6 * body * 40 + 6 * (8 * 100) * 16 + 3 * 2 * 2 * 8 * 10**2 * rows
    assert step_flops(config, record, rows=rows) == expected
