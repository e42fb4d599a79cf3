"""KV pool write: the quantize-on-write kernel against a numpy e4m3 quantizer (bit for bit), the jnp reference,
and the slots it must leave alone. CPU tests run the kernel in interpret mode; `-m gpu` runs it compiled."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import kv_quant as kq


# the pool layouts: bf16, fp8, fp8 with V key-major
LAYOUTS = pytest.mark.parametrize("dtype,v_layout", [(jnp.bfloat16, "rows"), (kq.FP8, "rows"), (kq.FP8, "keys")],
                                  ids=["bf16", "fp8", "fp8-vkeys"])


def numpy_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The e4m3 quantizer written out in numpy: scale = amax / 448 in fp32, codes = x / scale rounded to nearest
    even by ml_dtypes; an all-zero row gets scale 0 and zero codes."""
    x = x.astype(np.float32)
    scale = (np.max(np.abs(x), axis=-1) / np.float32(448.0)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    codes = np.where(scale[..., None] > 0, x / safe[..., None], np.float32(0.0)).astype(ml_dtypes.float8_e4m3fn)
    return codes, scale


def random_pool(rng, hkv, num_pages, page_size, d, dtype) -> kq.KVPool:
    """A pool full of random bits (never zeros), so a slot the write must not touch is recognisable."""
    shape = (hkv, num_pages, page_size, d)
    if jnp.dtype(dtype) == jnp.dtype(kq.FP8):
        codes = [jnp.asarray(numpy_quantize(rng.standard_normal(shape))[0]) for _ in range(2)]
        scales = [jnp.asarray(rng.random(shape[:3], np.float32) + 0.5) for _ in range(2)]
        return kq.KVPool(*codes, *scales)
    return kq.KVPool(*(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2)))


def write_case(rng, *, s, t, hkv, d, num_pages, page_size, pmax):
    """Rows for s streams at scattered, non-aligned positions; pages handed out out of order, page 0 never."""
    pages = rng.permutation(np.arange(1, num_pages))[: s * pmax].reshape(s, pmax)
    start = rng.integers(0, pmax * page_size - t, size=s)
    positions = start[:, None] + np.arange(t)[None, :]
    valid = rng.random((s, t)) < 0.8
    positions[0, -1] = pmax * page_size + 3  # outside the page table: must be dropped, not wrapped
    scale = rng.uniform(0.1, 30.0, size=(s, t, hkv, 1))  # rows of very different magnitudes
    k_new = jnp.asarray(rng.standard_normal((s, t, hkv, d)) * scale, jnp.bfloat16)
    v_new = jnp.asarray(rng.standard_normal((s, t, hkv, d)) * scale, jnp.bfloat16)
    k_new = k_new.at[0, 0, 0].set(0)  # an all-zero row: scale 0, zero codes
    return k_new, v_new, jnp.asarray(pages, jnp.int32), jnp.asarray(positions, jnp.int32), jnp.asarray(valid)


def expected_pool(pool: kq.KVPool, k_new, v_new, page_table, positions, valid) -> dict[str, np.ndarray]:
    """The pool after the write, built slot by slot in numpy."""
    out = {"k": np.array(pool.k), "v": np.array(pool.v)}
    if pool.fp8:
        out["k_scale"], out["v_scale"] = np.array(pool.k_scale), np.array(pool.v_scale)
    ps = pool.page_size
    pt, pos, ok = np.asarray(page_table), np.asarray(positions), np.asarray(valid)
    for name, rows in (("k", np.asarray(k_new.astype(jnp.float32))), ("v", np.asarray(v_new.astype(jnp.float32)))):
        for si in range(pos.shape[0]):
            for ti in range(pos.shape[1]):
                p = pos[si, ti]
                if not ok[si, ti] or p < 0 or p // ps >= pt.shape[1]:
                    continue
                page, row = pt[si, p // ps], p % ps
                if pool.fp8:
                    codes, scale = numpy_quantize(rows[si, ti])
                    out[name][:, page, row] = codes
                    out[f"{name}_scale"][:, page, row] = scale
                else:
                    out[name][:, page, row] = rows[si, ti].astype(out[name].dtype)
    return out


def assert_pool_bits(got: kq.KVPool, want: dict[str, np.ndarray]) -> None:
    for name, arr in want.items():
        g = np.asarray(getattr(got, name))
        assert g.dtype == arr.dtype, name
        diff = g.view(np.uint8) != arr.view(np.uint8)
        assert not diff.any(), f"{name}: {int(diff.sum())} bytes differ"


@functools.partial(jax.jit, static_argnames="interpret")
def _write(pool, k_new, v_new, page_table, positions, valid, interpret):
    return kq.write(pool, k_new, v_new, page_table, positions, valid, interpret=interpret)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, kq.FP8], ids=["bf16", "fp8"])
def test_write_kernel_bits_equal_numpy_quantizer(dtype):
    rng = np.random.default_rng(1)
    pool = random_pool(rng, 2, 12, 8, 32, dtype)
    args = write_case(rng, s=3, t=7, hkv=2, d=32, num_pages=12, page_size=8, pmax=3)
    want = expected_pool(pool, *args)
    assert_pool_bits(_write(pool, *args, interpret=True), want)
    assert_pool_bits(kq.write_reference(pool, *args), want)


def test_write_into_a_keys_major_v_stores_the_same_bytes():
    """An fp8 pool with v key-major (`KVPool.v_layout` "keys", v [Hkv, P, D, page]): the kernel and the reference
    write the bytes the row layout holds, moved, and the layout survives the write."""
    rng = np.random.default_rng(5)
    pool = random_pool(rng, 2, 12, 8, 32, kq.FP8)
    args = write_case(rng, s=3, t=7, hkv=2, d=32, num_pages=12, page_size=8, pmax=3)
    want = expected_pool(pool, *args)
    want["v"] = np.swapaxes(want["v"], 2, 3)
    keys = kq.with_v_layout(pool, "keys")
    assert keys.v.shape == (2, 12, 32, 8) and keys.keys_major
    for got in (_write(keys, *args, interpret=True), kq.write_reference(keys, *args)):
        assert got.v_layout == "keys"
        assert_pool_bits(got, want)
    empty = kq.empty_pool(2, 5, 8, 32, kq.FP8, v_layout="keys")
    assert empty.v.shape == (2, 5, 32, 8) and empty.keys_major
    with pytest.raises(ValueError, match="fp8"):
        kq.with_v_layout(random_pool(rng, 2, 6, 8, 32, jnp.bfloat16), "keys")
    with pytest.raises(ValueError, match="v_layout"):
        kq.empty_pool(2, 5, 8, 32, kq.FP8, v_layout="cols")
    with pytest.raises(ValueError, match="v_layout"):  # a rows-shaped v that says "keys"
        kq.write(kq.KVPool(pool.k, pool.v, pool.k_scale, pool.v_scale, "keys"), *args, interpret=True)


@functools.partial(jax.jit, static_argnames=("interpret", "share"))
def _write_prefix(pool, k_new, v_new, page_table, positions, valid, prefix, interpret, share=1):
    return kq.write(pool, k_new, v_new, page_table, positions, valid, prefix, interpret=interpret, share=share)


def shared_rows(args, share: int):
    """prefix_case's args with every group of `share` streams writing the first stream's rows of the group: (the
    args as `write(share=share)` takes them, the same rows repeated for a write without share)."""
    k, v = (a[::share] for a in args[:2])
    return (k, v, *args[2:]), tuple(jnp.repeat(a, share, axis=0) for a in (k, v)) + tuple(args[2:])


def prefix_case(rng, pool, *, s, t, d, page_size):
    """A tree window's write (`attention.tree_pass`): each stream's page src's first `rows` rows go to its own page
    dst, and its rows land at positions from rows on in dst and the page after it."""
    num_pages = pool.num_pages
    pages = rng.permutation(np.arange(1, num_pages))
    src, dst, nxt = pages[:s], pages[s:2 * s], pages[2 * s:3 * s]
    keep = rng.integers(0, page_size, size=s)
    keep[0] = 0  # the committed length on a page boundary: nothing to copy
    table = np.stack([dst, nxt], axis=1)  # the window's logical pages 0 and 1
    positions = keep[:, None] + np.arange(t)[None, :]
    valid = rng.random((s, t)) < 0.8
    hkv = pool.k.shape[0]
    k_new = jnp.asarray(rng.standard_normal((s, t, hkv, d)), jnp.bfloat16)
    v_new = jnp.asarray(rng.standard_normal((s, t, hkv, d)), jnp.bfloat16)
    args = (k_new, v_new, jnp.asarray(table, jnp.int32), jnp.asarray(positions, jnp.int32), jnp.asarray(valid))
    prefix = tuple(jnp.asarray(a, jnp.int32) for a in (src, dst, keep))
    return args, prefix


def expected_prefix(pool: kq.KVPool, args, prefix, keys_major: bool) -> dict[str, np.ndarray]:
    """The pool after the copy (rows moved byte for byte) and then the write, in numpy."""
    src, dst, keep = (np.asarray(a) for a in prefix)
    rows_v = kq.KVPool(pool.k, jnp.swapaxes(pool.v, 2, 3), pool.k_scale, pool.v_scale) if keys_major else pool
    copied = {"k": np.array(rows_v.k), "v": np.array(rows_v.v)}
    if pool.fp8:
        copied["k_scale"], copied["v_scale"] = np.array(pool.k_scale), np.array(pool.v_scale)
    for name, a in copied.items():
        for i in range(len(src)):
            a[:, dst[i], :keep[i]] = a[:, src[i], :keep[i]]
    moved = kq.KVPool(*(jnp.asarray(copied[n]) for n in ("k", "v")),
                      *((jnp.asarray(copied["k_scale"]), jnp.asarray(copied["v_scale"])) if pool.fp8 else ()))
    want = expected_pool(moved, *args)
    if keys_major:
        want["v"] = np.swapaxes(want["v"], 2, 3)
    return want


@LAYOUTS
def test_write_with_prefix_copy(dtype, v_layout):
    """`write(prefix=)`: the first rows of a page copied into another in the write's launch, bytes and scales as
    stored, beside rows written from the copied rows on; every other slot untouched. Kernel and reference."""
    rng = np.random.default_rng(8)
    pool = random_pool(rng, 2, 16, 8, 32, dtype)
    if v_layout == "keys":
        pool = kq.with_v_layout(pool, "keys")
    args, prefix = prefix_case(rng, pool, s=4, t=9, d=32, page_size=8)
    want = expected_prefix(pool, args, prefix, v_layout == "keys")
    assert_pool_bits(_write_prefix(pool, *args, prefix, interpret=True), want)
    assert_pool_bits(kq.write_reference(pool, *args, prefix), want)


@LAYOUTS
def test_write_shared_rows(dtype, v_layout):
    """`write(share=)`: streams that write the rows of one k_new stream (a tree window's rows, each writing its
    ancestors through its own table) store what a write of those rows repeated stores. Kernel and reference, with
    the prefix copy as the tree pass issues them; a k_new whose streams do not match the table's is refused."""
    rng = np.random.default_rng(10)
    pool = random_pool(rng, 2, 16, 8, 32, dtype)
    if v_layout == "keys":
        pool = kq.with_v_layout(pool, "keys")
    args, prefix = prefix_case(rng, pool, s=4, t=9, d=32, page_size=8)
    shared, repeated = shared_rows(args, 2)
    want = expected_prefix(pool, repeated, prefix, v_layout == "keys")
    assert_pool_bits(_write_prefix(pool, *shared, prefix, interpret=True, share=2), want)
    assert_pool_bits(kq.write_reference(pool, *shared, prefix, share=2), want)
    for write in (functools.partial(kq.write, interpret=True), kq.write_reference):
        with pytest.raises(ValueError, match="share"):
            write(pool, *shared, prefix, share=4)


def test_quantize_reference_equals_numpy():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 256)).astype(np.float32) * rng.uniform(1e-3, 1e3, size=(64, 1)).astype(np.float32)
    x[3] = 0.0
    codes, scale = kq.quantize_reference(jnp.asarray(x))
    want_codes, want_scale = numpy_quantize(x)
    assert np.array_equal(np.asarray(codes).view(np.uint8), want_codes.view(np.uint8))
    assert np.array_equal(np.asarray(scale).view(np.uint32), want_scale.view(np.uint32))
    assert float(scale[3]) == 0.0 and not np.asarray(codes[3]).astype(np.float32).any()


def test_write_rejects_bad_shapes():
    rng = np.random.default_rng(3)
    pool = random_pool(rng, 2, 6, 8, 32, jnp.bfloat16)
    k, v, pt, pos, ok = write_case(rng, s=2, t=3, hkv=2, d=32, num_pages=6, page_size=8, pmax=2)
    with pytest.raises(ValueError, match="Hkv"):
        kq.write(pool, k[:, :, :1], v[:, :, :1], pt, pos, ok, interpret=True)
    with pytest.raises(ValueError, match="positions and valid"):
        kq.write(pool, k, v, pt, pos[:, :2], ok, interpret=True)
    with pytest.raises(ValueError, match="page_table"):
        kq.write(pool, k, v, pt[:1], pos, ok, interpret=True)


@pytest.mark.gpu
@LAYOUTS
def test_write_kernel_gpu_27b_shape(dtype, v_layout):
    rng = np.random.default_rng(4)
    pool = random_pool(rng, 4, 40, 64, 256, dtype)
    args = write_case(rng, s=4, t=37, hkv=4, d=256, num_pages=40, page_size=64, pmax=9)
    want = expected_pool(pool, *args)
    if v_layout == "keys":
        pool = kq.with_v_layout(pool, "keys")
        want["v"] = np.swapaxes(want["v"], 2, 3)
    assert_pool_bits(_write(pool, *args, interpret=False), want)


@pytest.mark.gpu
@LAYOUTS
@pytest.mark.parametrize("share", [1, 16])
def test_write_with_prefix_copy_gpu_27b_shape(dtype, v_layout, share):
    """share 16: one stream's 16 tree rows, each writing through its own table, as the tree pass issues them."""
    rng = np.random.default_rng(9)
    pool = random_pool(rng, 4, 60, 64, 256, dtype)
    if v_layout == "keys":
        pool = kq.with_v_layout(pool, "keys")
    args, prefix = prefix_case(rng, pool, s=16, t=16, d=256, page_size=64)
    shared, repeated = shared_rows(args, share)
    assert_pool_bits(_write_prefix(pool, *shared, prefix, interpret=False, share=share),
                     expected_prefix(pool, repeated, prefix, v_layout == "keys"))
