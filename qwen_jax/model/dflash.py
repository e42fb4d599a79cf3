"""The DFlash block drafter (z-lab `DFlashDraftModel`, model_spec Part C) as pure functions over its params.

A small Qwen3 decoder stack with no embedding or head of its own. A draft call embeds a block of B tokens, the
anchor (the newest committed token) then B - 1 mask tokens, with the *target's* embedding, runs it through the
drafter's layers and reads rows 1..B-1 out through the drafter's final norm and the *target's* lm_head: row j
proposes the token at the anchor's position + j. The layers are conditioned on the target: the target's hidden
states after `target_layer_ids` for every committed row, concatenated, become `c = hidden_norm(fc(taps))`, and each
layer projects c with its own k/v projections (k_norm, RoPE at the row's position) into context keys and values.
Block rows attend non-causally to all context rows and to every block row (no mask inside the block).

State: a per-slot cache of the context K/V of committed rows (`DraftCache`). The block's own K/V are never kept
(dflash crops its cache back to the block's start after each call). The engine's round for a stream:
  1. the target verifies [anchor, drafts] and commits a rows; its taps of those committed rows arrive;
  2. `draft` appends them (`n_new` of `P` padded feature rows, positions cache_len..) and drafts from the new anchor;
  3. cache_len += n_new on the host. A prompt's taps go in through `append_context` (in chunks of at most the
     window) before the first `draft`, or with it.

Positions: the cache holds positions 0..cache_len-1; new context rows sit at cache_len..cache_len+n_new-1 and the
block at ctx_end = cache_len + n_new onwards, as in dflash_generate. Row r of a slot's cache holds the position
p with p % W = r (W the window): within W rows the drafter sees every committed row, as the reference does; past W
it sees the newest W (a sliding draft window, like SGLang's `--speculative-dflash-draft-window-size`).

Every matmul goes through `ops.linear` (dense or packed weights, kernels or reference) and every norm through
`ops.rms_norm`; the target's embedding and head through `ops.embed` / `ops.linear`, so a quantized target works.
Precision: the residual stream in the compute dtype (the cache's), norms and RoPE and the softmax in fp32, logits
fp32 like the target's.

Letters: s streams, p new context rows, w cache rows (the window), b block rows, n keys (w + b), k kv heads,
g query heads per kv head, d head dim, h hidden, v vocab, l layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.config import DFlashConfig
from qwen_jax.model import ops
from qwen_jax.model.layers import apply_rope, mlp
from qwen_jax.model.ops import Backend, linear, linear_split

_HI = jax.lax.Precision.HIGHEST
# Context projections of at least this many rows (streams x rows) take the qmm's prompt path (ops.linear).
PROMPT_ROWS = 64
_MASKED = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
    """Context K/V of each slot's committed rows, in the compute dtype: k after k_norm and RoPE at its position.
    k, v: [L, N, W, Hkv, D] (layer, slot, row = position % W, kv head, head dim)."""
    k: jax.Array
    v: jax.Array

    @property
    def window(self) -> int:
        return self.k.shape[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftBatch:
    """One draft call for S streams (a stream with slot 0, n_new 0 is a dummy if the engine reserves slot 0)."""
    slot: jax.Array  # [S] int32: each stream's cache slot
    cache_len: jax.Array  # [S] int32: committed rows already in the cache (positions 0..cache_len-1)
    features: jax.Array  # [S, P, n*H]: target taps of the next committed rows (positions cache_len..), rows past
    #                      n_new are padding (never written, never attended)
    n_new: jax.Array  # [S] int32: live rows of features, 0..P
    block: jax.Array  # [S, B] int32: the anchor (at position cache_len + n_new) then B - 1 mask tokens
    block_len: jax.Array  # [S] int32: live block rows, B unless a generation's end shortens the block (the block
    #                       attends non-causally, so a short block is not a prefix of a long one)


def init_cache(cfg: DFlashConfig, *, num_slots: int, window: int, dtype=jnp.bfloat16) -> DraftCache:
    shape = (cfg.num_layers, num_slots, window, cfg.num_kv_heads, cfg.head_dim)
    return DraftCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def block_tokens(anchor, cfg: DFlashConfig, block_size: int | None = None) -> jax.Array:
    """anchor [S] -> [S, B]: each anchor followed by B - 1 mask tokens."""
    anchor = jnp.asarray(anchor, jnp.int32)
    b = cfg.block_size if block_size is None else block_size
    return jnp.concatenate([anchor[:, None], jnp.full((anchor.shape[0], b - 1), cfg.mask_token_id, jnp.int32)], 1)


def make_batch(slot, cache_len, features, n_new, anchor, cfg: DFlashConfig, *, block_len=None,
               block_size: int | None = None) -> DraftBatch:
    """A DraftBatch from host values: block = [anchor, MASK x (B - 1)]; block_len defaults to B."""
    block = block_tokens(anchor, cfg, block_size)
    s, b = block.shape
    block_len = jnp.full((s,), b, jnp.int32) if block_len is None else jnp.asarray(block_len, jnp.int32)
    return DraftBatch(jnp.asarray(slot, jnp.int32), jnp.asarray(cache_len, jnp.int32), jnp.asarray(features),
                      jnp.asarray(n_new, jnp.int32), block, block_len)


def _inv_freq(cfg: DFlashConfig) -> np.ndarray:
    """theta^(-2i/D) rounded once to fp32 from float64: a constant of the config. Computed with jnp.power it would
    come out of each compiled program a few ulp apart (XLA lowers pow per fusion), and angles scale that by the
    position: 3.8e-6 rad apart at position 88 between a jitted and an eager call."""
    return (1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)).astype(
        np.float32)


def _rope(x: jax.Array, positions: jax.Array, cfg: DFlashConfig) -> jax.Array:
    """x [..., T, heads, D] at positions [..., T]: full-head rotate-half RoPE, fp32 angles position x inv_freq."""
    return apply_rope(x, positions.astype(jnp.float32)[..., None] * _inv_freq(cfg), cfg.head_dim)


def context_kv(params, cfg: DFlashConfig, features: jax.Array, positions: jax.Array, backend: Backend):
    """features [S, P, n*H] (target taps, concatenated in target layer order) at positions [S, P] ->
    (k, v) [L, S, P, Hkv, D] in features' dtype: every layer's context keys (k_norm, RoPE) and values."""
    s, p = positions.shape
    prompt = s * p >= PROMPT_ROWS
    with jax.named_scope("dflash_context"):
        c = linear(features, params["fc"], backend, prompt=prompt)
        c = ops.rms_norm(backend, c, params["hidden_norm"], cfg.rms_norm_eps)
        ks, vs = [], []
        for layer in params["layers"]:
            k, v = linear_split(c, layer["attn"]["kv"], backend, prompt=prompt)
            k = ops.rms_norm(backend, k.reshape(s, p, cfg.num_kv_heads, cfg.head_dim), layer["attn"]["k_norm"],
                             cfg.rms_norm_eps)
            ks.append(_rope(k, positions, cfg))
            vs.append(v.reshape(s, p, cfg.num_kv_heads, cfg.head_dim))
    return jnp.stack(ks), jnp.stack(vs)


def append_context(params, cfg: DFlashConfig, cache: DraftCache, batch: DraftBatch, backend: Backend
                   ) -> DraftCache:
    """Write the batch's n_new context rows of each stream into its slot at positions cache_len.. (padding rows
    and the block are not written). P must not exceed the window (a wrapped chunk would overwrite itself)."""
    s, p = batch.features.shape[:2]
    if p > cache.window:
        raise ValueError(f"dflash: {p} new context rows a call exceed the draft window of {cache.window}; "
                         "append a long prompt in chunks")
    rows = jnp.arange(p, dtype=jnp.int32)[None, :]
    positions = batch.cache_len[:, None] + rows
    k, v = context_kv(params, cfg, batch.features.astype(cache.k.dtype), positions, backend)
    # Padding rows go to row W, past the end, and are dropped.
    where = jnp.where(rows < batch.n_new[:, None], positions % cache.window, cache.window)
    slot = batch.slot[:, None]
    return DraftCache(cache.k.at[:, slot, where].set(k, mode="drop"),
                      cache.v.at[:, slot, where].set(v, mode="drop"))


def _attend(q, keys, values, valid, cfg: DFlashConfig) -> jax.Array:
    """q [S, B, Hq, D]; keys, values [S, N, Hkv, D]; valid [S, N] -> [S, B, Hq * D] in q's dtype. Non-causal: every
    query sees every valid key. fp32 scores and softmax."""
    s, b = q.shape[:2]
    g = cfg.num_heads // cfg.num_kv_heads
    qg = q.reshape(s, b, cfg.num_kv_heads, g, cfg.head_dim).astype(jnp.float32)
    scores = jnp.einsum("sbkgd,snkd->skgbn", qg, keys.astype(jnp.float32), precision=_HI) * cfg.head_dim ** -0.5
    # A finite floor: a dummy stream with no live row gets uniform weights, not NaN.
    scores = jnp.where(valid[:, None, None, None, :], scores, _MASKED)
    weights = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("skgbn,snkd->sbkgd", weights, values.astype(jnp.float32), precision=_HI)
    return o.reshape(s, b, cfg.num_heads * cfg.head_dim).astype(q.dtype)


def _layer(layer, cfg: DFlashConfig, x, ctx_k, ctx_v, ctx_valid, positions, block_valid, backend: Backend):
    """One decoder layer over the block rows x [S, B, H] at positions [S, B]; ctx_k, ctx_v [S, W, Hkv, D] and
    ctx_valid [S, W] the context; block_valid [S, B] the live block rows (keys past them are masked)."""
    s, b = x.shape[:2]
    a = layer["attn"]
    eps = cfg.rms_norm_eps
    h = ops.rms_norm(backend, x, layer["input_norm"], eps)
    q = linear(h, a["q"], backend, prompt=False).reshape(s, b, cfg.num_heads, cfg.head_dim)
    k, v = linear_split(h, a["kv"], backend, prompt=False)
    q = _rope(ops.rms_norm(backend, q, a["q_norm"], eps), positions, cfg)
    k = _rope(ops.rms_norm(backend, k.reshape(s, b, cfg.num_kv_heads, cfg.head_dim), a["k_norm"], eps), positions,
              cfg)
    v = v.reshape(s, b, cfg.num_kv_heads, cfg.head_dim)
    keys = jnp.concatenate([ctx_k.astype(k.dtype), k], axis=1)
    values = jnp.concatenate([ctx_v.astype(v.dtype), v], axis=1)
    o = _attend(q, keys, values, jnp.concatenate([ctx_valid, block_valid], axis=1), cfg)
    x = x + linear(o, a["o"], backend, prompt=False)
    # mlp may hand back its down projection unmultiplied (`ops.Deferred`, packed weights on the GPU): add_residual
    # finishes it.
    return ops.add_residual(backend, x, mlp(ops.rms_norm(backend, x, layer["post_norm"], eps), layer["mlp"], backend,
                                            prompt=False))


def _block_embeddings(target_params, cfg: DFlashConfig, tokens: jax.Array, dtype, backend: Backend) -> jax.Array:
    x = ops.embed(target_params["embed"], tokens, dtype, backend)
    if cfg.input_embedding_scale != 1.0:
        x = (x.astype(jnp.float32) * cfg.input_embedding_scale).astype(dtype)
    return x


def run_block(params, target_params, cfg: DFlashConfig, tokens, positions, block_valid, ctx_k, ctx_v, ctx_valid,
              dtype, backend: Backend) -> jax.Array:
    """The block through every layer and the final norm -> hidden [S, B, H]; ctx_k, ctx_v [L, S, W, Hkv, D]."""
    x = _block_embeddings(target_params, cfg, tokens, dtype, backend)
    for i, layer in enumerate(params["layers"]):
        with jax.named_scope(f"dflash_layer{i}"):
            x = _layer(layer, cfg, x, ctx_k[i], ctx_v[i], ctx_valid, positions, block_valid, backend)
    return ops.rms_norm(backend, x, params["norm"], cfg.rms_norm_eps)


def draft_hidden(params, target_params, cfg: DFlashConfig, cache: DraftCache, batch: DraftBatch, backend: Backend
                 ) -> tuple[jax.Array, DraftCache]:
    """Append the batch's context rows, then run its block -> (hidden [S, B, H] after the final norm, in the cache's
    dtype, cache with the new rows). Rows past block_len are computed but mean nothing."""
    cache = append_context(params, cfg, cache, batch, backend)
    s, b = batch.block.shape
    ctx_end = batch.cache_len + batch.n_new
    positions = ctx_end[:, None] + jnp.arange(b, dtype=jnp.int32)[None, :]
    w = cache.window
    ctx_valid = jnp.arange(w, dtype=jnp.int32)[None, :] < jnp.minimum(ctx_end, w)[:, None]
    block_valid = jnp.arange(b, dtype=jnp.int32)[None, :] < batch.block_len[:, None]
    hidden = run_block(params, target_params, cfg, batch.block, positions, block_valid, cache.k[:, batch.slot],
                       cache.v[:, batch.slot], ctx_valid, cache.k.dtype, backend)
    return hidden, cache


def _target_head(target_params):
    """The target's output weight: lm_head, or the embedding when tied (as `forward._head_weight`)."""
    return target_params["embed"] if target_params["lm_head"] is None else target_params["lm_head"]


def logits_of(target_params, cfg: DFlashConfig, hidden: jax.Array, backend: Backend) -> jax.Array:
    """hidden [..., H] (the drafter's normalised output) -> fp32 logits [..., V] through the target's lm_head, with
    the drafter's output multiplier and soft cap."""
    logits = linear(hidden, _target_head(target_params), backend, prompt=False).astype(jnp.float32)
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping is not None:
        logits = jnp.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits


def draft(params, target_params, cfg: DFlashConfig, cache: DraftCache, batch: DraftBatch, backend: Backend
          ) -> tuple[jax.Array, DraftCache]:
    """One draft call: -> (logits [S, B - 1, V] fp32 of the mask rows 1..B-1, cache with the batch's context rows).
    Greedy drafts are argmax(logits); row j - 1 proposes the token at position cache_len + n_new + j."""
    hidden, cache = draft_hidden(params, target_params, cfg, cache, batch, backend)
    return logits_of(target_params, cfg, hidden[:, 1:], backend), cache


def forward(params, target_params, cfg: DFlashConfig, features: jax.Array, block: jax.Array, backend: Backend, *,
            start: int = 0, dtype=None) -> jax.Array:
    """The drafter without a cache, DFlashDraftModel.forward on an empty cache: context rows features [S, C, n*H]
    at positions start..start+C-1, block [S, B] tokens right after them -> hidden [S, B, H] (after the final
    norm). The plain path the cached, padded `draft` must agree with; dtype defaults to features'."""
    dtype = features.dtype if dtype is None else dtype
    s, c = features.shape[:2]
    b = block.shape[1]
    ctx_positions = jnp.broadcast_to(start + jnp.arange(c, dtype=jnp.int32), (s, c))
    ctx_k, ctx_v = context_kv(params, cfg, features.astype(dtype), ctx_positions, backend)
    positions = jnp.broadcast_to(start + c + jnp.arange(b, dtype=jnp.int32), (s, b))
    return run_block(params, target_params, cfg, block, positions, jnp.ones((s, b), bool), ctx_k, ctx_v,
                     jnp.ones((s, c), bool), dtype, backend)
