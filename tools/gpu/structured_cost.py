"""What one structured-output stream costs the other streams of the engine, measured through the Engine itself on
random weights (`--synthetic 27b` on a GPU; `--synthetic tiny` runs on a CPU in about a minute).

A stream with a grammar is never pipelined itself: before each of its steps its last token must be on the host,
to compute its mask (`structured.Matcher.allowed`) and put its bias row. Since session 49 it sits out the decode
call after each of its own, so the other streams' calls stay pipelined (before, every call in flight landed
first, and the other streams' rounds lost their host/device overlap). Per count N of free streams (`--streams`),
in one process, after warm-up:
  (a) N free streams alone (greedy, EOS ignored): their forwards/s over `--rounds` tokens each, after `--warmup`;
  (b) the same N free streams beside one structured stream (a JSON schema, seeded sampling, EOS its stop; a new one
      is submitted whenever its document closes, so one always runs, each with a short prompt of its own): the
      free streams' forwards/s again over the same tokens, the structured stream's tokens/s over that window, and
      the host time of its grammar calls. The schema is compiled anew for (b), so its masks start cold, as a new
      schema's would;
  (c) (b) again with the same grammar and requests: the same replies (a reply does not depend on the streams
      beside it), so the same parser states, whose masks the grammar's cache now holds (as far as its
      `structured.MASK_CACHE_BYTES` keeps them: ~130 masks at the 27B's vocabulary, and ~1080 more bit-packed);
  (d) the control: the same requests without the grammar (EOS ignored), each as long as its structured reply was,
      so the free streams share their calls with one more stream, whose requests come and go as in (b), but every
      call stays pipelined. (b) and (c) against (d) is what the grammar costs; (d) against (a) what one more
      stream costs (on a GPU's batched shapes, a lone free stream's calls move from the 1-stream to the 2-stream
      program).
The grammar's calls are timed by wrapping Matcher.allowed and Matcher.advance for each phase (the engine keeps no
counters of its own there). A mask is "computed" when allowed() hands back an array it has not handed back before
(the grammar's cache returns the same array on a hit), else "cached".

The synthetic model has no tokenizer, and structured outputs need each token's bytes, so the tool builds one: a
byte-level BPE vocabulary of the model's size (`synthetic_tokenizer`: tools/bench_structured.py's synthetic token
texts, i.e. single bytes, JSON punctuation runs, whitespace runs, digits, escapes, CJK characters whole and in
pieces, words bare and glued to quotes; the EOS ids and the ids between them special, ids past them padding, as a
Qwen checkpoint's vocabulary is laid out) through the tokenizers library, so the engine builds its TokenBytes from
it (`Engine.token_bytes`) and detokenizes every reply as it does when serving.

    python tools/gpu/structured_cost.py --synthetic 27b --streams 1,15 --rounds 256 --repeats 2
    python tools/gpu/structured_cost.py --synthetic tiny --streams 1,15 --rounds 128 --context 64   # CPU, ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import statistics
import sys
import time
import weakref
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tools.bench_structured (the synthetic vocabulary), qwen_jax without an install

# The structured stream's schema: strings with length limits, integers, an array and a nested object, so that its
# documents close (every part is bounded) and its parser goes through keys, strings, numbers and brackets.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "email": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "integer"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}

# `--synthetic tiny`: a small qwen3_5 text shape with 4-bit weights (GDN and attention layers alternating), its
# vocabulary laid out as the 27B's: text tokens, the EOS ids among a few special ones, padding.
TINY = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, full_attention_interval=2,
            rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]})
TINY_EOS = [4000, 4002]


def synthetic_tokenizer(vocab_size: int, eos_ids, seed: int = 0):
    """A byte-level BPE tokenizer (transformers' fast tokenizer over a tokenizers BPE model with no merges: it
    decodes every id, it is not meant to encode) for a model of `vocab_size` ids: text tokens below the first EOS
    id (tools/bench_structured.py's synthetic vocabulary), special tokens from there up to the last EOS id,
    padding past it. -> (tokenizer, the text tokens' bytes)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from qwen_jax.structured import _byte_level_alphabet  # the table TokenBytes.from_tokenizer reads back
    from tools.bench_structured import synthetic_vocab
    first, last = min(eos_ids), max(eos_ids)
    if not 1024 <= first <= last < vocab_size:
        raise ValueError(f"EOS ids {sorted(eos_ids)} leave no room for a byte-level vocabulary of {vocab_size} ids")
    texts = synthetic_vocab(first, seed)[:first]
    letter = {b: c for c, b in _byte_level_alphabet().items()}
    vocab = {"".join(letter[b] for b in t): i for i, t in enumerate(texts)}
    model = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.add_special_tokens([AddedToken(f"<|special_{i}|>", special=True) for i in range(first, last + 1)])
    return PreTrainedTokenizerFast(tokenizer_object=model), texts


def synthetic_model(name: str, dtype: str, layers: int | None, seed: int):
    """(params, config) of random weights at the named shape."""
    from qwen_jax.engine import bench
    if name == "27b":
        return bench.synthetic_params("27b", dtype=dtype, layers=layers, seed=seed)
    import jax
    import jax.numpy as jnp

    from qwen_jax.config import parse_config
    from qwen_jax.synthetic import random_params
    raw = dict(model_type="qwen3_5_text", **TINY, quantization={"bits": 4, "group_size": 32})
    if layers is not None:
        raw["num_hidden_layers"] = layers
    cfg = parse_config(raw, {"eos_token_id": TINY_EOS})
    params = random_params(cfg.text, jax.random.key(seed), dtype=jnp.float32 if dtype == "float32" else jnp.bfloat16,
                           quant=cfg.quantization)
    jax.block_until_ready(params)
    return params, cfg


class GrammarTimer:
    """Times every call of Matcher.allowed and Matcher.advance while installed (a context manager; the scheduler
    thread makes them): `calls` holds (end time, seconds, kind), kind "computed", "cached" or "advance". `handed`:
    the masks allowed() handed back so far (by id; give the same one to the phases of one grammar), since a cache
    hit hands back the same array and a mask computed again (evicted meanwhile) is a new one."""

    def __init__(self, handed: weakref.WeakValueDictionary | None = None):
        self.calls: list[tuple[float, float, str]] = []
        self.handed = weakref.WeakValueDictionary() if handed is None else handed

    def __enter__(self) -> "GrammarTimer":
        from qwen_jax import structured
        matcher = structured.Matcher
        self._shipped = matcher.allowed, matcher.advance
        allowed, advance = self._shipped
        calls, handed = self.calls, self.handed

        def timed_allowed(m):
            t0 = time.perf_counter()
            mask = allowed(m)
            t1 = time.perf_counter()
            kind = "cached" if handed.get(id(mask)) is mask else "computed"
            handed[id(mask)] = mask
            calls.append((t1, t1 - t0, kind))
            return mask

        def timed_advance(m, token_id):
            t0 = time.perf_counter()
            try:
                return advance(m, token_id)
            finally:
                t1 = time.perf_counter()
                calls.append((t1, t1 - t0, "advance"))

        matcher.allowed, matcher.advance = timed_allowed, timed_advance
        return self

    def __exit__(self, *exc) -> None:
        from qwen_jax import structured
        structured.Matcher.allowed, structured.Matcher.advance = self._shipped


@dataclasses.dataclass
class Phase:
    """One timed phase: the free streams' rates over the window, and with a structured stream its figures."""
    free: int
    rates: list[float]  # each free stream's tokens/s within the window
    window_s: float  # from the first free stream's window start to the last one's end (`_Window`)
    extra_tokens: int = 0  # the extra stream's tokens within the window (its requests one after another)
    # every extra request of the phase: (tokens, finish reason, text)
    documents: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    computed_s: list[float] = dataclasses.field(default_factory=list)  # masks computed, the whole phase
    cached_s: list[float] = dataclasses.field(default_factory=list)  # masks from the cache, the whole phase
    grammar_window_s: float = 0.0  # allowed() and advance() calls within the window, in all

    @property
    def forwards_per_s(self) -> float:
        return statistics.fmean(self.rates)

    @property
    def tokens_per_s(self) -> float:
        return sum(self.rates)

    @property
    def extra_tokens_per_s(self) -> float:
        return self.extra_tokens / self.window_s

    @property
    def closed(self) -> list[int]:
        """Tokens of each document that closed (finish "stop")."""
        return [n for n, why, _ in self.documents if why == "stop"]

    @property
    def grammar_ms_per_token(self) -> float:
        return 1000 * self.grammar_window_s / max(1, self.extra_tokens)  # 0 for a plain extra stream


class _Window:
    """The free streams' token times, and each one's window: `rounds` tokens from the one it had when the last of
    them reached `warmup` tokens (all prompts done, every free stream decoding); then it cancels them. A stream's
    rate is measured on its own times (the tokens of one call reach the readers microseconds apart)."""

    def __init__(self, handles, warmup: int, rounds: int):
        self.handles, self.warmup, self.rounds = handles, warmup, rounds
        self.times: list[list[float]] = [[] for _ in handles]
        self.first: list[int] | None = None  # each stream's token index where its window starts
        self.warm, self.done = set(), set()

    def seen(self, i: int) -> None:
        n = len(self.times[i])
        if self.first is None:
            if n >= self.warmup:
                self.warm.add(i)
            if len(self.warm) == len(self.times):
                # a stream whose token of this call is not read yet starts at its previous one: also after every
                # prompt call, as `warmup` >= 2 tokens came after the last stream's prompt
                self.first = [len(t) - 1 for t in self.times]
        elif i not in self.done and n > self.first[i] + self.rounds:
            self.done.add(i)
            if len(self.done) == len(self.times):
                for h in self.handles:
                    h.cancel()

    @property
    def closed(self) -> bool:
        return len(self.done) == len(self.times)

    def spans(self) -> list[tuple[float, float]]:
        """Each stream's window: (time of its first token, time of its last) -> `rounds` tokens apart."""
        return [(t[a], t[a + self.rounds]) for t, a in zip(self.times, self.first)]

    async def read(self, i: int) -> None:
        async for ev in self.handles[i]:
            if ev.token_ids:
                self.times[i] += [time.perf_counter()] * len(ev.token_ids)
                self.seen(i)
            if ev.finish_reason in ("error", "length") or (ev.finish_reason == "cancelled" and not self.closed):
                raise RuntimeError(f"free stream {i} ended ({ev.finish_reason}: {ev.error}) after "
                                   f"{len(self.times[i])} tokens, before the window closed")


async def _extra_loop(engine, make_request, stop: asyncio.Event, started: asyncio.Event, times: list[float],
                      documents: list[tuple[int, str, str]]) -> None:
    """The extra stream's requests one after another, each submitted as the one before it ends, until `stop` (the
    one running then is cancelled)."""
    k = 0
    while not stop.is_set():
        handle = engine.submit(make_request(k))
        k += 1
        before, cancelled, text = len(times), False, []
        async for ev in handle:
            text.append(ev.text)
            if ev.token_ids:
                times += [time.perf_counter()] * len(ev.token_ids)
                started.set()
            if ev.finish_reason == "error":
                raise RuntimeError(f"extra request {k - 1}: {ev.error}")
            if stop.is_set() and not cancelled:
                handle.cancel()
                cancelled = True
        documents.append((len(times) - before, handle.finish_reason, "".join(text)))


async def _phase(engine, free_requests, warmup: int, rounds: int, make_extra):
    stop, started = asyncio.Event(), asyncio.Event()
    extra_times: list[float] = []
    documents: list[tuple[int, str, str]] = []
    loop = None
    if make_extra is not None:  # running before the free streams come, and until they are done
        loop = asyncio.create_task(_extra_loop(engine, make_extra, stop, started, extra_times, documents))
        first = asyncio.create_task(started.wait())
        await asyncio.wait([loop, first], return_when=asyncio.FIRST_COMPLETED)
        if loop.done():
            first.cancel()
            loop.result()  # it failed before its first token
    try:
        window = _Window(engine.submit_all(free_requests), warmup, rounds)
        await asyncio.gather(*(window.read(i) for i in range(len(free_requests))))
    finally:
        stop.set()
        if loop is not None:
            await loop
    return window, extra_times, documents


def run_phase(engine, free: int, *, rounds: int, warmup: int, context: int, prompt_ids, grammar=None,
              plain_lengths: list[int] | None = None, structured_prompt: int = 64, structured_max_tokens: int = 512,
              bias=(), seed: int = 0, handed: weakref.WeakValueDictionary | None = None) -> Phase:
    """N free streams (prompts of `context` tokens, greedy, EOS ignored), alone, or with one more stream beside
    them: structured when `grammar` (a structured.Grammar) is given, plain when `plain_lengths` is (the same
    requests without the grammar, EOS ignored, the k-th one `plain_lengths[k]` tokens long) -> the phase's figures
    over the window (`_Window`: `rounds` tokens of every free stream after each has had `warmup`). The extra
    requests of a phase are the same for the same seed, and so are their replies (a reply does not depend on the
    streams beside it). `handed`: the masks the grammar handed back in earlier phases (GrammarTimer)."""
    from qwen_jax.engine.api import GenerationRequest, SamplingOptions
    rng = np.random.default_rng(seed)
    free_requests = [GenerationRequest(prompt_ids(rng, context), engine.max_model_len - context,
                                       SamplingOptions(temperature=0.0), ignore_eos=True, request_id=f"free-{i}")
                     for i in range(free)]

    def extra_request(k: int) -> GenerationRequest:
        prompt = prompt_ids(np.random.default_rng((seed, k)), structured_prompt)
        options = SamplingOptions(temperature=1.0, seed=seed * 1000 + k, logit_bias=bias)
        if grammar is not None:
            return GenerationRequest(prompt, structured_max_tokens, options, grammar=grammar,
                                     request_id=f"structured-{k}")
        tokens = plain_lengths[k] if k < len(plain_lengths) else round(statistics.fmean(plain_lengths))
        return GenerationRequest(prompt, max(1, tokens), options, ignore_eos=True, request_id=f"plain-{k}")

    beside = grammar is not None or plain_lengths is not None
    with GrammarTimer(handed) as timer:
        window, extra_times, documents = asyncio.run(
            _phase(engine, free_requests, warmup, rounds, extra_request if beside else None))
    spans = window.spans()
    start, end = min(a for a, _ in spans), max(b for _, b in spans)
    return Phase(free, [rounds / (b - a) for a, b in spans], end - start,
                 sum(1 for t in extra_times if start < t <= end), documents,
                 [s for _, s, k in timer.calls if k == "computed"], [s for _, s, k in timer.calls if k == "cached"],
                 sum(s for t, s, k in timer.calls if start < t <= end))


@dataclasses.dataclass
class Row:
    """One count of free streams: its repeats alone, beside a structured stream of a new grammar, beside the same
    structured requests again (the grammar's masks cached, where its cache kept them), and beside a plain stream
    of the same requests without the grammar, each as long as its structured reply was; each kind's median."""
    free: int
    alone_runs: list[Phase] = dataclasses.field(default_factory=list)
    new_runs: list[Phase] = dataclasses.field(default_factory=list)
    again_runs: list[Phase] = dataclasses.field(default_factory=list)
    plain_runs: list[Phase] = dataclasses.field(default_factory=list)

    @staticmethod
    def median(runs: list[Phase]) -> Phase:
        """The repeat whose free forwards/s is the median (the lower one of an even count)."""
        return sorted(runs, key=lambda p: p.forwards_per_s)[(len(runs) - 1) // 2]


def describe(p: Phase) -> str:
    """One phase in a line of the log."""
    line = f"{p.forwards_per_s:.1f} forwards/s, {p.tokens_per_s:.1f} tok/s (window {p.window_s:.2f} s)"
    if not p.documents:
        return line
    docs = [n for n, _, _ in p.documents]
    line += (f"; the extra stream {p.extra_tokens_per_s:.1f} tok/s, {len(docs)} requests (tokens: "
             f"{', '.join(map(str, docs[:8]))}{' ...' if len(docs) > 8 else ''})")
    if not (p.computed_s or p.cached_s):
        return line
    sample = next((text for _, why, text in p.documents if why == "stop"), None)
    return (f"{line}, {len(p.closed)} documents closed, masks {len(p.computed_s)} computed "
            f"({1000 * sum(p.computed_s):.1f} ms) + {len(p.cached_s)} cached ({1000 * sum(p.cached_s):.1f} ms), "
            f"grammar {p.grammar_ms_per_token:.3f} ms a structured token in the window"
            + (f"; the first document: {sample[:300]!r}" if sample else ""))


def table(rows: list[Row]) -> list[str]:
    """The markdown table: per count of free streams, the medians' figures."""
    def change(p: Phase, base: Phase) -> str:
        return f"{p.forwards_per_s:.1f} ({100 * (p.forwards_per_s / base.forwards_per_s - 1):+.1f} %)"

    def masks(p: Phase) -> str:
        computed = (f"{len(p.computed_s)} computed ({1e3 * statistics.fmean(p.computed_s):.2f} / "
                    f"{1e3 * max(p.computed_s):.2f} ms)" if p.computed_s else "0 computed")
        cached = f"{len(p.cached_s)} cached ({1e6 * statistics.fmean(p.cached_s):.0f} us)" if p.cached_s else "0 cached"
        return f"{computed}, {cached}"

    out = ["| free streams | free fwd/s alone | beside 1 plain stream (vs alone) | beside 1 structured, new grammar "
           "(vs plain) | beside the same again (vs plain) | extra stream tok/s (plain / new / again) | documents "
           "closed (mean tokens) | masks, new grammar (mean / max) | masks, again | grammar host ms a structured "
           "token (new / again) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        alone, plain, new, again = (Row.median(r) for r in (row.alone_runs, row.plain_runs, row.new_runs,
                                                              row.again_runs))
        out.append(f"| {row.free} | {alone.forwards_per_s:.1f} | {change(plain, alone)} | {change(new, plain)} | "
                   f"{change(again, plain)} | {plain.extra_tokens_per_s:.1f} / {new.extra_tokens_per_s:.1f} / "
                   f"{again.extra_tokens_per_s:.1f} | {len(new.closed)} "
                   f"({statistics.fmean(new.closed) if new.closed else 0:.0f}) | {masks(new)} | {masks(again)} | "
                   f"{new.grammar_ms_per_token:.3f} / {again.grammar_ms_per_token:.3f} |")
    return out


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic", choices=("27b", "tiny"), default="27b",
                    help="the shape with random weights: the 27B's (a GPU) or a tiny one (a CPU run)")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first layers of the shape")
    ap.add_argument("--streams", default="1,15", help="free streams beside the structured one (comma list)")
    ap.add_argument("--rounds", type=int, default=256, help="measured tokens of each free stream")
    ap.add_argument("--warmup", type=int, default=16, help="tokens of each free stream before the measured ones")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of each free stream")
    ap.add_argument("--structured-prompt", type=int, default=64, help="prompt tokens of each structured request")
    ap.add_argument("--structured-max-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3, help="each count's four phases this many times (medians kept)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--kv-cache", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-cache", default="", help="a persistent compilation cache dir ('' = off)")
    args = ap.parse_args(argv)
    try:
        streams = sorted({int(s) for s in args.streams.split(",") if s.strip()})
    except ValueError:
        raise SystemExit(f"error: --streams must be comma-separated integers, got {args.streams!r}") from None
    if not streams or streams[0] < 1:
        raise SystemExit("error: --streams must be positive")
    if args.warmup < 2:
        raise SystemExit("error: --warmup must be at least 2 (the window starts after every prompt call)")
    for name in ("rounds", "context", "structured_prompt", "structured_max_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be positive")
    command = "python tools/gpu/structured_cost.py " + shlex.join(sys.argv[1:] if argv is None else argv)

    import jax

    from qwen_jax import programs as P
    from qwen_jax import structured as S
    from qwen_jax.engine.engine import Engine
    if args.compile_cache:
        P.enable_compilation_cache(args.compile_cache)
    device = jax.devices()[0].device_kind
    t0 = time.perf_counter()
    params, cfg = synthetic_model(args.synthetic, args.dtype, args.layers, args.seed)
    print(f"synthetic {args.synthetic}: random weights in {time.perf_counter() - t0:.1f} s on {device}", flush=True)
    t0 = time.perf_counter()
    vocab = cfg.text.vocab_size
    tokenizer, texts = synthetic_tokenizer(vocab, cfg.eos_token_ids, args.seed)
    print(f"synthetic tokenizer: {len(texts)} texts, {len(tokenizer)} ids of {vocab}, in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    # Prompts: ids of text tokens; the context holds a free stream's prompt and tokens, or a structured reply.
    def prompt_ids(rng, n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(0, len(texts), n))

    # A free stream's tokens: its warm-up and window, and those it makes while later free streams still prompt
    # (up to a prompt call a chunk of each of them).
    stagger = streams[-1] * P.pages_for(args.context, P.GRID)
    need = max(args.context + args.warmup + args.rounds + stagger + P.GRID,
               args.structured_prompt + args.structured_max_tokens)
    engine = Engine(params, cfg, tokenizer, model_name=f"synthetic-{args.synthetic}", dtype=args.dtype,
                    kv_cache=args.kv_cache, max_model_len=P.pages_for(need + 1, P.GRID) * P.GRID,
                    parallel=streams[-1] + 1, max_queued=streams[-1] + 1, max_prefill_chunk=P.GRID,
                    prefill_step=P.GRID, progress=False)
    t0 = time.perf_counter()
    engine.start()
    print(f"engine: {engine.shape_policy} shapes, decode buckets {engine.buckets.decode_streams}, compiled in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    token_bytes = engine.token_bytes()  # else built at the first structured request, on the scheduler thread
    print(f"TokenBytes ({token_bytes.vocab_size} ids) built in {time.perf_counter() - t0:.2f} s", flush=True)
    # -100 on whitespace-only tokens (added to the grammar's mask), as the engine's tests do: random weights may
    # favour whitespace, which JSON allows (16 bytes a run) between any two tokens, and which only lengthens the
    # documents.
    bias = tuple((i, -100.0) for i, t in enumerate(texts) if not t.strip())
    common = dict(context=args.context, prompt_ids=prompt_ids, bias=bias,
                  structured_prompt=args.structured_prompt, structured_max_tokens=args.structured_max_tokens)

    rows: list[Row] = []
    try:
        t0 = time.perf_counter()
        for n in streams:  # every decode bucket the phases use, the grammar's host paths, the event readers
            for extra in ({}, dict(grammar=S.compile_json_schema(SCHEMA)), dict(plain_lengths=[8])):
                run_phase(engine, n, rounds=4, warmup=4, seed=args.seed + 99, **extra, **common)
        print(f"warm-up: {time.perf_counter() - t0:.1f} s", flush=True)
        for n in streams:
            row = Row(n)
            for r in range(args.repeats):
                grammar = S.compile_json_schema(SCHEMA)  # a new grammar: its masks start cold
                handed = weakref.WeakValueDictionary()
                seed = args.seed + r
                for what, into, extra in (("alone", row.alone_runs, {}),
                                          ("beside 1 structured, new grammar", row.new_runs, dict(grammar=grammar)),
                                          ("beside the same again", row.again_runs, dict(grammar=grammar)),
                                          ("beside 1 plain stream", row.plain_runs, None)):
                    if extra is None:  # the structured replies' lengths, without the grammar
                        extra = dict(plain_lengths=[k for k, _, _ in row.new_runs[-1].documents])
                    into.append(run_phase(engine, n, rounds=args.rounds, warmup=args.warmup, seed=seed,
                                          handed=handed, **extra, **common))
                    print(f"{n} free streams, repeat {r + 1}, {what}: {describe(into[-1])}", flush=True)
            rows.append(row)
    finally:
        engine.shutdown()

    def runs(which: str) -> str:
        return "; ".join(", ".join(f"{p.forwards_per_s:.1f}" for p in getattr(r, which)) for r in rows)

    print(f"\n{command}\n\n{device}, synthetic {args.synthetic}{f' ({args.layers} layers)' if args.layers else ''}, "
          f"{engine.shape_policy} shapes, {args.dtype}, {args.kv_cache} KV; free streams: greedy, prompts of "
          f"{args.context} tokens, {args.rounds} tokens timed each after {args.warmup}; structured: a JSON schema, "
          f"seeded sampling, prompts of {args.structured_prompt} tokens, a new grammar each repeat (masks cold), "
          f"then the same requests again (masks cached where the grammar's cache kept them), then as a plain stream "
          f"(no grammar, each request as long as its structured reply); the median of {args.repeats} repeats (free "
          f"fwd/s alone: {runs('alone_runs')}; plain: {runs('plain_runs')}; new grammar: {runs('new_runs')}; again: "
          f"{runs('again_runs')}). Masks: n and ms over each phase; grammar host ms (allowed + advance) within the "
          f"window.\n")
    print("\n".join(table(rows)))
    return rows


if __name__ == "__main__":
    main()
