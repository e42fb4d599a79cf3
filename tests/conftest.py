import os
import sys
from pathlib import Path

import pytest

# The CPU suite runs on the CPU even where a GPU is present, unless `-m gpu` asks for the device.
if not any(a == "gpu" or a.endswith(" gpu") for a in sys.argv):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parents[1]
CAPTURES = ROOT / "captures"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))



@pytest.fixture
def h200_lowering():
    """Lower Pallas Triton kernels for an H200 on this CPU (jax's private gpu_info registry; skipped when a jax
    upgrade moves it), so an op the Triton lowering lacks fails in the CPU suite rather than on the device."""
    import jax
    try:
        from jax._src.pallas.triton import gpu_info
        target = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    except (ImportError, AttributeError) as e:
        pytest.skip(f"no abstract H200 in this jax: {e}")
    kind = jax.devices()[0].device_kind
    gpu_info.registry[kind] = lambda: target
    try:
        yield
    finally:
        del gpu_info.registry[kind]
