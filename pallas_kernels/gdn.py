"""Gated DeltaNet: chunked prompt pass, tree/chain verify window, commit of the accepted path, and the causal
depthwise conv in front of it. Plain-jnp references here define the math every kernel must match.

Letters: s streams, t rows (time), r window rows (nodes), h value heads, k key dim (dk), v value dim (dv),
c conv channels, w conv taps (K = 4 for qwen3_5).

The recurrence, per value head h (key/query head h // (Hv/Hk)), state S [dk, dv] in fp32:
    S <- exp(g_t) S;   delta = beta_t (v_t - S^T k_t);   S <- S + k_t delta^T;   o_t = S^T q_t
q and k arrive already l2-normalised (q also scaled by dk^-1/2). g <= 0 and beta in (0, 1) arrive in fp32.

State lives in pools indexed by slot: rec_pool [N, Hv, dk, dv] fp32, conv_pool [N, K-1, C]. A prompt pass whose
`start` is 0 begins from the zero state whatever its slot holds, so the engine never needs to clear a slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64
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
                     parents: jax.Array, rec_pool: jax.Array, slot: jax.Array) -> jax.Array:
    """Every node's output from its parent's state updated by its own row; states read-only.

    q, k [S, R, Hk, dk]; v [S, R, Hv, dv]; g, beta [S, R, Hv] fp32
    parents [S, R] int32: -1 = the stream's committed state, else an earlier row (parents[s, r] < r)
    rec_pool [N, Hv, dk, dv] fp32; slot [S] -> o [S, R, Hv, dv] in v.dtype
    """
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


# ----------------------------------------------------------------------------------------------------------------
# Causal depthwise conv (+ SiLU) in front of the recurrence
# ----------------------------------------------------------------------------------------------------------------

def _conv_silu(rows: jax.Array, weight: jax.Array) -> jax.Array:
    """rows [K, C] oldest first, weight [C, K] -> silu(sum_j weight[:, j] * rows[j]) [C] in fp32."""
    acc = jnp.sum(rows.astype(jnp.float32) * weight.astype(jnp.float32).T, axis=0)
    return jax.nn.silu(acc)


def conv_prompt_reference(m: jax.Array, conv_pool: jax.Array, slot: jax.Array, weight: jax.Array,
                          start: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """m [S, T, C] pre-conv inputs; conv_pool [N, K-1, C] the last K-1 committed inputs (oldest first);
    weight [C, K] (tap K-1 multiplies the current row); start/lengths [S] as in the prompt pass (start 0 = zero
    history). -> (u [S, T, C] = silu(conv) in m.dtype, conv_pool with the last K-1 real inputs of each stream)."""
    kw = weight.shape[1]
    hist = conv_pool[slot]
    hist = jnp.where((start == 0)[:, None, None], jnp.zeros_like(hist), hist)
    seq = jnp.concatenate([hist.astype(m.dtype), m], axis=1)  # [S, K-1+T, C]
    t = m.shape[1]
    windows = jnp.stack([seq[:, j:j + t] for j in range(kw)], axis=2)  # [S, T, K, C]
    u = jax.vmap(jax.vmap(lambda rows: _conv_silu(rows, weight)))(windows)
    new_hist = jax.vmap(lambda s, n: jax.lax.dynamic_slice_in_dim(s, n, kw - 1, axis=0))(seq, lengths)
    return u.astype(m.dtype), conv_pool.at[slot].set(new_hist.astype(conv_pool.dtype))


def _ancestor_rows(parents: jax.Array, depth_needed: int) -> tuple[jax.Array, jax.Array]:
    """For each node r and distance d in 1..depth_needed: the ancestor index (or -1) and, once the path runs out,
    how far into the committed history it reaches. parents [R] -> (anc [D, R], back [D, R])."""
    r = parents.shape[0]
    anc = []
    cur = jnp.arange(r)
    back = jnp.zeros((r,), jnp.int32)
    backs = []
    for _ in range(depth_needed):
        par = jnp.where(cur >= 0, parents[jnp.maximum(cur, 0)], -1)
        back = jnp.where(cur < 0, back + 1, back)
        back = jnp.where((cur >= 0) & (par < 0), 1, back)
        cur = par
        anc.append(cur)
        backs.append(back)
    return jnp.stack(anc), jnp.stack(backs)


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
        rows = jnp.stack(taps[::-1], axis=1)  # [R, K, C] oldest first
        return jax.vmap(lambda x: _conv_silu(x, weight))(rows)

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
