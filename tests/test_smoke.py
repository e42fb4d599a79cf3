import jax.numpy as jnp
import numpy as np

from pallas_kernels.qweight import QuantizedWeight, dequantize, dequantize_numpy, quantize_numpy


def test_quantize_roundtrip_matches_numpy_oracle():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(24, 128)).astype(np.float32)
    words, scales, biases = quantize_numpy(w, 4, 64)
    qw = QuantizedWeight(jnp.asarray(words), jnp.asarray(scales), jnp.asarray(biases), 4, 64)
    qw.validate()
    ours = np.asarray(dequantize(qw))
    oracle = dequantize_numpy(words, scales, biases, 4, 64)
    assert np.abs(ours - oracle).max() < 1e-6
    # 4-bit affine with 16 levels: the dequantized weight is within half a step of the original
    step = np.repeat(scales, 64, axis=1)
    assert np.all(np.abs(oracle - w) <= step * 0.5 + 1e-6)
