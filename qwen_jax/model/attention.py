"""Gated full attention: per-head [q | gate] split, q/k RMSNorm, partial rotate-half (M-)RoPE, GQA paged
attention (through the ops swap points), sigmoid output gate, o_proj. Letters: s streams, t rows, h heads, d."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import attn_prep as attn_prep_k
from qwen_jax.config import TextConfig
from qwen_jax.model import ops
from qwen_jax.model.layers import apply_rope, rope_angles
from qwen_jax.model.ops import Backend, linear, linear_split


def project(x, p, rope_positions, cfg: TextConfig, backend: Backend, *, prompt: bool, pool=None, page_table=None):
    """x [S, T, H] -> q [S, T, Hq, D], gate [S, T, Hq*D], k, v [S, T, Hkv, D] (post-norm, post-RoPE), and q packed
    for the window's pass 1 or None (window rows: the pool and page table given). Verify and step rows with kernels:
    the norms and rotations in one `attn_prep` launch, which also finishes the projection's decode qmm pieces where
    it can (`ops.project_pieces`) and writes the packed q where the window reads it (`ops.window_packed_rows`)."""
    s, t = x.shape[:2]
    d = cfg.head_dim
    ang = rope_angles(rope_positions, cfg)  # [S, T, rd/2]
    if not prompt and ops.attn_prep_applies(backend, p["qkv"], cfg):
        rows = None if pool is None else ops.window_packed_rows(backend, (s, t, cfg.num_heads, d), x.dtype, pool,
                                                                page_table)
        pieces = ops.project_pieces(x, p["qkv"].weight, backend)  # the prep finishes the qmm's pieces itself
        if pieces is not None:
            q, k, v, gate, *packed = ops.attn_prep(backend, pieces, p, jnp.cos(ang), jnp.sin(ang), cfg, rows)
        else:
            y = linear(x, p["qkv"].weight, backend, prompt=False)
            q, k, v, *packed = ops.attn_prep(backend, y, p, jnp.cos(ang), jnp.sin(ang), cfg, rows)
            gate = attn_prep_k.gate_of(y, cfg.num_heads, d)
        return q, gate, k, v, (packed[0] if packed else None)
    qg, k, v = linear_split(x, p["qkv"], backend, prompt=prompt)
    qg = qg.reshape(s, t, cfg.num_heads, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(s, t, cfg.num_heads * d)
    k = k.reshape(s, t, cfg.num_kv_heads, d)
    v = v.reshape(s, t, cfg.num_kv_heads, d)
    q = ops.rms_norm(backend, q, p["q_norm"], cfg.rms_norm_eps)
    k = ops.rms_norm(backend, k, p["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, ang, cfg.rotary_dim), gate, apply_rope(k, ang, cfg.rotary_dim), v, None


def finish(o, gate, p, cfg: TextConfig, backend: Backend, *, prompt: bool):
    """The sigmoid gate, then o_proj. Where the projection's decode qmm pads its rows (`ops.pad_rows`), the gate's
    fusion writes them padded (`ops.Padded`: zeros past the live rows, 0 x sigmoid(0)), so no pad launch sits
    between it and the qmm; the live rows' operations are the same."""
    s, t = o.shape[:2]
    o = o.reshape(s, t, cfg.num_heads * cfg.head_dim)
    r = ops.pad_rows(backend, o, p["o"], prompt=prompt)
    if r is not None:
        pad = lambda a: jnp.pad(a.reshape(s * t, -1), ((0, r - s * t), (0, 0)))
        o, gate = pad(o), pad(gate)
    o = (o.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(o.dtype)
    return ops.project(o if r is None else ops.Padded(o, (s, t)), p["o"], backend, prompt=prompt)


def prompt_pass(x, p, pool, batch, cfg: TextConfig, backend: Backend):
    q, gate, k, v, _ = project(x, p, batch.rope_positions, cfg, backend, prompt=True)
    t = x.shape[1]
    rows = jnp.arange(t)[None, :]
    positions = batch.start[:, None] + rows
    valid = rows < batch.lengths[:, None]
    pool = ops.kv_write(backend, pool, k, v, batch.page_table, positions, valid)
    o = ops.attention_prompt(backend, q, pool, batch.page_table, batch.start, batch.lengths,
                             scale=cfg.head_dim ** -0.5)
    return finish(o, gate, p, cfg, backend, prompt=True), pool


def window_pass(x, p, pool, window, cfg: TextConfig, backend: Backend):
    q, gate, k, v, q_packed = project(x, p, window.rope_positions, cfg, backend, prompt=False, pool=pool,
                                      page_table=window.page_table)
    o = ops.attention_window(backend, q, k, v, window.parents, pool, window.page_table, window.cache_len,
                             scale=cfg.head_dim ** -0.5, q_packed=q_packed)
    return finish(o, gate, p, cfg, backend, prompt=False), {"k": k, "v": v}


def chain_valid(window):
    """[S, R] the rows of each stream's chain: row 0 and every row whose parent is the row before it (the rows a
    chain is padded with hang off the root's parent), of live streams (slot > 0)."""
    r = window.parents.shape[1]
    return (window.parents == jnp.arange(r)[None, :] - 1) & (window.slot[:, None] > 0)


def chain_pass(x, p, pool, window, cfg: TextConfig, backend: Backend):
    """A chain window's rows as the serial steps they stand for (drafted ≡ serial): each row's K/V is written at
    its position first, then row r of a stream attends as a stream of its own, over cache_len + r committed keys
    with its own key as its one window key, which is what the serial step at that position does (`window_pass`
    over one row). A window of several rows would add its own keys after the committed keys' fold, another order
    (docs/kernels/attention.md, session 38). The kernels read the keys below the window once for all its rows
    (`attention.window_rows`). -> (y, pool with the chain's K/V written, kept rows for `commit`)."""
    q, gate, k, v, _ = project(x, p, window.rope_positions, cfg, backend, prompt=False)
    s, r = q.shape[:2]
    positions = window.cache_len[:, None] + jnp.arange(r)[None, :]
    valid = chain_valid(window)
    pool = ops.kv_write(backend, pool, k, v, window.page_table, positions, valid)
    # Padding rows and dummy streams attend to no committed key (their outputs are never read).
    o = ops.attention_rows(backend, q, k, v, pool, window.page_table, jnp.repeat(window.page_table, r, axis=0),
                           jnp.where(valid, positions, 0), window.cache_len, scale=cfg.head_dim ** -0.5)
    return finish(o, gate, p, cfg, backend, prompt=False), pool, {"k": k, "v": v}


def tree_valid(window):
    """[S, R] the rows of each stream's tree: row 0 and every row hanging off a window row (the rows a tree is
    padded with hang off the root's parent), of live streams (slot > 0)."""
    r = window.parents.shape[1]
    return ((window.parents >= 0) | (jnp.arange(r)[None, :] == 0)) & (window.slot[:, None] > 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeView:
    """How a tree window's rows read the pool (`tree_pass`), the same in every attention layer: each row's page
    table [S*R, Pmax], the page whose first `keep` rows are copied into its first scratch page (src, dst, keep
    [S*R]), its position [S*R] (0 for rows outside the tree) and, per row, which window rows are its ancestors
    [S*R, R] and at which positions [S*R, R]."""
    tables: jax.Array
    src: jax.Array
    dst: jax.Array
    keep: jax.Array
    positions: jax.Array
    anc: jax.Array
    anc_positions: jax.Array


def tree_view(window, scratch, page_size: int) -> TreeView:
    """A tree window's `TreeView` (scratch [S, R, 2]: the page ids kept for its rows; see `tree_pass`)."""
    from qwen_jax.model.forward import depth_of, window_ancestors  # forward imports this module
    s, r = window.parents.shape
    if r > page_size + 1:
        raise ValueError(f"a tree window of {r} rows spans more than two pages of {page_size}")
    anc = window_ancestors(window.parents)
    depth = depth_of(anc)
    valid = tree_valid(window)
    first = window.cache_len // page_size  # the logical page holding position cache_len
    width = window.page_table.shape[1]
    logical = jnp.arange(width)[None, None, :]
    f = first[:, None, None]
    tables = jnp.where(logical == f, scratch[..., :1], jnp.where(logical == f + 1, scratch[..., 1:],
                                                                 window.page_table[:, None, :]))  # [S, R, Pmax]
    src = jnp.take_along_axis(window.page_table, jnp.minimum(first, width - 1)[:, None], axis=1)  # [S, 1]
    positions = window.cache_len[:, None] + depth - 1  # [S, R]
    return TreeView(tables.reshape(s * r, width), jnp.broadcast_to(src, (s, r)).reshape(-1),
                    scratch[..., 0].reshape(-1),
                    jnp.broadcast_to((window.cache_len % page_size)[:, None], (s, r)).reshape(-1),
                    jnp.where(valid, positions, 0).reshape(-1),
                    (anc & valid[:, :, None]).reshape(s * r, r),
                    jnp.broadcast_to(positions[:, None], (s, r, r)).reshape(s * r, r))


def tree_pass(x, p, pool, window, view: TreeView, cfg: TextConfig, backend: Backend):
    """A tree window's rows as the serial steps they stand for (drafted ≡ serial), `chain_pass` for trees. Row i of
    a stream at depth d attends as a stream of its own over cache_len + d - 1 committed keys, the last d - 1 of them
    its ancestors' K/V, with its own key as its one window key: what the serial step at its position reads once its
    ancestors are committed. Siblings would claim the same positions in the stream's pages, so each row reads
    through a page table of its own whose pages from the one holding cache_len on are the row's scratch pages
    (`tree_view`; two a row, the engine keeps them for windows; a window of up to page_size + 1 rows spans two): the
    first takes the stream's page there up to cache_len (the committed keys before it), then the ancestors' keys
    are written into them as the serial steps wrote them, both in one `kv_write` launch. The stream's own pages are
    not written; `commit` writes the accepted path. -> (y, pool with the scratch pages written, kept rows for
    `commit`)."""
    q, gate, k, v, _ = project(x, p, window.rope_positions, cfg, backend, prompt=False)
    s, r = q.shape[:2]
    # Every row's ancestors, at their positions, through that row's table: the S*R write streams read the window
    # rows of their stream (share=r), not copies of them.
    pool = ops.kv_write(backend, pool, k, v, view.tables, view.anc_positions, view.anc,
                        (view.src, view.dst, view.keep), share=r)
    o = ops.attention_rows(backend, q, k, v, pool, window.page_table, view.tables, view.positions.reshape(s, r),
                           window.cache_len, scale=cfg.head_dim ** -0.5)
    return finish(o, gate, p, cfg, backend, prompt=False), pool, {"k": k, "v": v}


def commit(kept, pool, window, path, path_len, backend: Backend):
    """Write the accepted path's K/V rows at positions cache_len, cache_len + 1, ..."""
    r = path.shape[1]
    idx = jnp.maximum(path, 0)
    k = jnp.take_along_axis(kept["k"], idx[:, :, None, None], axis=1)
    v = jnp.take_along_axis(kept["v"], idx[:, :, None, None], axis=1)
    positions = window.cache_len[:, None] + jnp.arange(r)[None, :]
    valid = jnp.arange(r)[None, :] < path_len[:, None]
    return ops.kv_write(backend, pool, k, v, window.page_table, positions, valid)
