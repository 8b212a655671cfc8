"""The published `config.json` of three real architectures (facts from their model cards' files), for the planner's
tests: the plan must count their parameters exactly, from the config alone."""

from __future__ import annotations

import json
from pathlib import Path

LLAMA_3_1_8B = {  # meta-llama/Llama-3.1-8B
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
QWEN_2_5_0_5B = {  # Qwen/Qwen2.5-0.5B
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
PYTHIA_1B = {  # EleutherAI/pythia-1b
    "architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192, "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 8, "num_hidden_layers": 16,
    "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False, "torch_dtype": "float16",
    "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304,
}
# parameter counts as published (Llama 3.1 model card / safetensors index, Qwen2.5 safetensors metadata, Pythia paper)
PUBLISHED_PARAMETERS = {"llama_3_1_8b": 8_030_261_248, "qwen2_5_0_5b": 494_032_768, "pythia_1b": 1_011_781_632}
CONFIGS = {"llama_3_1_8b": LLAMA_3_1_8B, "qwen2_5_0_5b": QWEN_2_5_0_5B, "pythia_1b": PYTHIA_1B}


def write_config(folder: Path, config: dict) -> Path:
    """A model folder holding only ``config`` as its config.json (what the planner reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder
