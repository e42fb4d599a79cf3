"""The packed MLX affine-quantized weight, as the checkpoint loader hands it to the kernels.

A `Linear(in=K -> out=N)` quantized by MLX stores, per output row n and input group g (group_size inputs):
    words   uint32 [N, K * bits / 32]   little-endian fields along the input axis: element j of word c holds
                                         input column c * (32 / bits) + j in bits [j*bits, (j+1)*bits)
    scales  [N, K / group_size]          bf16, fp16 or fp32 (the source dtype)
    biases  [N, K / group_size]
    W[n, k] = scales[n, k // group] * q[n, k] + biases[n, k // group]
The weight stays packed in memory; nothing here dequantizes a whole matrix except the test/reference helpers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUPS = (32, 64, 128)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    words: jax.Array  # uint32 [N, K * bits / 32]
    scales: jax.Array  # [N, K / group_size]
    biases: jax.Array  # [N, K / group_size]
    bits: int = dataclasses.field(metadata=dict(static=True))
    group_size: int = dataclasses.field(metadata=dict(static=True))
    # Optional copies of scales and biases as [K / group_size, N], made once for the Mosaic GPU decode kernel
    # (`pallas_kernels.qmm.decode_layout`), which reads a step's scales as rows; None: it transposes them per call.
    scales_t: jax.Array | None = None
    biases_t: jax.Array | None = None
    # Whether `words` hold the 4-bit fields in the Mosaic GPU decode kernel's lane order (`to_lane_words`: the
    # bytes of each group of 8 words permuted; made once by `pallas_kernels.qmm.decode_layout`) instead of MLX's
    # natural order. Readers that want natural order call `natural_words`; the decode kernel and the prompt
    # path's dequantization pass read lane order directly.
    lanes: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # With lanes: whether each lane word holds its four pairs' first fields in its low 16 bits and their second
    # fields in its high 16 bits (`to_lane_words(halves=True)`, the "halves" conversion's order) instead of a pair
    # a byte.
    halves: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # Whether scales_t / biases_t hold the Mosaic GPU decode kernel's "subnormal" copies (`qmm_mgpu.subnormal_scales`,
    # made once by `pallas_kernels.qmm.decode_layout`: s 2^(133 - d), b 2^-d per output row) instead of s and b;
    # row_scale: [1, N] fp32 2^d, present only where some row has d > 0.
    subnormal: bool = dataclasses.field(default=False, metadata=dict(static=True))
    row_scale: jax.Array | None = None

    @property
    def out_features(self) -> int:
        return self.words.shape[0]

    @property
    def in_features(self) -> int:
        return self.words.shape[1] * 32 // self.bits

    @property
    def shape(self) -> tuple[int, int]:
        """The logical [N, K] shape of the dequantized matrix."""
        return (self.out_features, self.in_features)

    def validate(self, name: str = "weight") -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"{name}: {self.bits}-bit quantization is not supported (supported: {SUPPORTED_BITS})")
        if self.group_size not in SUPPORTED_GROUPS:
            raise ValueError(f"{name}: group size {self.group_size} is not supported (supported: {SUPPORTED_GROUPS})")
        if self.words.dtype != jnp.uint32:
            raise ValueError(f"{name}: packed words must be uint32, got {self.words.dtype}")
        n, k = self.shape
        want = (n, k // self.group_size)
        if k % self.group_size:
            raise ValueError(f"{name}: input size {k} is not a multiple of the group size {self.group_size}")
        for part, arr in (("scales", self.scales), ("biases", self.biases)):
            if tuple(arr.shape) != want:
                raise ValueError(f"{name}: {part} shape {tuple(arr.shape)} does not match words {tuple(self.words.shape)} "
                                 f"at {self.bits} bits, group {self.group_size} (expected {want})")
        for part, arr in (("scales_t", self.scales_t), ("biases_t", self.biases_t)):
            if arr is not None and tuple(arr.shape) != want[::-1]:
                raise ValueError(f"{name}: {part} shape {tuple(arr.shape)} is not the transpose of {want}")
        if self.row_scale is not None and (not self.subnormal or tuple(self.row_scale.shape) != (1, n)):
            raise ValueError(f"{name}: row_scale must be [1, {n}] beside subnormal scales, got "
                             f"{tuple(self.row_scale.shape)} (subnormal={self.subnormal})")
        if self.subnormal and self.scales_t is None:
            raise ValueError(f"{name}: subnormal scales need scales_t and biases_t")
        if self.halves and not self.lanes:
            raise ValueError(f"{name}: the halves order is an order of lane words (lanes=True)")
        if self.lanes and (self.bits != 4 or k % 64):
            raise ValueError(f"{name}: lane-ordered words need 4 bits and K a multiple of 64, got {self.bits} bits, "
                             f"K={k}")


def natural_words(w: QuantizedWeight) -> jax.Array:
    """w's words in MLX's natural field order (undoing `to_lane_words` where w holds lane order)."""
    return from_lane_words(w.words, halves=w.halves) if w.lanes else w.words


def to_lane_words(words: jax.Array, halves: bool = False) -> jax.Array:
    """4-bit words uint32 [N, K / 8] (groups of 64 columns = 8 words) -> the same fields in the order the Mosaic GPU
    decode kernel's lanes read them. A byte holds two adjacent columns; in a group, byte q of word 4h + j (columns
    32h + 8j + 2q and + 1) moves to byte j of word 2q + h. The MMA's register layout gives lane q of a row the column
    pairs 2q + 8t (t = 0..7) of each group, and loads its words 2q and 2q + 1: after the repack those two words hold
    exactly its pairs, in order. halves: then, within each word, pair j's two fields (nibbles 2j, 2j + 1) move to
    nibbles j and j + 4, so the low 16 bits hold the four pairs' first fields and the high 16 bits their second
    fields (the "halves" conversion: a pair is one mask away from a bf16x2)."""
    n, c = words.shape
    b = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(n, c // 8, 2, 4, 4)  # [n, group, h, j, q]
    lanes = jax.lax.bitcast_convert_type(b.transpose(0, 1, 4, 2, 3).reshape(n, c, 4), jnp.uint32)
    return _nibbles(lanes, _HALVES) if halves else lanes


def from_lane_words(lanes: jax.Array, halves: bool = False) -> jax.Array:
    """The inverse of `to_lane_words` (of the same order)."""
    if halves:
        lanes = _nibbles(lanes, _HALVES_INVERSE)
    n, c = lanes.shape
    b = jax.lax.bitcast_convert_type(lanes, jnp.uint8).reshape(n, c // 8, 4, 2, 4)  # [n, group, q, h, j]
    return jax.lax.bitcast_convert_type(b.transpose(0, 1, 3, 4, 2).reshape(n, c, 4), jnp.uint32)


# The halves order's nibble permutation: new nibble i takes old nibble _HALVES[i] (pair j = old nibbles 2j, 2j + 1
# -> new nibbles j, j + 4).
_HALVES = (0, 2, 4, 6, 1, 3, 5, 7)
_HALVES_INVERSE = tuple(int(i) for i in np.argsort(_HALVES))


def _nibbles(words: jax.Array, source: tuple[int, ...]) -> jax.Array:
    """uint32 words with nibble i of each word taken from nibble source[i] of the same word."""
    out = jnp.zeros_like(words)
    for i, j in enumerate(source):
        out = out | (((words >> jnp.uint32(4 * j)) & jnp.uint32(15)) << jnp.uint32(4 * i))
    return out


def add_rounded_once_to_bf16(a: jax.Array, b: jax.Array) -> jax.Array:
    """fp32 a + b (a = q * s exact) rounded once to bf16, as a fused bf16 FMA rounds it (the fused kernel's
    HFMA2.BF16), not twice (fp32, then bf16) as a plain add + convert would.

    The fp32 sum t differs from a once-rounded bf16 result only where t lands exactly on a bf16 midpoint (low 16
    bits 0x8000) while the exact sum does not; there TwoSum's error term says which side the exact sum is on, and
    t moves one fp32 ulp that way before the round-to-nearest-even convert. Exact for any fp32 a, b; every step is
    exact or one IEEE rounding, so FMA contraction of a's product into the adds changes nothing when a is exact.
    """
    t = a + b
    bb = t - a
    err = (a - (t - bb)) + (b - bb)  # TwoSum (Knuth): a + b == t + err exactly
    tbits = jax.lax.bitcast_convert_type(t, jnp.uint32)
    on_midpoint = (tbits & jnp.uint32(0xFFFF)) == jnp.uint32(0x8000)
    away = (err > 0) == (t > 0)  # the exact sum is larger in magnitude than t
    nudged = jnp.where(away, tbits + jnp.uint32(1), tbits - jnp.uint32(1))
    tbits = jnp.where(on_midpoint & (err != 0), nudged, tbits)
    return jax.lax.bitcast_convert_type(tbits, jnp.float32).astype(jnp.bfloat16)


def unpack(words: jax.Array, bits: int) -> jax.Array:
    """uint32 [..., C] -> uint32 [..., C * 32 / bits] field values, input-axis order."""
    per_word = 32 // bits
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
    fields = (words[..., None] >> shifts) & jnp.uint32((1 << bits) - 1)
    return fields.reshape(*words.shape[:-1], words.shape[-1] * per_word)


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The whole [N, K] matrix in `dtype` (tests, references and small weights only)."""
    q = unpack(natural_words(w), w.bits).astype(jnp.float32)
    n, k = w.shape
    q = q.reshape(n, k // w.group_size, w.group_size)
    deq = q * w.scales.astype(jnp.float32)[..., None] + w.biases.astype(jnp.float32)[..., None]
    return deq.reshape(n, k).astype(dtype)


def dequantize_rows(w: QuantizedWeight, rows: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Rows `rows` (int [...]) of the dequantized matrix -> [..., K]: the quantized embedding gather."""
    sub = QuantizedWeight(w.words[rows.reshape(-1)], w.scales[rows.reshape(-1)], w.biases[rows.reshape(-1)],
                          w.bits, w.group_size, lanes=w.lanes)  # lane order is per row: the gathered rows keep it
    return dequantize(sub, dtype).reshape(*rows.shape, w.in_features)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "scale_dtype"))
def quantize(w: jax.Array, *, bits: int = 4, group_size: int = 64, scale_dtype=jnp.bfloat16) -> QuantizedWeight:
    """A dense [N, K] weight -> MLX's affine packed form, on the device (a drafter shipped in bf16, quantized at
    load). Per output row and group: the scale spans the group's range over the 2^bits - 1 levels and the bias is
    its minimum, both rounded to `scale_dtype`; each value takes the nearest level under those rounded factors
    (ties to even), clipped to the levels. Every value dequantizes to within one step of itself (half a step but
    for the factors' rounding)."""
    n, k = w.shape
    if bits not in SUPPORTED_BITS or group_size not in SUPPORTED_GROUPS or k % group_size:
        raise ValueError(f"quantize: {bits} bits, group {group_size} for K={k} (bits {SUPPORTED_BITS}, groups "
                         f"{SUPPORTED_GROUPS}, K a multiple of the group)")
    levels = (1 << bits) - 1
    g = w.astype(jnp.float32).reshape(n, k // group_size, group_size)
    lo, hi = g.min(-1), g.max(-1)
    scales = jnp.maximum((hi - lo) / levels, 1e-7).astype(scale_dtype)
    biases = lo.astype(scale_dtype)
    s32, b32 = scales.astype(jnp.float32)[..., None], biases.astype(jnp.float32)[..., None]
    q = jnp.clip(jnp.round((g - b32) / s32), 0, levels).astype(jnp.uint32)
    per_word = 32 // bits
    fields = q.reshape(n, k // per_word, per_word) << (jnp.arange(per_word, dtype=jnp.uint32) * bits)
    words = jax.lax.reduce(fields, jnp.uint32(0), jax.lax.bitwise_or, (2,))
    return QuantizedWeight(words, scales, biases, bits, group_size)


def quantize_numpy(w: np.ndarray, bits: int, group_size: int, scale_dtype=np.float32
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A plain min/max affine quantizer in numpy (test fixtures; not MLX's exact rounding rule).

    Returns (words uint32 [N, K*bits/32], scales [N, K/g], biases [N, K/g]).
    """
    n, k = w.shape
    if k % group_size or k % (32 // bits):
        raise ValueError(f"input size {k} must be a multiple of group {group_size}")
    levels = (1 << bits) - 1
    g = w.astype(np.float64).reshape(n, k // group_size, group_size)
    lo, hi = g.min(-1), g.max(-1)
    scale = np.maximum((hi - lo) / levels, 1e-7)
    scale = scale.astype(scale_dtype).astype(np.float64)
    bias = lo.astype(scale_dtype).astype(np.float64)
    q = np.clip(np.rint((g - bias[..., None]) / scale[..., None]), 0, levels).astype(np.uint32).reshape(n, k)
    per_word = 32 // bits
    q = q.reshape(n, k // per_word, per_word)
    words = np.zeros((n, k // per_word), np.uint32)
    for j in range(per_word):
        words |= q[..., j] << np.uint32(j * bits)
    return words, scale.astype(scale_dtype), bias.astype(scale_dtype)


def dequantize_numpy(words: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int
                     ) -> np.ndarray:
    """float64 [N, K] from the packed form: an independent numpy oracle for the kernels' tests."""
    per_word = 32 // bits
    n, c = words.shape
    q = np.empty((n, c, per_word), np.float64)
    for j in range(per_word):
        q[..., j] = (words >> np.uint32(j * bits)) & np.uint32((1 << bits) - 1)
    q = q.reshape(n, c * per_word)
    s = np.repeat(scales.astype(np.float64), group_size, axis=1)
    b = np.repeat(biases.astype(np.float64), group_size, axis=1)
    return q * s + b
