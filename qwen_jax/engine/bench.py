"""`python -m qwen_jax bench`: device throughput of the engine's compiled programs.

Prompt: one stream's prompt of L tokens as the engine runs it (chunks of up to `max_chunk` rows, one after
another), after one untimed pass -> tokens/s. Decode: S streams at `context` cached tokens each, `rounds` decode
calls (verify + commit + sampling, every call's tokens read back to the host, pipelined as the scheduler runs
them: each call dispatched before the previous one is fetched) after a few untimed ones, timed `repeats` times ->
forwards/s (rounds/s, the median of the repeats; every repeat's figure is kept, since a host-bound round moves
from run to run) and tokens/s (S x forwards/s). Draft windows (`draft_rows`, the copy drafts' cost curve): S streams
at `context`, chain windows of R rows (`programs.draft_program`: every row computed as the serial step at its
position, accepted and committed in the same call), each fetched before the next is built, then again enqueued
back to back (`draft_windows`) -> ms a window and its ratio to the decode round at the same S (a window of R rows
pays when it yields more tokens than that ratio; every row accepted yields R). With a drafter, the windows are
DFlash windows (the drafter run on the device after each). Compile: every program of the run, first against an
empty persistent cache (cold), then again from that cache (warm).

Cached K/V and GDN states are zeros rather than a real prefix: the cost of a round depends on the context length,
not on the values.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time

import numpy as np

from qwen_jax import programs as P
from qwen_jax import sampling


@dataclasses.dataclass
class BenchResult:
    prompt_tokens_per_s: dict[int, float] = dataclasses.field(default_factory=dict)
    decode_forwards_per_s: dict[int, float] = dataclasses.field(default_factory=dict)
    decode_tokens_per_s: dict[int, float] = dataclasses.field(default_factory=dict)
    decode_repeats: dict[int, list[float]] = dataclasses.field(default_factory=dict)  # forwards/s, in run order
    compile_cold_s: float | None = None
    compile_warm_s: float | None = None
    programs: int = 0
    context: int = 0
    draft_window_ms: dict[int, dict[int, float]] = dataclasses.field(default_factory=dict)  # streams -> rows -> ms
    draft_pipelined_ms: dict[int, dict[int, float]] = dataclasses.field(default_factory=dict)  # likewise
    block_drafts: bool = False  # the windows were DFlash windows (the drafter run after each)
    tree_drafts: bool = False  # ... trees of the drafter's likeliest continuations (--draft-tree)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def lines(self) -> list[str]:
        out = []
        if self.compile_cold_s is not None:
            warm = f"{self.compile_warm_s:.1f} s" if self.compile_warm_s is not None else "not measured"
            out.append(f"compile ({self.programs} programs): cold {self.compile_cold_s:.1f} s, warm {warm}")
        for n, v in self.prompt_tokens_per_s.items():
            out.append(f"prompt {n:>6} tokens: {v:10.1f} tok/s")
        for s, v in self.decode_forwards_per_s.items():
            reps = self.decode_repeats.get(s, [])
            spread = (f"  (median of {len(reps)}: {' / '.join(f'{x:.1f}' for x in reps)})" if len(reps) > 1
                      else "")
            out.append(f"decode {s:>2} streams @ {self.context} ctx: {v:8.1f} forwards/s "
                       f"{self.decode_tokens_per_s[s]:9.1f} tok/s{spread}")
        for s, by_rows in self.draft_window_ms.items():
            fps = self.decode_forwards_per_s.get(s)
            for r, ms in by_rows.items():
                for what, v in (("", ms), (", pipelined", self.draft_pipelined_ms.get(s, {}).get(r))):
                    if v is None:
                        continue
                    ratio = f" = {v * fps / 1000:.2f} decode rounds" if fps else ""
                    kind = "tree  " if self.tree_drafts else "block " if self.block_drafts else "draft  "
                    out.append(f"{kind}{s:>2} streams x {r:>2} rows @ {self.context} ctx: {v:8.2f} ms a "
                               f"window{ratio}{what}")
        costs = self.draft_costs()
        if costs:
            out.append(f"--draft-costs '{costs}'")
        return out

    def draft_costs(self) -> str | None:
        """The windows' costs in decode rounds at the fewest streams timed, pipelined where timed so (as the engine
        runs them), as the server's --draft-costs JSON; None without window and decode figures."""
        import json
        for s in sorted(self.draft_window_ms):
            fps = self.decode_forwards_per_s.get(s)
            if not fps:
                continue
            table = {str(r): round(self.draft_pipelined_ms.get(s, {}).get(r, ms) * fps / 1000, 2)
                     for r, ms in sorted(self.draft_window_ms[s].items())}
            kind = "tree" if self.tree_drafts else "block" if self.block_drafts else "copy"
            return json.dumps({kind: table})
        return None


def _parse_sizes(text: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in vals):
        raise ValueError(f"{what} must be positive, got {text!r}")
    return vals


def run(params, cfg, *, backend, dtype: str = "bfloat16", kv_cache: str = "bf16", streams=(1, 16),
        prompt_lengths=(4096,), context: int = 1024, rounds: int = 64, repeats: int = 3, max_chunk: int = 4096,
        compile_timing: bool = True, warm: bool = True, logprobs: int = 0, progress: bool = True,
        draft_rows=(), drafter=None, draft_tree: int = 0, log=print) -> BenchResult:
    if max_chunk % P.GRID or max_chunk < P.GRID:
        raise ValueError(f"--max-chunk must be a positive multiple of {P.GRID}, got {max_chunk}")
    if rounds < 1 or context < 1 or repeats < 1:
        raise ValueError("--rounds, --repeats and --context must be positive")
    if draft_rows and not streams:
        raise ValueError("--draft-rows needs --streams (the windows run at each stream count)")
    if any(r > 16 for r in draft_rows):
        raise ValueError(f"--draft-rows must be at most 16, got {','.join(map(str, draft_rows))}")
    if drafter is not None and not draft_rows:
        raise ValueError("--drafter times draft windows: give --draft-rows")
    if draft_tree and drafter is None:
        raise ValueError("--draft-tree times DFlash tree windows: give --drafter")
    if drafter is not None and not draft_tree and max(draft_rows) > drafter[1].block_size:
        raise ValueError(f"--draft-rows: the drafter's block holds {drafter[1].block_size} rows")
    page = 64
    packing = P.Packing.BATCHED if P.row_invariant(params, backend) else P.Packing.MAPPED
    rows = tuple(sorted({min(P.pages_for(n, P.GRID) * P.GRID, max_chunk) for n in prompt_lengths}))
    result = BenchResult(context=context, block_drafts=drafter is not None, tree_drafts=bool(draft_tree))
    jobs = []
    if prompt_lengths:
        pp = P.pages_for(max(prompt_lengths), page)
        lay = P.Layout(page, pp, pp + 1, 2, dtype, kv_cache)
        jobs.append(("prompt", lay, P.Buckets(rows, (1,), (1,), packing=packing, logprobs=logprobs)))
    if streams:
        dp = P.pages_for(context + rounds * max((1, *draft_rows)) + 8, page)
        tree_pages = 2 * max(streams) * max(draft_rows) if draft_tree else 0
        lay = P.Layout(page, dp, max(streams) * dp + 1, max(streams) + 1, dtype, kv_cache, tree_pages=tree_pages)
        jobs.append(("decode", lay, P.Buckets((P.GRID,), (1,), tuple(streams), packing=packing, logprobs=logprobs,
                                              chain_rows=tuple(draft_rows))))

    def build():
        from qwen_jax import dflash_programs as D
        out = {}
        for kind, lay, b in jobs:
            block = (D.Drafter(*drafter, D.DRAFT_WINDOW, tree_rows=max(draft_rows) if draft_tree else 0,
                               tree_branch=draft_tree or 2) if drafter is not None and kind == "decode" else None)
            progs = P.Programs(params, cfg, lay, b, backend, drafter=block)
            keys = [k for k in progs.bucket_keys() if k[0] == kind or (kind == "decode" and k[0] == "draft")]
            out[kind] = (progs, keys)
        return out

    def compile_all(built) -> float:
        t0 = time.perf_counter()
        for progs, keys in built.values():
            progs.compile(keys, progress=progress)
        return time.perf_counter() - t0

    if compile_timing:
        cache = tempfile.mkdtemp(prefix="qwen_jax_bench_cache_")
        P.enable_compilation_cache(cache)
        built = build()
        result.compile_cold_s = compile_all(built)
        result.programs = sum(len(k) for _, k in built.values())
        log(f"compile cold: {result.compile_cold_s:.1f} s ({result.programs} programs, cache {cache})")
        if warm:
            built = None
            built = build()
            result.compile_warm_s = compile_all(built)
            log(f"compile warm: {result.compile_warm_s:.1f} s")
    else:
        built = build()
        compile_all(built)
        result.programs = sum(len(k) for _, k in built.values())

    greedy = sampling.RequestSampling(seed=0, temperature=0.0)
    rng = np.random.default_rng(0)
    vocab = cfg.text.vocab_size
    if "prompt" in built:
        progs, _ = built["prompt"]
        table = np.arange(1, progs.layout.pages_per_stream + 1, dtype=np.int32)
        for n in prompt_lengths:
            ids = rng.integers(0, vocab, size=n)

            def one_prompt():
                for start in range(0, n, max_chunk):
                    k = min(max_chunk, n - start)
                    t = min(P.pages_for(k, P.GRID) * P.GRID, max_chunk)
                    t = next(r for r in rows if r >= t)
                    batch = P.prompt_batch(progs.layout, 1, t, [P.PromptChunk(ids[start:start + k], start, 1, table)])
                    out = progs.prompt(batch, P.sample_params([greedy], [start + k], 1))
                return out

            one_prompt()
            t0 = time.perf_counter()
            one_prompt()
            result.prompt_tokens_per_s[n] = n / (time.perf_counter() - t0)
            log(f"prompt {n} tokens: {result.prompt_tokens_per_s[n]:.1f} tok/s")
        progs.state = None
        built.pop("prompt")
    if "decode" in built:
        progs, _ = built["decode"]
        dp = progs.layout.pages_per_stream
        for s in streams:
            tables = [np.arange(1 + i * dp, 1 + (i + 1) * dp, dtype=np.int32) for i in range(s)]
            tokens = list(rng.integers(0, vocab, size=s))
            cache_len = [context] * s

            pipelined_decode(progs, tables, cache_len, greedy, 3, first_tokens=tokens)
            reps = []
            for _ in range(repeats):  # each from the same context: the same work
                cache_len = [context] * s
                t0 = time.perf_counter()
                pipelined_decode(progs, tables, cache_len, greedy, rounds, first_tokens=tokens)
                reps.append(rounds / (time.perf_counter() - t0))
            fps = float(np.median(reps))
            result.decode_forwards_per_s[s] = fps
            result.decode_tokens_per_s[s] = fps * s
            result.decode_repeats[s] = reps
            log(f"decode {s} streams: {fps:.1f} forwards/s, {fps * s:.1f} tok/s (repeats: "
                + ", ".join(f"{x:.1f}" for x in reps) + ")")
            for r in sorted(set(draft_rows)):
                for pipelined, into in ((False, result.draft_window_ms), (True, result.draft_pipelined_ms)):
                    ms = draft_windows(progs, tables, context, greedy, r, rounds, repeats, vocab, rng, pipelined,
                                       block=drafter is not None)
                    into.setdefault(s, {})[r] = ms
                    log(f"draft {s} streams x {r} rows{', pipelined' if pipelined else ''}"
                        f"{', block drafts' if drafter is not None else ''}"
                        f"{f', trees of branch {draft_tree}' if draft_tree else ''}: {ms:.2f} ms a window "
                        f"({ms * fps / 1000:.2f} decode rounds)")
    return result


def draft_windows(progs, tables, context: int, rule, rows: int, rounds: int, repeats: int, vocab: int,
                  rng, pipelined: bool = False, block: bool = False, slots: list[int] | None = None,
                  bucket: int | None = None) -> float:
    """`rounds` chain windows of `rows` rows for streams in slots 1..S from `context` cached tokens, after two
    untimed ones; timed `repeats` times -> ms a window (the median). As the engine's draft round runs them (each
    window's tokens on the host before the next one is built), or `pipelined`: each window after the first takes
    its first token and its streams' lengths from the device (`programs.draft_program`) and is enqueued before the
    previous one is fetched. The drafts are random tokens, so a window mostly keeps its first row only; what it
    costs does not depend on how many it keeps. `block`: DFlash windows (programs with a drafter), whose drafts
    the drafter made on the device after the previous window (`dflash_programs.FROM_DRAFT`). `slots`: the streams'
    GDN slots (default 1..S); `bucket`: the call's stream bucket (default S)."""
    from qwen_jax import dflash_programs as D
    import jax
    s = len(tables)
    slots = list(range(1, s + 1)) if slots is None else list(slots)
    lanes = s if bucket is None else bucket
    chain = list(range(-1, rows - 1))

    def windows(n: int) -> None:
        cache_len = [context] * s
        prev = None
        for k in range(n):
            toks = [list(rng.integers(0, vocab, size=rows)) for _ in range(s)]
            if block:
                toks = [t[:1] + [D.FROM_DRAFT] * (rows - 1) for t in toks]
            if pipelined and k:
                for t in toks:
                    t[0] = P.FROM_LAST
                window = P.tree_window(progs.layout, lanes, rows, toks, [chain] * s, [-1] * s, slots, tables)
                sp = P.sample_params([rule] * (s * rows), [0] * (s * rows), lanes * rows)
            else:
                window = P.tree_window(progs.layout, lanes, rows, toks, [chain] * s, cache_len, slots, tables)
                positions = [c + r + 1 for c in cache_len for r in range(rows)]
                sp = P.sample_params([rule] * (s * rows), positions, lanes * rows)
            cur = progs.draft_async(window, sp)
            if not pipelined:
                _, took, _ = progs.fetch_draft(cur)
                cache_len = [c + int(k) for c, k in zip(cache_len, took)]
            elif prev is not None:
                progs.fetch_draft(prev)
            prev = cur
        if pipelined and prev is not None:
            progs.fetch_draft(prev)
        jax.block_until_ready(progs.state)

    windows(2)
    reps = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        windows(rounds)
        reps.append((time.perf_counter() - t0) * 1000 / rounds)
    return float(np.median(reps))


def pipelined_decode(progs, tables, cache_len: list[int], rule, rounds: int, first_tokens=None,
                     slots: list[int] | None = None, bucket: int | None = None) -> None:
    """`rounds` decode calls for streams in `slots` (default 1..S; page `tables`, one per stream) as the engine runs
    them: each call dispatched before the previous one is fetched, its input tokens read on the device from the
    previous call's (programs.FROM_LAST; `first_tokens` feeds the first call from the host). Every stream samples
    with `rule`; cache_len advances in place. `bucket`: the calls' stream bucket (default S)."""
    s = len(tables)
    slots = list(range(1, s + 1)) if slots is None else list(slots)
    n = s if bucket is None else bucket
    prev = None
    for r in range(rounds):
        tokens = first_tokens if r == 0 and first_tokens is not None else [None] * s
        window = P.decode_window(progs.layout, n, tokens, cache_len, slots, tables)
        cur = progs.decode_async(window, P.sample_params([rule] * s, [c + 1 for c in cache_len], n))
        if prev is not None:
            progs.fetch(prev)
        prev = cur
        for i in range(s):
            cache_len[i] += 1
    if prev is not None:
        progs.fetch(prev)


def window_costs(progs, slot: int, table, context: int, rows: tuple[int, ...], *, block: bool, rounds: int,
                 max_windows: int, repeats: int = 5, seconds: float = 0.05, seed: int = 0) -> dict[int, float]:
    """What a lone stream's window of each of `rows` rows costs in decode rounds: the stream in `slot` (page
    `table`) at `context` cached tokens, in the smallest stream buckets of `progs`, timed as `run` times them and the
    engine runs them (decode rounds pipelined, each window enqueued behind the previous one) -> {rows: rounds}, the
    tables `DraftPolicy` decides from. Each timing runs at least `rounds` calls and enough for about `seconds` of
    decode rounds (a small model's millisecond rounds are host noise in a few calls), at most `max_windows` (the
    pages `table` holds past `context`); the median of `repeats` timings. The slot and pages are left holding what
    the calls wrote."""
    rng = np.random.default_rng(seed)
    greedy = sampling.RequestSampling(seed=0, temperature=0.0)
    vocab = progs.cfg.text.vocab_size
    first = [int(rng.integers(0, vocab))]
    n = progs.buckets.decode_bucket(1)

    def per_round(k: int) -> float:
        t0 = time.perf_counter()
        pipelined_decode(progs, [table], [context], greedy, k, first_tokens=first, slots=[slot], bucket=n)
        return (time.perf_counter() - t0) * 1000 / k

    per_round(3)
    calls = max(1, min(max_windows, max(rounds, int(seconds * 1000 / per_round(rounds)))))
    round_ms = float(np.median([per_round(calls) for _ in range(repeats)]))
    out = {}
    for r in rows:
        bucket, width = progs.buckets.chain_bucket(1, r)
        out[r] = draft_windows(progs, [table], context, greedy, width, calls, repeats, vocab, rng, pipelined=True,
                               block=block, slots=[slot], bucket=bucket) / round_ms
    return out


def synthetic_params(name: str, *, dtype: str, seed: int = 0, layers: int | None = None):
    """The named shape with random weights (4-bit where the config says so), built on the default device tensor
    by tensor (one small compiled program per distinct shape). -> (params, config)."""
    import jax
    import jax.numpy as jnp

    from qwen_jax.synthetic import random_params, synthetic_config
    cfg = synthetic_config(name, layers)
    jdt = jnp.float32 if dtype == "float32" else jnp.bfloat16
    params = random_params(cfg.text, jax.random.key(seed), dtype=jdt, quant=cfg.quantization)
    jax.block_until_ready(params)
    return params, cfg
