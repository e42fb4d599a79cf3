import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The CPU suite runs on the CPU even where a GPU is present, unless `-m gpu` asks for the device.
CPU_SUITE = not any(a == "gpu" or a.endswith(" gpu") for a in sys.argv)
if CPU_SUITE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Mosaic GPU's interpreter runs a CTA's warpgroups as concurrent CPU executions that block in host callbacks
    # (barrier waits) until the others arrive; XLA's CPU client runs such callbacks on its thread pool, one thread
    # a core by default. On a 2-core machine the pool can fill with waiting warpgroups and the kernel never
    # finishes (a CI run hung in test_attention_mgpu; with PJRT_NPROC=1 that test hangs every time here). A CTA
    # has at most 4 warpgroups and the interpreter runs one CTA at a time, so 16 threads leave room.
    os.environ.setdefault("PJRT_NPROC", str(max(16, os.cpu_count() or 1)))
    # The persistent compilation cache's default directory (engine.DEFAULT_CACHE_DIR, read at import) is one of this
    # run's own, shared by its workers and the servers they start (the environment is inherited), never ~/.cache.
    if "QWEN_JAX_CACHE_DIR" not in os.environ:
        os.environ["QWEN_JAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="qwen-jax-test-cache-")
        atexit.register(shutil.rmtree, os.environ["QWEN_JAX_CACHE_DIR"], ignore_errors=True)


def _interpreter_spawns_without_dispatch() -> None:
    """The interpreter's thread map (jax._src.pallas.mosaic.interpret.thread_map) starts a CTA's warpgroups one by
    one from inside a host callback, building each one's thread id with `jnp.int32(i)`: a computation dispatched
    to the CPU device from within the running kernel. Session 17 caught a CI hang there: the spawning thread
    waited in that dispatch while the warpgroups already started waited at a barrier for the one not yet spawned
    (py-spy at PJRT_NPROC 16; the hang is rare and was not reproduced on demand, and PJRT_NPROC=1's hang is the
    pool starvation above, which this does not touch). The module's `jnp` is given numpy's int32 (the same int32
    scalar to the jitted warpgroup, a host value rather than a device computation); the rest of jnp is
    unchanged."""
    import types

    import jax.numpy as jnp
    import numpy as np
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:  # a jax without the module: nothing to patch
        return
    if getattr(thread_map.jnp, "int32", None) is not np.int32:
        shim = types.ModuleType("jnp_host_int32")
        shim.__dict__.update({k: getattr(jnp, k) for k in dir(jnp) if not k.startswith("__")})
        shim.int32 = np.int32
        thread_map.jnp = shim


_interpreter_spawns_without_dispatch()

# Computations run inline in the calling thread, not dispatched asynchronously (CPU suite only). A CI run (session
# 24, test_attention_mgpu) hung with the test's thread already past an interpreted kernel's call and waiting in the
# dispatch of its next small op, while that kernel's warpgroup threads waited in the execution of their own
# computations: under async dispatch a kernel that runs on after its call returns shares the CPU client with the
# caller's next ops. Inline, the caller stays in the kernel's call until it is done.
if CPU_SUITE:
    import jax as _jax

    _jax.config.update("jax_cpu_enable_async_dispatch", False)
    # Several CPU devices for the tensor-parallel cases (tests/test_parallel.py runs them in a pytest of their own
    # with this set; the suite's workers keep one device).
    if os.environ.get("QWEN_JAX_TEST_CPU_DEVICES"):
        _jax.config.update("jax_num_cpu_devices", int(os.environ["QWEN_JAX_TEST_CPU_DEVICES"]))

ROOT = Path(__file__).resolve().parents[1]
CAPTURES = ROOT / "captures"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if CPU_SUITE:
    # The run's persistent compilation cache is on for every test, not only for the engines and servers that turn
    # it on themselves: many tests build engines of the same model and buckets, whose programs are the same XLA
    # modules (a module's key is its HLO, the compile options and the jaxlib), and compiling them is most of such a
    # test's time (test_dflash_engine's resumed-with-the-drafter test: 37 s compiling, 11 s with its programs in the
    # cache). A loaded executable is what the compiler builds for that key, so no result depends on whether a
    # program came from the cache; `programs.CompileWatch` counts loads as compiles either way.
    from qwen_jax import programs as _programs

    _programs.enable_compilation_cache(os.environ["QWEN_JAX_CACHE_DIR"])


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_go_with_their_module():
    """Each test file's compiled programs are dropped when it ends (jax's caches, and its engines' executables once
    collected). A CI worker runs many files, and late in the run XLA:CPU has segfaulted compiling the next engine
    (three clean-clone runs in session 40, each in a different file); the guess is the process's accumulated
    compiled code, so none is kept past its file."""
    yield
    import gc

    import jax
    gc.collect()
    jax.clear_caches()


@pytest.fixture(autouse=True)
def _compilation_cache_stays_in_its_test():
    """A test that points the persistent compilation cache elsewhere (or turns it off) leaves it as it found it:
    the run's own cache (above), or off in the gpu suite."""
    import jax
    before = jax.config.jax_compilation_cache_dir
    yield
    if jax.config.jax_compilation_cache_dir != before:
        from qwen_jax import programs
        programs.enable_compilation_cache(before)


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


def first_layers(ck, n: int | None = None):
    """The checkpoint cut to its first `n` decoder layers (embedding, final norm and head kept): a model of its own,
    for the engine tests whose subject is the engine (scheduling, drafting, windows, state), not the model's numbers.
    Their test time is mostly XLA:CPU compiling each layer's interpreted kernels; at 4 of captures/tiny-mlx-4bit's 6
    layers (3 GDN, 1 attention, and the tiny drafter's taps 1 and 3) a DFlash engine starts in ~35 s instead of ~47
    (session 46). n None: the shortest prefix holding a layer of each kind (3 there: 2 GDN, 1 attention), so every
    kind of layer and state still runs. Tests against peer captures keep the whole checkpoint."""
    import dataclasses
    text = ck.config.text
    if n is None:
        n = max(text.layer_types.index(kind) for kind in set(text.layer_types)) + 1
    if not 0 < n <= text.num_layers:
        raise ValueError(f"first_layers: n={n} for a model of {text.num_layers} layers")
    cfg = dataclasses.replace(ck.config, text=dataclasses.replace(text, num_layers=n, layer_types=text.layer_types[:n]))
    return dataclasses.replace(ck, config=cfg, params=dict(ck.params, layers=ck.params["layers"][:n]))


def first_layers_drafter(drafter, n: int):
    """A drafter made for its whole target (`load_dflash(target=...)` checks that), run on the target's first `n`
    layers (`first_layers`): its taps must lie below n."""
    import dataclasses
    if drafter.config.target_layer_ids[-1] >= n:
        raise ValueError(f"first_layers_drafter: taps {drafter.config.target_layer_ids} reach past {n} layers")
    return dataclasses.replace(drafter, config=dataclasses.replace(drafter.config, num_target_layers=n))
