"""Gated DeltaNet mixer: projections, causal conv + SiLU, l2-normed q/k, beta and g, the delta rule (through
the ops swap points), gated RMSNorm and out_proj. Letters: s streams, t rows, h heads, c conv channels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import gdn as gdn_k
from qwen_jax.config import TextConfig
from qwen_jax.model import ops
from qwen_jax.model.ops import Backend, linear, linear_split


def project(x: jax.Array, p: dict, backend: Backend, *, prompt: bool):
    """x [S, T, H] -> (m [S, T, C] pre-conv, z, beta [S, T, Hv] fp32, g [S, T, Hv] fp32)."""
    m, z, b, a = linear_split(x, p["in_proj"], backend, prompt=prompt)
    beta, g = gdn_k.gates(b, a, p["A_log"], p["dt_bias"])
    return m, z, beta, g


def split_qkv(u: jax.Array, cfg: TextConfig, backend: Backend):
    """Post-conv channels [S, T, C] -> q, k [S, T, Hk, dk] (l2-normed, q scaled) and v [S, T, Hv, dv]."""
    s, t = u.shape[:2]
    kd, dk, dv = cfg.key_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    hk = cfg.linear_num_key_heads
    # q and k normalised by one call (a row's result depends on that row alone): one launch, not two.
    qk = ops.l2norm(backend, u[..., :2 * kd].reshape(s, t, 2 * hk, dk))
    v = u[..., 2 * kd:].reshape(s, t, cfg.linear_num_value_heads, dv)
    q = (qk[:, :, :hk] * (dk ** -0.5)).astype(u.dtype)
    k = qk[:, :, hk:].astype(u.dtype)
    return q, k, v


def finish(o: jax.Array, z: jax.Array, p: dict, cfg: TextConfig, backend: Backend, *, prompt: bool) -> jax.Array:
    s, t = o.shape[:2]
    z = z.reshape(s, t, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
    y = ops.gated_rms_norm(backend, o, z, p["norm"], cfg.rms_norm_eps, then=p["out"], prompt=prompt)
    return ops.project(y if isinstance(y, ops.Padded) else y.reshape(s, t, cfg.value_dim), p["out"], backend,
                       prompt=prompt)


def prompt_pass(x, p, rec_pool, conv_pool, batch, cfg: TextConfig, backend: Backend):
    """Prompt rows of S streams: x [S, T, H] -> (y [S, T, H], rec_pool, conv_pool)."""
    m, z, beta, g = project(x, p, backend, prompt=True)
    u, conv_pool = ops.conv_prompt(backend, m, conv_pool, batch.slot, p["conv"], batch.start, batch.lengths)
    q, k, v = split_qkv(u, cfg, backend)
    o, rec_pool = ops.gdn_prompt(backend, q, k, v, g, beta, rec_pool, batch.slot, batch.start, batch.lengths)
    return finish(o, z, p, cfg, backend, prompt=True), rec_pool, conv_pool


def window_pass(x, p, rec_pool, conv_pool, window, cfg: TextConfig, backend: Backend, tree: bool = False):
    """Verify-window rows (states read-only): x [S, R, H] -> (y, kept) where kept is what commit replays. tree:
    the window is a tree (the recurrence runs its leaves' paths side by side; `gdn.window`)."""
    if ops.decode_prep_applies(backend, p["in_proj"], cfg):
        y = linear(x, p["in_proj"].weight, backend, prompt=False)
        q, k, v, z, g, beta = ops.gdn_decode_prep(backend, y, window.parents, conv_pool, window.slot, p, cfg)
        m = y[..., :p["in_proj"].sizes[0]]
    else:
        m, z, beta, g = project(x, p, backend, prompt=False)
        u = ops.conv_window(backend, m, window.parents, conv_pool, window.slot, p["conv"])
        q, k, v = split_qkv(u, cfg, backend)
    o = ops.gdn_window(backend, q, k, v, g, beta, window.parents, rec_pool, window.slot, leaves=tree)
    kept = {"m": m, "k": k, "v": v, "g": g, "beta": beta}
    return finish(o, z, p, cfg, backend, prompt=False), kept


def step_pass(x, p, rec_pool, conv_pool, window, cfg: TextConfig, backend: Backend, counter=None):
    """A serial step (one row per stream, states updated in place): x [S, 1, H] -> (y, rec_pool, conv_pool),
    bit for bit `window_pass` with parents [[-1]] followed by `commit` of the row. Dummy streams (slot 0) leave
    the recurrent state of slot 0 unchanged (g = beta = 0 makes the update the identity). With kernels, the
    rows between the in-projection and the recurrence are one `gdn.decode_prep` launch in both passes; here it takes
    the in-projection's decode qmm pieces where it can (`ops.project_pieces`: the same bits as its output), and the
    recurrence and the output norm are one launch (`ops.gdn_step_norm`, the same bits; counter: the program's
    `ops.LaunchCount`)."""
    if ops.decode_prep_applies(backend, p["in_proj"], cfg):
        y = ops.project_pieces(x, p["in_proj"].weight, backend)
        if y is None:
            y = linear(x, p["in_proj"].weight, backend, prompt=False)
        q, k, v, z, g, beta, conv_pool = ops.gdn_decode_prep(backend, y, None, conv_pool, window.slot, p, cfg)
    else:
        m, z, beta, g = project(x, p, backend, prompt=False)
        u, conv_pool = ops.conv_step(backend, m, conv_pool, window.slot, p["conv"])
        q, k, v = split_qkv(u, cfg, backend)
        live = (window.slot > 0)[:, None, None]
        beta, g = jnp.where(live, beta, 0.0), jnp.where(live, g, 0.0)
    z = z.reshape(v.shape)
    normed = ops.gdn_step_norm(backend, q, k, v, g, beta, rec_pool, window.slot, z, p["norm"], cfg.rms_norm_eps,
                               then=p["out"], counter=counter)
    if normed is not None:
        y, rec_pool = normed
        return ops.project(y, p["out"], backend, prompt=False), rec_pool, conv_pool
    o, rec_pool = ops.gdn_step(backend, q, k, v, g, beta, rec_pool, window.slot)
    return finish(o, z, p, cfg, backend, prompt=False), rec_pool, conv_pool


def commit(kept: dict, rec_pool, conv_pool, window, path, path_len, backend: Backend):
    rec_pool = ops.gdn_commit(backend, kept["k"], kept["v"], kept["g"], kept["beta"], path, path_len, rec_pool,
                              window.slot)
    conv_pool = ops.conv_commit(backend, kept["m"], path, path_len, conv_pool, window.slot)
    return rec_pool, conv_pool
