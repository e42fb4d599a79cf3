"""pallas_kernels.calls: one jitted function per distinct kernel call, and never one shared by calls that differ."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import calls


def _scale_kernel(x_ref, o_ref, *, factor):
    o_ref[...] = (x_ref[...] * factor).astype(o_ref.dtype)


def _run(x, factor, block=8, index=None):
    index = index or (lambda i: (i,))
    return calls.pallas_call(
        functools.partial(_scale_kernel, factor=factor),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // block,),
        in_specs=[pl.BlockSpec((block,), index)],
        out_specs=pl.BlockSpec((block,), index),
        interpret=True,
    )(x)


def test_equal_calls_share_one_function_and_different_ones_do_not():
    x = jnp.arange(32, dtype=jnp.float32)
    before = calls.cached_calls()
    a = _run(x, 3.0)
    b = _run(x, 3.0)  # equal: a fresh partial and fresh index-map lambdas, same code and values
    assert calls.cached_calls() == before + 1
    np.testing.assert_array_equal(np.asarray(a), np.asarray(x) * 3)
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    c = _run(x, 2.0)  # another bound value
    d = _run(x, 3.0, block=16)  # another grid and block (jax#40847: one kernel function, several grids)
    e = _run(x[:16], 3.0)  # another operand shape
    assert calls.cached_calls() == before + 4
    np.testing.assert_array_equal(np.asarray(c), np.asarray(x) * 2)
    np.testing.assert_array_equal(np.asarray(d), np.asarray(x) * 3)
    np.testing.assert_array_equal(np.asarray(e), np.asarray(x[:16]) * 3)


def test_values_equal_in_python_but_not_in_a_trace_are_kept_apart():
    """1 == 1.0 == True in Python; as a kernel parameter they trace to different constants."""
    x = jnp.arange(16, dtype=jnp.int32)
    before = calls.cached_calls()
    as_int = _run(x, 3)
    as_float = _run(x, 3.0)
    assert calls.cached_calls() == before + 2
    assert as_int.dtype == jnp.int32 and as_float.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(as_int), np.arange(16) * 3)


def test_closures_over_other_values_are_other_calls():
    x = jnp.arange(32, dtype=jnp.float32)
    before = calls.cached_calls()
    outs = []
    for shift in (0, 1):
        outs.append(_run(x, 1.0, index=lambda i, s=shift: ((i + s) % 4,)))
    assert calls.cached_calls() == before + 2
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(x))  # a permutation of blocks onto themselves


class _Unhashable:
    __hash__ = None

    def __init__(self, value):
        self.value = value

    def __rmul__(self, other):
        return other * self.value


def test_unhashable_parameters_bypass_the_table():
    """A kernel parameter without a faithful key (an unhashable object) is not cached: it runs as a plain
    pallas_call."""
    x = jnp.arange(16, dtype=jnp.float32)
    before = calls.cached_calls()
    out = _run(x, _Unhashable(2.0))
    assert calls.cached_calls() == before
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2)


def test_sharing_off_is_a_plain_call():
    x = jnp.arange(16, dtype=jnp.float32)
    before = calls.cached_calls()
    with calls.sharing(False):
        out = _run(x, 5.0)
    assert calls.cached_calls() == before
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 5)
