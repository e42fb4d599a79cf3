"""What Triton makes of a window call's kernels for the H200, on a machine without a GPU. A probe, not a test.

The call is lowered for an abstract H200 on the CPU (jax's own Pallas-to-Triton lowering, as
`test_kernels_lower_to_triton_at_27b_shape` does); each Triton kernel's TTIR is captured from the lowering and
compiled for sm_90 by pip's Triton (which need not be the Triton XLA bundles: a lead, not a measurement). For each
kernel it prints the MMAs' layouts (version, warps, kWidth), its reductions' layouts, shared memory, registers,
spills and a SASS instruction count, then its main loop's instructions a trip (the longest backward branch's body:
pass 1's key-block step); `--keep DIR` writes the TTIR, TTGIR and SASS there. `--v-layout keys` gives the fp8 pool
V key-major (`kv_quant.KVPool.v_layout`).

    pip install --target /tmp/tri36 triton==3.6.0
    PYTHONPATH=/tmp/tri36:$PWD python tools/offline/triton_sm90.py --fp8 --streams 4 --rows 16 --pages 40 \\
        --tiles merge_block_rows=32 --tiles fp8_dot=bfloat16

(Session 26 found the fp8 merge's launch-dependent bits this way: kWidth 4 against 2, mma.sync against wgmma.)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp

from pallas_kernels import attention as at
from pallas_kernels import calls
from pallas_kernels import kv_quant as kq


def capture(fn, *args) -> list[tuple[str, int, int, str]]:
    """fn(*args) lowered for CUDA on an abstract H200 -> [(name, num_warps, num_stages, TTIR generic asm)]."""
    from jax._src.pallas.triton import gpu_info

    target = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    gpu_info.registry[jax.devices()[0].device_kind] = lambda: target
    with calls.triton_modules(lambda module: module.operation.get_asm(print_generic_op_form=True)) as modules:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # Each launch's warps and stages by kernel name, in the order of the text (kernels of one name in lowering order
    # is assumed where a name repeats).
    launches = collections.defaultdict(list)
    for name, stages, warps in re.findall(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32',
                                          text):
        launches[name].append((int(warps), int(stages)))
    out = []
    for module in modules:
        found = re.search(r'sym_name = "([^"]+)"', module)
        name = found.group(1) if found else "?"
        warps, stages = launches[name].pop(0) if launches.get(name) else (4, 2)
        out.append((name, warps, stages, module))
    return out


def main_loop(sass: str) -> collections.Counter:
    """The instructions (full opcodes) between the target and the source of the SASS's longest backward branch:
    a key-block loop's body, once."""
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in
            re.finditer(r"/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*)", sass)]
    loops = [(int(t.group(1), 16), at_) for at_, op, rest in code if op == "BRA"
             for t in [re.search(r"0x([0-9a-f]+)", rest)] if t and int(t.group(1), 16) < at_]
    if not loops:
        return collections.Counter()
    first, last = max(loops, key=lambda span: span[1] - span[0])
    return collections.Counter(op for at_, op, _ in code if first <= at_ <= last)


def compile_sm90(ttir: str, warps: int, stages: int, keep: str | None, label: str) -> None:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend, get_ptxas

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    opts = backend.parse_options(dict(num_warps=warps, num_stages=stages))
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(keep or tmp, f"{label}.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        mod = ir.parse_mlir_module(path, ctx)
        mod.context = ctx
        md: dict = {}
        mod = backend.make_ttir(mod, md, opts, 90)
        mod = backend.make_ttgir(mod, md, opts, 90)
        ttgir = str(mod)
        cubin = backend.make_cubin(backend.make_ptx(backend.make_llir(mod, md, opts, 90), md, opts, 90), md, opts, 90)
        cubin_path = os.path.join(keep or tmp, f"{label}.cubin")
        with open(cubin_path, "wb") as f:
            f.write(cubin)
        tool = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
        sass = subprocess.run([tool, "-sass", cubin_path], capture_output=True, text=True).stdout
        usage = subprocess.run([tool, "-res-usage", cubin_path], capture_output=True, text=True).stdout
        if keep:
            for ext, body in (("ttgir", ttgir), ("sass", sass)):
                with open(os.path.join(keep, f"{label}.{ext}"), "w") as f:
                    f.write(body)
    mmas = sorted(set(re.findall(r"#ttg\.nvidia_mma<\{versionMajor = (\d), [^}]*warpsPerCTA = (\[[^\]]*\])", ttgir)))
    kwidth = sorted(set(re.findall(r"kWidth = (\d+)", ttgir)))
    sums = collections.Counter(re.findall(r"arith\.addf [^:]*: tensor<\d+xf32, #ttg\.slice<\{dim = \d, parent = (#\w+)",
                                          ttgir))
    ops = collections.Counter(m.group(1).split(".")[0] for m in
                              re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", sass))
    print(f"{label}: warps {warps}, stages {stages}, shared {md.get('shared')} B, "
          f"{' '.join(re.findall(r'REG:\d+|STACK:\d+', usage))}; MMA (version, warps) {mmas}, kWidth {kwidth}; "
          f"row sums over {dict(sums)}; SASS {sum(ops.values())} instructions ({ops['BAR']} BAR, "
          f"{ops['HMMA']} HMMA, {ops['HGMMA']} HGMMA, {ops['F2FP']} F2FP, {ops['MUFU']} MUFU)", flush=True)
    loop = main_loop(sass)
    if loop:
        print(f"  main loop: {sum(loop.values())} instructions a trip ({loop['LDS.U8']} LDS.U8, "
              f"{sum(n for op, n in loop.items() if op.startswith('LDS'))} LDS*, {loop['BAR.SYNC.DEFER_BLOCKING']} BAR, "
              f"{sum(n for op, n in loop.items() if op.startswith('HMMA'))} HMMA)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fp8", action="store_true", help="an fp8 pool (else bf16)")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--pages", type=int, default=512, help="page-table width (64-key pages)")
    ap.add_argument("--tiles", action="append", default=[], metavar="FIELD=VALUE",
                    help="a WindowTiles field over window_tiles' (ints and None parsed)")
    ap.add_argument("--keep", metavar="DIR", help="write each kernel's TTIR, TTGIR and SASS here")
    ap.add_argument("--v-layout", choices=kq.V_LAYOUTS, default="rows",
                    help="an fp8 pool's V layout (kv_quant.KVPool.v_layout; 'keys': v [Hkv, P, D, page])")
    args = ap.parse_args()
    sds = jax.ShapeDtypeStruct
    kv = kq.FP8 if args.fp8 else jnp.bfloat16
    pages = args.streams * args.pages + 8
    if args.v_layout == "keys" and not args.fp8:
        ap.error("--v-layout keys is for fp8 pools (--fp8)")
    pool = kq.KVPool(sds((4, pages, 64, 256), kv),
                     sds((4, pages, 256, 64) if args.v_layout == "keys" else (4, pages, 64, 256), kv),
                     *((sds((4, pages, 64), jnp.float32),) * 2 if args.fp8 else ()), v_layout=args.v_layout)
    change = {}
    for item in args.tiles:
        field, value = item.split("=", 1)
        change[field] = None if value == "None" else int(value) if value.lstrip("-").isdigit() else value
    tiles = dataclasses.replace(at.window_tiles(page_size=64, max_keys=args.pages * 64, head_dim=256, fp8=args.fp8),
                                **change)
    s, r = args.streams, args.rows
    kernels = capture(functools.partial(at.window, scale=1 / 16, tiles=tiles),
                      sds((s, r, 24, 256), jnp.bfloat16), sds((s, r, 4, 256), jnp.bfloat16),
                      sds((s, r, 4, 256), jnp.bfloat16), sds((s, r), jnp.int32), pool, sds((s, args.pages), jnp.int32),
                      sds((s,), jnp.int32))
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    for i, (name, warps, stages, ttir) in enumerate(kernels):
        compile_sm90(ttir, warps, stages, args.keep, f"{i}_{name}")


if __name__ == "__main__":
    main()
