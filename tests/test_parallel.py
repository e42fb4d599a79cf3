"""Tensor parallelism on the CPU: tests/parallel_cases.py in a pytest of its own over two CPU devices (the suite's
workers hold one device each, fixed when jax starts), and what needs no second device."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from qwen_jax.config import load_config
from qwen_jax.model import parallel
from tests.conftest import CAPTURES, ROOT


def test_cases_on_two_cpu_devices():
    env = dict(os.environ, QWEN_JAX_TEST_CPU_DEVICES="2")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                          str(ROOT / "tests" / "parallel_cases.py")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def test_layout_errors_name_the_flag():
    cfg = load_config(CAPTURES / "tiny")  # 4 / 2 attention heads, 2 / 4 GDN heads, 256 MLP columns
    parallel.check(cfg, 2)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4: the model's 2 KV heads do not split in 4"):
        parallel.check(cfg, 4)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3"):
        parallel.check(cfg, 3)
    quant = load_config(CAPTURES / "tiny-mlx-4bit")  # groups of 64: 256 / 2 MLP columns a device are two groups
    parallel.check(quant, 2)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size must be at least 1, got 0"):
        parallel.TensorParallel.over(0)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 needs 2 devices; jax sees 1"):
        parallel.TensorParallel.over(2)
    from server.loading import build_engine  # the server's flag: refused before anything compiles
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3: the model's 4 attention heads do not split"):
        build_engine(model=str(CAPTURES / "tiny"), synthetic=None, dtype="float32", kv_cache="bf16", max_model_len=256,
                     parallel=2, max_queued=2, no_kernels=True, max_logprobs=0, progress=False, tensor_parallel=3)


def test_permutation_puts_each_device_pieces_together():
    idx = parallel._permutation((4, 2, 6), 2)
    assert idx.tolist() == [0, 1, 4, 6, 7, 8, 2, 3, 5, 9, 10, 11]
    assert sorted(parallel._permutation((8, 8, 4, 4), 4).tolist()) == list(range(24))
    assert jnp.asarray(idx).shape == (12,)


def test_cli_generate_over_two_devices():
    """`generate -tp 2` over two CPU devices gives the one-device greedy reply (fp32, captures/tiny); -tp 2 over one
    device is an error naming the flag."""
    args = [sys.executable, "-m", "qwen_jax", "generate", "--model", str(CAPTURES / "tiny"), "--token-ids",
            "5,17,300,42,7", "--max-tokens", "6", "--dtype", "float32", "--json", "--compile-cache", ""]
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    runs = [subprocess.Popen(args + extra, cwd=ROOT, env=dict(env, **more), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for extra, more in (([], {}), (["-tp", "2"], {"JAX_NUM_CPU_DEVICES": "2"}), (["-tp", "2"], {}))]
    (one, _), (two, err2), (_, refused) = (r.communicate(timeout=600) for r in runs)
    assert runs[1].returncode == 0, err2[-3000:]
    ids = [json.loads(out)["token_ids"] for out in (one, two)]
    assert len(ids[0]) == 6 and ids[0] == ids[1]
    assert runs[2].returncode != 0 and "--tensor-parallel-size 2 needs 2 devices; jax sees 1" in refused
