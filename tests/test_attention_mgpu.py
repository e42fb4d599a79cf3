"""The Mosaic GPU prompt-chunk kernel (`attention_mgpu.prompt_mgpu`) against `attention.prompt_reference` and the
float64 numpy attention of test_attention, plus the exactness properties: a row's bits never depend on where a
prompt was cut into chunks, on the other streams of the call, or on the CTA / warpgroup tile the row lands in.

CPU runs the kernel in Mosaic GPU's interpreter (unwritten outputs are NaN there, so an element nothing wrote
fails; the interpreter feeds P to the P V wgmma through shared memory and adds P V to O outside the MMA, see the
module docstring), at head dim 64 with 64-key blocks on 16-key pages (the kernel's least block; one interpreted
call takes a few seconds). `-m gpu` runs it compiled at the 27B attention shape (24 query heads, 4 KV heads, head
dim 256, page 64); the CPU lowers it for sm_90 (layout inference and the Mosaic GPU dialect lowering) at that shape."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import attention as at
from pallas_kernels import attention_mgpu as am
from pallas_kernels import kv_quant as kq
from tests.test_attention import BIG, bits, filled_pool, np_prompt, prompt_case, rel_err

GPU = pytest.mark.gpu
# An interpreted kernel stalled once (under another process's load; not reproduced in 10 runs since): fail, don't
# hang the suite. The first compile of a gpu test takes well under this.
pytestmark = pytest.mark.timeout(600)

SMALL = dict(hq=4, hkv=2, d=64, page_size=16)  # GQA: two query heads a KV head
# A fresh prompt; one resumed mid-page and mid-block after a 37-key prefix; a short one (rows past 9 -> zeros).
# 200 rows: two 128-row tiles, the second one part padding.
CASE = dict(s=3, t=200, pmax=20, num_pages=70, starts=[0, 37, 5], lengths=[200, 200, 9], **SMALL)
TILES = am.PromptMgpuTiles()


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "tiles"))
def run(q, pool, table, start, lengths, *, scale, interpret=True, tiles=TILES):
    return am.prompt_mgpu(q, pool, table, start, lengths, scale=scale, interpret=interpret, tiles=tiles)


prompt_reference = jax.jit(at.prompt_reference, static_argnames="scale")


def _row_invariant_matmul(a, b, dtype):
    """a [M, K] @ b [K, N] with every element summed over k in increasing order (numpy reduces a middle axis
    one slice at a time), so a row's result never depends on its place in the tile. Products of bf16 are exact
    in fp32."""
    return (np.asarray(a, dtype)[:, :, None] * np.asarray(b, dtype)[None]).sum(axis=1, dtype=dtype)


class _NumpyWithRowInvariantMatmul:
    matmul = staticmethod(_row_invariant_matmul)

    def __getattr__(self, name):
        return getattr(np, name)


@pytest.fixture(autouse=True, scope="module")
def row_invariant_interpreter_wgmma():
    """The interpreter's wgmma is numpy's matmul, which (OpenBLAS) rounds a row differently at different rows of
    the tile: a row moved from row 63 of a warpgroup's tile to row 50 (a chunk cut) came out 1 ulp off in float32.
    The wgmma rounds a row the same wherever it sits (a fixed datapath for every element; the gpu tests below
    check the kernel's rows there), so the interpreter gets a fixed-order sum instead, and the CPU tests see the
    kernel's own row independence. Fails, rather than skips, if a jax upgrade moves the interpreter. Module-scoped,
    so the module's shared calls (`bf16_whole`) run under it too."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    assert gpu_callbacks.np is np, "jax's GPU interpreter no longer calls numpy as expected"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu_callbacks, "np", _NumpyWithRowInvariantMatmul())
        yield


@pytest.fixture(scope="module")
def bf16_whole():
    """CASE over a bf16 pool and the kernel's output for it: the whole call that the reference, chunk-cut, poison
    and routing tests compare against (one interpreted call of ~3 s, made once for them)."""
    case = prompt_case(np.random.default_rng(40), dtype=jnp.bfloat16, **CASE)
    return case, run(*case, scale=SMALL["d"] ** -0.5)


def test_matches_reference_and_float64(bf16_whole):
    case, got = bf16_whole
    scale = SMALL["d"] ** -0.5
    want = np_prompt(*case, scale)
    ref = prompt_reference(*case, scale=scale)
    assert rel_err(got, want) < 1e-2
    assert rel_err(ref, want) < 1e-2
    assert rel_err(got, np.asarray(ref.astype(jnp.float32), np.float64)) < 1e-2
    assert not np.asarray(got[2, 9:].astype(jnp.float32)).any()


def test_row_bits_ignore_chunk_cuts_tiles_and_streams(bf16_whole):
    (q, pool, table, start, lengths), whole = bf16_whole
    scale = SMALL["d"] ** -0.5
    # Stream 1 (rows at 37..236) resumed in chunks cut off the tile, block and page grids: rows [0, 13), [13, 150),
    # [150, 200), each a call of its own with other streams beside it and padded rows (the whole call's shapes, so
    # its program; stream 0 holds stream 2's queries and, like stream 2, 9 rows, so the streams beside are short).
    pieces = []
    for a, b in ((0, 13), (13, 150), (150, 200)):
        qc = jnp.zeros_like(q).at[1, : b - a].set(q[1, a:b]).at[0].set(q[2])
        out = run(qc, pool, table, start.at[1].add(a), lengths.at[1].set(b - a).at[0].set(lengths[2]), scale=scale)
        pieces.append(out[1, : b - a])
    assert np.array_equal(bits(jnp.concatenate(pieces)), bits(whole[1]))
    # Alone in its call: the same bits.
    alone = run(q[1:2], pool, table[1:2], start[1:2], lengths[1:2], scale=scale)
    assert np.array_equal(bits(alone[0]), bits(whole[1]))
    # One compute warpgroup a CTA (64-row tiles), or more K/V stages in flight: launch choices, the same bits.
    for tiles in (am.PromptMgpuTiles(block_q=64), am.PromptMgpuTiles(stages=3), am.PromptMgpuTiles(stages=1)):
        assert np.array_equal(bits(run(q, pool, table, start, lengths, scale=scale, tiles=tiles)), bits(whole))


def test_resumed_after_a_long_prefix_and_128_key_blocks():
    """A chunk of 70 rows after 300 cached keys (5 key blocks wholly before the first row, then the diagonal) is
    the tail of one 370-row pass, bit for bit; 128-key blocks (another order) are right too."""
    rng = np.random.default_rng(42)
    q, pool, table, _, _ = prompt_case(rng, dtype=jnp.bfloat16, s=1, t=370, pmax=24, num_pages=30,
                                       starts=[0], lengths=[370], **SMALL)
    scale = SMALL["d"] ** -0.5
    one = jnp.asarray([0], jnp.int32)
    whole = run(q, pool, table, one * 0, one * 370, scale=scale)
    assert rel_err(whole, np_prompt(q, pool, table, one * 0, one * 370, scale)) < 1e-2
    tail = run(q[:, 300:], pool, table, one * 300, one * 70, scale=scale)
    assert np.array_equal(bits(tail[0]), bits(whole[0, 300:]))
    wide = run(q, pool, table, one * 0, one * 370, scale=scale, tiles=am.PromptMgpuTiles(block_k=128))
    assert rel_err(wide, np_prompt(q, pool, table, one * 0, one * 370, scale)) < 1e-2


@pytest.mark.parametrize("tiles", [TILES, am.PromptMgpuTiles(block_q=64, stages=1)], ids=str)
def test_pipeline_has_no_races(tiles):
    """The interpreter's happens-before race detector over the barriers (K/V slots handed between the memory and
    compute warpgroups, the ping-pong, Q's tile reused for O): no race, right values."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    rng = np.random.default_rng(47)
    case = prompt_case(rng, dtype=jnp.bfloat16, **dict(CASE, s=2, starts=[0, 137], lengths=[200, 100]))
    scale = SMALL["d"] ** -0.5
    got = am.prompt_mgpu(*case, scale=scale, tiles=tiles, interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not gpu_callbacks.get_races().races_found
    assert rel_err(got, np_prompt(*case, scale)) < 1e-2


def test_poison_outside_the_rows_and_the_table_never_leaks(bf16_whole):
    """NaN queries in rows past a stream's length and NaN keys in pages no table holds (page 0, the dummy page
    that pads the table to whole key blocks, excepted: masked keys there meet P = 0) change no real row and leave
    the padded rows zero."""
    (q, pool, table, start, lengths), clean = bf16_whole
    scale = SMALL["d"] ** -0.5
    unused = np.setdiff1d(np.arange(1, pool.num_pages), np.asarray(table).ravel())
    poison = lambda x: x.at[:, unused].set(jnp.nan)
    dirty_pool = kq.KVPool(poison(pool.k), poison(pool.v))
    dirty_q = q.at[2, 9:].set(jnp.nan)
    dirty = run(dirty_q, dirty_pool, table, start, lengths, scale=scale)
    assert np.array_equal(bits(dirty), bits(clean))


def dequantized_pool(pool: kq.KVPool) -> kq.KVPool:
    """An fp8 pool's values as a bf16 pool, by numpy: the code widened to float32, times its key's scale, rounded
    once to bf16 (ml_dtypes rounds to nearest even)."""
    def one(codes, scale):
        return jnp.asarray((np.asarray(codes).astype(np.float32) * np.asarray(scale)[..., None]).astype(jnp.bfloat16))
    return kq.KVPool(one(pool.k, pool.k_scale), one(pool.v, pool.v_scale))


def test_fp8_pool_runs_the_bf16_kernel_over_its_dequantized_values():
    """An fp8 pool's call is, bit for bit, the call over a bf16 pool holding bf16(code x scale) computed by numpy;
    right against float64 over the fp8 pool's exact values; a stream cut into two chunks off every grid gives the
    same bits; attention.prompt(impl="mgpu") routes fp8 pools here (checked on the first chunk's call)."""
    rng = np.random.default_rng(48)
    q, pool, table, start, lengths = prompt_case(rng, dtype=kq.FP8, **CASE)
    scale = SMALL["d"] ** -0.5
    got = run(q, pool, table, start, lengths, scale=scale)
    assert np.array_equal(bits(got), bits(run(q, dequantized_pool(pool), table, start, lengths, scale=scale)))
    assert rel_err(got, np_prompt(q, pool, table, start, lengths, scale)) < 1e-2
    head = run(q[1:2, :77], pool, table[1:2], start[1:2], jnp.asarray([77], jnp.int32), scale=scale)
    tail = run(q[1:2, 77:], pool, table[1:2], start[1:2] + 77, jnp.asarray([123], jnp.int32), scale=scale)
    assert np.array_equal(bits(jnp.concatenate([head[0], tail[0]])), bits(got[1]))
    routed = at.prompt(q[1:2, :77], pool, table[1:2], start[1:2], jnp.asarray([77], jnp.int32), scale=scale,
                       interpret=True, tiles=at.PromptTiles(impl="mgpu"))
    assert np.array_equal(bits(routed), bits(head))


def test_fp8_pool_with_v_keys_major_copies_the_same_rows():
    """An fp8 pool holding v key-major (`KVPool.v_layout` "keys") reaches the kernel as the same dequantized rows,
    bit for bit, so the call's bits are the row layout's."""
    rng = np.random.default_rng(49)
    _, pool, table, _, _ = prompt_case(rng, dtype=kq.FP8, **CASE)
    rows = am.dequantized_keys(pool, table)
    moved = am.dequantized_keys(kq.with_v_layout(pool, "keys"), table)
    for a, b in zip(rows, moved):
        assert a.shape == b.shape and np.array_equal(bits(a), bits(b))


def test_prompt_routes_bf16_and_fp8_to_mgpu_and_fp32_to_triton(bf16_whole):
    case, whole = bf16_whole
    scale = SMALL["d"] ** -0.5
    routed = at.prompt(*case, scale=scale, interpret=True, tiles=at.PromptTiles(impl="mgpu"))
    assert np.array_equal(bits(routed), bits(whole))
    wide = prompt_case(np.random.default_rng(45), dtype=jnp.float32, **dict(CASE, t=40, lengths=[40, 40, 9]))
    tiles = at.PromptTiles(block_q=16, block_k=16)
    assert np.array_equal(bits(at.prompt(*wide, scale=scale, interpret=True,
                                         tiles=dataclasses.replace(tiles, impl="mgpu"))),
                          bits(at.prompt(*wide, scale=scale, interpret=True, tiles=tiles)))
    with pytest.raises(ValueError, match="impl"):
        at.prompt(*case, scale=scale, interpret=True, tiles=at.PromptTiles(impl="cuda"))


def test_rejects_bad_inputs():
    rng = np.random.default_rng(46)
    q, pool, table, st, ln = prompt_case(rng, s=2, t=8, pmax=4, num_pages=10, dtype=jnp.bfloat16, starts=[0, 0],
                                         lengths=[8, 8], **SMALL)
    call = functools.partial(am.prompt_mgpu, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="start and lengths"):
        call(q, pool, table, st[:1], ln)
    with pytest.raises(ValueError, match="page_table"):
        call(q, pool, table[0], st, ln)
    with pytest.raises(ValueError, match="head dim"):
        call(q[..., :32], pool, table, st, ln)
    with pytest.raises(ValueError, match="bf16"):
        call(q, filled_pool(rng, 2, 10, 16, 64, jnp.float32), table, st, ln)
    with pytest.raises(ValueError, match="bf16"):
        call(q.astype(jnp.float32), pool, table, st, ln)
    with pytest.raises(ValueError, match="multiple"):
        call(q[:, :, :3], pool, table, st, ln)
    with pytest.raises(ValueError, match="block_k"):
        call(q, pool, table, st, ln, tiles=am.PromptMgpuTiles(block_k=32))
    with pytest.raises(ValueError, match="block_q"):
        call(q, pool, table, st, ln, tiles=am.PromptMgpuTiles(block_q=256))
    with pytest.raises(ValueError, match="shared memory"):
        small_pool = filled_pool(rng, 2, 10, 16, 256, jnp.bfloat16)
        call(jnp.zeros((2, 8, 4, 256), jnp.bfloat16), small_pool, table, st, ln, tiles=am.PromptMgpuTiles(stages=3))


# ---------------------------------------------------------------------------------------------------------------
# 27B shape: lowered for sm_90 on the CPU; compiled on the H200 (-m gpu)
# ---------------------------------------------------------------------------------------------------------------

GPU_TILES = (am.PromptMgpuTiles(), am.PromptMgpuTiles(block_q=64, stages=3), am.PromptMgpuTiles(block_k=128,
                                                                                                 stages=1))


@pytest.mark.parametrize("tiles", GPU_TILES, ids=str)
def test_lowers_for_sm90_at_27b_shape(tiles):
    """jax's lowering of the kernel for CUDA on this CPU: Mosaic GPU's layout inference and dialect lowering for
    sm_90 run here (shape and layout errors fail now); ptxas (registers, spills) only on the device."""
    sds = jax.ShapeDtypeStruct
    pool = kq.KVPool(sds((4, 600, 64, 256), jnp.bfloat16), sds((4, 600, 64, 256), jnp.bfloat16))
    fn = functools.partial(am.prompt_mgpu, scale=1 / 16, tiles=tiles)
    args = (sds((1, 4096, 24, 256), jnp.bfloat16), pool, sds((1, 576), jnp.int32), sds((1,), jnp.int32),
            sds((1,), jnp.int32))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1


@GPU
@pytest.mark.parametrize("tiles", GPU_TILES, ids=str)
def test_gpu_27b(tiles):
    """512 rows after 700 cached keys beside a 300-row fresh prompt: right against float64; cut into chunks at
    row 200 (off every grid), the same bits; the launch variants (64-row CTAs, 3 stages) the default's bits."""
    rng = np.random.default_rng(50)
    q, pool, table, _, _ = prompt_case(rng, s=2, t=512, pmax=24, num_pages=100, dtype=jnp.bfloat16, starts=[0, 0],
                                       lengths=[512, 512], **BIG)
    scale = 1 / 16
    start, lengths = jnp.asarray([700, 0], jnp.int32), jnp.asarray([512, 300], jnp.int32)
    got = run(q, pool, table, start, lengths, scale=scale, interpret=False, tiles=tiles)
    assert rel_err(got, np_prompt(q, pool, table, start, lengths, scale)) < 1e-2
    assert not np.asarray(got[1, 300:].astype(jnp.float32)).any()
    first = run(q[:1, :256], pool, table[:1], start[:1], jnp.asarray([200], jnp.int32), scale=scale,
                interpret=False, tiles=tiles)
    rest = jnp.zeros_like(q[:1]).at[0, :312].set(q[0, 200:])
    second = run(rest, pool, table[:1], start[:1] + 200, jnp.asarray([312], jnp.int32), scale=scale,
                 interpret=False, tiles=tiles)
    assert np.array_equal(bits(jnp.concatenate([first[0, :200], second[0, :312]])), bits(got[0]))
    if tiles.block_k == TILES.block_k:
        default = run(q, pool, table, start, lengths, scale=scale, interpret=False, tiles=TILES)
        assert np.array_equal(bits(got), bits(default))


@GPU
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("prefix", [0, 2048])
def test_gpu_27b_4k_chunk(prefix, kv):
    """The bench's chunk: 4096 rows after 0 or 2048 cached keys, against prompt_reference (fp32 over the pool's
    exact values, on the device); the same rows as chunks of 1000 and 3096 give the same bits;
    attention.prompt(impl="mgpu") is this kernel. fp8: bit for bit the kernel over the numpy-dequantized bf16 pool
    too (so the device's dequantizing gather rounds as numpy does)."""
    rng = np.random.default_rng(51 if kv == "bf16" else 52)
    t = 4096
    pages = (prefix + t) // 64
    q, pool, table, _, _ = prompt_case(rng, s=1, t=t, pmax=pages, num_pages=pages + 1,
                                       dtype=jnp.bfloat16 if kv == "bf16" else kq.FP8, starts=[0], lengths=[t], **BIG)
    scale = 1 / 16
    start, lengths = jnp.asarray([prefix], jnp.int32), jnp.asarray([t], jnp.int32)
    got = run(q, pool, table, start, lengths, scale=scale, interpret=False)
    ref = prompt_reference(q, pool, table, start, lengths, scale=scale)
    assert rel_err(got, np.asarray(ref.astype(jnp.float32), np.float64)) < 1e-2
    head = run(q[:, :1000], pool, table, start, jnp.asarray([1000], jnp.int32), scale=scale, interpret=False)
    tail = run(q[:, 1000:], pool, table, start + 1000, jnp.asarray([t - 1000], jnp.int32), scale=scale,
               interpret=False)
    assert np.array_equal(bits(jnp.concatenate([head[0], tail[0]])), bits(got[0]))
    routed = at.prompt(q, pool, table, start, lengths, scale=scale, tiles=at.PromptTiles(impl="mgpu"))
    assert np.array_equal(bits(routed), bits(got))
    if kv == "fp8":
        bf16 = run(q, dequantized_pool(pool), table, start, lengths, scale=scale, interpret=False)
        assert np.array_equal(bits(got), bits(bf16))
