"""What does one kernel launch cost the host? The question behind the Mosaic GPU decode qmm being faster on the
device but slower in the engine (BENCHMARKS.md, session 6: the round's host share 4.3-4.6 ms with it).

One jitted program chains `--calls` launches of one kernel on a tiny shape (so the device time a launch is a few
µs), and the program is timed three ways: `enqueue` (the jitted call returning: jax's dispatch), `sync` (call +
block_until_ready), `pipelined` (`--reps` programs dispatched back to back, then one block: the rate the engine's
pipelined loop can reach). Divided by the calls a program, the pipelined number is the larger of the host's and
the device's cost a launch. Kernels: the Triton decode qmm and the Mosaic GPU decode qmm (TMA descriptors for x,
words, scales, biases and the output made on the host at each launch). Each XLA flag variant runs in its own
process (XLA reads XLA_FLAGS once).

    python3 tools/gpu/dispatch_probe.py                 # on the device; ~10 s a variant
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

VARIANTS = {
    "default": "",
    "no-command-buffers": "--xla_gpu_enable_command_buffer=",
    "custom-calls-too": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
                        "--xla_gpu_graph_min_graph_size=1",
}
KERNELS = ("triton-qmm", "mgpu-qmm")


def _program(kernel: str, calls: int, size: int):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import qmm
    from pallas_kernels.bench.qmm import _random_weights

    qmm.DECODE_IMPL = "mgpu" if kernel == "mgpu-qmm" else "triton"
    w = qmm.decode_layout({"w": _random_weights(size, size, 1)[0]})["w"]

    def body(x, w):
        for _ in range(calls):
            x = qmm.qmm(x, w)
        return x

    return jax.jit(body), (jax.random.normal(jax.random.key(0), (1, size), jnp.bfloat16), w)


def child(kernel: str, calls: int, size: int, reps: int) -> None:
    import jax

    f, args = _program(kernel, calls, size)
    jax.block_until_ready(f(*args))
    enq, sync = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = f(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        enq.append(t1 - t0)
        sync.append(t2 - t0)
    t0 = time.perf_counter()
    outs = [f(*args) for _ in range(reps)]
    jax.block_until_ready(outs)
    pipe = (time.perf_counter() - t0) / reps
    us = lambda s: 1e6 * s / calls
    print(f"RESULT {kernel:10s} enqueue {us(statistics.median(enq)):7.2f}  sync "
          f"{us(statistics.median(sync)):7.2f}  pipelined {us(pipe):7.2f}  µs a launch ({calls} launches a program)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--calls", type=int, default=128)
    ap.add_argument("--size", type=int, default=1024, help="K = N of the qmm weight (4-bit g64)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.calls, args.size, args.reps)
        return 0
    for name in args.variants.split(","):
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + VARIANTS[name]).strip()
        for kernel in args.kernels.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", kernel, "--calls", str(args.calls),
                   "--size", str(args.size), "--reps", str(args.reps)]
            try:
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("RESULT") or "Error" in ln]
                print(f"{name:20s}", *(lines or [f"rc={r.returncode} " + (r.stderr[-300:] if r.stderr else "")]),
                      flush=True)
            except subprocess.TimeoutExpired:
                print(f"{name:20s} {kernel}: timed out after {args.timeout:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
