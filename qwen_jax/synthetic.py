"""Random params for a config, built on the default device: tests, and the `--synthetic 27b` benchmarks where
speed doesn't depend on the values. Quantized weights are random packed words with plausible scales/biases."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.qweight import QuantizedWeight
from qwen_jax.config import LAYER_GDN, ModelConfig, QuantConfig, TextConfig
from qwen_jax.model.ops import fuse

# The 27B's text shape (model_spec A.2), for `--synthetic 27b`.
QWEN35_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                  num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, rms_norm_eps=1e-6, full_attention_interval=4,
                  rope_parameters={"rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                   "mrope_interleaved": True},
                  tie_word_embeddings=False, max_position_embeddings=262144)


def synthetic_config(name: str, layers: int | None = None) -> ModelConfig:
    """The named shape's config; layers: keep only the first `layers` (same GDN/attention pattern), for
    measurements that scale with depth (per-layer time and compile cost)."""
    from qwen_jax.config import parse_config
    if name != "27b":
        raise ValueError(f"--synthetic: unknown shape {name!r} (known: 27b)")
    raw = {"model_type": "qwen3_5_text", **QWEN35_27B, "quantization": {"bits": 4, "group_size": 64}}
    if layers is not None:
        if not 1 <= layers <= raw["num_hidden_layers"]:
            raise ValueError(f"--layers must be in 1..{raw['num_hidden_layers']}, got {layers}")
        raw["num_hidden_layers"] = layers
    return parse_config(raw, {"eos_token_id": [248046, 248044]})


class _Keys:
    def __init__(self, key):
        self.key = key

    def __call__(self):
        self.key, sub = jax.random.split(self.key)
        return sub


# One small compiled program per tensor shape, called eagerly per tensor: tracing the whole model's random
# weights as one program makes XLA compile for many minutes at the 27B's size (seen on CPU and on the H200).


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _dense_array(key, n: int, k: int, dtype, scale: float):
    return (jax.random.normal(key, (n, k), jnp.float32) * scale).astype(dtype)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _quant_arrays(kw, ks, n: int, k: int, bits: int, group_size: int, scale: float):
    words = jax.random.bits(kw, (n, k * bits // 32), jnp.uint32)
    levels = (1 << bits) - 1
    s = (jax.random.uniform(ks, (n, k // group_size), jnp.float32, 0.5, 1.5) * (2 * scale / levels)
         ).astype(jnp.bfloat16)
    b = (-s.astype(jnp.float32) * levels / 2).astype(jnp.bfloat16)
    return words, s, b


def _dense(keys: _Keys, n: int, k: int, dtype, scale: float):
    return _dense_array(keys(), n, k, dtype, float(scale))


def _quant(keys: _Keys, n: int, k: int, q: QuantConfig, scale: float) -> QuantizedWeight:
    words, s, b = _quant_arrays(keys(), keys(), n, k, q.bits, q.group_size, float(scale))
    return QuantizedWeight(words, s, b, q.bits, q.group_size)


def random_params(cfg: TextConfig, key: jax.Array, *, dtype=jnp.bfloat16, quant: QuantConfig | None = None,
                  norm_jitter: float = 0.1) -> dict:
    keys = _Keys(key)

    def lin(n, k):
        scale = k ** -0.5
        return _quant(keys, n, k, quant, scale) if quant else _dense(keys, n, k, dtype, scale)

    def norm(n):
        return 1.0 + norm_jitter * jax.random.normal(keys(), (n,), jnp.float32)

    h, t = cfg.hidden_size, cfg
    layers = []
    for kind in t.layer_types:
        layer = {"input_norm": norm(h), "post_norm": norm(h),
                 "mlp": {"gate_up": fuse([lin(t.intermediate_size, h), lin(t.intermediate_size, h)]),
                         "down": lin(h, t.intermediate_size)}}
        if kind == LAYER_GDN:
            hv = t.linear_num_value_heads
            layer["gdn"] = {
                "in_proj": fuse([lin(t.conv_dim, h), lin(t.value_dim, h), lin(hv, h), lin(hv, h)]),
                "out": lin(h, t.value_dim),
                "conv": 0.5 * jax.random.normal(keys(), (t.conv_dim, t.linear_conv_kernel_dim), jnp.float32),
                "dt_bias": jax.random.normal(keys(), (hv,), jnp.float32) * 0.5,
                "A_log": jnp.log(jax.random.uniform(keys(), (hv,), jnp.float32, 0.5, 8.0)),
                "norm": norm(t.linear_value_head_dim),
            }
        else:
            layer["attn"] = {"qkv": fuse([lin(t.num_heads * t.head_dim * 2, h), lin(t.num_kv_heads * t.head_dim, h),
                                          lin(t.num_kv_heads * t.head_dim, h)]),
                             "o": lin(h, t.num_heads * t.head_dim),
                             "q_norm": norm(t.head_dim), "k_norm": norm(t.head_dim)}
        layers.append(layer)
    embed = (lambda: _quant(keys, t.vocab_size, h, quant, 1.0)) if quant else (
        lambda: _dense(keys, t.vocab_size, h, dtype, 1.0))
    return {"embed": embed(), "norm": norm(h), "lm_head": None if t.tie_word_embeddings else lin(t.vocab_size, h),
            "layers": tuple(layers)}


# The 27B's DFlash drafter (model_spec C.1: z-lab's Qwen3.5-27B drafter config), for `bench --drafter synthetic`.
QWEN35_27B_DFLASH = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=5120, num_hidden_layers=5,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=17408,
                         rope_theta=1e7, rms_norm_eps=1e-6, vocab_size=248320, num_target_layers=64, block_size=16,
                         dflash_config={"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]})


def synthetic_drafter(target: TextConfig, key: jax.Array, *, dtype=jnp.bfloat16):
    """Random dense weights at the 27B drafter's shapes (bf16, as z-lab ships it), checked against `target`.
    -> (params in `checkpoint.load_dflash`'s layout, DFlashConfig)."""
    from qwen_jax.config import parse_dflash_config
    cfg = parse_dflash_config(QWEN35_27B_DFLASH, target)
    keys = _Keys(key)
    h, hd = cfg.hidden_size, cfg.head_dim

    def lin(n, k):
        return _dense(keys, n, k, dtype, k ** -0.5)

    def norm(n):
        return 1.0 + 0.1 * jax.random.normal(keys(), (n,), jnp.float32)

    layers = tuple({"input_norm": norm(h), "post_norm": norm(h),
                    "mlp": {"gate_up": fuse([lin(cfg.intermediate_size, h), lin(cfg.intermediate_size, h)]),
                            "down": lin(h, cfg.intermediate_size)},
                    "attn": {"q": lin(cfg.num_heads * hd, h),
                             "kv": fuse([lin(cfg.num_kv_heads * hd, h), lin(cfg.num_kv_heads * hd, h)]),
                             "o": lin(h, cfg.num_heads * hd), "q_norm": norm(hd), "k_norm": norm(hd)}}
                   for _ in range(cfg.num_layers))
    params = {"fc": lin(h, cfg.num_taps * h), "hidden_norm": norm(h), "norm": norm(h), "layers": layers}
    return params, cfg
