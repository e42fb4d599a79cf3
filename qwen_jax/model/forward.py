"""The functional qwen3_5 text model over explicit state.

Two entry points (plus commit), each `f(params, state, batch, cfg, backend) -> (outputs, state)`:
  prefill  — prompt rows of S streams (chunked GDN form, chunks on the grid of absolute positions); writes K/V
             rows and advances GDN states in place.
  verify   — a window of up to R rows per stream after its committed prefix; rows form a chain or a tree
             (`parents`); states are read-only; returns logits for every row plus what `commit` needs.
  commit   — writes the accepted path of each stream into its state (GDN replay, conv window, K/V rows).
A serial decode step is verify with one row followed by commit of that row.

Letters: s streams, t prompt rows, r window rows, h hidden, v vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import FP8, KVPool, empty_pool
from qwen_jax.config import LAYER_GDN, ModelConfig, TextConfig
from qwen_jax.model import attention as attn_mixer
from qwen_jax.model import gdn as gdn_mixer
from qwen_jax.model import ops
from qwen_jax.model import parallel as tp_
from qwen_jax.model.layers import mlp
from qwen_jax.model.ops import Backend, embed, linear


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelState:
    """Device pools. kv: one KVPool per attention layer; rec: [N, Hv, dk, dv] fp32 and conv: [N, K-1, C] per GDN
    layer, indexed by slot."""
    kv: tuple[KVPool, ...]
    rec: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    tokens: jax.Array  # [S, T] int32 (rows past lengths are padding)
    start: jax.Array  # [S] int32 absolute position of row 0
    lengths: jax.Array  # [S] int32 real rows
    slot: jax.Array  # [S] int32 GDN state slot
    page_table: jax.Array  # [S, Pmax] int32
    rope_positions: jax.Array  # [3, S, T] int32 (M-RoPE rows; equal to start + i for text)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyWindow:
    tokens: jax.Array  # [S, R] int32
    parents: jax.Array  # [S, R] int32: -1 = after the committed prefix, else an earlier row
    cache_len: jax.Array  # [S] int32 committed length (row r sits at cache_len + depth(r) - 1)
    slot: jax.Array  # [S] int32
    page_table: jax.Array  # [S, Pmax] int32
    rope_positions: jax.Array  # [3, S, R] int32


def text_rope_positions(positions: jax.Array) -> jax.Array:
    """Text-only M-RoPE: all three rows equal the absolute position."""
    return jnp.broadcast_to(positions[None], (3,) + positions.shape)


def window_ancestors(parents: jax.Array) -> jax.Array:
    """parents [S, R] (parents[s, r] < r; -1: a child of the committed prefix) -> [S, R, R] bool, [s, i, j] when row
    j is a proper ancestor of row i. The parent relation closed by squaring: log2(R) small batched matmuls, not a
    launch or two a row (a window program runs it once, next to ~1000 kernels)."""
    r = parents.shape[1]
    anc = (parents[:, :, None] == jnp.arange(r)[None, None, :]).astype(jnp.float32)
    for _ in range(max(1, (r - 1).bit_length())):  # paths of up to 2, 4, ... steps
        anc = jnp.minimum(anc + jnp.einsum("sij,sjk->sik", anc, anc), 1.0)
    return anc > 0


def depth_of(ancestors: jax.Array) -> jax.Array:
    """`window_ancestors` [S, R, R] -> depth [S, R] (1 for a child of the committed prefix)."""
    return 1 + jnp.sum(ancestors, axis=2, dtype=jnp.int32)


def window_depth(parents: jax.Array) -> jax.Array:
    """parents [S, R] -> depth [S, R] (1 for a child of the committed prefix)."""
    return depth_of(window_ancestors(parents))


def make_prefill_batch(tokens, start, lengths, slot, page_table) -> PrefillBatch:
    tokens = jnp.asarray(tokens, jnp.int32)
    start = jnp.asarray(start, jnp.int32)
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    return PrefillBatch(tokens, start, jnp.asarray(lengths, jnp.int32), jnp.asarray(slot, jnp.int32),
                        jnp.asarray(page_table, jnp.int32), text_rope_positions(positions))


def make_window(tokens, parents, cache_len, slot, page_table) -> VerifyWindow:
    parents = jnp.asarray(parents, jnp.int32)
    cache_len = jnp.asarray(cache_len, jnp.int32)
    positions = cache_len[:, None] + window_depth(parents) - 1
    return VerifyWindow(jnp.asarray(tokens, jnp.int32), parents, cache_len, jnp.asarray(slot, jnp.int32),
                        jnp.asarray(page_table, jnp.int32), text_rope_positions(positions))


def init_state(cfg: TextConfig, *, num_slots: int, num_pages: int, page_size: int, dtype=jnp.bfloat16,
               kv_dtype=None) -> ModelState:
    """Zeroed pools: GDN slots and KV pages. kv_dtype defaults to the compute dtype; FP8 for an e4m3 cache."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    kv = tuple(empty_pool(cfg.num_kv_heads, num_pages, page_size, cfg.head_dim, kv_dtype) for _ in cfg.attn_layers)
    rec = tuple(jnp.zeros((num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                           cfg.linear_value_head_dim), jnp.float32) for _ in cfg.gdn_layers)
    conv = tuple(jnp.zeros((num_slots, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype) for _ in cfg.gdn_layers)
    return ModelState(kv, rec, conv)


def compute_dtype(state: ModelState):
    """The compute dtype: the conv windows' (an fp8 KV pool stores another)."""
    return state.conv[0].dtype if state.conv else state.kv[0].k.dtype


def _embed(params, state: ModelState, tokens: jax.Array, backend: Backend) -> jax.Array:
    """Token rows in the compute dtype."""
    return embed(params["embed"], tokens, compute_dtype(state), backend)


def _head_weight(params):
    return params["embed"] if params["lm_head"] is None else params["lm_head"]


def _head(params, x: jax.Array, cfg: TextConfig, backend: Backend, *, prompt: bool, h=None) -> jax.Array:
    """Final norm and lm_head (the embedding when tied) -> fp32 logits. h: the final norm of x, where the last
    residual add made it (`_layers` with head)."""
    w = _head_weight(params)
    if h is None:
        h = ops.rms_norm(backend, x, params["norm"], cfg.rms_norm_eps, then=w, prompt=prompt)
    logits = linear(h, w, backend, prompt=prompt).astype(jnp.float32)
    return tp_.head_logits(logits, cfg.vocab_size) if backend.sharded else logits


def _in_proj(layer, cfg: TextConfig, i: int):
    return layer["gdn"]["in_proj"] if cfg.layer_types[i] == LAYER_GDN else layer["attn"]["qkv"]


def _layers(params, state: ModelState, x, cfg: TextConfig, run_gdn, run_attn, taps: tuple[int, ...],
            backend: Backend, prompt: bool, head: bool = False):
    """The decoder stack, dispatching on the explicit layer schedule. Returns (x, its final norm for the lm_head
    if head else None, new pools, kept, tap rows). Each residual add goes with the norm that reads its result
    (`ops.add_residual_norm`): the MLP's, the next layer's input norm, and with head the final norm."""
    rec, conv, kv = list(state.rec), list(state.conv), list(state.kv)
    kept, tapped = [], []
    gi = ai = 0
    h = None
    counter = ops.LaunchCount(max(1, x.size // x.shape[-1] * cfg.linear_num_value_heads))
    layers = params["layers"]
    eps = cfg.rms_norm_eps
    for i, layer in enumerate(layers):
        with jax.named_scope(f"layer{i}"):
            if h is None:
                h = ops.rms_norm(backend, x, layer["input_norm"], eps, then=_in_proj(layer, cfg, i), prompt=prompt)
            if cfg.layer_types[i] == LAYER_GDN:
                y, rec[gi], conv[gi], k = run_gdn(h, layer["gdn"], rec[gi], conv[gi], counter)
                gi += 1
            else:
                y, kv[ai], k = run_attn(h, layer["attn"], kv[ai])
                ai += 1
            kept.append(k)
            x, h = ops.add_residual_norm(backend, x, y, layer["post_norm"], eps, then=layer["mlp"]["gate_up"],
                                         prompt=prompt, counter=counter)
            y = mlp(h, layer["mlp"], backend, prompt=prompt)
            if i + 1 < len(layers):
                norm, then = layers[i + 1]["input_norm"], _in_proj(layers[i + 1], cfg, i + 1)
            else:
                norm, then = (params["norm"], _head_weight(params)) if head else (None, None)
            if norm is None:
                x, h = ops.add_residual(backend, x, y), None
            else:
                x, h = ops.add_residual_norm(backend, x, y, norm, eps, then=then, prompt=prompt, counter=counter)
            if i in taps:
                tapped.append(x)
    return x, h, ModelState(tuple(kv), tuple(rec), tuple(conv)), kept, tapped


def _split(backend: Backend) -> bool:
    """Whether this call runs its body under shard_map over the backend's tensor-parallel mesh (not yet inside)."""
    return backend.parallel is not None and not backend.sharded


def _on_shards(fn, cfg: ModelConfig, backend: Backend, in_specs: tuple, out_specs, *args):
    """fn(*args, local config, inner backend) under shard_map: each device runs its 1/N of the layers' heads
    (`parallel`)."""
    local = tp_.local_config(cfg, backend.parallel.size)
    inner = dataclasses.replace(backend, sharded=True)
    return tp_.run(lambda *a: fn(*a, local, inner), backend.parallel, in_specs, out_specs, *args)


def prefill(params, state: ModelState, batch: PrefillBatch, cfg: ModelConfig, backend: Backend, *,
            all_logits: bool = False, taps: tuple[int, ...] = (), embeds: tuple[jax.Array, jax.Array] | None = None):
    """-> (logits, state, taps). logits: [S, T, V] if all_logits else the last real row's [S, V] fp32;
    taps: residual stream after the listed layers, [S, T, len(taps), H] (or None).
    embeds: (mask [S, T] bool, rows [S, T, H]) puts rows in place of the token embeddings where mask is set (image
    placeholder rows take the vision tower's output, `model.vision.image_rows`); None leaves the program as it was."""
    if _split(backend):
        body = lambda p, st, b, e, c, be: prefill(p, st, b, c, be, all_logits=all_logits, taps=taps, embeds=e)
        specs = tp_.state_specs(state)
        return _on_shards(body, cfg, backend, (tp_.param_specs(params), specs, tp_.whole(batch), tp_.whole(embeds)),
                          (tp_.P(), specs, tp_.P()), params, state, batch, embeds)
    t = cfg.text
    x = _embed(params, state, batch.tokens, backend)
    if embeds is not None:
        mask, rows = embeds
        x = jnp.where(mask[..., None], rows.astype(x.dtype), x)

    def run_gdn(h, p, rec, conv, _):
        y, rec, conv = gdn_mixer.prompt_pass(h, p, rec, conv, batch, t, backend)
        return y, rec, conv, None

    def run_attn(h, p, pool):
        y, pool = attn_mixer.prompt_pass(h, p, pool, batch, t, backend)
        return y, pool, None

    x, _, state, _, tapped = _layers(params, state, x, t, run_gdn, run_attn, taps, backend, True)
    if not all_logits:
        last = jnp.maximum(batch.lengths - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    # Only the last rows (one a stream) reach the lm_head unless all_logits: a few rows, the decode path's shape.
    logits = _head(params, x, t, backend, prompt=all_logits)
    return logits, state, (jnp.stack(tapped, axis=2) if tapped else None)


def verify(params, state: ModelState, window: VerifyWindow, cfg: ModelConfig, backend: Backend, *,
           taps: tuple[int, ...] = (), chain: bool = False, tree_scratch: jax.Array | None = None):
    """-> (logits [S, R, V] fp32, kept (per-layer rows for commit), taps [S, R, n, H] or None), and with chain or
    tree_scratch the state. State unchanged, except with chain: each stream's window is a chain (padded with rows
    off the root's parent), its K/V rows are written at their positions and every row attends as the serial step at
    its position would (`attention.chain_pass`), so its bits are the serial steps' (drafted ≡ serial); the K/V past
    the accepted rows are never read (cache_len) and later overwritten. With tree_scratch ([S, R, 2] page ids kept
    for windows), the same for a tree (`attention.tree_pass`): each row reads its ancestors' K/V through scratch
    pages of its own, and only those pages are written. -> (logits, kept, taps, state)."""
    if _split(backend):
        body = lambda p, st, w, ts, c, be: verify(p, st, w, c, be, taps=taps, chain=chain, tree_scratch=ts)
        specs = tp_.state_specs(state)
        out = (tp_.P(), tp_.KEPT, tp_.P()) + ((specs,) if chain or tree_scratch is not None else ())
        return _on_shards(body, cfg, backend,
                          (tp_.param_specs(params), specs, tp_.whole(window), tp_.whole(tree_scratch)), out,
                          params, state, window, tree_scratch)
    t = cfg.text
    x = _embed(params, state, window.tokens, backend)
    # a tree's rows' page tables and ancestors, once for every attention layer
    tree = None if tree_scratch is None else attn_mixer.tree_view(window, tree_scratch, state.kv[0].page_size)

    def run_gdn(h, p, rec, conv, _):
        y, k = gdn_mixer.window_pass(h, p, rec, conv, window, t, backend, tree=tree_scratch is not None)
        return y, rec, conv, k

    def run_attn(h, p, pool):
        if tree_scratch is not None:
            return attn_mixer.tree_pass(h, p, pool, window, tree, t, backend)
        if chain:
            return attn_mixer.chain_pass(h, p, pool, window, t, backend)
        y, k = attn_mixer.window_pass(h, p, pool, window, t, backend)
        return y, pool, k

    x, h, new, kept, tapped = _layers(params, state, x, t, run_gdn, run_attn, taps, backend, False, head=True)
    logits = _head(params, x, t, backend, prompt=False, h=h)
    out = logits, tuple(kept), (jnp.stack(tapped, axis=2) if tapped else None)
    return out + (new,) if chain or tree_scratch is not None else out


def step(params, state: ModelState, window: VerifyWindow, cfg: ModelConfig, backend: Backend):
    """A serial decode step for S streams of one row each (parents [[-1]]): -> (logits [S, 1, V] fp32, state).
    Bit for bit `verify` followed by `commit` of every live stream's row, with each GDN layer's state read once
    and updated in place by one fused launch. Dummy streams (slot 0) write no K/V and leave GDN slot 0 as it was
    (its conv history is scratch).

    On the reference path (no kernels) it is literally verify then commit: XLA:CPU's rounding of the same math
    can change with the program around it, and drafted ≡ serial needs the serial step to be the same program."""
    if _split(backend):
        specs = tp_.state_specs(state)
        return _on_shards(step, cfg, backend, (tp_.param_specs(params), specs, tp_.whole(window)), (tp_.P(), specs),
                          params, state, window)
    t = cfg.text
    s = window.tokens.shape[0]
    path = jnp.zeros((s, 1), jnp.int32)
    path_len = (window.slot > 0).astype(jnp.int32)
    if not backend.kernels:
        logits, kept, _ = verify(params, state, window, cfg, backend)
        # Every read of the pools feeds the logits; the barrier orders the commit's in-place writes after them,
        # so XLA updates the donated pools in place instead of copying them first.
        logits, kept, state = jax.lax.optimization_barrier((logits, kept, state))
        return logits, commit(state, kept, window, path, path_len, cfg, backend)
    x = _embed(params, state, window.tokens, backend)

    def run_gdn(h, p, rec, conv, counter):
        y, rec, conv = gdn_mixer.step_pass(h, p, rec, conv, window, t, backend, counter)
        return y, rec, conv, None

    def run_attn(h, p, pool):
        y, k = attn_mixer.window_pass(h, p, pool, window, t, backend)
        # The row's attention read the committed keys; its own K/V go in after (positions >= cache_len).
        y, k, pool = jax.lax.optimization_barrier((y, k, pool))
        return y, attn_mixer.commit(k, pool, window, path, path_len, backend), None

    x, h, state, _, _ = _layers(params, state, x, t, run_gdn, run_attn, (), backend, False, head=True)
    return _head(params, x, t, backend, prompt=False, h=h), state


def commit(state: ModelState, kept, window: VerifyWindow, path: jax.Array, path_len: jax.Array, cfg: ModelConfig,
           backend: Backend) -> ModelState:
    """Write each stream's accepted path (node indices root-first, path_len of them) into its state."""
    if _split(backend):
        specs = tp_.state_specs(state)
        return _on_shards(commit, cfg, backend, (specs, tp_.KEPT, tp_.whole(window), tp_.P(), tp_.P()), specs,
                          state, kept, window, path, path_len)
    t = cfg.text
    rec, conv, kv = list(state.rec), list(state.conv), list(state.kv)
    gi = ai = 0
    for i, k in enumerate(kept):
        if t.layer_types[i] == LAYER_GDN:
            rec[gi], conv[gi] = gdn_mixer.commit(k, rec[gi], conv[gi], window, path, path_len, backend)
            gi += 1
        else:
            kv[ai] = attn_mixer.commit(k, kv[ai], window, path, path_len, backend)
            ai += 1
    return ModelState(tuple(kv), tuple(rec), tuple(conv))


def kv_dtype_for(name: str, dtype):
    if name == "fp8":
        return FP8
    if name in ("bf16", "bfloat16", "auto"):
        return dtype
    raise ValueError(f"--kv-cache must be bf16 or fp8, got {name!r}")
