"""Offline evaluation (`python -m qwen_jax eval`): teacher-forced perplexity and fp8-vs-bf16 KV agreement, and
drafted against serial generation (acceptance, speed-up, the replies' equality).

A token sequence is cut into windows of `context` tokens, each scored from a fresh state (position 0); a window
runs as prompt chunks of `chunk` rows (one compiled program) through the same prefill the engine uses. Row i of
a window predicts token i + 1, so a window of W tokens scores W - 1 predictions.

The KV agreement can also run through the decode path (`kv_agreement(path="decode")`): each window as chain
verify windows of `rows` teacher-forced tokens, each committed before the next. Those are the window kernels a
served stream's every token goes through (a drafted window's rows have the serial steps' bits), where the fp8
cache is read by the decode attention rather than the prompt's.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np

from qwen_jax import programs as P
from qwen_jax.model import parallel


@dataclasses.dataclass(frozen=True)
class PplResult:
    tokens: int  # predictions scored
    nll: float  # mean negative log-likelihood (nats)
    ppl: float
    seconds: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class KvResult:
    tokens: int
    top1_agreement: float  # fraction of positions where fp8-KV and bf16-KV agree on the most likely next token
    mean_kl: float  # mean KL(p_bf16 || p_fp8) of the next-token distributions (nats)
    max_kl: float
    ppl_bf16: float
    ppl_fp8: float
    seconds: float
    path: str = "prompt"  # the kernels the cache was read through: prompt chunks or decode windows

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check(tokens: np.ndarray, context: int, chunk: int) -> None:
    if tokens.ndim != 1 or len(tokens) < 2:
        raise ValueError(f"the text has {len(tokens)} tokens; at least 2 are needed to score one prediction")
    if chunk < P.GRID or chunk % P.GRID:
        raise ValueError(f"--chunk must be a positive multiple of {P.GRID}, got {chunk}")
    if context < 2:
        raise ValueError(f"--context must be at least 2, got {context}")


def _windows(tokens: np.ndarray, context: int):
    for w0 in range(0, len(tokens) - 1, context):
        window = tokens[w0:w0 + context + 1]  # one token more: the last row's target
        if len(window) >= 2:
            yield window


def _chunks(window: np.ndarray, chunk: int, page_table: np.ndarray, layout: P.Layout):
    """(batch [1 x chunk], targets [chunk], real rows) for each chunk of a window's W - 1 scored rows."""
    rows = len(window) - 1
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        batch = P.prompt_batch(layout, 1, chunk, [P.PromptChunk(window[start:start + n], start, 1, page_table)])
        targets = np.zeros(chunk, np.int32)
        targets[:n] = window[start + 1:start + n + 1]
        yield batch, targets, n


def _layout(context: int, dtype: str, kv_cache: str) -> P.Layout:
    page = 64
    pages = P.pages_for(context, page)
    return P.Layout(page, pages, pages + 1, 2, dtype, kv_cache)


def _state(cfg, layout: P.Layout, backend):
    return parallel.place_state(P.init_pools(cfg, layout), backend)


def perplexity(params, cfg, tokens, *, backend, dtype: str = "bfloat16", kv_cache: str = "bf16",
               context: int = 4096, chunk: int = 512) -> PplResult:
    tokens = np.asarray(tokens, np.int32)
    _check(tokens, context, chunk)
    layout = _layout(context, dtype, kv_cache)
    state = _state(cfg, layout, backend)
    params = parallel.prepare(params, cfg, backend)
    page_table = np.arange(1, layout.pages_per_stream + 1, dtype=np.int32)
    fn = jax.jit(P.score_program(cfg, backend), donate_argnums=1)
    example = next(_chunks(tokens[:2], chunk, page_table, layout))
    exe = fn.lower(params, state, example[0], example[1]).compile()
    t0 = time.perf_counter()
    total, count = 0.0, 0
    for window in _windows(tokens, context):
        for batch, targets, n in _chunks(window, chunk, page_table, layout):
            state, lp, _ = exe(params, state, batch, targets)
            lp = np.asarray(lp, np.float64)[:n]
            total -= float(lp.sum())
            count += n
    nll = total / count
    return PplResult(count, nll, math.exp(nll), time.perf_counter() - t0)


KV_PATHS = ("prompt", "decode")
MAX_WINDOW_ROWS = 16  # the widest verify window the attention kernels take (`attention.window`: 1..16 rows)
_SLOT = 1  # the stream's GDN slot (slot 0 is the dummies')


def _decode_windows(window: np.ndarray, rows: int, page_table: np.ndarray, layout: P.Layout):
    """(chain verify window [1 x rows], targets [rows], path [1, rows], path_len [1], real rows) for each run of
    `rows` of a window's W - 1 scored rows, at the positions the earlier runs committed."""
    scored = len(window) - 1
    for start in range(0, scored, rows):
        n = min(rows, scored - start)
        win = P.tree_window(layout, 1, rows, [window[start:start + n]], [list(range(-1, n - 1))], [start], [_SLOT],
                            [page_table])
        targets = np.zeros(rows, np.int32)
        targets[:n] = window[start + 1:start + n + 1]
        yield win, targets, np.arange(rows, dtype=np.int32)[None], np.array([n], np.int32), n


def kv_agreement(params, cfg, tokens, *, backend, dtype: str = "bfloat16", context: int = 4096,
                 chunk: int = 512, path: str = "prompt", rows: int = MAX_WINDOW_ROWS) -> KvResult:
    """Teacher-forced fp8 (e4m3) KV cache against the compute-dtype cache, on the same tokens and weights.
    path "prompt": each window as prompt chunks of `chunk` rows; "decode": as chain verify windows of `rows`
    (`_decode_windows`), each window from fresh states."""
    if path not in KV_PATHS:
        raise ValueError(f"path must be one of {KV_PATHS}, got {path!r}")
    if path == "decode" and not 1 <= rows <= MAX_WINDOW_ROWS:
        raise ValueError(f"--window-rows must be in 1..{MAX_WINDOW_ROWS}, got {rows}")
    tokens = np.asarray(tokens, np.int32)
    _check(tokens, context, chunk)
    ref_layout = _layout(context, dtype, "bf16")
    test_layout = _layout(context, dtype, "fp8")
    ref, test = _state(cfg, ref_layout, backend), _state(cfg, test_layout, backend)
    params = parallel.prepare(params, cfg, backend)
    page_table = np.arange(1, ref_layout.pages_per_stream + 1, dtype=np.int32)
    if path == "prompt":
        fn = jax.jit(P.kv_compare_program(cfg, backend), donate_argnums=(1, 2))
        runs = lambda window: ((args, n) for *args, n in _chunks(window, chunk, page_table, ref_layout))
    else:
        fn = jax.jit(P.kv_compare_window_program(cfg, backend), donate_argnums=(1, 2))
        runs = lambda window: ((args, n) for *args, n in _decode_windows(window, rows, page_table, ref_layout))
    exe = fn.lower(params, ref, test, *next(runs(tokens[:2]))[0]).compile()
    t0 = time.perf_counter()
    kls, agree, nll_ref, nll_test = [], [], 0.0, 0.0
    for i, window in enumerate(_windows(tokens, context)):
        if path == "decode" and i:  # (a chain window reads its slot's GDN state: each window from zeros)
            ref, test = _state(cfg, ref_layout, backend), _state(cfg, test_layout, backend)
        for args, n in runs(window):
            ref, test, kl, ag, lp_ref, lp_test = exe(params, ref, test, *args)
            kls.append(np.asarray(kl, np.float64)[:n])
            agree.append(np.asarray(ag)[:n])
            nll_ref -= float(np.asarray(lp_ref, np.float64)[:n].sum())
            nll_test -= float(np.asarray(lp_test, np.float64)[:n].sum())
    kl = np.concatenate(kls)
    n = len(kl)
    return KvResult(n, float(np.concatenate(agree).mean()), float(kl.mean()), float(kl.max()),
                    math.exp(nll_ref / n), math.exp(nll_test / n), time.perf_counter() - t0, path)


# Used by `eval kv` when no --text is given: plain prose written for this purpose.
DEFAULT_TEXT = """\
The lighthouse keeper wrote down the weather every morning before the kettle boiled. Wind from the west, he
would write, a grey sea with long swells, two fishing boats leaving the harbour before six. On clear days he
added the colour of the hills across the bay, which changed with the seasons from brown to green to a pale,
almost silver blue in the weeks after the first frost. Nobody had asked him to keep these notes. The light had
been automatic for eleven years, and the company that owned it sent an engineer twice a year to look at the
batteries and the lamp. But the keeper had kept the log for thirty years when the work still needed him, and
he saw no reason to stop now that it did not.
His daughter visited in the summer and read through the older books in the evenings. She found storms she
remembered from her childhood, described in three flat lines, and a page from the winter her mother died on
which he had written only the wind direction and the temperature. She asked him once why he never wrote about
himself. He said the weather was what there was to write about, and that anyone who wanted to know how he had
been could read the weather and work it out. She thought that was probably true. The calm weeks in spring were
the weeks he had been happiest, and the long autumn gales were the months he had been ill, though he had
written nothing about being ill. When she left at the end of August she took the oldest book with her, and he
started a new one the next morning, as he always did when a book was full.
"""


@dataclasses.dataclass(frozen=True)
class DraftResult:
    """Drafted against serial generation of the same prompts on one engine (`draft_speedup`)."""
    prompts: int
    streams: int  # requests in flight at once
    tokens: int  # generated tokens of each pass (the same replies)
    serial_seconds: float
    drafted_seconds: float
    windows: int  # drafted windows verified (one a stream)
    proposed: int  # draft tokens proposed
    accepted: int  # draft tokens accepted
    mismatched: int  # prompts whose drafted reply is not the serial one (an exactness failure: must be 0)

    @property
    def accepted_per_window(self) -> float:
        return self.accepted / self.windows if self.windows else 0.0

    @property
    def speedup(self) -> float:
        return self.serial_seconds / self.drafted_seconds if self.drafted_seconds else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "accepted_per_window": self.accepted_per_window,
                "tokens_per_window": self.accepted_per_window + 1, "speedup": self.speedup}

    def line(self) -> str:
        return (f"{self.prompts} prompts, {self.streams} at a time, {self.tokens} tokens: serial "
                f"{self.tokens / self.serial_seconds:.1f} tok/s, drafted {self.tokens / self.drafted_seconds:.1f} "
                f"tok/s ({self.speedup:.2f}x); {self.accepted_per_window:.2f} of "
                f"{self.proposed / max(self.windows, 1):.2f} drafts accepted a window ({self.windows} windows); "
                f"drafted replies equal serial: {self.prompts - self.mismatched}/{self.prompts}")


def draft_prompts(tokens, count: int, length: int) -> list[tuple[int, ...]]:
    """`count` prompts of `length` tokens cut from tokens at evenly spaced offsets."""
    tokens = list(tokens)
    if count < 1 or length < 1:
        raise ValueError(f"--prompts and --prompt-tokens must be at least 1, got {count} and {length}")
    if len(tokens) < length:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than --prompt-tokens {length}")
    offsets = (i * (len(tokens) - length) // max(count - 1, 1) for i in range(count))
    return [tuple(tokens[o:o + length]) for o in offsets]


def draft_speedup(engine, prompts, *, max_tokens: int, streams: int = 1) -> DraftResult:
    """Each prompt's greedy reply of max_tokens (EOS ignored), serially (`draft` False) and drafted, `streams`
    requests at a time; both passes run once untimed first (the first calls of a program pay for loading it)."""
    from qwen_jax.engine.api import GenerationRequest

    reqs = [GenerationRequest(tuple(p), max_tokens, ignore_eos=True) for p in prompts]
    if streams < 1:
        raise ValueError(f"--streams must be at least 1, got {streams}")

    def run(draft: bool):
        out = []
        t0 = time.perf_counter()
        for i in range(0, len(reqs), streams):
            handles = [engine.submit(dataclasses.replace(r, draft=draft)) for r in reqs[i:i + streams]]
            out += [h.result() for h in handles]
        return out, time.perf_counter() - t0

    for draft in (False, True):
        engine.submit(dataclasses.replace(reqs[0], max_tokens=min(max_tokens, 8), draft=draft)).result()
    serial, serial_s = run(False)
    before = engine.stats()
    drafted, drafted_s = run(True)
    after = engine.stats()
    for r in serial + drafted:
        if r.finish_reason == "error":
            raise RuntimeError(f"generation failed: {r.error}")
    return DraftResult(
        prompts=len(reqs), streams=min(streams, len(reqs)), tokens=sum(len(r.token_ids) for r in serial),
        serial_seconds=serial_s, drafted_seconds=drafted_s,
        windows=after.draft_windows_total - before.draft_windows_total,
        proposed=after.draft_proposed_total - before.draft_proposed_total,
        accepted=after.draft_accepted_total - before.draft_accepted_total,
        mismatched=sum(a.token_ids != b.token_ids for a, b in zip(serial, drafted)))
