"""Group-quantized matmul (MLX affine, 4/8-bit): y[M, N] = x[M, K] @ dequantize(w)[N, K]^T.

Letters: m rows of x (tokens), n output features, k input features, g groups along k, c packed uint32 words,
j field position inside a word. `reference()` is the plain-jnp definition every kernel here must match; it
dequantizes the whole weight (fine for tests and tiny models, slow at the 27B's shapes).

How the kernel works (Pallas, Triton lowering; docs/kernels/qmm.md has the measurements behind each choice):
- K is cut into blocks of `block` columns (fixed by K and bits alone, see `block_cols`). Inside a block, the
  weight words are read once, 16 bytes at a time, and split into "field pairs": fields j and j + per/2 of a word
  sit 16 bits apart, so one shift, one AND with 0x000F000F and one OR with 0x43004300 turn them into two bf16
  numbers 128 + q (the bf16 mantissa has 7 bits; no int->float conversion). Field pair j of all the block's words
  is one "chunk" of 2 * words columns, an MMA operand built in registers: w = (q' - 128) * scale + bias, one
  bf16 FMA for two weights, rounded once from the exact dequantized value.
- Chunk column 2c + t is (word c, field j + t * per/2). A plain QuantizedWeight is used as stored, and x is
  permuted per call into that "chunk order" (a tiny XLA transpose that fuses into x's producer). `prepare()`
  instead moves the fields once at load so that chunk j is natural columns [j * chunk, (j + 1) * chunk) of its
  block, and x is read as it is. The two forms sum k in different orders: each is exact in its own right (and
  row-invariant), but their last bits differ, so a weight should stay in one form for the life of a server.
- The MMA runs weight-major (w [block_n, chunk] @ x^T [chunk, block_m], Hopper wgmma when block_n >= 64), fp32
  accumulation, one chunk after another in increasing k.

Exactness (STYLE.md): the k order (blocks, then chunks, each one MMA of fixed shape) and every tile shape are fixed
by the weight's shape and the path (`prompt`) alone. A row of x is always computed in a `block_m`-row MMA tile of
one shape, whatever M is and whichever rows share the call, so row i's bits never depend on M or on the other
rows. M is padded inside (masked loads and stores).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.qweight import SUPPORTED_BITS, SUPPORTED_GROUPS, QuantizedWeight, dequantize, dequantize_rows

# Two bf16 128.0s: OR-ing a 4-bit field q into the low mantissa bits of one gives the bf16 number 128 + q exactly.
_BF16_128_PAIR = 0x43004300
_MAX_BLOCK = 256


def _min_block(bits: int) -> int:
    """Smallest block whose chunks have the 16 columns an MMA needs (chunk = block * 2 / fields per word)."""
    return 16 * (32 // bits) // 2


def block_cols(k: int, bits: int) -> int:
    """The k block of a weight: the largest power of two <= 256 dividing K, at least `_min_block(bits)`.

    K not divisible by the minimum (only a 32-group 4-bit weight with K an odd multiple of 32) is zero-padded.
    """
    block = _MAX_BLOCK
    while block > _min_block(bits) and k % block:
        block //= 2
    return block


def _padded_k(k: int, bits: int) -> int:
    step = _min_block(bits)
    return -(-k // step) * step


# ---------------------------------------------------------------------------------------------------------------
# layouts


def _chunk_order(k: int, bits: int, block: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(natural split shape, permutation to kernel order, kernel split shape) of a k axis of length K."""
    per = 32 // bits
    half = per // 2
    words = block * bits // 32
    natural = (k // block, words, 2, half)  # column = blk * block + c * per + t * half + j
    to_kernel = (0, 3, 1, 2)  # -> (blk, j, c, t): column = blk * block + j * 2 * words + 2 * c + t
    return natural, to_kernel, (k // block, half, words, 2)


def _to_kernel_order(a: jax.Array, bits: int, block: int) -> jax.Array:
    """Permute the last axis (natural k order) into the kernel's chunk order."""
    *lead, k = a.shape
    natural, perm, _ = _chunk_order(k, bits, block)
    nl = len(lead)
    a = a.reshape(*lead, *natural)
    a = jnp.transpose(a, (*range(nl), *(nl + p for p in perm)))
    return a.reshape(*lead, k)


def _from_kernel_order(a: jax.Array, bits: int, block: int) -> jax.Array:
    *lead, k = a.shape
    _, perm, kernel_shape = _chunk_order(k, bits, block)
    nl = len(lead)
    inverse = [perm.index(i) for i in range(len(perm))]
    a = a.reshape(*lead, *kernel_shape)
    a = jnp.transpose(a, (*range(nl), *(nl + p for p in inverse)))
    return a.reshape(*lead, k)


def _fields(words: jax.Array, bits: int) -> jax.Array:
    """uint32 [..., C] -> uint8 [..., C * 32/bits] field values in natural order (uint8 keeps a 27B table small)."""
    per = 32 // bits
    shifts = jnp.arange(per, dtype=jnp.uint32) * bits
    f = (words[..., None] >> shifts) & jnp.uint32((1 << bits) - 1)
    return f.astype(jnp.uint8).reshape(*words.shape[:-1], words.shape[-1] * per)


def _pack(fields: jax.Array, bits: int) -> jax.Array:
    per = 32 // bits
    f = fields.reshape(*fields.shape[:-1], fields.shape[-1] // per, per).astype(jnp.uint32)
    return functools.reduce(jnp.bitwise_or, [f[..., j] << jnp.uint32(j * bits) for j in range(per)])


def _repack_words(words: jax.Array, bits: int, block: int) -> jax.Array:
    """Checkpoint words -> words the kernel reads against x in natural order.

    The kernel pairs (word c, field j + t * per/2) with x position j * chunk + 2c + t; for a plain weight that
    position holds natural column c * per + t * per/2 + j (x is permuted to kernel order). Here the field at that
    spot is made to hold natural column j * chunk + 2c + t instead, i.e. the fields are moved by the inverse map.
    """
    return _pack(_from_kernel_order(_fields(words, bits), bits, block), bits)


def _unrepack_words(words: jax.Array, bits: int, block: int) -> jax.Array:
    return _pack(_to_kernel_order(_fields(words, bits), bits, block), bits)


def _pad_weight(w: QuantizedWeight) -> QuantizedWeight:
    n, k = w.shape
    kp = _padded_k(k, w.bits)
    if kp == k:
        return w
    # Zero words, scales and biases: the padded columns dequantize to exactly 0.
    wpad = kp * w.bits // 32 - w.words.shape[1]
    gpad = kp // w.group_size - w.scales.shape[1]
    return QuantizedWeight(jnp.pad(w.words, ((0, 0), (0, wpad))), jnp.pad(w.scales, ((0, 0), (0, gpad))),
                           jnp.pad(w.biases, ((0, 0), (0, gpad))), w.bits, w.group_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreparedWeight:
    """The kernel's layout of a QuantizedWeight, built once at load by `prepare()`: same fields, same values.

    Each row's fields are permuted within blocks of `block` columns into the kernel's k order, so x is read as it
    is; scales and biases are unchanged. K is zero-padded only where `block_cols` says so.
    """
    words: jax.Array  # uint32 [N, Kp * bits / 32], fields in kernel order
    scales: jax.Array  # [N, Kp / group_size]
    biases: jax.Array  # [N, Kp / group_size]
    bits: int = dataclasses.field(metadata=dict(static=True))
    group_size: int = dataclasses.field(metadata=dict(static=True))
    in_features: int = dataclasses.field(metadata=dict(static=True))  # the real K (Kp >= K)

    @property
    def out_features(self) -> int:
        return self.words.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def padded_in_features(self) -> int:
        return self.words.shape[1] * 32 // self.bits

    @property
    def block(self) -> int:
        return block_cols(self.padded_in_features, self.bits)

    def validate(self, name: str = "weight") -> None:
        QuantizedWeight(self.words, self.scales, self.biases, self.bits, self.group_size).validate(name)
        if self.padded_in_features != _padded_k(self.in_features, self.bits):
            raise ValueError(f"{name}: prepared words cover K={self.padded_in_features}, expected "
                             f"{_padded_k(self.in_features, self.bits)} for K={self.in_features}; "
                             "build it with qmm.prepare()")


AnyWeight = QuantizedWeight | PreparedWeight


def prepare(w: QuantizedWeight) -> PreparedWeight:
    """The checkpoint loader's optional one-time repack: saves the per-call permutation of x (see the module doc)."""
    w.validate()
    k = w.in_features
    wp = _pad_weight(w)
    block = block_cols(wp.in_features, w.bits)
    return PreparedWeight(_repack_words(wp.words, w.bits, block), wp.scales, wp.biases, w.bits, w.group_size, k)


def unprepare(w: PreparedWeight) -> QuantizedWeight:
    words = _unrepack_words(w.words, w.bits, w.block)
    kw = w.in_features * w.bits // 32
    kg = w.in_features // w.group_size
    return QuantizedWeight(words[:, :kw], w.scales[:, :kg], w.biases[:, :kg], w.bits, w.group_size)


def _as_quantized(w: AnyWeight) -> QuantizedWeight:
    return unprepare(w) if isinstance(w, PreparedWeight) else w


def _validate(x: jax.Array, w: AnyWeight) -> None:
    if not isinstance(w, (QuantizedWeight, PreparedWeight)):
        raise ValueError(f"qmm: weight must be a QuantizedWeight or a qmm.PreparedWeight, got {type(w).__name__}")
    w.validate()
    if x.ndim != 2:
        raise ValueError(f"qmm: x must be [M, K], got shape {x.shape}")
    if x.shape[1] != w.in_features:
        raise ValueError(f"qmm: x has K={x.shape[1]} but the weight takes K={w.in_features}")
    if x.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16):
        raise ValueError(f"qmm: x dtype {x.dtype} not supported (bfloat16, float16 or float32)")


def reference(x: jax.Array, w: AnyWeight) -> jax.Array:
    """x [M, K] (bf16/fp16/fp32), w packed [N, K] -> y [M, N] in x.dtype, fp32 accumulation."""
    _validate(x, w)
    deq = dequantize(_as_quantized(w), jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), deq.T, precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# tiles


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One kernel configuration. Part of the numerics: a path must pick it from the weight's shape alone."""
    block_m: int  # rows of x per MMA tile (power of 2, >= 16)
    block_n: int  # output features per program (power of 2, >= 16)
    blocks_per_step: int = 1  # k blocks per loop step (power of 2)
    num_warps: int = 4
    num_stages: int = 3
    max_m_blocks: int = 1  # block_m-row tiles one program carries, so one weight chunk serves up to this many

    def check(self) -> None:
        for name, least in (("block_m", 8), ("block_n", 16)):
            v = getattr(self, name)
            if v < least or v & (v - 1):
                raise ValueError(f"qmm tiles: {name}={v} must be a power of two >= {least}")
        for name in ("blocks_per_step", "max_m_blocks", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"qmm tiles: {name} must be >= 1")


def decode_tiles(n: int, k: int, bits: int, group: int) -> Tiles:
    """Decode/verify (memory-bound) tiles, from the weight's shape only.

    block_n is the largest of 64/32/16 that still gives two programs per SM of the H200's 132, so every SM
    streams weights; a program carries up to 8192 accumulator elements (64 fp32 registers a thread at 4 warps).
    """
    block_n = 16
    for cand in (64, 32):
        if pl.cdiv(n, cand) >= 264:
            block_n = cand
            break
    steps = 2 if _padded_k(k, bits) % (2 * block_cols(_padded_k(k, bits), bits)) == 0 else 1
    return Tiles(block_m=16, block_n=block_n, blocks_per_step=steps, num_warps=4, num_stages=3,
                 max_m_blocks=2)


def prompt_tiles(n: int, k: int, bits: int, group: int) -> Tiles:
    """Prompt (compute-bound) tiles: a 128x128 output tile per program, weight tiles reused from L2."""
    return Tiles(block_m=128, block_n=128, blocks_per_step=1, num_warps=8, num_stages=3, max_m_blocks=1)


# ---------------------------------------------------------------------------------------------------------------
# kernel


def _weight_chunk(words, j: int, bits: int, s, b, w_dtype, bf16_fma: bool):
    """words uint32 [bn, c] -> the chunk's dequantized weights [bn, 2c]: fields j and j + per/2 of each word."""
    bn, c = words.shape
    shifted = words >> jnp.uint32(j * bits) if j else words
    # Fields j and j + half sit 16 bits apart: one AND (and for bf16 one OR of the 128.0 pattern) builds both
    # halves of the MMA operand's 32-bit register.
    field = (1 << bits) - 1
    pair = shifted & jnp.uint32(field | field << 16)
    if bf16_fma:
        pair = pair | jnp.uint32(_BF16_128_PAIR)
    halves = [(pair & jnp.uint32(0xFFFF)).astype(jnp.uint16), (pair >> jnp.uint32(16)).astype(jnp.uint16)]
    fields = jnp.stack(halves, axis=-1).reshape(bn, 2 * c)  # Triton `join`: both halves stay in one thread
    if bf16_fma:
        q = jax.lax.bitcast_convert_type(fields, jnp.bfloat16)  # 128 + q, exact
        return (q - jnp.bfloat16(128)) * s + b  # exact q, one bf16 FMA: the dequantized value rounded once
    q = fields.astype(jnp.int32).astype(jnp.float32)
    return (q * s.astype(jnp.float32) + b.astype(jnp.float32)).astype(w_dtype)


def _qmm_kernel(x_ref, w_ref, s_ref, b_ref, *out_refs, m: int, n: int, kp: int, bits: int, group: int,
                block: int, natural: bool, tiles: Tiles, m_blocks: int, w_dtype, bf16_fma: bool, precision):
    # x_ref [M, Kp] in the k order the words imply (natural for prepared words, else the chunk order);
    # w_ref uint32 [N, Kp*bits/32]; s_ref, b_ref [N, Kp/g]; o_ref [M, N] (preceded by the aliased input buffer
    # when the caller passes one to poison).
    o_ref = out_refs[-1]
    # Grid (row super-block, n tile): each program owns rows [pid_m * m_blocks * block_m, ...) x one n tile.
    bm, bn = tiles.block_m, tiles.block_n
    per = 32 // bits
    half = per // 2
    words_per_block = block * bits // 32
    chunk = 2 * words_per_block  # columns per chunk
    if natural:
        # Chunk j is natural columns [j * chunk, (j + 1) * chunk) of its block: runs of `group` columns per group.
        chunk_groups = max(1, chunk // group)
    else:
        # Chunk column 2c + t is natural column c * per + t * half + j, in group c // (group / per): every chunk
        # meets every group of its block (or the one group holding the block) in runs of 2 * group / per.
        chunk_groups = max(1, block // group)
    run = chunk // chunk_groups
    pid_m, pid_n = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(pid_n * bn, bn)
    nsl = pl.ds(n0, bn)
    cols = n0 + jnp.arange(bn, dtype=jnp.int32)
    n_ragged = n % bn != 0
    row0 = pid_m * (m_blocks * bm)
    row_ok = [(row0 + mb * bm + jnp.arange(bm, dtype=jnp.int32)) < m for mb in range(m_blocks)]
    row_idx = [pl.ds(row0 + mb * bm, bm) for mb in range(m_blocks)]

    def load_n_rows(ref, idx, width):
        if not n_ragged:
            return ref[idx]
        return plt.load(ref.at[idx], mask=jnp.broadcast_to((cols < n)[:, None], (bn, width)), other=0)

    def step(it, accs):
        accs = list(accs)
        for blk in range(tiles.blocks_per_step):
            kb = it * tiles.blocks_per_step + blk
            words = load_n_rows(w_ref, (nsl, pl.ds(pl.multiple_of(kb * words_per_block, words_per_block),
                                                   words_per_block)), words_per_block)
            for j in range(half):
                col0 = kb * block + j * chunk
                if natural or j == 0:  # the chunk-order scales are the same for every chunk of a block
                    gsl = pl.ds((col0 if natural else kb * block) // group, chunk_groups)
                    s = load_n_rows(s_ref, (nsl, gsl), chunk_groups)
                    b = load_n_rows(b_ref, (nsl, gsl), chunk_groups)
                    s = jnp.broadcast_to(s[:, :, None], (bn, chunk_groups, run)).reshape(bn, chunk)
                    b = jnp.broadcast_to(b[:, :, None], (bn, chunk_groups, run)).reshape(bn, chunk)
                wt = _weight_chunk(words, j, bits, s, b, w_dtype, bf16_fma)  # [bn, chunk]
                xcols = pl.ds(pl.multiple_of(col0, chunk), chunk)
                for mb in range(m_blocks):
                    xmask = jnp.broadcast_to(row_ok[mb][:, None], (bm, chunk))
                    xc = plt.load(x_ref.at[row_idx[mb], xcols], mask=xmask, other=0).astype(w_dtype)
                    # dot first: Triton folds `dot + acc` (not `acc + dot`) into the MMA's accumulator.
                    accs[mb] = jax.lax.dot_general(
                        wt, xc, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) + accs[mb]
        return tuple(accs)

    zeros = tuple(jnp.zeros((bn, bm), jnp.float32) for _ in range(m_blocks))
    accs = jax.lax.fori_loop(0, kp // (block * tiles.blocks_per_step), step, zeros)
    for mb in range(m_blocks):
        mask = row_ok[mb][:, None] & (cols < n)[None, :]
        plt.store(o_ref.at[row_idx[mb], nsl], accs[mb].T.astype(o_ref.dtype), mask=mask)


def _arith(x_dtype, scale_dtype, bits: int):
    """(MMA operand dtype, dot precision, whether the bf16 bit trick + bf16 FMA builds the weights)."""
    if x_dtype == jnp.float32:
        # The verification path: fp32 weights and full fp32 products (IEEE FMA, not tf32).
        return jnp.float32, jax.lax.Precision.HIGHEST, False
    bf16_fma = x_dtype == jnp.bfloat16 and scale_dtype == jnp.bfloat16 and bits == 4
    return x_dtype, None, bf16_fma


def _qmm_call(xk: jax.Array, words, scales, biases, n: int, bits: int, group: int, natural: bool, out_dtype,
              tiles: Tiles, interpret: bool, out: jax.Array | None = None) -> jax.Array:
    m, kp = xk.shape
    block = block_cols(kp, bits)
    if kp % (block * tiles.blocks_per_step):
        raise ValueError(f"qmm tiles: blocks_per_step={tiles.blocks_per_step} does not divide K={kp} into "
                         f"blocks of {block}")
    m_blocks = min(tiles.max_m_blocks, pl.cdiv(m, tiles.block_m))
    grid = (pl.cdiv(m, m_blocks * tiles.block_m), pl.cdiv(n, tiles.block_n))
    w_dtype, precision, bf16_fma = _arith(xk.dtype, scales.dtype, bits)
    # A fresh partial per call: jax#40847 reuses a stale jaxpr when one kernel function meets several grids.
    kernel = functools.partial(_qmm_kernel, m=m, n=n, kp=kp, bits=bits, group=group, block=block,
                               natural=natural, tiles=tiles,
                               m_blocks=m_blocks, w_dtype=w_dtype, bf16_fma=bf16_fma, precision=precision)
    operands = (xk, words, scales, biases) + (() if out is None else (out,))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=grid,
        compiler_params=plt.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        input_output_aliases={} if out is None else {4: 0},
        interpret=interpret,
        name=f"qmm_{bits}b_g{group}",
    )(*operands)


def qmm(x: jax.Array, w: AnyWeight, *, prompt: bool = False, interpret: bool = False,
        tiles: Tiles | None = None) -> jax.Array:
    """x [M, K] -> y [M, N] = x @ dequantize(w)^T in x.dtype, fp32 accumulation, through the Pallas kernel.

    w: a QuantizedWeight as the checkpoint stores it, or its `prepare()`d form (one XLA op fewer a call; a
        different k order, so different last bits -- keep each weight in one form).
    prompt: static choice of the call site -- False for decode/verify rows (memory-bound, any M), True for prompt
        chunks (compute-bound, M >= 64 typical). Within a path, a row's bits are independent of M and of the
        other rows; the two paths may differ from each other in the last bits (different tiles).
    tiles: override the shape-derived tiles (tests and benchmarks; a caller that overrides must keep it fixed).
    """
    return _qmm(x, w, prompt=prompt, interpret=interpret, tiles=tiles)


def _qmm(x: jax.Array, w: AnyWeight, *, prompt: bool, interpret: bool, tiles: Tiles | None,
         out: jax.Array | None = None) -> jax.Array:
    """`qmm`, optionally writing into `out` [M, N] (tests pass a NaN-filled buffer to catch unwritten elements)."""
    _validate(x, w)
    n, k = w.shape
    if tiles is None:
        tiles = (prompt_tiles if prompt else decode_tiles)(n, k, w.bits, w.group_size)
    tiles.check()
    if x.shape[0] == 0:
        return jnp.zeros((0, n), x.dtype)
    with jax.named_scope("qmm_prompt" if prompt else "qmm_decode"):
        kp = _padded_k(k, w.bits)
        xk = x if kp == k else jnp.pad(x, ((0, 0), (0, kp - k)))
        if isinstance(w, PreparedWeight):
            words, scales, biases = w.words, w.scales, w.biases
        else:
            wp = _pad_weight(w)
            words, scales, biases = wp.words, wp.scales, wp.biases
            xk = _to_kernel_order(xk, w.bits, block_cols(kp, w.bits))
        if out is not None and (out.shape != (x.shape[0], n) or out.dtype != x.dtype):
            raise ValueError(f"qmm: out must be {(x.shape[0], n)} {x.dtype}, got {out.shape} {out.dtype}")
        natural = isinstance(w, PreparedWeight)
        return _qmm_call(xk, words, scales, biases, n, w.bits, w.group_size, natural, x.dtype, tiles, interpret,
                         out)


# ---------------------------------------------------------------------------------------------------------------
# quantized embedding


def embed_reference(w: AnyWeight, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Quantized embedding gather: ids int [...] -> [..., K] rows of the dequantized table."""
    return dequantize_rows(_as_quantized(w), ids, dtype)


def embed(w: AnyWeight, ids: jax.Array, dtype=jnp.float32, *, interpret: bool = False) -> jax.Array:
    """ids int [...] -> [..., K]: gathers only the rows asked for (T x K/2 bytes at 4 bits), then dequantizes them.

    An XLA gather + elementwise fusion reads just those rows, so a Pallas kernel would not move fewer bytes.
    """
    del interpret
    if not isinstance(w, (QuantizedWeight, PreparedWeight)):
        raise ValueError(f"embed: table must be a QuantizedWeight or a qmm.PreparedWeight, got {type(w).__name__}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"embed: ids must be integers, got {ids.dtype}")
    w.validate("embedding")
    if isinstance(w, PreparedWeight):
        flat = ids.reshape(-1)
        rows = PreparedWeight(w.words[flat], w.scales[flat], w.biases[flat], w.bits, w.group_size, w.in_features)
        return dequantize(unprepare(rows), dtype).reshape(*ids.shape, w.in_features)
    return embed_reference(w, ids, dtype)
