"""Serving benchmark: TTFT, inter-token latency and output tokens/s (mean, p50, p90, p99) at fixed concurrency, the
way vLLM's `bench serve` measures them (streaming requests, a client-side clock, `ignore_eos` so every request
produces exactly --max-tokens tokens).

    python -m server.bench --url http://127.0.0.1:8000 --concurrency 1,4,16 --prompt-tokens 512 --max-tokens 128
    python -m server.bench --engine --model-dir DIR --concurrency 1,4,16 --prompt-tokens 512 --max-tokens 128
    python -m server.bench --compare --synthetic 27b --concurrency 1,4,16 --prompt-tokens 512 --max-tokens 128

--url talks HTTP to a running `python -m server` (token-id prompts on /v1/completions, so the prompt length is
exact and no template or tokenizer is involved). --engine drives the engine in-process with the same prompts and
the same clock; `--baseline engine.json` on an HTTP run then prints the server's overhead. --compare does both in
turn (engine alone in a child process, then a server child with the same engine flags) and prints the overhead.

Definitions (per request unless said otherwise): TTFT = send -> first token arrives; ITL = gap between consecutive
token-bearing chunks; TPOT = (latency - TTFT) / (tokens - 1); stream tok/s = 1 / TPOT; output throughput =
all generated tokens / wall time of the run. Prompts are random ids below 256 (byte tokens in every Qwen
vocabulary), a different prompt per request so no cache can hit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from server.loading import DECODE_KERNELS, SHAPES


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class LevelResult:
    concurrency: int
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tpot_ms: dict[str, float]
    stream_tok_s: dict[str, float]
    errors: list[str]


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    v = sorted(values)

    def pct(q: float) -> float:
        # Linear interpolation between closest ranks (numpy's default), so small samples aren't biased high.
        pos = (len(v) - 1) * q
        lo = int(pos)
        hi = min(lo + 1, len(v) - 1)
        return (v[lo] + (v[hi] - v[lo]) * (pos - lo)) * scale

    return {"mean": sum(v) / len(v) * scale, "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


# ------------------------------------------------------------------------------------------------ drivers

class HTTPDriver:
    def __init__(self, url: str, model: str | None, api_key: str | None, max_tokens: int, timeout: float):
        import httpx
        self.url = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.max_tokens = max_tokens
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0),
                                        limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))

    async def close(self) -> None:
        await self.client.aclose()

    async def run(self, prompt: list[int]) -> RequestResult:
        body = {"prompt": prompt, "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0.0, "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        start = time.perf_counter()
        res = RequestResult(ok=False, prompt_tokens=len(prompt))
        last = None
        try:
            async with self.client.stream("POST", self.url, json=body) as r:
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        res.error = chunk["error"].get("message", "error event")
                        return res
                    if chunk.get("usage"):
                        res.output_tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices"):
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
        except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash of the run
            res.error = f"{type(e).__name__}: {e}"
            return res
        res.latency = time.perf_counter() - start
        res.ok = last is not None and res.output_tokens > 0
        if not res.ok and not res.error:
            res.error = "no tokens / no usage chunk"
        return res


class EngineDriver:
    """The engine in this process, same prompts, same clock: the baseline the server's overhead is measured to."""

    def __init__(self, engine, max_tokens: int):
        self.engine = engine
        self.max_tokens = max_tokens

    async def close(self) -> None:
        pass

    async def run(self, prompt: list[int]) -> RequestResult:
        from qwen_jax.engine.api import GenerationRequest, SamplingOptions
        start = time.perf_counter()
        res = RequestResult(ok=False, prompt_tokens=len(prompt))
        last = None
        try:
            handle = self.engine.submit(GenerationRequest(
                prompt_ids=tuple(prompt), max_tokens=self.max_tokens, sampling=SamplingOptions(temperature=0.0),
                ignore_eos=True))
            async for ev in handle:
                if ev.token_ids:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if ev.finish_reason is not None:
                    if ev.finish_reason not in ("stop", "length"):
                        res.error = f"finished with {ev.finish_reason}: {ev.error}"
                        return res
                    break
        except Exception as e:  # noqa: BLE001
            res.error = f"{type(e).__name__}: {e}"
            return res
        res.latency = time.perf_counter() - start
        res.output_tokens = handle.completion_tokens
        res.ok = last is not None
        return res


# -------------------------------------------------------------------------------------------------- runner

async def run_level(driver, prompts: list[list[int]], concurrency: int) -> LevelResult:
    sem = asyncio.Semaphore(concurrency)

    async def one(p):
        async with sem:
            return await driver.run(p)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    duration = time.perf_counter() - start
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    return LevelResult(
        concurrency=concurrency, num_prompts=len(prompts), completed=len(good), failed=len(results) - len(good),
        duration_s=duration, input_tokens=sum(r.prompt_tokens for r in good), output_tokens=out_tokens,
        request_throughput=len(good) / duration, output_throughput=out_tokens / duration,
        ttft_ms=percentiles([r.ttft for r in good], 1e3),
        itl_ms=percentiles([x for r in good for x in r.itl], 1e3),
        tpot_ms=percentiles(tpot, 1e3),
        stream_tok_s=percentiles([1.0 / t for t in tpot if t > 0]),
        errors=sorted({r.error for r in results if not r.ok})[:5])


def print_level(r: LevelResult, label: str) -> None:
    print(f"\n============ {label}: concurrency {r.concurrency} ============")
    print(f"{'Successful / failed requests:':<40}{r.completed} / {r.failed}")
    print(f"{'Benchmark duration (s):':<40}{r.duration_s:.2f}")
    print(f"{'Total input / generated tokens:':<40}{r.input_tokens} / {r.output_tokens}")
    print(f"{'Request throughput (req/s):':<40}{r.request_throughput:.2f}")
    print(f"{'Output token throughput (tok/s):':<40}{r.output_throughput:.1f}")
    print(f"{'':<28}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name, d in (("TTFT (ms)", r.ttft_ms), ("ITL (ms)", r.itl_ms), ("TPOT (ms)", r.tpot_ms),
                    ("Per-stream output tok/s", r.stream_tok_s)):
        print(f"{name:<28}" + "".join(f"{d[k]:>10.2f}" for k in ("mean", "p50", "p90", "p99")))
    for e in r.errors:
        print(f"  error: {e}")


def print_overhead(results: list[LevelResult], baseline: list[dict]) -> None:
    base = {b["concurrency"]: b for b in baseline}
    print("\n============ server vs engine alone ============")
    print(f"{'concurrency':<12}{'out tok/s srv':>15}{'engine':>10}{'overhead':>10}{'TTFT p50 +ms':>14}"
          f"{'ITL p50 +ms':>13}")
    for r in results:
        b = base.get(r.concurrency)
        if b is None:
            continue
        overhead = 1.0 - r.output_throughput / b["output_throughput"] if b["output_throughput"] else float("nan")
        print(f"{r.concurrency:<12}{r.output_throughput:>15.1f}{b['output_throughput']:>10.1f}{overhead:>10.1%}"
              f"{r.ttft_ms['p50'] - b['ttft_ms']['p50']:>14.2f}{r.itl_ms['p50'] - b['itl_ms']['p50']:>13.2f}")


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise argparse.ArgumentTypeError(f"concurrency levels must be positive, got {text!r}")
    return levels


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--engine", action="store_true", help="drive the engine in this process (the baseline)")
    target.add_argument("--compare", action="store_true",
                        help="both, one after the other (one GPU holds one engine at a time): the engine alone in "
                             "a child process, then `python -m server` with the same engine flags and the HTTP "
                             "run against it; prints the server's overhead")
    p.add_argument("--concurrency", type=_levels, default=[1, 4, 16], help="comma-separated levels (default 1,4,16)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length in tokens (default 512)")
    p.add_argument("--max-tokens", type=int, default=128, help="generated tokens per request (default 128)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per level (default 5 x concurrency, at least 8)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests before the first level (default 2)")
    p.add_argument("--seed", type=int, default=0, help="prompt RNG seed")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--baseline", metavar="FILE", help="an --engine run's --json: print the server's overhead")
    p.add_argument("--reuse-baseline", action="store_true",
                   help="with --compare: skip the engine-alone run when --baseline already exists (same flags, same "
                        "machine), e.g. to re-run only the server half")
    h = p.add_argument_group("HTTP target")
    h.add_argument("--model", default=None, help="model name to send (default: none, the server's only model)")
    h.add_argument("--api-key", default=None, help="bearer token")
    h.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    e = p.add_argument_group("engine (--engine, --compare): pass the flags the server was started with")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--model-dir", default=None, help="checkpoint dir (default: the embedded tiny model)")
    src.add_argument("--synthetic", choices=("27b",), default=None, help="random weights at a named shape")
    e.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    e.add_argument("--kv-cache", choices=("bf16", "fp8"), default="bf16")
    e.add_argument("--max-model-len", type=int, default=4096)
    e.add_argument("--parallel", type=int, default=16)
    e.add_argument("--max-queued", type=int, default=256)
    e.add_argument("--max-logprobs", type=int, default=20)
    e.add_argument("--no-kernels", action="store_true")
    e.add_argument("--shapes", choices=tuple(SHAPES), default="auto")
    e.add_argument("--decode-kernel", choices=DECODE_KERNELS, default="auto")
    return p


def _build_engine(args):
    from server.loading import build_engine
    engine = build_engine(model=args.model_dir, synthetic=args.synthetic, dtype=args.dtype, kv_cache=args.kv_cache,
                          max_model_len=args.max_model_len, parallel=args.parallel, max_queued=args.max_queued,
                          no_kernels=args.no_kernels, max_logprobs=args.max_logprobs, progress=True,
                          shapes=args.shapes, decode_kernel=args.decode_kernel).engine
    engine.start()
    return engine


async def amain(args) -> list[LevelResult]:
    engine = None
    if args.engine:
        engine = _build_engine(args)
        driver = EngineDriver(engine, args.max_tokens)
        label = "engine alone"
    else:
        driver = HTTPDriver(args.url, args.model, args.api_key, args.max_tokens, args.timeout)
        label = f"server {args.url}"
    results = []
    try:
        if args.warmup:
            warm = await run_level(driver, make_prompts(args.warmup, args.prompt_tokens, args.seed + 10_000),
                                   args.warmup)
            if warm.failed:
                raise SystemExit(f"error: warm-up requests failed: {warm.errors}")
        for i, c in enumerate(args.concurrency):
            n = args.num_prompts or max(5 * c, 8)
            r = await run_level(driver, make_prompts(n, args.prompt_tokens, args.seed + i), c)
            print_level(r, label)
            results.append(r)
    finally:
        await driver.close()
        if engine is not None:
            engine.shutdown()
    return results


def _engine_flags(args) -> list[str]:
    """The engine's flags, spelt the same for `server.bench --engine` and `python -m server`."""
    flags = ["--dtype", args.dtype, "--kv-cache", args.kv_cache, "--max-model-len", str(args.max_model_len),
             "--parallel", str(args.parallel), "--max-queued", str(args.max_queued),
             "--max-logprobs", str(args.max_logprobs), "--shapes", args.shapes, "--decode-kernel", args.decode_kernel]
    if args.synthetic:
        flags += ["--synthetic", args.synthetic]
    if args.no_kernels:
        flags.append("--no-kernels")
    return flags


def _load_flags(args) -> list[str]:
    flags = ["--concurrency", ",".join(map(str, args.concurrency)), "--prompt-tokens", str(args.prompt_tokens),
             "--max-tokens", str(args.max_tokens), "--warmup", str(args.warmup), "--seed", str(args.seed)]
    if args.num_prompts:
        flags += ["--num-prompts", str(args.num_prompts)]
    return flags


def compare(args) -> int:
    import subprocess
    import tempfile

    from server.launch import ServerProcess
    with tempfile.TemporaryDirectory() as tmp:
        baseline = args.baseline or f"{tmp}/engine.json"
        engine_cmd = [sys.executable, "-m", "server.bench", "--engine", *_engine_flags(args), *_load_flags(args),
                      "--json", baseline]
        engine_cmd += ["--model-dir", args.model_dir] if args.model_dir else []
        if args.reuse_baseline and os.path.exists(baseline):
            print(f"engine alone: reusing {baseline}", flush=True)
        else:
            print("$ " + " ".join(engine_cmd[1:]), flush=True)
            if subprocess.run(engine_cmd).returncode != 0:
                raise SystemExit("error: the engine-alone run failed")
        server_flags = _engine_flags(args) + (["--model", args.model_dir] if args.model_dir else [])
        print("$ python -m server " + " ".join(server_flags), flush=True)
        with ServerProcess(server_flags) as srv:
            args.url, args.compare, args.baseline = srv.url, False, baseline
            return _run_and_report(args)


def _run_and_report(args) -> int:
    results = asyncio.run(amain(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": "engine" if args.engine else args.url, "prompt_tokens": args.prompt_tokens,
                       "max_tokens": args.max_tokens, "levels": [asdict(r) for r in results]}, f, indent=1)
    if args.baseline:
        with open(args.baseline) as f:
            print_overhead(results, json.load(f)["levels"])
    return 0 if all(r.failed == 0 for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompt_tokens < 1 or args.max_tokens < 1:
        raise SystemExit("error: --prompt-tokens and --max-tokens must be positive")
    return compare(args) if args.compare else _run_and_report(args)


if __name__ == "__main__":
    sys.exit(main())
