"""Row norms (pallas_kernels/rownorm.py): accuracy against the jnp references and a float64 numpy oracle, and the
property they exist for, bit for bit: a row's output never depends on how many rows share the call or where the
row sits among them.

CPU tests run the kernels in interpret mode (whose outputs start NaN-filled, so an element a kernel never writes
shows as NaN), and cross-lower them for an H200 to check that the Triton program is the same for every row count.
The `gpu` tests run the accuracy and invariance checks compiled on the device at the 27B's widths."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import calls, rownorm

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
EPS = 1e-6
OPS = ("rms", "gated", "l2")
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs the GPU backend (run with -m gpu on the device)")

# Error bounds against the float64 value of the same math, in units of the output dtype's spacing at the exact
# value. fp32 outputs: the sum of squares of up to 5120 positive terms in a chunked tree, halved by the rsqrt, plus
# the rsqrt and two or three multiplies (and silu's exp and division for the gated norm) stay within 8 ulps; the
# model's jnp forms meet the same bound. bf16 outputs of a single final rounding: half a spacing, plus the fp32
# error before it (8 fp32 ulps = 2^-13 bf16 spacings) -> 0.5 + 2^-12.
F32_ULPS = 8.0
BF16_ROUNDED_ULPS = 0.5 + 2.0**-12
# The bf16 gated norm rounds three times (the normalised row, its product with the weight, the output), each
# within the bf16 unit roundoff 2^-8 relative, plus the fp32 work: relative error within 3 * 2^-8 + 2^-12.
BF16_GATED_REL = 3 * 2.0**-8 + 2.0**-12


def _case(rng, lead: tuple[int, ...], d: int, dtype):
    x = jnp.asarray(rng.standard_normal((*lead, d)) * 3.0, dtype)
    gate = jnp.asarray(rng.standard_normal((*lead, d)) * 2.0, dtype)
    weight = jnp.asarray(1.0 + 0.3 * rng.standard_normal(d), jnp.float32)
    return x, gate, weight


@functools.cache
def _kernel(op: str, tiles: rownorm.RowTiles | None = None):
    kw = dict(tiles=tiles, interpret=INTERPRET)
    fns = {
        "rms": lambda x, gate, weight: rownorm.rms_norm(x, weight, EPS, **kw),
        "gated": lambda x, gate, weight: rownorm.gated_rms_norm(x, gate, weight, EPS, **kw),
        "l2": lambda x, gate, weight: rownorm.l2norm(x, EPS, **kw),
    }
    return jax.jit(fns[op])


@functools.cache
def _reference(op: str):
    fns = {
        "rms": lambda x, gate, weight: rownorm.rms_norm_reference(x, weight, EPS),
        "gated": lambda x, gate, weight: rownorm.gated_rms_norm_reference(x, gate, weight, EPS),
        "l2": lambda x, gate, weight: rownorm.l2norm_reference(x, EPS),
    }
    return jax.jit(fns[op])


def _exact(op: str, x, gate, weight) -> np.ndarray:
    """The same math in float64 from the same (rounded) inputs, without intermediate roundings. The gated norm
    scales by the weight in x's dtype, so its weight is rounded to that dtype first, as the model does."""
    if op == "gated":
        weight = weight.astype(x.dtype)
    x64, g64, w64 = (np.asarray(a, np.float64) for a in (x, gate, weight))
    if op == "l2":
        return x64 / np.sqrt((x64 * x64).sum(-1, keepdims=True) + EPS)
    normed = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS)
    if op == "rms":
        return normed * w64
    return normed * w64 * (g64 / (1.0 + np.exp(-g64)))


def _spacings(got, exact: np.ndarray) -> float:
    """Largest |got - exact| in units of got's dtype spacing at |exact|."""
    dtype = ml_dtypes.bfloat16 if got.dtype == jnp.bfloat16 else np.float32
    got = np.asarray(got, np.float64)
    assert not np.isnan(got).any(), "NaN in output: an element was never written or a row leaked into another"
    spacing = np.spacing(np.abs(exact).astype(dtype)).astype(np.float64)
    return float(np.max(np.abs(got - exact) / spacing))


def _check_accuracy(op: str, x, gate, weight, out) -> None:
    exact = _exact(op, x, gate, weight)
    if op == "gated" and out.dtype == jnp.bfloat16:
        got = np.asarray(out, np.float64)
        assert not np.isnan(got).any()
        assert np.all(np.abs(got - exact) <= BF16_GATED_REL * np.abs(exact) + 1e-30)
    elif out.dtype == jnp.bfloat16:
        assert _spacings(out, exact) <= BF16_ROUNDED_ULPS
    else:
        assert _spacings(out, exact) <= F32_ULPS


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _assert_same_bits(a, b, what: str) -> None:
    a, b = _bits(a), _bits(b)
    assert a.shape == b.shape, what
    bad = np.argwhere(a != b)
    assert bad.size == 0, f"{what}: {len(bad)} elements differ, first at {bad[0].tolist()}"


def _check_row_invariance(op: str, d: int, dtype, counts, tiles: rownorm.RowTiles | None = None, seed: int = 0,
                          alone_rows: int | None = None, fn=None) -> None:
    """Rows among `max(counts)` rows == the same rows among fewer (every prefix count in `counts`) == each row alone
    == the rows in reversed order, all bit for bit. fn: the function under test (default: the kernel for op)."""
    rng = np.random.default_rng(seed + d)
    n = max(counts)
    x, gate, weight = _case(rng, (n,), d, dtype)
    f = _kernel(op, tiles) if fn is None else fn
    full = f(x, gate, weight)
    _check_accuracy(op, x, gate, weight, full)
    for count in counts:
        _assert_same_bits(f(x[:count], gate[:count], weight), full[:count], f"first {count} of {n} rows")
    for i in range(n if alone_rows is None else alone_rows):
        _assert_same_bits(f(x[i:i + 1], gate[i:i + 1], weight), full[i:i + 1], f"row {i} alone")
    rev = slice(None, None, -1)
    _assert_same_bits(f(x[rev], gate[rev], weight), full[rev], "rows reversed")


# ------------------------------------------------------------------------------------------------------------
# CPU (interpret mode)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("d", [8, 96, 128, 256, 5120])
@pytest.mark.parametrize("op", OPS)
def test_accuracy_against_reference_and_float64(op, d, dtype):
    rng = np.random.default_rng(d)
    x, gate, weight = _case(rng, (3, 5), d, dtype)
    out = _kernel(op)(x, gate, weight)
    ref = _reference(op)(x, gate, weight)
    assert out.shape == x.shape and out.dtype == ref.dtype
    _check_accuracy(op, x, gate, weight, out)
    _check_accuracy(op, x, gate, weight, ref)  # the bounds are ones the model's own jnp forms meet


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("d", [96, 128, 256])
@pytest.mark.parametrize("op", OPS)
def test_row_invariance(op, d, dtype):
    _check_row_invariance(op, d, dtype, counts=[1, 2, 3, 16, 17, 33, 64])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("op", OPS)
def test_row_invariance_hidden_width(op, dtype):
    _check_row_invariance(op, 5120, dtype, counts=[1, 2, 3, 7, 16, 17], alone_rows=4)


def test_invariance_check_catches_xla_row_reductions():
    """The invariance check is not vacuous, and the kernels answer a real effect: applied to the jnp form of GDN's
    l2norm (the model's reference path) at head width 128, XLA:CPU (jax 0.11.2) gives some rows other bits among
    64 rows than among fewer or alone, because it picks its row-reduction code from the whole array's shape. Should a
    later XLA make this form invariant on the CPU, this test fails and should go."""
    with pytest.raises(AssertionError, match="differ"):
        _check_row_invariance("l2", 128, jnp.float32, counts=[1, 2, 3, 7, 8, 16, 17, 64], fn=_reference("l2"))


@pytest.mark.parametrize("tiles", [rownorm.RowTiles(1, 32), rownorm.RowTiles(4, 64), rownorm.RowTiles(64, 128),
                                   rownorm.RowTiles(8, 8, num_warps=1)], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_other_tiles(op, tiles):
    _check_row_invariance(op, 128, jnp.bfloat16, counts=[1, 3, 9, 40], tiles=tiles, alone_rows=9)


@pytest.mark.parametrize("op", OPS)
def test_model_shapes_stream_alone_vs_among_16(op):
    """The model's layouts [S, T, heads, D]: stream 0 of a 1-stream call == stream 0 of a 16-stream call, for
    decode (T=1) and a few rows (T=3), at GDN's head width 128."""
    rng = np.random.default_rng(7)
    for t in (1, 3):
        x, gate, weight = _case(rng, (16, t, 6, 128), 128, jnp.bfloat16)
        f = _kernel(op)
        _assert_same_bits(f(x[:1], gate[:1], weight), f(x, gate, weight)[:1], f"stream 0, T={t}")


@pytest.mark.parametrize("op", OPS)
def test_nan_and_zero_rows_stay_in_their_row(op):
    rng = np.random.default_rng(3)
    x, gate, weight = _case(rng, (9,), 128, jnp.float32)
    x = x.at[2, 5].set(jnp.nan).at[6].set(0.0)
    out = np.asarray(_kernel(op)(x, gate, weight))
    assert np.isnan(out[2]).all()
    assert not np.isnan(np.delete(out, 2, axis=0)).any()
    assert not out[6].any()  # an all-zero row normalises to zeros (rsqrt(eps) is finite)
    ref = np.asarray(_reference(op)(x, gate, weight))
    assert np.array_equal(np.isnan(out), np.isnan(ref))


def test_one_dimensional_and_empty_inputs():
    rng = np.random.default_rng(4)
    x, gate, weight = _case(rng, (), 256, jnp.bfloat16)
    for op in OPS:
        out = _kernel(op)(x, gate, weight)
        assert out.shape == (256,)
        _assert_same_bits(out, _kernel(op)(x[None], gate[None], weight)[0], f"{op}: 1-D input")
    empty = jnp.zeros((0, 3, 128), jnp.bfloat16)
    assert rownorm.rms_norm(empty, weight[:128], EPS).shape == (0, 3, 128)
    assert rownorm.l2norm(empty).dtype == jnp.float32


def test_rejects_bad_arguments():
    x = jnp.zeros((4, 128), jnp.bfloat16)
    w = jnp.ones((128,), jnp.float32)
    with pytest.raises(ValueError, match="weight must have shape"):
        rownorm.rms_norm(x, w[:64], EPS, interpret=True)
    with pytest.raises(ValueError, match="gate must have"):
        rownorm.gated_rms_norm(x, x[:2], w, EPS, interpret=True)
    with pytest.raises(ValueError, match="floating point"):
        rownorm.l2norm(jnp.zeros((4, 128), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        rownorm.l2norm(x, tiles=rownorm.RowTiles(3, 128), interpret=True)
    with pytest.raises(ValueError, match="must divide"):
        rownorm.l2norm(x, tiles=rownorm.RowTiles(4, 256), interpret=True)


def test_default_tiles_depend_on_width_only():
    assert rownorm.tiles_for(128) == rownorm.RowTiles(block_rows=32, chunk=128, num_warps=4)
    assert rownorm.tiles_for(256) == rownorm.RowTiles(block_rows=16, chunk=256, num_warps=4)
    assert rownorm.tiles_for(5120) == rownorm.RowTiles(block_rows=1, chunk=1024, num_warps=8)
    for d in (1, 6, 96, 100, 128, 640, 5120, 8192):
        tiles = rownorm.tiles_for(d)
        assert d % tiles.chunk == 0 and tiles.chunk & (tiles.chunk - 1) == 0
        assert tiles.block_rows & (tiles.block_rows - 1) == 0


def _triton_programs(monkeypatch, fn, *avals) -> tuple[list[str], list[str]]:
    """Cross-lowers fn for an H200 on this machine -> (each Triton kernel's module text after canonicalize + cse,
    each Triton custom call's launch attributes)."""
    registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    from jax._src.lib.mlir import ir, passmanager

    monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    def canonical(module):
        with module.context:
            copy = ir.Module.parse(module.operation.get_asm(enable_debug_info=False))
            passmanager.PassManager.parse("builtin.module(canonicalize,cse)").run(copy.operation)
            return copy.operation.get_asm(enable_debug_info=False)

    with calls.triton_modules(canonical) as programs:
        text = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    launches = re.findall(r"@__gpu\$xla\.gpu\.triton\(.*?grid_x = (\d+)", text)
    return programs, launches


@pytest.mark.parametrize("op,width,heads", [("rms", 5120, None), ("rms", 256, 24), ("l2", 128, 16),
                                            ("gated", 128, 48)])
def test_triton_program_is_the_same_for_every_row_count(monkeypatch, op, width, heads):
    """The compiled kernel cannot treat a row differently for another row count if it is the same program: the
    Triton module a call lowers to (canonicalized) is identical for 1, 3, 16 and 4096 streams' rows, only the grid
    differs. The row count reaches the kernel at run time."""
    sds = jax.ShapeDtypeStruct
    fns = {
        "rms": lambda x, g, w: rownorm.rms_norm(x, w, EPS),
        "gated": lambda x, g, w: rownorm.gated_rms_norm(x, g, w, EPS),
        "l2": lambda x, g, w: rownorm.l2norm(x),
    }
    seen = {}
    for streams in (1, 3, 16, 4096):
        shape = (streams, 1, width) if heads is None else (streams, 1, heads, width)
        avals = (sds(shape, jnp.bfloat16), sds(shape, jnp.bfloat16), sds((width,), jnp.float32))
        programs, launches = _triton_programs(monkeypatch, fns[op], *avals)
        assert len(programs) == 1 and len(launches) == 1
        tiles = rownorm.tiles_for(width)
        assert int(launches[0]) == max(2, -(-(streams * (heads or 1)) // tiles.block_rows))
        seen[streams] = programs[0]
    assert all(p == seen[1] for p in seen.values())


# ------------------------------------------------------------------------------------------------------------
# GPU: compiled, at the 27B's widths
# ------------------------------------------------------------------------------------------------------------


def _poison_allocator(shape, dtype):
    """Best effort on the GPU: leave a freed NaN block of the output's size for the allocator to hand out next,
    so an element the kernel never writes is likely to read NaN."""
    jax.block_until_ready(jnp.full(shape, jnp.nan, dtype)).delete()


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("op,d", [("rms", 5120), ("rms", 256), ("l2", 128), ("gated", 128)])
def test_gpu_accuracy_27b_widths(op, d, dtype):
    rng = np.random.default_rng(d + 1)
    x, gate, weight = _case(rng, (16, 3, 4), d, dtype)
    _poison_allocator(x.shape, jnp.float32 if op == "l2" else dtype)
    out = _kernel(op)(x, gate, weight)
    _check_accuracy(op, x, gate, weight, out)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("op,d", [("rms", 5120), ("rms", 256), ("l2", 128), ("gated", 128)])
def test_gpu_row_invariance_27b_widths(op, d, dtype):
    """Every prefix count 1..64 (ragged ones included), every row alone and the rows reversed, bit for bit, on
    the device: the row's position in its block of rows must not matter either."""
    _check_row_invariance(op, d, dtype, counts=range(1, 65))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("op,heads,d", [("rms", None, 5120), ("rms", 24, 256), ("rms", 4, 256), ("l2", 16, 128),
                                        ("gated", 48, 128)])
def test_gpu_model_shapes_stream_alone_vs_among_16(op, heads, d):
    """The 27B's call layouts: stream 0 of [1, T, (heads,) D] == stream 0 of [16, T, (heads,) D] for decode (T=1),
    a verify window (T=16) and a prompt chunk (T=512), bf16."""
    rng = np.random.default_rng(11)
    f = _kernel(op)
    for t in (1, 16, 512):
        lead = (16, t) if heads is None else (16, t, heads)
        x, gate, weight = _case(rng, lead, d, jnp.bfloat16)
        _assert_same_bits(f(x[:1], gate[:1], weight), f(x, gate, weight)[:1], f"stream 0, T={t}")



@pytest.mark.parametrize("op", ["rms", "gated"])
def test_out_rows_pad_with_zero_rows(op):
    """out_rows: the rows of the plain call, bit for bit, flattened, then zero rows up to out_rows (what the decode
    qmm would pad them with); fewer rows than x has is refused."""
    _check_out_rows(op, 256)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("op", ["rms", "gated"])
@pytest.mark.parametrize("d", [5120, 128])
def test_gpu_out_rows_pad_with_zero_rows(op, d):
    _check_out_rows(op, d)


def _check_out_rows(op: str, d: int):
    rng = np.random.default_rng(5)
    x, gate, weight = _case(rng, (3, 2), d, jnp.bfloat16)
    fns = {"rms": lambda r: rownorm.rms_norm(x, weight, EPS, interpret=INTERPRET, out_rows=r),
           "gated": lambda r: rownorm.gated_rms_norm(x, gate, weight, EPS, interpret=INTERPRET, out_rows=r)}
    plain = np.asarray(_kernel(op)(x, gate, weight)).reshape(6, d)
    for r in (6, 16, 40):
        out = np.asarray(fns[op](r))
        assert out.shape == (r, d)
        _assert_same_bits(out[:6], plain, f"{op}: out_rows={r}")
        assert not out[6:].any()
    with pytest.raises(ValueError, match="out_rows=5"):
        fns[op](5)
