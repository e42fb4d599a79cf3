"""The Qwen3.5 vision tower (model_spec A.8) as pure functions over its params (`checkpoint.load_vision`).

An image's patches (`qwen_jax.vision.preprocess_image`: rows in merge-block order) go through
  patch embed   a Conv3d with stride = kernel, i.e. one [C·T·P·P] -> [D] matmul a patch, with bias;
  + position    the learned G x G table bilinearly resampled (align_corners) to the image's h x w patch grid;
  blocks        x += proj(attn(LN1(x))), x += fc2(gelu_tanh(fc1(LN2(x)))), LayerNorm eps 1e-6, qkv with bias,
                bidirectional attention over the image's own patches, 2-D RoPE over the whole head (d/4
                frequencies; a half-split rotation whose angles are [row·f, col·f] in each half);
  merger        LN per patch, each merge block's M = merge² consecutive patches concatenated to [M·D], then
                fc2(gelu_exact(fc1(.))) to the text model's hidden size: one prompt row per merge block.

Exactness (TensorFold's rule for rows, applied to images): an image's output bits depend only on the image. A call
runs image slots [I, L, ...], each slot one image from row 0, padded to L rows (the bucket); the slots go through one
compiled per-image body (`lax.map`), so a slot's bits do not depend on the other slots or its index; padding rows are
zeroed on the way in and masked out of attention as keys (and zeroed as values), so their contents never reach a
live row. `patch_bucket` picks L from the image's own patch count, so the same image always runs the same program.

Letters: i image slots, l patch rows (the bucket), q/k query and key rows, n heads, d head dim, c hidden,
p patch values, m merged rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax.config import VisionConfig
from qwen_jax.vision.processing import ProcessedImage

_HI = jax.lax.Precision.HIGHEST
# Masked scores: finite, so a slot with no live key (an empty slot) softmaxes to finite garbage instead of NaN;
# exp(_MASKED - max) is exactly 0 beside any live score.
_MASKED = -1e30
# Query rows a block above which attention runs in blocks of ATTN_BLOCK queries (scores [n, block, l] fp32).
ATTN_BLOCK = 1024


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionBatch:
    patches: jax.Array  # [I, L, C·T·P·P] each slot's image from row 0 in merge-block order; rows past h·w padding
    grid_hw: jax.Array  # [I, 2] int32 patch rows h and columns w of each slot's image ((0, 0): an empty slot)


def patch_bucket(num_patches: int, minimum: int = 64) -> int:
    """Patch rows of the slot an image of num_patches runs in: the next power of two >= max(num_patches, minimum)
    (a function of the image alone, so its bits never depend on what else is encoded)."""
    if num_patches <= 0:
        raise ValueError(f"an image has at least one patch, got {num_patches}")
    return 1 << (max(num_patches, minimum) - 1).bit_length()


def make_vision_batch(images: Sequence[ProcessedImage], cfg: VisionConfig, bucket: int,
                      slots: int | None = None) -> VisionBatch:
    """Host images -> one call's slots: image j in slot j (rows past its patches zero), `slots` slots in all
    (default len(images); extra slots are empty). Raises ValueError for videos (t > 1), an image whose patches do
    not fit `bucket`, or a bucket that is not a multiple of the merge unit."""
    slots = len(images) if slots is None else slots
    if slots < len(images):
        raise ValueError(f"{len(images)} images do not fit {slots} slots")
    if bucket % cfg.merge_unit or (bucket > ATTN_BLOCK and bucket % ATTN_BLOCK):
        raise ValueError(f"bucket {bucket} must be a multiple of the merge unit {cfg.merge_unit} (and of "
                         f"{ATTN_BLOCK} above {ATTN_BLOCK})")
    patches = np.zeros((slots, bucket, cfg.patch_dim), np.float32)
    grid = np.zeros((slots, 2), np.int32)
    for j, im in enumerate(images):
        t, h, w = im.grid_thw
        if t != 1:
            raise ValueError(f"image {j}: grid_thw {im.grid_thw} has {t} frame groups; only still images (t = 1) are "
                             "supported")
        if im.patches.shape != (h * w, cfg.patch_dim):
            raise ValueError(f"image {j}: patches {im.patches.shape} do not match grid {h}x{w} of {cfg.patch_dim} "
                             "values")
        if h * w > bucket:
            raise ValueError(f"image {j}: {h * w} patches exceed the bucket of {bucket}")
        if h % cfg.spatial_merge_size or w % cfg.spatial_merge_size:
            raise ValueError(f"image {j}: patch grid {h}x{w} is not a multiple of the merge size")
        patches[j, :h * w] = im.patches
        grid[j] = (h, w)
    return VisionBatch(jnp.asarray(patches), jnp.asarray(grid))


def _linear(x: jax.Array, p: dict) -> jax.Array:
    """x [..., in] @ w[out, in]^T + b in fp32 (HIGHEST), rounded once to x.dtype."""
    y = jnp.dot(x, p["w"].T.astype(x.dtype), precision=_HI, preferred_element_type=jnp.float32)
    return (y + p["b"]).astype(x.dtype)


def _layer_norm(x: jax.Array, p: dict, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * p["w"] + p["b"]).astype(x.dtype)


def _patch_coords(rows: jax.Array, w: jax.Array, merge: int) -> tuple[jax.Array, jax.Array]:
    """Patch row and column of each merge-block-order index (block_row, block_col, row_in_block, col_in_block)."""
    blocks_w = jnp.maximum(w // merge, 1)
    in_col = rows % merge
    in_row = (rows // merge) % merge
    block = rows // (merge * merge)
    return (block // blocks_w) * merge + in_row, (block % blocks_w) * merge + in_col


def _axis_taps(coord: jax.Array, size: jax.Array, side: int) -> tuple[jax.Array, jax.Array]:
    """Bilinear (align_corners) taps [l, 2] into a `side`-long axis and their weights, for coordinates on an axis of
    `size` patches: src = coord·(side - 1)/(size - 1), taps floor(src) and floor(src) + 1 clamped to the table."""
    src = coord.astype(jnp.float32) * jnp.float32(side - 1) / jnp.maximum(size - 1, 1).astype(jnp.float32)
    floor = jnp.floor(src)
    offsets = jnp.arange(2, dtype=jnp.float32)
    taps = jnp.clip(floor[:, None] + offsets, 0, side - 1).astype(jnp.int32)
    weights = jnp.maximum(1 - jnp.abs(src[:, None] - floor[:, None] - offsets), 0)
    return taps, weights


def _position_embedding(table: jax.Array, row: jax.Array, col: jax.Array, h: jax.Array, w: jax.Array,
                        cfg: VisionConfig) -> jax.Array:
    """[l, c] fp32: the G x G table resampled to the h x w grid at each patch, the four taps summed in order
    (row tap 0 col 0, 0 1, 1 0, 1 1)."""
    side = cfg.grid_side
    h_taps, h_w = _axis_taps(row, h, side)
    w_taps, w_w = _axis_taps(col, w, side)
    table = table.astype(jnp.float32)
    out = None
    for a in range(2):
        for b in range(2):
            term = table[h_taps[:, a] * side + w_taps[:, b]] * (h_w[:, a] * w_w[:, b])[:, None]
            out = term if out is None else out + term
    return out


def _rope_cos_sin(row: jax.Array, col: jax.Array, cfg: VisionConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin [l, d] fp32 of the 2-D RoPE: frequencies θ^(-2j / (d/2)) for j < d/4; angles [row·f, col·f]
    repeated for the two rotate-half halves."""
    spatial = cfg.head_dim // 2  # each of the row and column angles spans half the head
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, spatial, 2, dtype=jnp.float32) / spatial))
    ang = jnp.concatenate([row.astype(jnp.float32)[:, None] * inv_freq, col.astype(jnp.float32)[:, None] * inv_freq],
                          axis=-1)
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [l, n, d] -> rotate-half RoPE over the whole head, in fp32, rounded back to x.dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, live: jax.Array, scale: float) -> jax.Array:
    """q [q, n, d] over k, v [k, n, d] with live [k] keys -> [q, n, d]. Scores in fp32, scaled after the product,
    softmax in fp32 rounded to the activation dtype before the value product (HF's eager attention)."""
    s = jnp.einsum("qnd,knd->nqk", q, k, precision=_HI, preferred_element_type=jnp.float32) * scale
    s = jnp.where(live[None, None, :], s, _MASKED)
    s = s - jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s)
    probs = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(v.dtype)
    return jnp.einsum("nqk,knd->qnd", probs, v, precision=_HI, preferred_element_type=jnp.float32).astype(v.dtype)


def _attention(x: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, live: jax.Array, cfg: VisionConfig
               ) -> jax.Array:
    l = x.shape[0]
    n, d = cfg.num_heads, cfg.head_dim
    qkv = _linear(x, p["qkv"]).reshape(l, 3, n, d)
    q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    v = jnp.where(live[:, None, None], v, 0)
    scale = d ** -0.5
    if l <= 2 * ATTN_BLOCK:
        o = _attend(q, k, v, live, scale)
    else:
        blocks = q.reshape(l // ATTN_BLOCK, ATTN_BLOCK, n, d)
        o = jax.lax.map(lambda qb: _attend(qb, k, v, live, scale), blocks).reshape(l, n, d)
    return _linear(o.reshape(l, n * d), p["proj"])


def _one_image(params: dict, patches: jax.Array, grid_hw: jax.Array, cfg: VisionConfig) -> jax.Array:
    """One slot: patches [l, p], grid_hw [2] -> merged rows [l / M, out_hidden] (rows past h·w / M are padding)."""
    dtype = params["patch_embed"]["w"].dtype
    l = patches.shape[0]
    h, w = grid_hw[0], grid_hw[1]
    rows = jnp.arange(l, dtype=jnp.int32)
    live = rows < h * w
    eps = cfg.layer_norm_eps
    with jax.named_scope("patch_embed"):
        x = _linear(jnp.where(live[:, None], patches, 0).astype(dtype), params["patch_embed"])
        row, col = _patch_coords(rows, w, cfg.spatial_merge_size)
        x = x + _position_embedding(params["pos_embed"], row, col, h, w, cfg).astype(dtype)
        cos, sin = _rope_cos_sin(row, col, cfg)
    for i, blk in enumerate(params["blocks"]):
        with jax.named_scope(f"block{i}"):
            x = x + _attention(_layer_norm(x, blk["norm1"], eps), blk, cos, sin, live, cfg)
            x = x + _linear(jax.nn.gelu(_linear(_layer_norm(x, blk["norm2"], eps), blk["fc1"]), approximate=True),
                            blk["fc2"])
    with jax.named_scope("merger"):
        m = params["merger"]
        y = _layer_norm(x, m["norm"], eps).reshape(l // cfg.merge_unit, cfg.merge_unit * cfg.hidden_size)
        return _linear(jax.nn.gelu(_linear(y, m["fc1"]), approximate=False), m["fc2"])


def encode(params: dict, batch: VisionBatch, cfg: VisionConfig) -> jax.Array:
    """-> [I, L / M, out_hidden] in the params' dtype: row r of slot i is image i's r-th prompt row (merge block r),
    for r < h·w / M; rows past it are padding (finite, to be ignored). jit with cfg static."""
    return jax.lax.map(lambda a: _one_image(params, a[0], a[1], cfg), (batch.patches, batch.grid_hw))


_encode_jit = jax.jit(encode, static_argnames="cfg")


def encode_images(params: dict, images: Sequence[ProcessedImage], cfg: VisionConfig) -> list[jax.Array]:
    """Each image's prompt rows [h·w / M, out_hidden], in order. Images of one `patch_bucket` share a call; each
    image's bits are those it gets alone."""
    by_bucket: dict[int, list[int]] = {}
    for j, im in enumerate(images):
        by_bucket.setdefault(patch_bucket(im.patches.shape[0]), []).append(j)
    out: list[jax.Array | None] = [None] * len(images)
    for bucket, members in sorted(by_bucket.items()):
        rows = _encode_jit(params, make_vision_batch([images[j] for j in members], cfg, bucket), cfg=cfg)
        for slot, j in enumerate(members):
            _, h, w = images[j].grid_thw
            out[j] = rows[slot, :h * w // cfg.merge_unit]
    return out


def image_rows(mask: jax.Array, features: jax.Array, first: jax.Array) -> jax.Array:
    """Rows for `forward.prefill(..., embeds=(mask, rows))`: mask [S, T] bool marks a chunk's image placeholder rows,
    features [S, N, H] each stream's image rows in prompt order, first [S] int32 how many of them earlier chunks
    used. Placeholder row t takes features[s, first[s] + (placeholders before t in the chunk)]; others get zeros.
    -> [S, T, H] in features' dtype."""
    index = first[:, None] + jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1
    index = jnp.clip(index, 0, features.shape[1] - 1)
    rows = jnp.take_along_axis(features, index[:, :, None], axis=1)
    return jnp.where(mask[:, :, None], rows, jnp.zeros((), features.dtype))
