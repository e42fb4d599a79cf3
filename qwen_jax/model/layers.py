"""SwiGLU MLP and (M-)RoPE: pure functions over params (the norms are `ops` swap points). Letters: t rows,
h heads, d head dim."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import swiglu as swiglu_k
from qwen_jax.config import TextConfig
from qwen_jax.model import ops, parallel
from qwen_jax.model.ops import Backend, linear, linear_split


def mlp(x: jax.Array, p: dict, backend: Backend, *, prompt: bool) -> jax.Array:
    if ops.swiglu_applies(backend, x, p["gate_up"], prompt=prompt):  # decode rows: the activation in one kernel
        return ops.project(ops.swiglu(backend, x, p["gate_up"]), p["down"], backend, prompt=prompt)
    gate, up = linear_split(x, p["gate_up"], backend, prompt=prompt)
    y = linear(swiglu_k.activation(gate, up, x.dtype), p["down"], backend, prompt=prompt)
    return parallel.reduce(y) if backend.sharded else y


def rope_angles(positions: jax.Array, cfg: TextConfig) -> jax.Array:
    """positions [3, ...] (temporal, height, width rows; equal for text) -> angles [..., rotary_dim / 2] fp32.

    Frequency j takes its position from the H row for j % 3 == 1 (j < 3 * section[1]), the W row for
    j % 3 == 2 (j < 3 * section[2]) and the T row otherwise (interleaved M-RoPE); the non-interleaved layout
    gives contiguous sections instead."""
    rd = cfg.rotary_dim
    half = rd // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, rd, 2, dtype=jnp.float32) / rd))
    j = jnp.arange(half)
    sec = cfg.mrope_section
    if cfg.mrope_interleaved:
        comp = jnp.where((j % 3 == 1) & (j < 3 * sec[1]), 1, jnp.where((j % 3 == 2) & (j < 3 * sec[2]), 2, 0))
    else:
        comp = jnp.where(j < sec[0], 0, jnp.where(j < sec[0] + sec[1], 1, 2))
    pos = positions.astype(jnp.float32)  # [3, ...]
    pos_j = jnp.take(pos, comp, axis=0)  # [half, ...]
    pos_j = jnp.moveaxis(pos_j, 0, -1)  # [..., half]
    return pos_j * inv_freq


def apply_rope(x: jax.Array, angles: jax.Array, rotary_dim: int) -> jax.Array:
    """x [..., H, D]; angles [..., half] -> rotate-half RoPE on the first rotary_dim dims, rest unchanged."""
    ang = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # broadcast over heads
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    xr = x[..., :rotary_dim].astype(jnp.float32)
    half = rotary_dim // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = xr * cos + rotated * sin
    return jnp.concatenate([out.astype(x.dtype), x[..., rotary_dim:]], axis=-1)
