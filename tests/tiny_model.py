"""A tiny random qwen3_5 text model for fast self-consistency tests (not a peer capture)."""

import jax
import jax.numpy as jnp

from qwen_jax.config import parse_config
from qwen_jax.synthetic import random_params

TINY_RAW = {
    "model_type": "qwen3_5_text", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
    "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]},
}


def tiny(dtype=jnp.float32, seed: int = 0, quant=None):
    cfg = parse_config(TINY_RAW)
    return cfg, random_params(cfg.text, jax.random.key(seed), dtype=dtype, quant=quant)
