import os
import sys
from pathlib import Path

import pytest

# The CPU suite runs on the CPU even where a GPU is present, unless `-m gpu` asks for the device.
if not any(a == "gpu" or a.endswith(" gpu") for a in sys.argv):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Mosaic GPU's interpreter runs a CTA's warpgroups as concurrent CPU executions that block in host callbacks
    # (barrier waits) until the others arrive; XLA's CPU client runs such callbacks on its thread pool, one thread
    # a core by default. On a 2-core machine the pool can fill with waiting warpgroups and the kernel never
    # finishes (a CI run hung in test_attention_mgpu; with PJRT_NPROC=1 that test hangs every time here). A CTA
    # has at most 4 warpgroups and the interpreter runs one CTA at a time, so 16 threads leave room.
    os.environ.setdefault("PJRT_NPROC", str(max(16, os.cpu_count() or 1)))

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
