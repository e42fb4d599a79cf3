"""The MLP decode rows' activation kernel (pallas_kernels/swiglu.py): against its reference bit for bit (interpret
mode), against the model's own path (the decode qmm's epilogue, then `layers.mlp`'s activation) on the Mosaic GPU
interpreter, a row alone against the same row among others and in every piece height; `gpu`: compiled at the 27B's
MLP (5120 -> 2 x 17408)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import qmm, qmm_mgpu
from pallas_kernels import swiglu as sw
from pallas_kernels.qweight import QuantizedWeight
from qwen_jax.model import ops
from qwen_jax.model.ops import Backend, Fused, Padded

INTERPRET = jax.default_backend() != "gpu"


def bits(x):
    return np.asarray(x).view(np.uint16)


def random_pieces(rng, p: int, n: int, r: int) -> tuple[jax.Array, jax.Array]:
    """Decode qmm pieces [P, N, R] as a reader of them gets them: (parts, valid), piece 0 written everywhere, the
    others at random, NaN in every unwritten piece (a reader must select them away, never sum them)."""
    valid = jnp.asarray(rng.random((p, n)) > 0.3).at[0].set(True)
    parts = jnp.where(valid[:, :, None], jnp.asarray(rng.standard_normal((p, n, r)) * 3, jnp.float32), jnp.nan)
    return parts, valid


@pytest.mark.parametrize("p,n,r,live", [(2, 200, 16, 1), (3, 256, 8, 8), (1, 384, 64, 37), (4, 96, 32, 20)])
def test_swiglu_matches_reference_bitwise(p, n, r, live):
    """Unwritten pieces hold NaN: selected away, never summed."""
    parts, valid = random_pieces(np.random.default_rng(500 + n), p, 2 * n, r)
    got = sw.swiglu(parts, valid, live=live, interpret=INTERPRET)
    want = sw.reference(parts, valid, live=live)
    assert got.shape == (r, n) and got.dtype == jnp.bfloat16
    assert np.array_equal(bits(got), bits(want))
    assert not np.any(bits(got)[live:]) and np.all(np.isfinite(np.asarray(got, np.float32)))


def test_swiglu_rejects_bad_inputs():
    parts = jnp.zeros((2, 64, 16), jnp.float32)
    with pytest.raises(ValueError, match="live"):
        sw.swiglu(parts, jnp.ones((2, 64), bool), live=0, interpret=True)
    with pytest.raises(ValueError, match="valid"):
        sw.swiglu(parts, jnp.ones((2, 32), bool), live=1, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        sw.swiglu(jnp.zeros((2, 64, 12), jnp.float32), jnp.ones((2, 64), bool), live=1, interpret=True)


def _gate_up(rng, n: int, k: int) -> Fused:
    words = rng.integers(0, 2**32, size=(2 * n, k // 8), dtype=np.uint32)
    scales = jnp.asarray(rng.uniform(0.002, 0.02, size=(2 * n, k // 64)), jnp.bfloat16)
    biases = jnp.asarray(rng.normal(size=(2 * n, k // 64)) * 0.01, jnp.bfloat16)
    w = qmm.decode_layout(QuantizedWeight(jnp.asarray(words), scales, biases, 4, 64))
    return Fused(w, (n, n))


def _unfused(backend, x, gate_up):
    gate, up = ops.linear_split(x, gate_up, backend, prompt=False)
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)


def test_swiglu_is_the_model_epilogue_on_the_interpreter(monkeypatch):
    """With the Mosaic GPU decode qmm (its interpreter): `ops.swiglu` gives the bits of the projection's own epilogue
    then `layers.mlp`'s activation (the same operations in the same order), as a `Padded` for the down projection
    when the rows are padded; a row alone has the bits it has among 20 (a 32-row piece)."""
    monkeypatch.setattr(qmm, "DECODE_IMPL", "mgpu")
    rng = np.random.default_rng(510)
    backend = Backend(kernels=True, interpret=True)
    gate_up = _gate_up(rng, 192, 256)
    x = jnp.asarray(rng.normal(size=(20, 256)), jnp.bfloat16)
    assert ops.swiglu_applies(backend, x, gate_up, prompt=False)
    assert not ops.swiglu_applies(backend, x, gate_up, prompt=True)
    got = ops.swiglu(backend, x, gate_up)
    assert isinstance(got, Padded) and got.rows.shape == (32, 192) and got.lead == (20,)
    assert not np.any(bits(got.rows[20:]))
    want = _unfused(backend, x, gate_up)
    assert np.array_equal(bits(got.rows[:20]), bits(want))
    alone = ops.swiglu(backend, x[7:8], gate_up)
    assert np.array_equal(bits(alone.rows[0]), bits(got.rows[7]))
    padded = Padded(jnp.pad(x[:3], ((0, 13), (0, 0))), (3,))
    assert np.array_equal(bits(ops.swiglu(backend, padded, gate_up).rows[:3]), bits(want[:3]))


def test_swiglu_lowers_for_h200(h200_lowering):
    sds = jax.ShapeDtypeStruct
    text = jax.jit(functools.partial(sw.swiglu, live=1)).trace(
        sds((2, 2 * 17408, 16), jnp.float32), sds((2, 2 * 17408), jnp.bool_)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
def test_gpu_swiglu_27b():
    """The 27B's MLP shape on the H200: the kernel's rows bit for bit its reference's (the pieces as the decode
    qmm wrote them) and within bf16 rounding of the model's unfused path; a row's bits the same alone, among 16
    rows and in a 64-row piece (pieces 64 + 8 for 70 rows: `qmm_mgpu.pieces`)."""
    rng = np.random.default_rng(520)
    backend = Backend(kernels=True, interpret=False)
    gate_up = _gate_up(rng, 17408, 5120)
    x = jnp.asarray(rng.normal(size=(70, 5120)), jnp.bfloat16)
    parts, written = qmm_mgpu.qmm_parts(x[:16], gate_up.weight, rows=16)
    kernel = sw.swiglu(parts, jnp.asarray(written), live=16)
    assert np.array_equal(bits(kernel), bits(sw.reference(parts, jnp.asarray(written), live=16)))
    many = ops.swiglu(backend, x, gate_up)
    assert many.rows.shape == (sum(qmm_mgpu.pieces(70)), 17408) == (72, 17408)
    want = np.asarray(_unfused(backend, x, gate_up), np.float32)
    got = np.asarray(many.rows[:70], np.float32)
    assert np.max(np.abs(got - want) / (np.abs(want) + 1e-2)) < 2 ** -6
    for lo, hi in ((3, 4), (0, 16)):
        part = ops.swiglu(backend, x[lo:hi], gate_up)
        rows = part.rows if isinstance(part, Padded) else part
        assert np.array_equal(bits(rows[:hi - lo]), bits(many.rows[lo:hi])), (lo, hi)
    assert np.array_equal(bits(kernel), bits(ops.swiglu(backend, x[:16], gate_up)))
