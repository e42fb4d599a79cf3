"""Is the 27B decode round launch-bound? The same decode program compiled under several XLA command-buffer
settings, each in its own process (XLA reads XLA_FLAGS once), through tools/gpu/decode_profile.py: a round's wall
time (host-synchronous and device-bound) and how much of the compiled program XLA wrapped in command buffers
(CUDA graphs). If disabling command buffers changes nothing, the program runs as single launches; if the
"min graph size 1" or custom-call variants are faster, the Pallas calls were splitting the graphs.

    python3 tools/gpu/launch_probe.py --synthetic 27b          # on the device; about 40 s a variant
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

VARIANTS = {
    "default": "",
    "no-command-buffers": "--xla_gpu_enable_command_buffer=",
    "min-graph-1": "--xla_gpu_graph_min_graph_size=1",
    "custom-calls-too": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
                        "--xla_gpu_graph_min_graph_size=1",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", choices=("27b",), default=None)
    ap.add_argument("--model", default="captures/tiny-mlx-4bit")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--layers", default="", help="comma-separated depths to run the default variant at as well "
                    "(e.g. 8,16: per-layer round time and compile time)")
    ap.add_argument("--tiles", default="", metavar="A;B",
                    help="';'-separated qmm decode-tile overrides to run under the default flags as well, each "
                         "FIELD=V,... (decode_profile.py --decode-tiles), e.g. 'prefetch=1;prefetch=1,lop3=1'")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds a variant")
    ap.add_argument("--qmm-decode-impl", choices=("triton", "mgpu"), default=None,
                    help="decode_profile.py --qmm-decode-impl for every variant")
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    src = ["--synthetic", args.synthetic] if args.synthetic else ["--model", args.model]
    runs = [(name, None, "") for name in args.variants.split(",") if name]
    runs += [("default", None, t) for t in args.tiles.split(";") if t]
    runs += [("default", int(n), "") for n in args.layers.split(",") if n]
    for name, layers, tiles in runs:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + VARIANTS[name]).strip()
        cmd = [sys.executable, os.path.join(here, "decode_profile.py"), *src, "--rounds", "16", "--profiled", "0"]
        if layers:
            cmd += ["--layers", str(layers)]
        if tiles:
            cmd += ["--decode-tiles", tiles]
        if args.qmm_decode_impl:
            cmd += ["--qmm-decode-impl", args.qmm_decode_impl]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in (r.stdout + r.stderr).splitlines()
                     if ln.startswith(("compiled", "device-bound", "pipelined", "cpu:", "gpu:", "cuda:")) or " layers: " in ln
                     or "Error" in ln]
        except subprocess.TimeoutExpired:
            lines = [f"timed out after {args.timeout:.0f} s"]
        print(f"== {name}{f' ({layers} layers)' if layers else ''}{f' tiles {tiles}' if tiles else ''} "
              f"(XLA_FLAGS={env['XLA_FLAGS']!r})")
        for ln in lines[-6:]:
            print("   " + ln)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
