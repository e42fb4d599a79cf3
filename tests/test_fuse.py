"""`model.ops.fuse`: projections that read the same input become one matmul, split back in order."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.qweight import QuantizedWeight, quantize_numpy
from qwen_jax.model.ops import Backend, Fused, fuse, linear, linear_split, parts


def _q(rng, n, k, bits=4, group=64):
    w = rng.standard_normal((n, k)).astype(np.float32)
    words, scales, biases = quantize_numpy(w, bits, group)
    return QuantizedWeight(jnp.asarray(words), jnp.asarray(scales, jnp.bfloat16), jnp.asarray(biases, jnp.bfloat16),
                           bits, group)


def test_fused_packed_projections_equal_the_parts():
    rng = np.random.default_rng(0)
    ws = [_q(rng, 96, 128), _q(rng, 64, 128), _q(rng, 8, 128)]
    f = fuse(ws)
    assert isinstance(f, Fused) and f.sizes == (96, 64, 8) and parts(f) == (f.weight,)
    x = jnp.asarray(rng.standard_normal((5, 128)), jnp.float32)
    outs = linear_split(x, f, Backend(), prompt=False)
    assert [o.shape for o in outs] == [(5, 96), (5, 64), (5, 8)]
    for o, w in zip(outs, ws):
        np.testing.assert_allclose(np.asarray(o), np.asarray(linear(x, w, Backend(), prompt=False)), rtol=1e-6,
                                   atol=1e-5)
    # a pytree: dtype casts and device transfers map through it
    assert len(jax.tree.leaves(f)) == 3


def test_fused_dense_and_unfusable_mixes():
    rng = np.random.default_rng(1)
    dense = [jnp.asarray(rng.standard_normal((n, 32)), jnp.float32) for n in (16, 8)]
    f = fuse(dense)
    assert isinstance(f, Fused) and f.weight.shape == (24, 32)
    x = jnp.asarray(rng.standard_normal((3, 32)), jnp.float32)
    for o, w in zip(linear_split(x, f, Backend(), prompt=False), dense):
        np.testing.assert_allclose(np.asarray(o), np.asarray(linear(x, w, Backend(), prompt=False)), rtol=1e-6,
                                   atol=1e-5)
    # different bits (a mixed-precision checkpoint) or packed beside dense: separate matmuls, while consecutive
    # parts in one format still share one
    mixed = [_q(rng, 32, 128, bits=4), _q(rng, 32, 128, bits=8)]
    assert fuse(mixed) == tuple(mixed)
    runs = fuse([mixed[0], mixed[0], jnp.zeros((16, 128)), jnp.ones((8, 128))])
    assert isinstance(runs, tuple) and len(runs) == 2 and all(isinstance(r, Fused) for r in runs)
    assert runs[0].sizes == (32, 32) and runs[1].sizes == (16, 8) and len(parts(runs)) == 2
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.float32)
    outs = linear_split(x, runs, Backend(), prompt=False)
    assert [o.shape for o in outs] == [(2, 32), (2, 32), (2, 16), (2, 8)]
    np.testing.assert_allclose(np.asarray(outs[3]), np.asarray(jnp.broadcast_to(x.sum(-1, keepdims=True), (2, 8))),
                               rtol=1e-6)
    outs = linear_split(x, fuse(mixed), Backend(), prompt=False)
    assert [o.shape for o in outs] == [(2, 32), (2, 32)]
