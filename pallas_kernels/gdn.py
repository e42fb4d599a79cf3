"""Gated DeltaNet: chunked prompt pass, tree/chain verify window, commit of the accepted path, the serial decode
step (a one-row window and its commit in one pass), and the causal depthwise conv in front of it. Plain-jnp
references here define the math every kernel must match.

Letters: s streams, t rows (time), r window rows (nodes), h value heads, k key dim (dk), v value dim (dv),
c conv channels, w conv taps (K = 4 for qwen3_5).

The recurrence, per value head h (key/query head h // (Hv/Hk)), state S [dk, dv] in fp32:
    S <- exp(g_t) S;   delta = beta_t (v_t - S^T k_t);   S <- S + k_t delta^T;   o_t = S^T q_t
q and k arrive already l2-normalised (q also scaled by dk^-1/2). g <= 0 and beta in (0, 1) arrive in fp32.

State lives in pools indexed by slot: rec_pool [N, Hv, dk, dv] fp32, conv_pool [N, K-1, C]. A prompt pass whose
`start` is 0 begins from the zero state whatever its slot holds, so the engine never needs to clear a slot.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pt

from pallas_kernels.calls import pallas_call
from pallas_kernels import rownorm
from pallas_kernels.qmm_mgpu import Pieces, piece_row, rows_operands, rows_shape

CHUNK = 64
QK_NORM_EPS = 1e-6  # the q/k l2 norm's epsilon (the model's `ops.l2norm`)
_HI = jax.lax.Precision.HIGHEST


def _expand_heads(x: jax.Array, num_value_heads: int) -> jax.Array:
    """[..., Hk, d] -> [..., Hv, d]: value head h reads key head h // (Hv/Hk) (repeat, not tile)."""
    ratio = num_value_heads // x.shape[-2]
    return jnp.repeat(x, ratio, axis=-2) if ratio > 1 else x


def delta_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """One recurrent step for all value heads. state [Hv, dk, dv] f32; q, k [Hv, dk]; v [Hv, dv]; g, beta [Hv].
    Returns (new state, output [Hv, dv] f32). The one definition the window and the commit both use, so a
    committed path and its window rows compute the same expressions."""
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    decayed = state * jnp.exp(g)[:, None, None]
    kv_mem = jnp.einsum("hkv,hk->hv", decayed, k, precision=_HI)
    delta = (v - kv_mem) * beta[:, None]
    new = decayed + k[:, :, None] * delta[:, None, :]
    out = jnp.einsum("hkv,hk->hv", new, q, precision=_HI)
    return new, out


# ----------------------------------------------------------------------------------------------------------------
# Prompt pass (chunked WY/UT form, chunk 64 on the grid of absolute positions)
# ----------------------------------------------------------------------------------------------------------------

def _chunk_body(state: jax.Array, chunk: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
    """One 64-row chunk for all heads. state [Hv, dk, dv]; q, k [C, Hv, dk]; v [C, Hv, dv]; g, beta [C, Hv]."""
    q, k, v, g, beta = chunk
    c = q.shape[0]
    gam = jnp.cumsum(g, axis=0)  # [C, Hv]
    diff = gam[:, None, :] - gam[None, :, :]  # [r, s, h] = Gamma_r - Gamma_s
    lower_incl = jnp.tril(jnp.ones((c, c), bool))[:, :, None]
    strict = jnp.tril(jnp.ones((c, c), bool), -1)[:, :, None]
    decay = jnp.exp(jnp.where(lower_incl, diff, -jnp.inf))  # M, zero above the diagonal
    kk = jnp.einsum("rhk,shk->rsh", k, k, precision=_HI)
    a = jnp.where(strict, beta[:, None, :] * kk * decay, 0.0)  # strictly lower
    eye = jnp.eye(c, dtype=jnp.float32)
    # (I + A) X = B by unit lower-triangular solve, per head.
    lhs = jnp.moveaxis(a, -1, 0) + eye  # [h, r, s]
    bv = jnp.moveaxis(v * beta[..., None], 1, 0)  # [h, C, dv]
    bk = jnp.moveaxis(k * (beta * jnp.exp(gam))[..., None], 1, 0)  # [h, C, dk]
    solve = lambda m, b: jax.scipy.linalg.solve_triangular(m, b, lower=True, unit_diagonal=True)
    u = jax.vmap(solve)(lhs, bv)  # [h, C, dv]
    w = jax.vmap(solve)(lhs, bk)  # [h, C, dk]
    v_new = u - jnp.einsum("hck,hkv->hcv", w, state, precision=_HI)
    qh = jnp.moveaxis(q, 1, 0)  # [h, C, dk]
    kh = jnp.moveaxis(k, 1, 0)
    gh = jnp.moveaxis(gam, 1, 0)  # [h, C]
    inter = jnp.einsum("hck,hkv->hcv", qh * jnp.exp(gh)[..., None], state, precision=_HI)
    qk = jnp.einsum("hrk,hsk->hrs", qh, kh, precision=_HI) * jnp.moveaxis(decay, -1, 0)
    out = inter + jnp.einsum("hrs,hsv->hrv", qk, v_new, precision=_HI)
    g_last = gh[:, -1]
    k_decayed = kh * jnp.exp(g_last[:, None] - gh)[..., None]
    new_state = state * jnp.exp(g_last)[:, None, None] + jnp.einsum("hck,hcv->hkv", k_decayed, v_new, precision=_HI)
    return new_state, jnp.moveaxis(out, 0, 1)  # [C, Hv, dv]


def _prompt_one(q, k, v, g, beta, state, start, length):
    """One stream: rows [T] at absolute positions start + i, the first `length` real."""
    t = q.shape[0]
    hv = v.shape[1]
    q, k = _expand_heads(q, hv), _expand_heads(k, hv)
    shift = start % CHUNK
    padded = ((t + CHUNK - 1) // CHUNK + 1) * CHUNK
    rows = jnp.arange(t)
    real = rows < length
    # Padding rows are identities of the recurrence: k = 0, beta = 0, g = 0 leave the state as it is.
    def place(x, fill=0.0):
        x = jnp.where(real.reshape((t,) + (1,) * (x.ndim - 1)), x.astype(jnp.float32), fill)
        buf = jnp.zeros((padded,) + x.shape[1:], jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(buf, x, shift, axis=0)
    qp, kp, vp, gp, bp = (place(a) for a in (q, k, v, g, beta))
    n = padded // CHUNK
    split = lambda x: x.reshape((n, CHUNK) + x.shape[1:])
    state0 = jnp.where(start == 0, jnp.zeros_like(state), state)
    final, out = jax.lax.scan(_chunk_body, state0, tuple(split(a) for a in (qp, kp, vp, gp, bp)))
    out = out.reshape((padded,) + out.shape[2:])
    out = jax.lax.dynamic_slice_in_dim(out, shift, t, axis=0)
    return out, final


def prompt_reference(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     rec_pool: jax.Array, slot: jax.Array, start: jax.Array, lengths: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """Chunked prompt pass for S streams padded to T rows.

    q, k     [S, T, Hk, dk]   (l2-normed; q scaled)
    v        [S, T, Hv, dv]
    g, beta  [S, T, Hv] fp32
    rec_pool [N, Hv, dk, dv] fp32; slot [S] int32 (each stream's slot; distinct)
    start    [S] int32 absolute position of row 0; lengths [S] int32 real rows (rows past it are ignored)
    -> (o [S, T, Hv, dv] in v.dtype, rec_pool with each slot holding the state after its real rows)
    """
    state = rec_pool[slot]
    out, final = jax.vmap(_prompt_one)(q, k, v, g, beta, state, start, lengths)
    return out.astype(v.dtype), rec_pool.at[slot].set(final)


# ----------------------------------------------------------------------------------------------------------------
# Verify window (tree or chain) and commit
# ----------------------------------------------------------------------------------------------------------------

def _window_one(q, k, v, g, beta, parents, state):
    r = q.shape[0]
    hv = v.shape[1]
    q, k = _expand_heads(q, hv), _expand_heads(k, hv)
    states = []
    outs = []
    for i in range(r):  # parents[i] < i, so every parent's state exists when its child runs
        base = state
        for j in range(i):
            base = jnp.where(parents[i] == j, states[j], base)
        new, o = delta_step(base, q[i], k[i], v[i], g[i], beta[i])
        states.append(new)
        outs.append(o)
    return jnp.stack(outs)


def window_reference(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     parents: jax.Array, rec_pool: jax.Array, slot: jax.Array, leaves: bool = False) -> jax.Array:
    """Every node's output from its parent's state updated by its own row; states read-only.

    q, k [S, R, Hk, dk]; v [S, R, Hv, dv]; g, beta [S, R, Hv] fp32
    parents [S, R] int32: -1 = the stream's committed state, else an earlier row (parents[s, r] < r)
    rec_pool [N, Hv, dk, dv] fp32; slot [S] -> o [S, R, Hv, dv] in v.dtype
    leaves: the kernel's schedule (`window`); the reference's result does not depend on it.
    """
    del leaves
    out = jax.vmap(_window_one)(q, k, v, g, beta, parents, rec_pool[slot])
    return out.astype(v.dtype)


def _commit_one(k, v, g, beta, path, path_len, state):
    r = k.shape[0]
    hv = v.shape[1]
    k = _expand_heads(k, hv)
    q_unused = jnp.zeros_like(k)
    for i in range(r):
        node = jnp.maximum(path[i], 0)
        new, _ = delta_step(state, q_unused[node], k[node], v[node], g[node], beta[node])
        state = jnp.where(i < path_len, new, state)
    return state


def commit_reference(k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, path: jax.Array,
                     path_len: jax.Array, rec_pool: jax.Array, slot: jax.Array) -> jax.Array:
    """Replay the accepted path into the committed state.

    k [S, R, Hk, dk]; v [S, R, Hv, dv]; g, beta [S, R, Hv]: the window's rows
    path [S, R] int32 node indices root-first (entries past path_len ignored); path_len [S] int32 (0 = no change)
    -> rec_pool with each stream's slot advanced along its path
    """
    new = jax.vmap(_commit_one)(k, v, g, beta, path, path_len, rec_pool[slot])
    return rec_pool.at[slot].set(new)


def step_reference(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, rec_pool: jax.Array,
                   slot: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One serial decode row per stream: the one-row window (parents [[-1]]) and the commit of that row together.

    q, k [S, 1, Hk, dk]; v [S, 1, Hv, dv]; g, beta [S, 1, Hv] fp32; rec_pool [N, Hv, dk, dv] fp32; slot [S]
    (distinct) -> (o [S, 1, Hv, dv] in v.dtype, rec_pool with each slot advanced by its row)
    """
    hv = v.shape[2]
    q1, k1 = _expand_heads(q[:, 0], hv), _expand_heads(k[:, 0], hv)
    new, out = jax.vmap(delta_step)(rec_pool[slot], q1, k1, v[:, 0], g[:, 0], beta[:, 0])
    return out[:, None].astype(v.dtype), rec_pool.at[slot].set(new)


# ----------------------------------------------------------------------------------------------------------------
# Causal depthwise conv (+ SiLU) in front of the recurrence
# ----------------------------------------------------------------------------------------------------------------

def _conv_taps(taps: list, weight: jax.Array | list) -> jax.Array:
    """taps: K arrays [..., C] in the inputs' dtype, oldest first; weight [C, K], or its K columns [C] as loaded
    (`decode_prep`'s kernel) -> silu(sum_j weight[:, j] taps[j]) [..., C] in fp32, the products added in tap order.
    Every conv entry point (prompt, window, step, decode_prep) computes this same elementwise expression, so a
    row's conv has the same bits whichever pass computes it, and XLA fuses it into its consumers with no transpose
    of the weight or concatenation of the taps (on the H200, session 14, the step's earlier form cost a transpose
    and a concatenation launch a GDN layer)."""
    cols = ([w.astype(_F32) for w in weight] if isinstance(weight, list)
            else [weight.astype(_F32)[:, j] for j in range(len(taps))])
    acc = taps[0].astype(_F32) * cols[0]
    for j in range(1, len(taps)):
        acc = acc + taps[j].astype(_F32) * cols[j]
    return jax.nn.silu(acc)


def conv_prompt_reference(m: jax.Array, conv_pool: jax.Array, slot: jax.Array, weight: jax.Array,
                          start: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """m [S, T, C] pre-conv inputs; conv_pool [N, K-1, C] the last K-1 committed inputs (oldest first);
    weight [C, K] (tap K-1 multiplies the current row); start/lengths [S] as in the prompt pass (start 0 = zero
    history). -> (u [S, T, C] = silu(conv) in m.dtype, conv_pool with the last K-1 real inputs of each stream)."""
    return _conv_prompt(m, conv_pool[slot], conv_pool, slot, weight, start, lengths)


def _conv_prompt(m, hist, conv_pool, slot, weight, start, lengths):
    """`conv_prompt_reference` given hist = conv_pool[slot] [S, K-1, C].

    Tap j of row t reads seq[t + j] of seq = history then rows, i.e. row t - (K-1-j) of m, or the history when
    that is negative. The taps are shifted views of m and of the history, picked per row and added in tap order in
    fp32: one elementwise pass that XLA fuses, each output element the same scalar expression whatever T and S
    are (so chunk cuts keep the bits). On the H200 at T = 4K, C = 10240 (tools/gpu/conv_profile.py): the
    concatenation of history and rows this replaced cost 198 µs on its own, the stacked taps' reduction 148 µs
    more, the fused shifted taps 82 µs."""
    kw = weight.shape[1]
    t = m.shape[1]
    # The history rows are read into their own small array before the pool is updated: left to itself, XLA fused
    # the gather into consumers that read the whole pool, which then had to be copied to be updated in place (on
    # the GPU, tools/gpu/copies_probe.py, 2026-11-30; on the CPU, test_pools_are_updated_in_place). The barrier
    # changes no value.
    hist = jax.lax.optimization_barrier(hist)
    hist = jnp.where((start == 0)[:, None, None], jnp.zeros_like(hist), hist).astype(m.dtype)
    row = jax.lax.broadcasted_iota(jnp.int32, (1, t, 1), 1)
    taps = []
    for j in range(kw):
        back = kw - 1 - j
        from_m = jax.lax.pad(m, jnp.zeros((), m.dtype), ((0, 0, 0), (back, -back, 0), (0, 0, 0)))
        if back:
            from_h = jax.lax.pad(hist[:, j:], jnp.zeros((), m.dtype), ((0, 0, 0), (0, t - back, 0), (0, 0, 0)))
            from_m = jnp.where(row < back, from_h, from_m)
        taps.append(from_m)
    u = _conv_taps(taps, weight).astype(m.dtype)
    # The new history: seq rows [n, n + K-1) for n = lengths.
    idx = lengths[:, None] + jnp.arange(kw - 1)[None, :]  # [S, K-1]
    from_h = jnp.take_along_axis(hist, jnp.clip(idx, 0, kw - 2)[:, :, None], axis=1)
    from_m = jnp.take_along_axis(m, jnp.clip(idx - (kw - 1), 0, t - 1)[:, :, None], axis=1)
    new_hist = jnp.where((idx < kw - 1)[:, :, None], from_h, from_m)
    return u, conv_pool.at[slot].set(new_hist.astype(conv_pool.dtype))


def _ancestor_walk(node, parent_of, depth_needed: int) -> list[tuple[jax.Array, jax.Array]]:
    """For node(s) `node` (an int32 array or scalar) and distance d in 1..depth_needed: (the ancestor index or -1,
    once the path has run out how far into the committed history it reaches). parent_of(i) -> the parent of the
    valid node index i (a gather over all rows in `_ancestor_rows`, a scalar load in `decode_prep`'s kernel)."""
    out = []
    cur, back = node, jnp.zeros_like(node)
    for _ in range(depth_needed):
        par = jnp.where(cur >= 0, parent_of(jnp.maximum(cur, 0)), -1)
        back = jnp.where(cur < 0, back + 1, back)
        back = jnp.where((cur >= 0) & (par < 0), 1, back)
        cur = par
        out.append((cur, back))
    return out


def _ancestor_rows(parents: jax.Array, depth_needed: int) -> tuple[jax.Array, jax.Array]:
    """`_ancestor_walk` of every node r of parents [R] -> (anc [D, R], back [D, R])."""
    walk = _ancestor_walk(jnp.arange(parents.shape[0], dtype=jnp.int32), lambda i: parents[i], depth_needed)
    return jnp.stack([a for a, _ in walk]), jnp.stack([b for _, b in walk])


def conv_window_reference(m: jax.Array, parents: jax.Array, conv_pool: jax.Array, slot: jax.Array,
                          weight: jax.Array) -> jax.Array:
    """Each node's conv over its own root-to-node path, reaching into the committed history before the root.

    m [S, R, C] pre-conv inputs of the window rows; parents [S, R]; conv_pool [N, K-1, C]; slot [S];
    weight [C, K] -> u [S, R, C] = silu(conv) in m.dtype
    """
    kw = weight.shape[1]

    def one(m_s, par, hist):
        anc, back = _ancestor_rows(par, kw - 1)  # [K-1, R]
        taps = [m_s]  # distance 0: the node itself
        for d in range(kw - 1):
            from_path = m_s[jnp.maximum(anc[d], 0)]
            from_hist = hist[jnp.clip(kw - 1 - back[d], 0, kw - 2)].astype(m_s.dtype)
            taps.append(jnp.where((anc[d] >= 0)[:, None], from_path, from_hist))
        return _conv_taps(taps[::-1], weight)  # [R, C], taps oldest first

    return jax.vmap(one)(m, parents, conv_pool[slot]).astype(m.dtype)


def conv_commit_reference(m: jax.Array, path: jax.Array, path_len: jax.Array, conv_pool: jax.Array,
                          slot: jax.Array) -> jax.Array:
    """New conv history = the last K-1 rows of (committed history + accepted path rows).
    m [S, R, C]; path [S, R]; path_len [S]; conv_pool [N, K-1, C]; slot [S] -> conv_pool"""
    km1 = conv_pool.shape[1]

    def one(m_s, p, n, hist):
        rows = m_s[jnp.maximum(p, 0)].astype(hist.dtype)  # [R, C] in path order
        seq = jnp.concatenate([hist, rows], axis=0)
        return jax.lax.dynamic_slice_in_dim(seq, n, km1, axis=0)

    return conv_pool.at[slot].set(jax.vmap(one)(m, path, path_len, conv_pool[slot]))


def conv_step_reference(m: jax.Array, conv_pool: jax.Array, slot: jax.Array, weight: jax.Array
                        ) -> tuple[jax.Array, jax.Array]:
    """One serial decode row per stream: `conv_window_reference` with parents [[-1]] and `conv_commit_reference`
    of that row together, with the same casts. m [S, 1, C]; conv_pool [N, K-1, C]; slot [S] (distinct);
    weight [C, K] -> (u [S, 1, C] in m.dtype, conv_pool holding the last K-1 inputs)"""
    hist = conv_pool[slot]  # [S, K-1, C] oldest first
    taps = [hist[:, j:j + 1].astype(m.dtype) for j in range(hist.shape[1])] + [m]  # the window's taps, [S, 1, C]
    u = _conv_taps(taps, weight)
    new_hist = jnp.concatenate([hist, m.astype(hist.dtype)], axis=1)[:, 1:]  # the commit's casts
    return u.astype(m.dtype), conv_pool.at[slot].set(new_hist)


def gates(b: jax.Array, a: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias), both fp32, from the projection's b and a (the
    model's `gdn.project` and `decode_prep` alike)."""
    beta = jax.nn.sigmoid(b.astype(_F32))
    g = -jnp.exp(a_log.astype(_F32)) * jax.nn.softplus(a.astype(_F32) + dt_bias.astype(_F32))
    return beta, g


def decode_prep_reference(y: jax.Array, parents: jax.Array | None, conv_pool: jax.Array, slot: jax.Array,
                   weight: jax.Array, a_log: jax.Array, dt_bias: jax.Array, *, hk: int, dk: int, hv: int, dv: int
                   ) -> tuple[jax.Array, ...]:
    """Verify or step rows' inputs to the recurrence, from the GDN in-projection's output.

    y [S, R, N] in the activation dtype (or `qmm_mgpu.Pieces` of it), columns q (hk dk) | k (hk dk) | v (hv dv) |
    z (hv dv) | b (hv) | a (hv);
    parents [S, R] for a verify window, or None for the serial step (R = 1: the conv pool takes the row, as
    `conv_step_reference`, and streams on slot 0 get g = beta = 0, the identity update); conv_pool [N, K-1, C] with
    C = 2 hk dk + hv dv; slot [S]; weight [C, K]; a_log, dt_bias [hv].
    -> (q, k [S, R, hk, dk] in y.dtype (l2-normed over dk, q then times dk^-1/2), v, z [S, R, hv, dv] in y.dtype,
    g, beta [S, R, hv] fp32), and the conv pool after them for the step."""
    if isinstance(y, Pieces):
        y = y.materialize()
    s, r = y.shape[:2]
    kd, vd = hk * dk, hv * dv
    c = 2 * kd + vd
    m, z = y[..., :c], y[..., c:c + vd].reshape(s, r, hv, dv)
    beta, g = gates(y[..., c + vd:c + vd + hv], y[..., c + vd + hv:c + vd + 2 * hv], a_log, dt_bias)
    if parents is None:
        u, conv_pool = conv_step_reference(m, conv_pool, slot, weight)
        live = (slot > 0)[:, None, None]
        beta, g = jnp.where(live, beta, 0.0), jnp.where(live, g, 0.0)
    else:
        u = conv_window_reference(m, parents, conv_pool, slot, weight)
    qk = rownorm.l2norm_reference(u[..., :2 * kd].reshape(s, r, 2 * hk, dk), QK_NORM_EPS)
    q = (qk[:, :, :hk] * (dk ** -0.5)).astype(y.dtype)
    out = (q, qk[:, :, hk:].astype(y.dtype), u[..., 2 * kd:].reshape(s, r, hv, dv), z, g, beta)
    return out if parents is not None else (*out, conv_pool)


# ================================================================================================================
# Pallas kernels (Triton lowering) and the public entry points
# ================================================================================================================
#
# Backend: `pl.pallas_call` with Triton compiler params. It is deprecated in jax 0.11 but runs, and it runs under
# `interpret=True` on CPU, so the CPU suite executes the same kernel source. Every in-kernel shape is a power of
# two (Triton's rule), so dk, dv and the tiles must be powers of two of at least 16.
#
# Prompt pass = three launches (the split of flash-linear-attention's chunk kernels, written anew here):
#   1. `_prep_kernel`, grid (stream, chunk, value head), fully parallel: everything of a 64-row chunk that needs no
#      state: Gamma, T = (I + A)^-1, W = T diag(beta e^Gamma) K, U = T diag(beta) V.
#   2. `_state_kernel`, grid (stream, value head, dv block): the only sequential part. It walks one stream's chunks
#      in order with its [dk, block_v] state slice on chip: V' = U - W S, S <- e^Gamma_C S + K~^T V', and leaves
#      each chunk's entering state and V' for the third launch.
#   3. `_output_kernel`, grid (stream, chunk, value head), fully parallel: O = (Q e^Gamma) S_c + (Q K^T o M) V'.
# Verify and commit = `_recurrent_kernel`, grid (stream, value head, dv block): a list of steps (rows of the serial
# recurrence) over a state slice in registers. The window runs it over the steps of its tree, the commit over the
# accepted path; both step with `_row_update`, which is what makes a committed path and its window nodes the same
# arithmetic bit for bit. The serial decode step = `_step_kernel`, same grid and tiles: one row with the same
# `_row_update` / `_row_output`, state read once and written back in place, so a serial step is the bits of a
# one-row window plus its commit.

_F32 = jnp.float32
_ALGORITHMS = {
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
}


@dataclasses.dataclass(frozen=True)
class PromptTiles:
    """block_v: dv columns of state one program of the state pass keeps on chip (power of two, >= 16).
    precision: how products with an fp32 operand run on the GPU: 'tf32' (one tensor-core pass) or 'tf32x3' (three
    passes, about fp32). Products of two bf16 inputs (K K^T, Q K^T) are exact in both. Interpret mode always
    computes fp32 (XLA:CPU has no tf32). 'bf16': the precision flash-linear-attention's chunk kernels run at --
    the inverse (I + A)^-1 still in tf32, every other product on operands rounded to bf16 (fp32 accumulation),
    W and U travel from the prep pass in bf16; the roundings are explicit casts, so interpret mode computes the
    same values up to summation order.
    store_dtype: how the per-chunk states and V' travel from the state pass to the output pass: 'float32', or
    'bfloat16' (half the traffic; the output then carries about one more bf16 rounding, the recurrence none).
    Measured on the H200 at the 27B shape, T = 16K (docs/kernels/gdn.md): these defaults 4.3 ms, o error 1.2e-3,
    state 3.5e-4 vs the fp32 reference; store_dtype='bfloat16' 3.3 ms, o 3.2e-3; precision='tf32x3' 10 ms,
    o 4e-5, state 6e-7."""
    block_v: int = 64
    num_warps: int = 8
    num_stages: int = 2
    prep_warps: int = 4
    output_warps: int = 8
    precision: str = "tf32"
    store_dtype: str = "float32"
    # The state pass keeps S^T [block_v, dk] instead of S: both of its products then take their register operand
    # from the previous product's result (S^T W^T, then V'^T-scaled K) and only W and K come from shared memory,
    # where S [dk, block_v] needs the state and V' written to shared memory as operands every chunk. U, the
    # chunk states and V' travel transposed ([dv, 64], [dv, dk], [dv, 64]). An order change.
    transposed: bool = False
    # With transposed: the state pass also computes the outputs (the output pass's two products per chunk, off the
    # recurrence's critical path), the prep pass leaves P = (Q K^T o M) per chunk for it, and no chunk states or
    # V' are stored. An order change.
    fused_output: bool = False
    # The prep pass in two launches (session 10, not yet timed): (I + A)^-1 first, stored in the dtype the W and
    # U products round it to (bf16 at precision 'bf16', else fp32: 8 or 16 KB a chunk and head), then W, U [and P]
    # from it. Each kernel keeps fewer tiles live than the one-launch prep (offline for the H200 at the shipped
    # bf16 tiles: 168 and 152 registers, 3 programs an SM each, against 255 and 2). The same values meet the same
    # products: the bits do not change.
    split_prep: bool = False


def prompt_tiles(dtype) -> PromptTiles:
    """The shipped prompt-pass tiles for the model's activation dtype (fixed for a model, so a stream's bits never
    depend on the call). bf16: products on bf16 operands, as flash-linear-attention's chunk kernels compute them,
    the state pass on S^T in 32-column slices on 4 warps writing the outputs itself (`fused_output`: no output
    pass, no chunk states in memory). H200, one run (docs/kernels/gdn.md, session 9): 642 / 2041 / 6216 µs a layer
    at T = 4K / 16K / 64K against 675 / 2168 / 7739 for session 8's tiles (16-column slices on 2 warps, three
    launches) and fla's 620 / 1536 / 5814. Other dtypes: the tf32 defaults."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return PromptTiles(block_v=32, num_warps=4, precision="bf16", store_dtype="bfloat16", transposed=True,
                           fused_output=True)
    return PromptTiles()


@dataclasses.dataclass(frozen=True)
class WindowTiles:
    """block_v: dv columns of state per program of the step, window and commit kernels. All three must use the
    same tiles, or their reductions over dk could group differently and the bits part ways (drafted = serial).

    Default 64 columns on 4 warps (since session 8): the serial decode step, the call the engine runs every round
    in every GDN layer, took 13.5 / 30.6 / 52.6 µs at 1 / 4 / 16 streams against 15.0 / 31.2 / 86.6 for 16 columns
    on one warp (H200, session 7, one run), and the one-row window 43.9 against 58.5 µs at 16 streams (run 3); the
    step's bits equal window + commit's at these tiles on the H200 (test_gpu_step_other_tiles_27b_heads[64-4]).
    On 4 warps the dk reduction crosses warps (a shared-memory round trip a row), where one warp keeps it in
    shuffles: multi-row verify windows at these tiles are not timed yet, so drafting will have to choose the
    tiles of all three again by measuring whole drafted rounds."""
    block_v: int = 64
    num_warps: int = 4


def _mm(a: jax.Array, b: jax.Array, precision: str, interpret: bool) -> jax.Array:
    """a [m, k] @ b [k, n] -> fp32. Two half-precision operands: exact products, fp32 accumulation."""
    if precision == "bf16":
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    if interpret:  # XLA:CPU lacks some bf16 x bf16 -> f32 dots; widening first is exact, and so are the products
        return jnp.dot(a.astype(_F32), b.astype(_F32), precision=_HI, preferred_element_type=_F32)
    if a.dtype == b.dtype and a.dtype in (jnp.bfloat16, jnp.float16):
        return jnp.dot(a, b, preferred_element_type=_F32)
    return jnp.dot(a.astype(_F32), b.astype(_F32), precision=_ALGORITHMS[precision], preferred_element_type=_F32)


def _iota(n: int, axis: int = 0, ndim: int = 1) -> jax.Array:
    shape = [1] * ndim
    shape[axis] = n
    return jax.lax.broadcasted_iota(jnp.int32, (n,) if ndim == 1 else tuple(shape), axis)


def _chunk_geometry(c, shift, length):
    """Chunk c of a stream covers array rows [c*64 - shift, c*64 - shift + 64) (absolute positions on the grid of
    multiples of 64). It is loaded from row max(that, 0): a stream that starts off the grid gets its first, partial
    chunk with the real rows first and identity rows (k = 0, beta = 0, g = 0) after them, which is the same
    recurrence as identity rows before them. -> (first array row loaded, rows that are real [64], rows this chunk
    owns [64] (real or padding inside the call's T))."""
    lo = c * CHUNK - shift
    first = jnp.maximum(lo, 0)
    rows = first + _iota(CHUNK)
    return first, rows < jnp.minimum(lo + CHUNK, length), rows < lo + CHUNK


def _num_chunks(shift, length):
    return (shift + length + CHUNK - 1) // CHUNK


def _unit_lower_inverse(a: jax.Array, mm) -> jax.Array:
    """(I + a)^-1 for strictly lower-triangular a [C, C], by recursive doubling: if D inverts the block-diagonal
    part of I + a at block size b, then D - D A_b D inverts it at block size 2b, where A_b keeps only the lower-left
    b x b block inside each 2b x 2b diagonal block. log2(C) - 1 levels of two C x C x C products run on the tensor
    cores, where forward substitution would be C dependent row steps with cross-warp reductions."""
    n = a.shape[0]
    r, c = _iota(n, 0, 2), _iota(n, 1, 2)
    d = jnp.where(r == c, 1.0, 0.0) - jnp.where(jax.lax.div(r, 2) == jax.lax.div(c, 2), a, 0.0)
    b = 2
    while b < n:
        pair = jax.lax.div(r, 2 * b) == jax.lax.div(c, 2 * b)
        a_b = jnp.where(pair & (jax.lax.div(r, b) != jax.lax.div(c, b)), a, 0.0)
        d = d - mm(mm(d, a_b), d)
        b *= 2
    return d


def _load_chunk(ref, s, rows, head, real):
    """A chunk's rows of one head: [64, d] from ref [S, T, H, d], or [64] from ref [S, T, H]; rows that are not
    real read as zeros."""
    if len(ref.shape) == 3:
        return pt.load(ref.at[s, rows, head], mask=real, other=0.0)
    return pt.load(ref.at[s, rows, head, :], mask=jnp.broadcast_to(real[:, None], (CHUNK, ref.shape[-1])), other=0)


def _chunk_inverse(k, beta, gam, mm, mm_inverse):
    """T = (I + A)^-1, A = strict(diag(beta) K K^T o decay) of one chunk [64, 64]."""
    strict = _iota(CHUNK, 0, 2) > _iota(CHUNK, 1, 2)
    decay = jnp.exp(jnp.where(strict, gam[:, None] - gam[None, :], -jnp.inf))
    return _unit_lower_inverse(jnp.where(strict, beta[:, None] * mm(k, k.T) * decay, 0.0), mm_inverse)


def _chunk_p(q, k, gam, mm):
    """P = Q K^T o M, M the causal decay e^(Gamma_i - Gamma_j) for i >= j."""
    causal = _iota(CHUNK, 0, 2) >= _iota(CHUNK, 1, 2)
    return mm(q, k.T) * jnp.exp(jnp.where(causal, gam[:, None] - gam[None, :], -jnp.inf))


def _store_wu(w_ref, u_ref, at, t_inv, k, v, beta, gam, mm, transposed):
    """W = T diag(beta e^Gamma) K and U = T diag(beta) V of one chunk into w_ref[at], u_ref[at]."""
    w_ref[at] = mm(t_inv, k.astype(_F32) * (beta * jnp.exp(gam))[:, None]).astype(w_ref.dtype)
    u = mm(t_inv, v.astype(_F32) * beta[:, None])
    u_ref[at] = (u.T if transposed else u).astype(u_ref.dtype)


def _prep_mms(precision, interpret):
    """(mm for the chunk's products, mm for the inverse: tf32 where the others run on bf16 operands)."""
    mm = functools.partial(_mm, precision=precision, interpret=interpret)
    mm_inverse = functools.partial(_mm, precision="tf32" if precision == "bf16" else precision, interpret=interpret)
    return mm, mm_inverse


def _for_chunk(start_ref, len_ref, body) -> None:
    """The prep launches' frame: program (stream s, chunk c, value head h) runs body(s, c, h, rows, real) when
    chunk c holds rows of stream s (`_chunk_geometry`); chunks past a stream's end stay unwritten (the state pass
    never reads them)."""
    s, c, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    shift = start_ref[s] % CHUNK
    length = len_ref[s]

    @pl.when(c < _num_chunks(shift, length))
    def _():
        first, real, _ = _chunk_geometry(c, shift, length)
        body(s, c, h, pl.ds(first, CHUNK), real)


def _prep_kernel(*refs, group, precision, interpret, transposed, fused):
    """Everything of a chunk that does not need the state, one (stream, chunk, value head) per program.
    [q (fused only)], k [S, T, Hk, dk]; v [S, T, Hv, dv]; g, beta [S, T, Hv]; start, lengths [S] ->
    w [S, NC, Hv, 64, dk] = T diag(beta e^Gamma) K, u [S, NC, Hv, 64, dv] = T diag(beta) V with T = (I + A)^-1,
    gam [S, NC, Hv, 64] = Gamma (chunk-local cumulative g), [p [S, NC, Hv, 64, 64] = Q K^T o M, M the causal
    decay e^(Gamma_i - Gamma_j) for i >= j (fused only)]."""
    if fused:
        q_ref, k_ref, v_ref, g_ref, beta_ref, start_ref, len_ref, w_ref, u_ref, gam_ref, p_ref = refs
    else:
        k_ref, v_ref, g_ref, beta_ref, start_ref, len_ref, w_ref, u_ref, gam_ref = refs
    mm, mm_inverse = _prep_mms(precision, interpret)

    def body(s, c, h, rows, real):
        k = _load_chunk(k_ref, s, rows, h // group, real)
        v = _load_chunk(v_ref, s, rows, h, real)
        g = _load_chunk(g_ref, s, rows, h, real)
        beta = _load_chunk(beta_ref, s, rows, h, real)
        gam = jnp.cumsum(g)
        if fused:  # first, so that q and the product are dead before the inverse's chain
            p_ref[s, c, h] = _chunk_p(_load_chunk(q_ref, s, rows, h // group, real), k, gam, mm).astype(p_ref.dtype)
        _store_wu(w_ref, u_ref, (s, c, h), _chunk_inverse(k, beta, gam, mm, mm_inverse), k, v, beta, gam, mm,
                  transposed)
        gam_ref[s, c, h] = gam

    _for_chunk(start_ref, len_ref, body)


def _inverse_kernel(k_ref, g_ref, beta_ref, start_ref, len_ref, t_ref, gam_ref, *, group, precision, interpret):
    """The prep pass's first launch with tiles.split_prep: k, g, beta, start, lengths -> t [S, NC, Hv, 64, 64]
    (T = (I + A)^-1 in the dtype the W / U products round it to) and gam. Same values as `_prep_kernel`'s."""
    mm, mm_inverse = _prep_mms(precision, interpret)

    def body(s, c, h, rows, real):
        k = _load_chunk(k_ref, s, rows, h // group, real)
        gam = jnp.cumsum(_load_chunk(g_ref, s, rows, h, real))
        beta = _load_chunk(beta_ref, s, rows, h, real)
        t_ref[s, c, h] = _chunk_inverse(k, beta, gam, mm, mm_inverse).astype(t_ref.dtype)
        gam_ref[s, c, h] = gam

    _for_chunk(start_ref, len_ref, body)


def _wu_kernel(*refs, group, precision, interpret, transposed, fused):
    """The prep pass's second launch with tiles.split_prep: W and U from the stored T and Gamma, and P (fused)."""
    if fused:
        q_ref, k_ref, v_ref, beta_ref, gam_ref, t_ref, start_ref, len_ref, w_ref, u_ref, p_ref = refs
    else:
        k_ref, v_ref, beta_ref, gam_ref, t_ref, start_ref, len_ref, w_ref, u_ref = refs
    mm, _ = _prep_mms(precision, interpret)

    def body(s, c, h, rows, real):
        k = _load_chunk(k_ref, s, rows, h // group, real)
        gam = gam_ref[s, c, h]
        if fused:
            p_ref[s, c, h] = _chunk_p(_load_chunk(q_ref, s, rows, h // group, real), k, gam, mm).astype(p_ref.dtype)
        _store_wu(w_ref, u_ref, (s, c, h), t_ref[s, c, h], k, _load_chunk(v_ref, s, rows, h, real),
                  _load_chunk(beta_ref, s, rows, h, real), gam, mm, transposed)

    _for_chunk(start_ref, len_ref, body)


def _initial_slice(pool_ref, slot, h, cols, start):
    """A stream's [dk, block_v] state slice entering its prompt pass: zeros for a fresh prompt (start 0 ignores
    whatever its slot holds)."""
    state = pool_ref[slot, h, :, cols]
    return jnp.where(start == 0, 0.0, state)


def _g_last(gam, is_last):
    """Gamma_C, the chunk's last cumulative gate, as a masked sum (the lowering has no element extraction); is_last
    = _iota(CHUNK) == CHUNK - 1, built once outside the chunk loop."""
    return jnp.sum(jnp.where(is_last, gam, 0.0))


def _v_new_t(state, u_t, w, mm):
    """V'^T = U^T - S^T W^T [block_v, 64] for the state slice S^T [block_v, dk] (PromptTiles.transposed; both state
    passes step with this and `_advance_t`): u_t [block_v, 64] fp32, U^T's rows of the slice; w [64, dk]."""
    return u_t - mm(state, w.T)


def _advance_t(state, v_new, k, gam, g_last, mm):
    """The next S^T = e^Gamma_C S^T + (V'^T e^(Gamma_C - Gamma)) K: k [64, dk], gam [64], g_last = Gamma_C."""
    return state * jnp.exp(g_last) + mm(v_new * jnp.exp(g_last - gam)[None, :], k)


def _state_kernel(k_ref, w_ref, u_ref, gam_ref, start_ref, len_ref, slot_ref, pool_ref, h_ref, vn_ref,
                  pool_out_ref, *, group, block_v, precision, interpret, transposed):
    """The only sequential part: the chunks of one stream in order, its [dk, block_v] state slice on chip.
    k [S, T, Hk, dk]; w [S, NC, Hv, 64, dk]; u [S, NC, Hv, 64, dv]; gam [S, NC, Hv, 64]; start, lengths, slot [S];
    pool [N, Hv, dk, dv] (aliased to pool_out) -> h [S, NC, Hv, dk, dv] the state entering each chunk,
    vn [S, NC, Hv, 64, dv] = V' = U - W S, pool_out. Per chunk: S <- e^Gamma_C S + (K e^(Gamma_C - Gamma))^T V'.
    The outputs are left to `_output_kernel`, which runs on all chunks at once: keeping them here would put
    three more products and two more row tiles on this kernel's critical path and registers (measured so in run 1
    of docs/kernels/gdn.md; `_state_output_kernel` tries it again on S^T, with P made by the prep pass).
    transposed: the slice is kept as S^T [block_v, dk]; u, h, vn are [.., dv, 64], [.., dv, dk], [.., dv, 64]."""
    s, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, length, slot = start_ref[s], len_ref[s], slot_ref[s]
    shift = start % CHUNK
    dk = k_ref.shape[-1]
    cols = pl.ds(j * block_v, block_v)
    mm = functools.partial(_mm, precision=precision, interpret=interpret)
    is_last = _iota(CHUNK) == CHUNK - 1

    def chunk(c, state):
        first, real, _ = _chunk_geometry(c, shift, length)
        k = pt.load(k_ref.at[s, pl.ds(first, CHUNK), h // group, :],
                    mask=jnp.broadcast_to(real[:, None], (CHUNK, dk)), other=0)
        gam = gam_ref[s, c, h]
        g_last = _g_last(gam, is_last)
        if transposed:  # state = S^T [block_v, dk]
            h_ref[s, c, h, cols, :] = state.astype(h_ref.dtype)
            v_new = _v_new_t(state, u_ref[s, c, h, cols, :].astype(_F32), w_ref[s, c, h], mm)  # [block_v, 64]
            vn_ref[s, c, h, cols, :] = v_new.astype(vn_ref.dtype)
            return _advance_t(state, v_new, k, gam, g_last, mm)
        h_ref[s, c, h, :, cols] = state.astype(h_ref.dtype)
        v_new = u_ref[s, c, h, :, cols].astype(_F32) - mm(w_ref[s, c, h], state)  # [64, block_v]
        vn_ref[s, c, h, :, cols] = v_new.astype(vn_ref.dtype)
        k_tail = k.astype(_F32) * jnp.exp(g_last - gam)[:, None]
        return state * jnp.exp(g_last) + mm(k_tail.T, v_new)

    state = _initial_slice(pool_ref, slot, h, cols, start)
    if transposed:
        state = state.T
    state = jax.lax.fori_loop(0, _num_chunks(shift, length), chunk, state)
    pool_out_ref[slot, h, :, cols] = state.T if transposed else state


def _state_output_kernel(q_ref, k_ref, w_ref, u_ref, gam_ref, p_ref, start_ref, len_ref, slot_ref, pool_ref, o_ref,
                         pool_out_ref, *, group, block_v, precision, interpret):
    """`_state_kernel` on S^T with `_output_kernel`'s work done per chunk as it goes (PromptTiles.fused_output):
    O^T = (S^T Q^T) e^Gamma + V'^T P^T for the program's block_v output columns, with the chunk state and V'
    rounded to the store dtype as the output pass would have read them. u [S, NC, Hv, dv, 64]; p [S, NC, Hv, 64,
    64] -> o [S, T, Hv, dv], pool_out. The call's rows past the stream's last chunk are written as zeros."""
    s, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, length, slot = start_ref[s], len_ref[s], slot_ref[s]
    shift = start % CHUNK
    t_rows, dk = q_ref.shape[1], q_ref.shape[-1]
    cols = pl.ds(j * block_v, block_v)
    mm = functools.partial(_mm, precision=precision, interpret=interpret)
    is_last = _iota(CHUNK) == CHUNK - 1
    store = p_ref.dtype

    def out_mask(first, owned):
        return jnp.broadcast_to((owned & (first + _iota(CHUNK) < t_rows))[:, None], (CHUNK, block_v))

    def chunk(c, state):  # state = S^T [block_v, dk]
        first, real, owned = _chunk_geometry(c, shift, length)
        mask_k = jnp.broadcast_to(real[:, None], (CHUNK, dk))
        k = pt.load(k_ref.at[s, pl.ds(first, CHUNK), h // group, :], mask=mask_k, other=0)
        q = pt.load(q_ref.at[s, pl.ds(first, CHUNK), h // group, :], mask=mask_k, other=0)
        gam = gam_ref[s, c, h]
        g_last = _g_last(gam, is_last)
        inter = mm(state.astype(store), q.T) * jnp.exp(gam)[None, :]  # (Q S)^T [block_v, 64]
        v_new = _v_new_t(state, u_ref[s, c, h, cols, :].astype(_F32), w_ref[s, c, h], mm)  # [block_v, 64]
        o = inter + mm(v_new.astype(store), p_ref[s, c, h].T)
        pt.store(o_ref.at[s, pl.ds(first, CHUNK), h, cols], o.T.astype(o_ref.dtype), mask=out_mask(first, owned))
        return _advance_t(state, v_new, k, gam, g_last, mm)

    def zeros(c, carry):
        first, _, owned = _chunk_geometry(c, shift, length)
        pt.store(o_ref.at[s, pl.ds(first, CHUNK), h, cols], jnp.zeros((CHUNK, block_v), o_ref.dtype),
                 mask=out_mask(first, owned))
        return carry

    state = _initial_slice(pool_ref, slot, h, cols, start).T
    n = _num_chunks(shift, length)
    state = jax.lax.fori_loop(0, n, chunk, state)
    pool_out_ref[slot, h, :, cols] = state.T
    jax.lax.fori_loop(n, _max_chunks(t_rows), zeros, 0)


def _output_kernel(q_ref, k_ref, gam_ref, h_ref, vn_ref, start_ref, len_ref, o_ref, *, group, precision,
                   interpret, transposed):
    """O = (Q e^Gamma) S_c + (Q K^T o M) V' for one (stream, chunk, value head), all chunks in parallel.
    q, k [S, T, Hk, dk]; gam [S, NC, Hv, 64]; h [S, NC, Hv, dk, dv]; vn [S, NC, Hv, 64, dv]; start, lengths [S]
    -> o [S, T, Hv, dv]. Rows of the call past a stream's last chunk are written as zeros, like the reference's."""
    s, c, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    shift = start_ref[s] % CHUNK
    length = len_ref[s]
    t_rows, dk = q_ref.shape[1], q_ref.shape[-1]
    dv = o_ref.shape[-1]
    first, real, owned = _chunk_geometry(c, shift, length)
    rows = pl.ds(first, CHUNK)
    out_mask = jnp.broadcast_to((owned & (first + _iota(CHUNK) < t_rows))[:, None], (CHUNK, dv))
    active = c < _num_chunks(shift, length)

    @pl.when(active)
    def _():
        mm = functools.partial(_mm, precision=precision, interpret=interpret)
        mask_k = jnp.broadcast_to(real[:, None], (CHUNK, dk))
        q = pt.load(q_ref.at[s, rows, h // group, :], mask=mask_k, other=0)
        k = pt.load(k_ref.at[s, rows, h // group, :], mask=mask_k, other=0)
        gam = gam_ref[s, c, h]
        state, v_new = h_ref[s, c, h], vn_ref[s, c, h]
        if transposed:
            state, v_new = state.T, v_new.T
        decay = jnp.exp(jnp.where(_iota(CHUNK, 0, 2) >= _iota(CHUNK, 1, 2), gam[:, None] - gam[None, :], -jnp.inf))
        # With a 16-bit store the two products run on 16-bit operands: q is already bf16, and the attention
        # weights lose nothing the bf16 output would keep.
        inter = mm(q.astype(state.dtype), state) * jnp.exp(gam)[:, None]
        o = inter + mm((mm(q, k.T) * decay).astype(v_new.dtype), v_new)
        pt.store(o_ref.at[s, rows, h, :], o.astype(o_ref.dtype), mask=out_mask)

    @pl.when(jnp.logical_not(active))
    def _():
        pt.store(o_ref.at[s, rows, h, :], jnp.zeros((CHUNK, dv), o_ref.dtype), mask=out_mask)


_ROW_BITS = 8  # a step code is row | emit << 8 | restart << 9
_EMIT, _RESTART = 1 << _ROW_BITS, 2 << _ROW_BITS


def _row_update(state, k, v, g, beta):
    """One row of the recurrence on a [dk, block_v] fp32 state slice; k [dk], v [block_v] fp32, g, beta scalars.
    The window and the commit both step with this and nothing else, so a node's state is the same bits whichever
    kernel computed it. decay * S^T k is formed as decay * (S^T k): one multiply per column, not per element."""
    decay = jnp.exp(g)
    kv = jnp.sum(state * k[:, None], axis=0)
    delta = (v - decay * kv) * beta
    return decay * state + k[:, None] * delta[None, :]


def _row_output(state, q):
    """o = S^T q for a [dk, block_v] state slice and q [dk] fp32 -> [block_v] fp32. Shared like `_row_update`."""
    return jnp.sum(state * q[:, None], axis=0)


def _recurrent_kernel(*refs, group, block_v, emit, lists=1):
    """Runs a list of steps over one [dk, block_v] state slice per (step list, value head, dv block).
    q, k [S, R, Hk, dk]; v [S, R, Hv, dv]; g, beta [S, R, Hv]; steps [S * lists, L] codes (row | EMIT | RESTART),
    padded with two entries; n_steps [S * lists]; slot [S]; pool [N, Hv, dk, dv]. Step list i runs stream
    i // lists (the window's lists run side by side; `_leaf_steps`).
    emit (the window): q is read, a step flagged EMIT writes row `row` of o [S, R, Hv, dv], a step flagged RESTART
    starts again from the committed state, and the pool is only read. Otherwise (the commit): the final state goes
    back to the pool (aliased to pool_out).
    Each step's rows are fetched one step ahead and its code two steps ahead, so load latency hides behind the
    previous step's arithmetic instead of adding to every step."""
    if emit:
        q_ref, k_ref, v_ref, g_ref, beta_ref, steps_ref, n_ref, slot_ref, pool_ref, o_ref = refs
    else:
        k_ref, v_ref, g_ref, beta_ref, steps_ref, n_ref, slot_ref, pool_ref, pool_out_ref = refs
    i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s = i // lists
    cols = pl.ds(j * block_v, block_v)
    slot = slot_ref[s]

    def fetch(code):
        row = code % _EMIT
        data = (k_ref[s, row, h // group, :].astype(_F32), v_ref[s, row, h, cols].astype(_F32),
                g_ref[s, row, h], beta_ref[s, row, h])
        return data + ((q_ref[s, row, h // group, :].astype(_F32),) if emit else ())

    def step(n, carry):
        state, code, data, next_code = carry
        after_next = steps_ref[i, n + 2]
        next_data = fetch(next_code)
        if emit:
            state = jax.lax.cond((code // _RESTART) % 2 == 1, lambda: pool_ref[slot, h, :, cols], lambda: state)
        state = _row_update(state, *data[:4])
        if emit:
            out = _row_output(state, data[4]).astype(o_ref.dtype)
            flag = jnp.broadcast_to((code // _EMIT) % 2 == 1, (block_v,))
            pt.store(o_ref.at[s, code % _EMIT, h, cols], out, mask=flag)
        return state, next_code, next_data, after_next

    first = steps_ref[i, 0]
    # A window's list always starts by restarting from the committed state (its first node's path starts at the
    # root), which loads the slice: the carry starts as zeros rather than reading the slice twice. The commit
    # starts from it.
    state = jnp.zeros((k_ref.shape[-1], block_v), _F32) if emit else pool_ref[slot, h, :, cols]
    carry = (state, first, fetch(first), steps_ref[i, 1])
    state = jax.lax.fori_loop(0, n_ref[i], step, carry)[0]
    if not emit:
        pool_out_ref[slot, h, :, cols] = state


def _step_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, slot_ref, pool_ref, o_ref, pool_out_ref, *, group,
                 block_v):
    """One serial decode row per stream, state slice read once and written once: per (stream, value head, dv block)
    the arithmetic of a one-row window (`_row_update`, `_row_output`) and of a one-row commit, in one launch.
    q, k [S, 1, Hk, dk]; v [S, 1, Hv, dv]; g, beta [S, 1, Hv]; slot [S]; pool [N, Hv, dk, dv] (aliased to pool_out)
    -> o [S, 1, Hv, dv], pool_out. Straight-line: no step list, no loop, no restart reload of the state."""
    s, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)
    o_ref[s, 0, h, cols] = _step_row(q_ref, k_ref, v_ref, g_ref, beta_ref, slot_ref, pool_ref, pool_out_ref,
                                     s, h, cols, group).astype(o_ref.dtype)


def _step_row(q_ref, k_ref, v_ref, g_ref, beta_ref, slot_ref, pool_ref, pool_out_ref, s, h, cols, group):
    """The serial step of stream s, value head h, dv columns cols: the state slice updated and written back, and the
    row's output (fp32) returned; `_step_kernel`'s and `_step_norm_kernel`'s one arithmetic."""
    slot = slot_ref[s]
    state = _row_update(pool_ref[slot, h, :, cols], k_ref[s, 0, h // group, :].astype(_F32),
                        v_ref[s, 0, h, cols].astype(_F32), g_ref[s, 0, h], beta_ref[s, 0, h])
    out = _row_output(state, q_ref[s, 0, h // group, :].astype(_F32))
    pool_out_ref[slot, h, :, cols] = state
    return out


def _tree_schedule(parents: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """parents [S, R] -> (path [S, R, R]: each node's root-first path ending at itself, padded with 0;
    depth [S, R]: its length; resume [S, R]: how many of its entries node r-1's state already covers, 0 when r-1
    is not an ancestor). A parent outside [0, r) means the committed state, as in `window_reference`."""
    r = parents.shape[1]
    idx = jnp.arange(r, dtype=jnp.int32)
    parents = jnp.where((parents >= 0) & (parents < idx), parents, -1).astype(jnp.int32)
    anc = [jnp.broadcast_to(idx, parents.shape)]
    for _ in range(r - 1):
        cur = anc[-1]
        anc.append(jnp.where(cur >= 0, jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=1), -1))
    anc = jnp.stack(anc, axis=-1)  # [S, R, R]: ancestor at distance d, -1 past the root
    depth = jnp.sum(anc >= 0, axis=-1).astype(jnp.int32)
    back = jnp.clip(depth[..., None] - 1 - idx, 0, r - 1)
    path = jnp.where(idx < depth[..., None], jnp.take_along_axis(anc, back, axis=-1), 0)
    if r == 1:
        return path.astype(jnp.int32), depth, jnp.zeros_like(depth)
    prev_hit = anc[:, :, 1:] == (idx - 1)[None, :, None]  # node r-1 at distance d = 1 + position
    dist = jnp.argmax(prev_hit, axis=-1) + 1
    resume = jnp.where(jnp.any(prev_hit, axis=-1) & (idx > 0), depth - dist, 0).astype(jnp.int32)
    return path.astype(jnp.int32), depth, resume


def _window_steps(parents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """parents [S, R] -> (steps [S, R(R+1)/2 + 2] codes, n_steps [S]). Nodes run in index order and the state of
    the previous node is kept: a chain costs one step per node, a fan restarts from the committed state at each
    node, other trees replay only the part of a node's path that the previous node does not cover."""
    s, r = parents.shape
    path, depth, resume = _tree_schedule(parents)
    count = depth - resume  # steps node r runs: its uncovered ancestors, then itself
    offset = jnp.cumsum(count, axis=1) - count
    j = jnp.arange(r, dtype=jnp.int32)
    valid = j < count[..., None]  # [S, R (node), R (step)]
    row = jnp.take_along_axis(path, jnp.clip(resume[..., None] + j, 0, r - 1), axis=-1)
    code = (row + jnp.where(j == count[..., None] - 1, _EMIT, 0)
            + jnp.where((j == 0) & (resume[..., None] == 0), _RESTART, 0))
    length = r * (r + 1) // 2 + 2  # the most steps r nodes can need, and two entries of read-ahead padding
    where = jnp.where(valid, offset[..., None] + j, length).reshape(s, -1)
    steps = jnp.zeros((s, length), jnp.int32).at[jnp.arange(s)[:, None], where].set(
        code.reshape(s, -1).astype(jnp.int32), mode="drop")
    return steps, jnp.sum(count, axis=1).astype(jnp.int32)


def _leaf_steps(parents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """parents [S, R] -> (steps [S * R, R + 2] codes, n_steps [S * R]): one step list per (stream, row), run side by
    side. The list of a leaf (a row no row hangs off) replays the leaf's path from the committed state; every other
    list is empty. A row is emitted in the list of its first leaf (follow each row's lowest-numbered child), so
    exactly once, from the state its own path gives: the serial steps' bits, as in `_window_steps`. A tree's
    window then takes as long as its deepest path, where `_window_steps` runs its nodes one after another and
    replays a path at every node that does not hang off the one before it (a best-first tree's order). A chain
    is one list either way."""
    s, r = parents.shape
    idx = jnp.arange(r, dtype=jnp.int32)
    path, depth, _ = _tree_schedule(parents)
    parents = jnp.where((parents >= 0) & (parents < idx), parents, -1).astype(jnp.int32)
    hangs = parents[:, None, :] == idx[None, :, None]  # [S, R (node), R (row)]: row hangs off node
    first_child = jnp.min(jnp.where(hangs, idx[None, None, :], r), axis=2)  # r: a leaf
    down = jnp.where(first_child < r, first_child, idx[None, :])  # a leaf stays
    for _ in range(max(1, (r - 1).bit_length())):  # down^(2^k): every row's first leaf
        down = jnp.take_along_axis(down, down, axis=1)
    leaf = first_child == r  # [S, R]
    j = jnp.arange(r, dtype=jnp.int32)
    on = j[None, None, :] < depth[..., None]  # [S, R (list), R (step)]
    mine = jnp.take_along_axis(down, path.reshape(s, -1), axis=1).reshape(s, r, r) == idx[None, :, None]
    code = path + jnp.where(on & mine, _EMIT, 0) + jnp.where(j[None, None, :] == 0, _RESTART, 0)
    code = jnp.where(on & leaf[..., None], code, 0)
    steps = jnp.pad(code, ((0, 0), (0, 0), (0, 2))).reshape(s * r, r + 2).astype(jnp.int32)
    return steps, jnp.where(leaf, depth, 0).reshape(s * r).astype(jnp.int32)


def _is_pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _check_rows(name: str, q: jax.Array | None, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                rec_pool: jax.Array, slot: jax.Array) -> None:
    """Shapes and dtypes shared by the prompt pass, the window and the commit."""
    if k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"gdn.{name}: k must be [S, T, Hk, dk] and v [S, T, Hv, dv], got {k.shape} and {v.shape}")
    if q is not None and q.shape != k.shape:
        raise ValueError(f"gdn.{name}: q {q.shape} and k {k.shape} must have the same shape")
    s, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    if v.shape[:2] != (s, t):
        raise ValueError(f"gdn.{name}: v {v.shape} must share [S, T] = {(s, t)} with k")
    if hv % hk:
        raise ValueError(f"gdn.{name}: value heads ({hv}) must be a multiple of key heads ({hk})")
    for label, x in (("g", g), ("beta", beta)):
        if x.shape != (s, t, hv) or x.dtype != _F32:
            raise ValueError(f"gdn.{name}: {label} must be float32 [S, T, Hv] = {(s, t, hv)}, "
                             f"got {x.dtype} {x.shape}")
    if not (_is_pow2(dk) and _is_pow2(dv)):
        raise ValueError(f"gdn.{name}: the kernels need dk and dv to be powers of two >= 16, got {dk}, {dv}; "
                         f"use {name}_reference for other head sizes")
    if rec_pool.ndim != 4 or rec_pool.shape[1:] != (hv, dk, dv) or rec_pool.dtype != _F32:
        raise ValueError(f"gdn.{name}: rec_pool must be float32 [N, Hv, dk, dv] with (Hv, dk, dv) = "
                         f"{(hv, dk, dv)}, got {rec_pool.dtype} {rec_pool.shape}")
    if slot.shape != (s,) or not jnp.issubdtype(slot.dtype, jnp.integer):
        raise ValueError(f"gdn.{name}: slot must be an integer array of shape [S] = ({s},), got {slot.dtype} "
                         f"{slot.shape}")


def _check_per_stream(name: str, s: int, **arrays: jax.Array) -> None:
    for label, x in arrays.items():
        if x.shape != (s,) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"gdn.{name}: {label} must be an integer array of shape [S] = ({s},), got "
                             f"{x.dtype} {x.shape}")


def _block_v(block_v: int, dv: int, name: str) -> int:
    bv = min(block_v, dv)
    if not _is_pow2(bv):
        raise ValueError(f"gdn.{name}: tiles.block_v must be a power of two >= 16, got {block_v}")
    return bv


def prompt(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, rec_pool: jax.Array,
           slot: jax.Array, start: jax.Array, lengths: jax.Array, *, interpret: bool = False,
           tiles: PromptTiles = PromptTiles()) -> tuple[jax.Array, jax.Array]:
    """Chunked prompt pass; same contract as `prompt_reference` (q, k [S, T, Hk, dk]; v [S, T, Hv, dv];
    g, beta [S, T, Hv] fp32; rec_pool [N, Hv, dk, dv] fp32; slot, start, lengths [S]) -> (o [S, T, Hv, dv] in
    v.dtype, rec_pool). Rows past a stream's length read as zeros. Pass rec_pool donated to update it in place."""
    _check_rows("prompt", q, k, v, g, beta, rec_pool, slot)
    _check_per_stream("prompt", k.shape[0], start=start, lengths=lengths)
    if tiles.store_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"gdn.prompt: tiles.store_dtype must be 'float32' or 'bfloat16', got {tiles.store_dtype!r}")
    if tiles.precision not in (*_ALGORITHMS, "bf16"):
        raise ValueError(f"gdn.prompt: tiles.precision must be one of {sorted((*_ALGORITHMS, 'bf16'))}, got "
                         f"{tiles.precision!r}")
    _block_v(tiles.block_v, v.shape[3], "prompt")
    start = jnp.maximum(start.astype(jnp.int32), 0)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, k.shape[1])
    if tiles.fused_output:
        if not tiles.transposed:
            raise ValueError("gdn.prompt: tiles.fused_output needs tiles.transposed")
        w, u, gam, p = prompt_prep(k, v, g, beta, start, lengths, tiles=tiles, interpret=interpret, q=q)
        return prompt_state_output(q, k, w, u, gam, p, start, lengths, slot.astype(jnp.int32), rec_pool,
                                   v.dtype, tiles=tiles, interpret=interpret)
    w, u, gam = prompt_prep(k, v, g, beta, start, lengths, tiles=tiles, interpret=interpret)
    h_chunks, v_new, rec_pool = prompt_state(k, w, u, gam, start, lengths, slot.astype(jnp.int32), rec_pool,
                                             tiles=tiles, interpret=interpret)
    o = prompt_output(q, k, gam, h_chunks, v_new, start, lengths, v.dtype, tiles=tiles, interpret=interpret)
    return o, rec_pool


# The three launches of `prompt`, separately callable so the benchmark can time each; inputs as `prompt` has
# validated and clipped them.

def _max_chunks(t: int) -> int:
    return (t + 2 * CHUNK - 2) // CHUNK  # a stream starting off the grid spans one chunk more


def prompt_prep(k, v, g, beta, start, lengths, *, tiles: PromptTiles, interpret: bool, q=None):
    """-> w [S, NC, Hv, 64, dk], u [S, NC, Hv, 64, dv] (bf16 at precision 'bf16', else fp32), gam [S, NC, Hv, 64]
    (fp32), and with tiles.fused_output (pass q) p [S, NC, Hv, 64, 64] in the store dtype."""
    s, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    nc = _max_chunks(t)
    wu = jnp.bfloat16 if tiles.precision == "bf16" else _F32
    fused = tiles.fused_output
    extra = (jax.ShapeDtypeStruct((s, nc, hv, CHUNK, CHUNK), jnp.dtype(tiles.store_dtype)),) if fused else ()
    w_shape = jax.ShapeDtypeStruct((s, nc, hv, CHUNK, dk), wu)
    u_shape = jax.ShapeDtypeStruct((s, nc, hv) + ((dv, CHUNK) if tiles.transposed else (CHUNK, dv)), wu)
    gam_shape = jax.ShapeDtypeStruct((s, nc, hv, CHUNK), _F32)
    if tiles.split_prep:
        t_inv, gam = pallas_call(
            functools.partial(_inverse_kernel, group=hv // hk, precision=tiles.precision, interpret=interpret),
            out_shape=(jax.ShapeDtypeStruct((s, nc, hv, CHUNK, CHUNK), wu), gam_shape),
            grid=(s, nc, hv),
            compiler_params=pt.CompilerParams(num_warps=tiles.prep_warps),
            interpret=interpret,
            name="gdn_prompt_inverse",
        )(k, g, beta, start, lengths)
        w, u, *p = pallas_call(
            functools.partial(_wu_kernel, group=hv // hk, precision=tiles.precision, interpret=interpret,
                              transposed=tiles.transposed, fused=fused),
            out_shape=(w_shape, u_shape) + extra,
            grid=(s, nc, hv),
            compiler_params=pt.CompilerParams(num_warps=tiles.prep_warps),
            interpret=interpret,
            name="gdn_prompt_wu",
        )(*((q,) if fused else ()), k, v, beta, gam, t_inv, start, lengths)
        return (w, u, gam, *p)
    return pallas_call(
        functools.partial(_prep_kernel, group=hv // hk, precision=tiles.precision, interpret=interpret,
                          transposed=tiles.transposed, fused=fused),
        out_shape=(w_shape, u_shape, gam_shape) + extra,
        grid=(s, nc, hv),
        compiler_params=pt.CompilerParams(num_warps=tiles.prep_warps),
        interpret=interpret,
        name="gdn_prompt_prep",
    )(*((q,) if fused else ()), k, v, g, beta, start, lengths)


def prompt_state(k, w, u, gam, start, lengths, slot, rec_pool, *, tiles: PromptTiles, interpret: bool):
    """-> (h [S, NC, Hv, dk, dv] state entering each chunk, v_new [S, NC, Hv, 64, dv], rec_pool); the last two
    axes of u, h and v_new swapped with tiles.transposed."""
    s, t, hk, dk = k.shape
    nc, hv = u.shape[1], u.shape[2]
    dv = u.shape[3] if tiles.transposed else u.shape[4]
    bv = _block_v(tiles.block_v, dv, "prompt")
    store = jnp.dtype(tiles.store_dtype)
    tr = tiles.transposed
    return pallas_call(
        functools.partial(_state_kernel, group=hv // hk, block_v=bv, precision=tiles.precision,
                          interpret=interpret, transposed=tr),
        out_shape=(jax.ShapeDtypeStruct((s, nc, hv) + ((dv, dk) if tr else (dk, dv)), store),
                   jax.ShapeDtypeStruct((s, nc, hv) + ((dv, CHUNK) if tr else (CHUNK, dv)), store),
                   jax.ShapeDtypeStruct(rec_pool.shape, _F32)),
        grid=(s, hv, dv // bv),
        input_output_aliases={7: 2},
        compiler_params=pt.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="gdn_prompt_state",
    )(k, w, u, gam, start, lengths, slot, rec_pool)


def prompt_state_output(q, k, w, u, gam, p, start, lengths, slot, rec_pool, out_dtype, *, tiles: PromptTiles,
                        interpret: bool):
    """The state pass with the outputs (tiles.fused_output) -> (o [S, T, Hv, dv] in out_dtype, rec_pool)."""
    s, t, hk, dk = k.shape
    hv, dv = u.shape[2], u.shape[3]
    bv = _block_v(tiles.block_v, dv, "prompt")
    return pallas_call(
        functools.partial(_state_output_kernel, group=hv // hk, block_v=bv, precision=tiles.precision,
                          interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((s, t, hv, dv), out_dtype), jax.ShapeDtypeStruct(rec_pool.shape, _F32)),
        grid=(s, hv, dv // bv),
        input_output_aliases={9: 1},
        compiler_params=pt.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="gdn_prompt_state_output",
    )(q, k, w, u, gam, p, start, lengths, slot, rec_pool)


def prompt_output(q, k, gam, h_chunks, v_new, start, lengths, out_dtype, *, tiles: PromptTiles, interpret: bool):
    """-> o [S, T, Hv, dv] in out_dtype."""
    s, t, hk, _ = q.shape
    nc, hv = h_chunks.shape[1], h_chunks.shape[2]
    dv = h_chunks.shape[3] if tiles.transposed else h_chunks.shape[4]
    return pallas_call(
        functools.partial(_output_kernel, group=hv // hk, precision=tiles.precision, interpret=interpret,
                          transposed=tiles.transposed),
        out_shape=jax.ShapeDtypeStruct((s, t, hv, dv), out_dtype),
        grid=(s, nc, hv),
        compiler_params=pt.CompilerParams(num_warps=tiles.output_warps),
        interpret=interpret,
        name="gdn_prompt_output",
    )(q, k, gam, h_chunks, v_new, start, lengths)


def window(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, parents: jax.Array,
           rec_pool: jax.Array, slot: jax.Array, *, interpret: bool = False,
           tiles: WindowTiles = WindowTiles(), leaves: bool = False) -> jax.Array:
    """Verify window over trees or chains; same contract as `window_reference` (q, k [S, R, Hk, dk];
    v [S, R, Hv, dv]; g, beta [S, R, Hv] fp32; parents [S, R]; rec_pool read-only; slot [S]) -> o [S, R, Hv, dv].
    Each node's output is bit for bit what `commit` of its ancestors followed by a one-row window gives.
    leaves: each stream's leaves' paths side by side (`_leaf_steps`: for trees, R times the programs) instead of
    its nodes one after another (`_window_steps`: for chains); the same bits either way."""
    _check_rows("window", q, k, v, g, beta, rec_pool, slot)
    s, r, hk, _ = k.shape
    hv, dv = v.shape[2], v.shape[3]
    if parents.shape != (s, r) or not jnp.issubdtype(parents.dtype, jnp.integer):
        raise ValueError(f"gdn.window: parents must be an integer array [S, R] = {(s, r)}, got {parents.dtype} "
                         f"{parents.shape}")
    if r > _EMIT:
        raise ValueError(f"gdn.window: at most {_EMIT} rows per stream, got {r}")
    bv = _block_v(tiles.block_v, dv, "window")
    steps, n_steps = _leaf_steps(parents) if leaves else _window_steps(parents)
    lists = r if leaves else 1
    return pallas_call(
        functools.partial(_recurrent_kernel, group=hv // hk, block_v=bv, emit=True, lists=lists),
        out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
        grid=(s * lists, hv, dv // bv),
        compiler_params=pt.CompilerParams(num_warps=tiles.num_warps),
        interpret=interpret,
        name="gdn_window",
    )(q, k, v, g, beta, steps, n_steps, slot.astype(jnp.int32), rec_pool)


def commit(k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, path: jax.Array, path_len: jax.Array,
           rec_pool: jax.Array, slot: jax.Array, *, interpret: bool = False,
           tiles: WindowTiles = WindowTiles()) -> jax.Array:
    """Replay each stream's accepted path into its slot; same contract as `commit_reference` (k [S, R, Hk, dk];
    v [S, R, Hv, dv]; g, beta [S, R, Hv]; path [S, R] root-first; path_len [S], 0 = unchanged) -> rec_pool.
    Use the same tiles as the window whose rows these are."""
    _check_rows("commit", None, k, v, g, beta, rec_pool, slot)
    s, r, hk, _ = k.shape
    hv, dv = v.shape[2], v.shape[3]
    if path.shape != (s, r) or not jnp.issubdtype(path.dtype, jnp.integer):
        raise ValueError(f"gdn.commit: path must be an integer array [S, R] = {(s, r)}, got {path.dtype} "
                         f"{path.shape}")
    _check_per_stream("commit", s, path_len=path_len)
    if r > _EMIT:
        raise ValueError(f"gdn.commit: at most {_EMIT} rows per stream, got {r}")
    bv = _block_v(tiles.block_v, dv, "commit")
    # Two entries of padding: the kernel reads each step's code two steps ahead.
    steps = jnp.pad(jnp.clip(path, 0, r - 1).astype(jnp.int32), ((0, 0), (0, 2)))
    return pallas_call(
        functools.partial(_recurrent_kernel, group=hv // hk, block_v=bv, emit=False),
        out_shape=jax.ShapeDtypeStruct(rec_pool.shape, _F32),
        grid=(s, hv, dv // bv),
        input_output_aliases={7: 0},
        compiler_params=pt.CompilerParams(num_warps=tiles.num_warps),
        interpret=interpret,
        name="gdn_commit",
    )(k, v, g, beta, steps, jnp.clip(path_len, 0, r).astype(jnp.int32), slot.astype(jnp.int32), rec_pool)


def step(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, rec_pool: jax.Array,
         slot: jax.Array, *, interpret: bool = False, tiles: WindowTiles = WindowTiles()
         ) -> tuple[jax.Array, jax.Array]:
    """Serial decode step, one launch; same contract as `step_reference` (q, k [S, 1, Hk, dk]; v [S, 1, Hv, dv];
    g, beta [S, 1, Hv] fp32; rec_pool [N, Hv, dk, dv] fp32; slot [S], distinct) -> (o [S, 1, Hv, dv] in v.dtype,
    rec_pool). Reads each state slice once and writes it back in place (pass rec_pool donated).
    Bit for bit, o is `window(..., parents=[[-1]] * S, ...)` and the pool is `commit(...)` of the row (path [[0]],
    path_len 1), given the same tiles: all three step with `_row_update` / `_row_output` over the same
    [dk, block_v] slice shape and warps, so a drafted window and its commit give the bits of serial steps."""
    _check_rows("step", q, k, v, g, beta, rec_pool, slot)
    s, r, hk, _ = k.shape
    hv, dv = v.shape[2], v.shape[3]
    if r != 1:
        raise ValueError(f"gdn.step: one row per stream (q, k [S, 1, Hk, dk]), got {r} rows; use window + commit "
                         f"for more")
    bv = _block_v(tiles.block_v, dv, "step")
    return pallas_call(
        functools.partial(_step_kernel, group=hv // hk, block_v=bv),
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(rec_pool.shape, _F32)),
        grid=(s, hv, dv // bv),
        input_output_aliases={6: 1},
        compiler_params=pt.CompilerParams(num_warps=tiles.num_warps),
        interpret=interpret,
        name="gdn_step",
    )(q, k, v, g, beta, slot.astype(jnp.int32), rec_pool)


def _step_norm_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, slot_ref, pool_ref, z_ref, w_ref, _,
                      o_ref, pool_out_ref, y_ref, count_ref, *, group, block_v, dv, hv, streams, out_rows, eps,
                      tiles: rownorm.RowTiles, interpret):
    """`_step_kernel`'s row (o into o_ref [S Hv, dv], a row a stream and value head), then GDN's output norm of it:
    the last of a head's dv / block_v programs to count itself in (count_ref [S Hv] int32, zero on entry and left
    zero) normalises the head's row into y_ref [out_rows Hv, dv] with `rownorm.norm_block` over the row's block as
    the gated_rms_norm kernel's program takes it (its tiles and warps: the same bits); the stream-0 programs write
    the padding rows (streams past S) as that kernel writes them (the norm of a zero row, gate zero)."""
    s, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)
    row = s * hv + h
    o_ref[row, cols] = _step_row(q_ref, k_ref, v_ref, g_ref, beta_ref, slot_ref, pool_ref, pool_out_ref,
                                 s, h, cols, group).astype(o_ref.dtype)
    io = o_ref.dtype
    if out_rows > streams:
        @pl.when(s == 0)
        def _padding():
            w = w_ref[cols].astype(io).astype(_F32)
            zero = ((w * 0.0).astype(io).astype(_F32) * 0.0).astype(io)  # (w n) silu(gate) at n = gate = 0
            for t in range(streams, out_rows):
                y_ref[t * hv + h, cols] = zero
    done = rownorm.count_in(count_ref, row, interpret)
    blocks = dv // block_v

    @pl.when(done == blocks - 1)
    def _last():
        rownorm.counted_in(interpret)
        n = streams * hv
        rownorm.norm_block(o_ref, z_ref, w_ref, y_ref, (row // tiles.block_rows) * tiles.block_rows, n, n,
                           kind="gated", d=dv, eps=eps, tiles=tiles, io_dtype=io, only_row=row)
        pt.atomic_add(count_ref, (row,), jnp.int32(-blocks))  # zero for the next call


def step_norm_supports(dv: int, tiles: WindowTiles = WindowTiles()) -> bool:
    """Whether `step_norm` can run the output norm in the step's launch: the norm's warps (`rownorm.tiles_for(dv)`)
    are the step's, so each keeps its bits."""
    return rownorm.tiles_for(dv).num_warps == tiles.num_warps and _is_pow2(min(tiles.block_v, dv))


def step_norm(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, rec_pool: jax.Array,
              slot: jax.Array, z: jax.Array, weight: jax.Array, count: jax.Array, *, eps: float,
              out_rows: int | None = None, interpret: bool = False, tiles: WindowTiles = WindowTiles()
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`step` and GDN's output norm of its o (`rownorm.gated_rms_norm(o, z, weight, eps, out_rows=out_rows Hv)`) in
    one launch: z [S, 1, Hv, dv] the gate, weight [dv], count int32 [>= S Hv] zero (a launch counter: give each
    call the previous call's returned one) -> (y [out_rows Hv, dv] (out_rows None: S) with zero rows past S Hv,
    rec_pool, count, zero again). y's bits are the two kernels', the pool's `step`'s."""
    _check_rows("step_norm", q, k, v, g, beta, rec_pool, slot)
    s, r, hk, _ = k.shape
    hv, dv = v.shape[2], v.shape[3]
    out_rows = s if out_rows is None else out_rows
    if r != 1 or z.shape != v.shape or weight.shape != (dv,) or count.ndim != 1 or count.shape[0] < s * hv:
        raise ValueError(f"gdn.step_norm: one row a stream, z like v {v.shape}, weight [{dv}], count [>= {s * hv}]; "
                         f"got {r} rows, z {z.shape}, weight {weight.shape}, count {count.shape}")
    if count.dtype != jnp.int32 or out_rows < s or not step_norm_supports(dv, tiles):
        raise ValueError(f"gdn.step_norm: count int32 ({count.dtype}), out_rows >= S ({out_rows}), the norm's "
                         f"warps the step's ({tiles.num_warps})")
    bv = _block_v(tiles.block_v, dv, "step")
    kernel = functools.partial(_step_norm_kernel, group=hv // hk, block_v=bv, dv=dv, hv=hv, streams=s,
                               out_rows=out_rows, eps=float(eps), tiles=rownorm.tiles_for(dv), interpret=interpret)
    o, rec_pool, y, count = pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((s * hv, dv), v.dtype), jax.ShapeDtypeStruct(rec_pool.shape, _F32),
                   jax.ShapeDtypeStruct((out_rows * hv, dv), v.dtype), jax.ShapeDtypeStruct(count.shape, jnp.int32)),
        grid=(s, hv, dv // bv),
        input_output_aliases={6: 1, 9: 3},
        compiler_params=pt.CompilerParams(num_warps=tiles.num_warps),
        interpret=interpret,
        name="gdn_step_norm",
    )(q, k, v, g, beta, slot.astype(jnp.int32), rec_pool, z.reshape(s * hv, dv), weight, count)
    del o  # the norm's input, read back within the launch
    return y, rec_pool, count


# The conv in front of the recurrence stays plain jnp: XLA fuses each of these into one or two memory-bound
# passes (see docs/kernels/gdn.md for timings at the 27B's shape), so a Pallas kernel would buy nothing.

def _check_conv(name: str, m: jax.Array, conv_pool: jax.Array, slot: jax.Array) -> None:
    if m.ndim != 3:
        raise ValueError(f"gdn.{name}: m must be [S, T, C], got {m.shape}")
    if conv_pool.ndim != 3 or conv_pool.shape[2] != m.shape[2]:
        raise ValueError(f"gdn.{name}: conv_pool must be [N, K-1, C] with C = {m.shape[2]}, got {conv_pool.shape}")
    _check_per_stream(name, m.shape[0], slot=slot)


def _check_weight(name: str, weight: jax.Array, conv_pool: jax.Array) -> None:
    if weight.shape != (conv_pool.shape[2], conv_pool.shape[1] + 1):
        raise ValueError(f"gdn.{name}: weight must be [C, K] = {(conv_pool.shape[2], conv_pool.shape[1] + 1)}, "
                         f"got {weight.shape}")


def conv_prompt(m: jax.Array, conv_pool: jax.Array, slot: jax.Array, weight: jax.Array, start: jax.Array,
                lengths: jax.Array, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Same contract as `conv_prompt_reference` (plain jnp: XLA fuses it into one pass)."""
    del interpret
    _check_conv("conv_prompt", m, conv_pool, slot)
    _check_weight("conv_prompt", weight, conv_pool)
    _check_per_stream("conv_prompt", m.shape[0], start=start, lengths=lengths)
    return _conv_prompt(m, conv_pool[slot], conv_pool, slot, weight, start, jnp.clip(lengths, 0, m.shape[1]))


def conv_window(m: jax.Array, parents: jax.Array, conv_pool: jax.Array, slot: jax.Array, weight: jax.Array, *,
                interpret: bool = False) -> jax.Array:
    """Same contract as `conv_window_reference`."""
    del interpret
    _check_conv("conv_window", m, conv_pool, slot)
    _check_weight("conv_window", weight, conv_pool)
    if parents.shape != m.shape[:2]:
        raise ValueError(f"gdn.conv_window: parents must be [S, R] = {m.shape[:2]}, got {parents.shape}")
    return conv_window_reference(m, parents, conv_pool, slot, weight)


def conv_commit(m: jax.Array, path: jax.Array, path_len: jax.Array, conv_pool: jax.Array, slot: jax.Array, *,
                interpret: bool = False) -> jax.Array:
    """Same contract as `conv_commit_reference`."""
    del interpret
    _check_conv("conv_commit", m, conv_pool, slot)
    if path.shape != m.shape[:2]:
        raise ValueError(f"gdn.conv_commit: path must be [S, R] = {m.shape[:2]}, got {path.shape}")
    _check_per_stream("conv_commit", m.shape[0], path_len=path_len)
    return conv_commit_reference(m, path, jnp.clip(path_len, 0, m.shape[1]), conv_pool, slot)


def conv_step(m: jax.Array, conv_pool: jax.Array, slot: jax.Array, weight: jax.Array, *,
              interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Same contract as `conv_step_reference`: u bit for bit `conv_window` of the row with parents [[-1]], the
    pool `conv_commit` of it. One XLA fusion reads the K-1 history rows once (about 60 KB per stream at the 27B's
    conv_dim), against the window's and the commit's two reads."""
    del interpret
    _check_conv("conv_step", m, conv_pool, slot)
    _check_weight("conv_step", weight, conv_pool)
    if m.shape[1] != 1:
        raise ValueError(f"gdn.conv_step: one row per stream (m [S, 1, C]), got {m.shape}")
    return conv_step_reference(m, conv_pool, slot, weight)


# The verify and step rows' preparation in one launch. Between the in-projection and the recurrence a GDN layer of
# a decode round ran six XLA fusions and the q/k norm kernel (the H200 trace of session 18, one stream: gates, q/k
# conv, l2 norm, q scale, v conv and z, conv pool update; 10.2 µs and 7 launches a layer). `decode_prep` computes the
# same values in one kernel, for the serial step and for verify windows alike: one body, whose only difference
# between the two is where a tap is read from and whether the pool takes the row, so a window row has the bits of
# the serial step that would compute it. One warp a program: the step updates the conv pool in place, and a
# vector shorter than the warps' threads is held by several threads; within one warp a replica's load of a
# history row is issued before any lane's store over it, across warps it need not be.

DECODE_PREP_WARPS = 1


def _decode_prep_kernel(*refs, hk: int, hv: int, dk: int, dv: int, kw: int, step: bool, n_pieces: int, rows: int):
    """Program (stream s, row r, key head h, part p): part 0 makes q and k of head h, part p > 0 v, z, g and beta of
    value head h hv / hk + p - 1 (the parts side by side: H200 trace, session 27, one program a key head doing all
    of them took 6.7 µs a call at one stream).
    refs: y [S, R, N] (n_pieces 0), or `qmm_mgpu.Pieces`' valid [P, N] int8 and parts [P, N, R'] fp32 (n_pieces P:
    y's row (s, r) is the pieces' row s R + r, `piece_row`; rows = R); parents [S, R] (windows only); slot [S]; pool
    [N, K-1, C]; weight [C, K]; a_log, dt_bias [hv]; outputs q, k [S, R, hk, dk], v, z [S, R, hv, dv], g, beta [S, R,
    hv]; the pool again (step only, aliased)."""
    if n_pieces:
        valid_ref, parts_ref, *refs = refs
    if step:
        *ys, slot_ref, pool_ref, w_ref, alog_ref, dtb_ref, q_ref, k_ref, v_ref, z_ref, g_ref, beta_ref, \
            pool_out_ref = refs
    else:
        *ys, parents_ref, slot_ref, pool_ref, w_ref, alog_ref, dtb_ref, q_ref, k_ref, v_ref, z_ref, g_ref, \
            beta_ref = refs
    s, r, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slot_ref[s]
    dtype = q_ref.dtype
    if not n_pieces:
        (y_ref,) = ys

    def y_at(i, cols):
        """y[s, i, cols]: read, or the pieces' sum rounded (`Pieces`)."""
        if not n_pieces:
            return y_ref[s, i, cols]
        return piece_row(parts_ref, valid_ref, n_pieces, s * rows + i, cols, dtype)

    kd, vd = hk * dk, hv * dv
    c = 2 * kd + vd
    group = hv // hk
    # The tap at distance d = 1..K-1: window row `anc` when >= 0, else history row `idx` of the slot
    # (`_ancestor_walk`; the step's taps are all history).
    if step:
        sources = [(None, kw - 1 - d) for d in range(1, kw)]
    else:
        sources = [(anc, jnp.clip(kw - 1 - back, 0, kw - 2))
                   for anc, back in _ancestor_walk(r, lambda i: parents_ref[s, i], kw - 1)]

    def conv(c0: int | jax.Array, n: int) -> jax.Array:
        """silu(conv) of channels [c0, c0 + n) in y.dtype: `_conv_taps`'s expression, taps oldest first."""
        cols = pl.ds(c0, n)
        row = y_at(r, cols)
        taps, olds = [row], []
        for anc, idx in sources:
            old = pool_ref[slot, idx, cols]
            olds.append(old)
            tap = old.astype(dtype)
            if anc is not None:
                tap = jnp.where(anc >= 0, y_at(jnp.maximum(anc, 0), cols), tap)
            taps.append(tap)
        u = _conv_taps(taps[::-1], [w_ref[cols, j] for j in range(kw)])
        if step:  # the new history: the old one's rows 1..K-2 (read oldest last above), then the row
            olds = olds[::-1]
            for i in range(kw - 2):
                pool_out_ref[slot, i, cols] = olds[i + 1]
            pool_out_ref[slot, kw - 2, cols] = row.astype(pool_out_ref.dtype)
        return u.astype(dtype)

    part = pl.program_id(3)

    @pl.when(part == 0)
    def _():
        for which, out_ref, c0 in ((0, q_ref, h * dk), (1, k_ref, kd + h * dk)):
            x = conv(c0, dk).astype(_F32)
            x = x * jax.lax.rsqrt(jnp.sum(x * x) + QK_NORM_EPS)
            if which == 0:
                x = x * (dk ** -0.5)
            out_ref[s, r, h, :] = x.astype(dtype)

    @pl.when(part > 0)
    def _():
        head = h * group + part - 1
        v_ref[s, r, head, :] = conv(2 * kd + head * dv, dv)
        z_ref[s, r, head, :] = y_at(r, pl.ds(c + head * dv, dv))
        beta, g = gates(y_at(r, c + vd + head), y_at(r, c + vd + hv + head), alog_ref[head], dtb_ref[head])
        if step:
            live = slot > 0
            beta, g = jnp.where(live, beta, 0.0), jnp.where(live, g, 0.0)
        beta_ref[s, r, head] = beta
        g_ref[s, r, head] = g


def decode_prep_supports(hk: int, dk: int, hv: int, dv: int) -> bool:
    """Whether `decode_prep` takes these heads: dk and dv powers of two >= 16, hv a multiple of hk."""
    return _is_pow2(dk) and _is_pow2(dv) and hv % hk == 0


def decode_prep(y: jax.Array, parents: jax.Array | None, conv_pool: jax.Array, slot: jax.Array, weight: jax.Array,
         a_log: jax.Array, dt_bias: jax.Array, *, hk: int, dk: int, hv: int, dv: int, interpret: bool = False
         ) -> tuple[jax.Array, ...]:
    """Same contract as `decode_prep_reference`, one launch, grid (stream, row, key head, its q/k or one of its value
    heads). For the step (parents None)
    the conv pool is updated in place (pass it donated); a window only reads it. Every value is computed in the
    program of its own row from that row, its ancestors and its slot, so a row's bits do not depend on the other
    rows or streams of the call, and a window row's equal the serial step's over the same history."""
    (s, r, n), dtype = rows_shape(y, "gdn.decode_prep")
    kd, vd = hk * dk, hv * dv
    c = 2 * kd + vd
    if n != c + vd + 2 * hv:
        raise ValueError(f"gdn.decode_prep: y's last axis must hold q, k, v, z, b, a = {c + vd + 2 * hv} columns for "
                         f"hk={hk}, dk={dk}, hv={hv}, dv={dv}, got {n}")
    if not decode_prep_supports(hk, dk, hv, dv):
        raise ValueError(f"gdn.decode_prep: the kernel needs dk and dv to be powers of two >= 16 and value heads a "
                         f"multiple of key heads, got dk={dk}, dv={dv}, hk={hk}, hv={hv}; use decode_prep_reference "
                         f"for other heads")
    _check_conv("decode_prep", jax.ShapeDtypeStruct((s, r, c), dtype), conv_pool, slot)
    _check_weight("decode_prep", weight, conv_pool)
    for label, x in (("a_log", a_log), ("dt_bias", dt_bias)):
        if x.shape != (hv,):
            raise ValueError(f"gdn.decode_prep: {label} must be [hv] = ({hv},), got {x.shape}")
    step = parents is None
    if step and r != 1:
        raise ValueError(f"gdn.decode_prep: the serial step (parents None) takes one row per stream, got {r}")
    if not step and (parents.shape != (s, r) or not jnp.issubdtype(parents.dtype, jnp.integer)):
        raise ValueError(f"gdn.decode_prep: parents must be an integer array [S, R] = {(s, r)}, got {parents.dtype} "
                         f"{parents.shape}")
    out_shape = [jax.ShapeDtypeStruct((s, r, hk, dk), dtype)] * 2 + [
        jax.ShapeDtypeStruct((s, r, hv, dv), dtype)] * 2 + [jax.ShapeDtypeStruct((s, r, hv), _F32)] * 2
    slot = slot.astype(jnp.int32)
    tail = (conv_pool, weight, a_log, dt_bias)
    ys, n_pieces = rows_operands(y)
    operands = (*ys, slot, *tail) if step else (*ys, parents.astype(jnp.int32), slot, *tail)
    out = pallas_call(
        functools.partial(_decode_prep_kernel, hk=hk, hv=hv, dk=dk, dv=dv, kw=weight.shape[1], step=step,
                          n_pieces=n_pieces, rows=r),
        out_shape=tuple(out_shape + ([jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype)] if step else [])),
        grid=(s, r, hk, 1 + hv // hk),
        input_output_aliases={len(ys) + 1: 6} if step else {},
        compiler_params=pt.CompilerParams(num_warps=DECODE_PREP_WARPS),
        interpret=interpret,
        name="gdn_decode_prep",
    )(*operands)
    q, k, v, z, g, beta = out[:6]
    return (q, k, v, z, g, beta) if not step else (q, k, v, z, g, beta, out[6])
