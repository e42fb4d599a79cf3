"""The engine's fixed set of jitted programs: static shapes, state pools donated and updated in place, every
bucket compiled ahead of time (`Programs.compile`), so serving never traces or compiles.

Programs (each one XLA executable per bucket):
  prompt  [lanes x rows]  one prompt chunk for each of up to `lanes` streams; writes K/V and advances the GDN
                          slots; samples each lane's next token from its last real row (kept only when the chunk
                          ends the prompt).
  decode  [streams x 1]   one serial step for every decoding stream: verify the pending token, commit it, sample
                          the next one. The fused form of verify + commit while windows are one row. A row's
                          input token may come from the host or (`FROM_LAST`) from the token the slot's previous
                          decode call sampled, kept on the device, so the engine dispatches a call before the
                          previous one is fetched. Two variants, `decode` and `decode_sorted`, fix the sampling
                          path; the host picks one per call (no device-side branch to wait for).
  verify  [streams x rows] a drafted window (chain or tree) per stream, states read-only; samples every row and
                          returns the per-layer rows `commit` replays. Only compiled for `Buckets.window_rows`.
  draft   [streams x rows] a copy-draft chain window per stream (`model.verify(chain=True)`): writes the chain's
                          K/V, every row attends as the serial step at its position would, samples every row,
                          accepts each chain up to its first draft that is not its predecessor row's sample, and
                          commits the accepted rows: one program a window, no host round trip between sampling
                          and commit. Only compiled for `Buckets.chain_rows`.
  commit  [streams x rows] writes each stream's accepted path into its state.
  slot_copy               copies one GDN slot's recurrent states and conv windows to another (the prompt cache
                          keeps and restores them). Only compiled with `Buckets.slot_copy`.
  score / kv_compare      teacher-forced evaluation chunks (`python -m qwen_jax eval`).
With a DFlash drafter (`Programs(drafter=)`), prompt, draft and slot_copy also take the drafter's params and
state: each prompt chunk and each window feeds the drafter the target's taps of its committed rows and drafts
the slot's next block on the device, which the next window reads (qwen_jax.dflash_programs).

Batches are the model's own pytrees (`PrefillBatch`, `VerifyWindow`) holding numpy arrays built on the host by
`prompt_batch` / `decode_window` / `tree_window`; the engine never builds jnp graphs.

Why the buckets look the way they do (exactness). A row's bits must not depend on which other rows ride in the
same call, nor on where its prompt was cut. What holds, measured on the reference path (XLA:CPU, captures/tiny,
fp32 and bf16; tests/test_programs.py keeps it checked):
  * Within one program shape, a row's bits depend neither on its lane nor on what the other lanes hold.
  * Across shapes they can differ. XLA:CPU's dot is row-invariant in bf16 (M = 1..4096) and in fp32 for M >= 2,
    but an fp32 row alone (M = 1, a GEMV) rounds differently once K >= 1024. Worse, the code XLA:CPU emits for a
    fused reduction (the RMS norm in front of the GDN output projection at [4, T, 4, 32]: T = 320 vs 256) and for
    `exp` on small arrays (5 or 7 elements) depends on the whole array's shape. Whole model, fp32: one stream's
    decode logits at 2 vs 16 streams differ from layer 0 on; decode buckets 1..16 made 10 of 16 requests differ
    from their solo runs (bf16: none). With one lane, prompt chunks of 64..512 rows gave bit-identical logits
    and states; four lanes batched at T = 320 vs 256 + 64 did not.
So on the reference path (`Packing.MAPPED`) a prompt call runs its lanes one after another through the one-lane
forward (`lax.scan`, empty lanes skipped), which makes every lane's computation the same shape whatever the
lane count; and decode uses one stream bucket (every round has the same shape; solo requests run in it too).
The Pallas kernels fix their reduction order from the weight and tile shapes alone (qmm, attention, GDN), so with
kernels on and quantized linear weights (`row_invariant`) prompt lanes can be batched into one forward
(`Packing.BATCHED`) with power-of-two decode stream buckets; `pytest -m gpu` checks that on the device, where it
failed in session 2 and holds since the row norms became kernels (session 3). There the batched shapes are the
default (`BATCHED_BY_DEFAULT`): a lone stream decodes in a 1-stream program instead of paying for fifteen idle
ones, for twice the programs to compile.

Letters: s lanes/streams in one call, t prompt rows, r window rows, v vocabulary, n top logprobs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import math
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import qmm
from pallas_kernels.qweight import QuantizedWeight
from qwen_jax import model as M
from qwen_jax import sampling
from qwen_jax.config import ModelConfig
from qwen_jax.model import parallel
from qwen_jax.model.forward import kv_dtype_for, text_rope_positions

GRID = 64  # prompt chunks start on this grid of absolute positions (the GDN chunk; attention key blocks)
# Rows (streams x rows each) a draft window call may have by default: the decode qmm streams a projection's weights
# once for up to 16 rows, and again for each 16 more, so a window of more rows costs several decode rounds (H100,
# session 40: 16 streams x 2 rows 1.8 rounds, x 8 rows 4.8; one stream x 16 rows 1.3). The engine drafts fewer rows
# a stream as more streams draft, and none past 8 streams.
CHAIN_ROW_BUDGET = 16


class Packing(str, enum.Enum):
    BATCHED = "batched"  # a prompt call's lanes share one forward ([lanes, rows] matmuls)
    MAPPED = "mapped"  # lanes run one after another through the one-lane forward inside the program


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static sizes shared by every program. The page-table width is the same everywhere, so attention's key
    axis has one length in every program (the reference gathers the whole table)."""
    page_size: int
    pages_per_stream: int  # page-table width: ceil(max_model_len / page_size)
    num_pages: int  # KV pages in the pool, page 0 the dummy that padding rows point at
    num_slots: int  # GDN state slots, slot 0 the dummy
    dtype: str = "bfloat16"  # compute dtype: bfloat16 or float32
    kv_cache: str = "bf16"  # bf16 (the compute dtype) or fp8 (e4m3 with per-row scales)
    # rows of the media pool (embeddings prompt rows take in place of their token's: an image's vision tower
    # output), row 0 the dummy; 0: no pool, and the prompt programs take no embeddings
    media_rows: int = 0
    # pages past num_pages that tree windows read their rows' ancestors through (`attention.tree_pass`), two a
    # window row; never handed to a stream
    tree_pages: int = 0

    def __post_init__(self):
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be bfloat16 or float32, got {self.dtype!r}")
        if self.page_size < 1 or GRID % self.page_size and self.page_size % GRID:
            raise ValueError(f"page_size must divide or be a multiple of {GRID}, got {self.page_size}")
        for name in ("pages_per_stream", "num_pages", "num_slots"):
            if getattr(self, name) < (2 if name != "pages_per_stream" else 1):
                raise ValueError(f"{name} is too small: {getattr(self, name)}")
        kv_dtype_for(self.kv_cache, jnp.bfloat16)  # validates the name
        if self.media_rows < 0 or self.media_rows == 1:
            raise ValueError(f"media_rows must be 0 (no media pool) or at least 2, got {self.media_rows}")
        if self.tree_pages < 0:
            raise ValueError(f"tree_pages must be at least 0, got {self.tree_pages}")

    @property
    def max_len(self) -> int:
        return self.pages_per_stream * self.page_size

    @property
    def jnp_dtype(self):
        return jnp.float32 if self.dtype == "float32" else jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Which shapes get compiled. prompt_rows: multiples of GRID; prompt_lanes: streams per prompt call, the
    smallest for every row bucket and the others only up to `multi_lane_rows` rows (None: all), since a call of
    several long chunks is no cheaper than one chunk at a time and each shape costs a compile; decode_streams:
    stream buckets of the decode (and verify) programs; window_rows: verify/commit row buckets for drafting
    (compiled for every decode stream bucket); chain_rows: draft/commit row buckets for copy drafts (likewise);
    logprobs: the top-n every sampling program computes (0 = none); slot_copy: compile the slot copy (a prompt
    cache); chain_budget: compile a draft program only where streams x rows is at most this (0: every pair), the
    rows a window call may cost before it costs more than several decode rounds (`CHAIN_ROW_BUDGET`).
    One variant per bucket: computing logprobs only in some rounds would switch a stream between programs."""
    prompt_rows: tuple[int, ...]
    prompt_lanes: tuple[int, ...]
    decode_streams: tuple[int, ...]
    window_rows: tuple[int, ...] = ()
    packing: Packing = Packing.MAPPED
    logprobs: int = 0
    multi_lane_rows: int | None = None
    chain_rows: tuple[int, ...] = ()
    slot_copy: bool = False
    chain_budget: int = 0

    def __post_init__(self):
        object.__setattr__(self, "packing", Packing(self.packing))
        for name in ("prompt_rows", "prompt_lanes", "decode_streams", "window_rows", "chain_rows"):
            vals = tuple(sorted(set(int(v) for v in getattr(self, name))))
            if name not in ("window_rows", "chain_rows") and not vals:
                raise ValueError(f"buckets: {name} is empty")
            if any(v < 1 for v in vals):
                raise ValueError(f"buckets: {name} must be positive, got {vals}")
            object.__setattr__(self, name, vals)
        bad = [t for t in self.prompt_rows if t % GRID]
        if bad:
            raise ValueError(f"buckets: prompt_rows must be multiples of {GRID}, got {bad}")
        if not 0 <= self.logprobs <= 20:
            raise ValueError(f"buckets: logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def prompt_shapes(self) -> tuple[tuple[int, int], ...]:
        """(lanes, rows) of every prompt program, cheapest first."""
        lo = self.prompt_lanes[0]
        shapes = [(s, t) for t in self.prompt_rows for s in self.prompt_lanes
                  if s == lo or self.multi_lane_rows is None or t <= self.multi_lane_rows]
        return tuple(sorted(shapes, key=lambda st: (st[0] * st[1], st[1])))

    def prompt_bucket(self, lanes: int, rows: int) -> tuple[int, int]:
        for s, t in self.prompt_shapes:
            if s >= lanes and t >= rows:
                return s, t
        raise ValueError(f"no prompt bucket holds {lanes} lanes of {rows} rows (compiled: {self.prompt_shapes})")

    def decode_bucket(self, streams: int) -> int:
        return _fit(self.decode_streams, streams, "decode streams")

    def window_bucket(self, streams: int, rows: int) -> tuple[int, int]:
        return self.decode_bucket(streams), _fit(self.window_rows, rows, "window rows")

    def chain_bucket(self, streams: int, rows: int) -> tuple[int, int]:
        return self.decode_bucket(streams), _fit(self.chain_rows, rows, "chain rows")

    def chain_cap(self, streams: int) -> int:
        """The most rows a chain window of `streams` streams may have (a compiled bucket; 0: none, or fewer than
        two rows, which draft nothing)."""
        s = self.decode_bucket(streams)
        fits = [r for r in self.chain_rows if not self.chain_budget or s * r <= self.chain_budget]
        return fits[-1] if fits and fits[-1] >= 2 else 0


def chain_row_buckets(rows: int) -> tuple[int, ...]:
    """Chain window row buckets up to `rows`: the powers of two from 2, and rows."""
    return tuple(sorted({r for r in pow2_buckets(2, rows) if r <= rows} | {rows}))


def _fit(options: tuple[int, ...], n: int, what: str) -> int:
    for o in options:
        if o >= n:
            return o
    raise ValueError(f"{n} {what} exceed the largest compiled bucket ({options[-1] if options else 'none'})")


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


def linear_weights(params) -> list:
    """Every matmul weight of the text model (the embedding only where it doubles as the lm_head)."""
    out = [params["embed"] if params["lm_head"] is None else params["lm_head"]]
    for layer in params["layers"]:
        out += [*M.ops.parts(layer["mlp"]["gate_up"]), layer["mlp"]["down"]]
        if "gdn" in layer:
            out += [*M.ops.parts(layer["gdn"]["in_proj"]), layer["gdn"]["out"]]
        else:
            out += [*M.ops.parts(layer["attn"]["qkv"]), layer["attn"]["o"]]
    return out


def row_invariant(params, backend: M.Backend) -> bool:
    """Whether every matmul row's bits are independent of how many rows share the call: true for the Pallas qmm
    kernel (quantized weights, kernels on); not for XLA's dot (a GEMV rounds differently from a GEMM row on CPU;
    cuBLAS picks algorithms by shape on GPU)."""
    return backend.kernels and all(isinstance(w, QuantizedWeight) for w in linear_weights(params))


# Whether the batched policy (prompt lanes in one forward, decode buckets 1, 2, 4, ...) is the default when
# `row_invariant` holds. On the H200, tests/test_engine_gpu.py failed it in session 2 (a decode logprob's last
# bits differed between buckets 1 and 16: XLA's own norms) and has passed it since session 3 (norms as
# row-invariant kernels; last in session 9). On since session 10: the engine alone at the 27B's shapes
# (`server.bench --engine --synthetic 27b --concurrency 1,16 --prompt-tokens 1024 --max-tokens 128`) decoded a
# lone stream at 12.36 ms a token against 14.97 with fixed shapes (+21 %), and 16 concurrent streams at 486.0
# against 482.6 tok/s, for 20 programs compiled in 66 s instead of 9 in 47 s (BENCHMARKS.md, session 10).
BATCHED_BY_DEFAULT = True


def default_buckets(params, backend: M.Backend, *, parallel: int, max_chunk: int = 4096, logprobs: int = 0,
                    window_rows: tuple[int, ...] = (), fixed_shapes: bool | None = None,
                    chain_rows: tuple[int, ...] = (), slot_copy: bool = False, chain_budget: int = 0) -> Buckets:
    """The engine's default shapes. fixed_shapes (default: unless `BATCHED_BY_DEFAULT` and `row_invariant`):
    prompt lanes mapped through the one-lane forward and a single decode bucket of `parallel` streams, so no
    row's computation changes shape with the load (module docstring); otherwise batched lanes and power-of-two
    decode buckets, which are faster (a lone stream does not pay for fifteen idle ones) and exact only where
    every op is row-invariant."""
    rows = pow2_buckets(GRID, max(GRID, max_chunk))
    if fixed_shapes is None:
        fixed_shapes = not (BATCHED_BY_DEFAULT and row_invariant(params, backend))
    if not fixed_shapes:
        return Buckets(rows, tuple(sorted({1, min(4, parallel)})), pow2_buckets(1, parallel), window_rows,
                       Packing.BATCHED, logprobs, multi_lane_rows=256, chain_rows=chain_rows, slot_copy=slot_copy,
                       chain_budget=chain_budget)
    return Buckets(rows, (min(4, parallel),), (parallel,), window_rows, Packing.MAPPED, logprobs,
                   chain_rows=chain_rows, slot_copy=slot_copy, chain_budget=chain_budget)


# ---------------------------------------------------------------------------------------------- host batches


@dataclasses.dataclass(frozen=True)
class PromptChunk:
    tokens: Sequence[int]  # the chunk's prompt ids
    start: int  # absolute position of its first row (on the GRID unless resuming a cache)
    slot: int
    page_table: np.ndarray  # [pages_per_stream] int32
    embed_rows: np.ndarray | None = None  # [n] int32: the media pool row each chunk row takes (-1: its token's)
    rope: np.ndarray | None = None  # [3, n] int32 M-RoPE positions (None: text, start + i)


def _text_rope(positions: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.broadcast_to(positions[None], (3,) + positions.shape)).astype(np.int32)


def prompt_batch(layout: Layout, lanes: int, rows: int, chunks: Sequence[PromptChunk]) -> M.PrefillBatch:
    """Host arrays for a prompt call of `lanes` x `rows`; lanes past the chunks are empty (dummy slot and pages)."""
    if len(chunks) > lanes:
        raise ValueError(f"{len(chunks)} chunks do not fit {lanes} lanes")
    tokens = np.zeros((lanes, rows), np.int32)
    start = np.zeros(lanes, np.int32)
    lengths = np.zeros(lanes, np.int32)
    slot = np.zeros(lanes, np.int32)
    table = np.zeros((lanes, layout.pages_per_stream), np.int32)
    for i, c in enumerate(chunks):
        n = len(c.tokens)
        if not 0 < n <= rows:
            raise ValueError(f"chunk {i} has {n} rows; the bucket holds 1..{rows}")
        tokens[i, :n] = c.tokens
        start[i], lengths[i], slot[i] = c.start, n, c.slot
        table[i] = c.page_table
    positions = start[:, None] + np.arange(rows, dtype=np.int32)[None, :]
    rope = _text_rope(positions)
    for i, c in enumerate(chunks):
        if c.rope is not None:
            rope[:, i, :len(c.tokens)] = c.rope
    return M.PrefillBatch(tokens, start, lengths, slot, table, rope)


def prompt_embed_rows(layout: Layout, lanes: int, rows: int, chunks: Sequence[PromptChunk]) -> np.ndarray | None:
    """[lanes, rows] int32: the media pool row each prompt row takes (-1: its token's embedding); None without a
    media pool (the prompt programs then take none)."""
    if not layout.media_rows:
        return None
    out = np.full((lanes, rows), -1, np.int32)
    for i, c in enumerate(chunks):
        if c.embed_rows is not None:
            out[i, :len(c.tokens)] = c.embed_rows
    return out


def window_depth_host(parents: np.ndarray) -> np.ndarray:
    """parents [S, R] (-1 = child of the committed prefix; parents[s, r] < r) -> depth [S, R], 1 at the root."""
    depth = np.ones(parents.shape, np.int32)
    for r in range(parents.shape[1]):
        par = parents[:, r]
        has = par >= 0
        depth[has, r] = depth[has, par[has]] + 1
    return depth


def tree_window(layout: Layout, streams: int, rows: int, tokens: Sequence[Sequence[int]],
                parents: Sequence[Sequence[int]], cache_len: Sequence[int], slot: Sequence[int],
                page_table: Sequence[np.ndarray], rope_delta: Sequence[int] | None = None) -> M.VerifyWindow:
    """Host arrays for a verify window of `streams` x `rows`; the given streams first, the rest dummies. A stream
    with fewer rows is padded with rows hanging off its root's parent (never read: nothing accepts them)."""
    n = len(tokens)
    if n > streams:
        raise ValueError(f"{n} streams do not fit a bucket of {streams}")
    tok = np.zeros((streams, rows), np.int32)
    par = np.full((streams, rows), -1, np.int32)
    cl = np.zeros(streams, np.int32)
    sl = np.zeros(streams, np.int32)
    pt = np.zeros((streams, layout.pages_per_stream), np.int32)
    for i in range(n):
        k = len(tokens[i])
        if not 0 < k <= rows or len(parents[i]) != k:
            raise ValueError(f"stream {i}: {k} window rows (and {len(parents[i])} parents) for a bucket of {rows}")
        tok[i, :k] = tokens[i]
        par[i, :k] = parents[i]
        cl[i], sl[i] = cache_len[i], slot[i]
        pt[i] = page_table[i]
    positions = cl[:, None] + window_depth_host(par) - 1
    if rope_delta is not None:  # a stream after images: its M-RoPE positions run `delta` from its cache positions
        positions[:n] += np.asarray(rope_delta, np.int32)[:, None]
    return M.VerifyWindow(tok, par, cl, sl, pt, _text_rope(positions))


# The decode program's variants, by sampling path (`decode_program`): the host picks one per call.
DECODE_KINDS = {"decode": "plain", "decode_sorted": "sorted"}

FROM_LAST = -1  # a decode window token that says: the token this slot's previous decode call sampled


def decode_window(layout: Layout, streams: int, tokens: Sequence[int | None], cache_len: Sequence[int],
                  slot: Sequence[int], page_table: Sequence[np.ndarray],
                  rope_delta: Sequence[int] | None = None) -> M.VerifyWindow:
    """One pending token per stream at position cache_len (the decode program's window). A token of None (or
    `FROM_LAST`) is read on the device from what the slot's previous decode call sampled, so a call can be
    dispatched before the previous one's tokens reach the host."""
    tokens = [FROM_LAST if t is None else t for t in tokens]
    return tree_window(layout, streams, 1, [[t] for t in tokens], [[-1]] * len(tokens), cache_len, slot,
                       page_table, rope_delta)


def sample_params(requests: Sequence[sampling.RequestSampling], positions: Sequence[int], rows: int):
    return sampling.pack_sample_params(list(requests), list(positions), rows)


def penalties(rows_penalties: Sequence[sampling.RequestPenalties | None], rows: int) -> sampling.Penalties:
    return sampling.pack_penalties(list(rows_penalties), rows)


# ------------------------------------------------------------------------------------------- program bodies


@dataclasses.dataclass(frozen=True)
class Sampled:
    """What a sampling program hands back, on the host. tokens [N] (or [S, R] for verify); logprob [N]; top_ids,
    top_logprobs [N, n] (None without logprobs)."""
    tokens: np.ndarray
    logprob: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class History:
    """What penalties read, per slot: counts [slots, V] int32, how often each token was generated so far (counted
    as it is fed back into a decode step: every generated token but the newest), seen [slots, V] bool, the prompt's
    tokens, and bias [slots, V] f32, the request's logit bias. A slot's rows are set when a stream with penalties
    takes it (`history_reset_program`); other slots' rows are stale and never matter (neutral penalties leave a
    row's logits as they are)."""
    counts: jax.Array
    seen: jax.Array
    bias: jax.Array


def sample_rows(logits: jax.Array, sp: sampling.SampleParams, top_n: int, path: str | None = None,
                penalties: tuple | None = None, allowed: jax.Array | None = None):
    """logits [N, V] -> tokens [N] (+ (logprob [N], top ids [N, n], top logprobs [N, n]) when top_n > 0).
    penalties: (sampling.Penalties [N], counts [N, V], seen [N, V], bias [N, V]) applied before the draw
    (`sampling.penalize`); allowed [N, V] bool: a grammar's masks, -inf where False before the penalties (the same
    values as a bias row holding the mask: -inf + bias is -inf, x + bias where allowed); logprobs are the raw
    logits' either way."""
    drawn = logits if allowed is None else jnp.where(allowed, logits, -jnp.inf)
    drawn = drawn if penalties is None else sampling.penalize(drawn, *penalties)
    tokens = sampling.sample(drawn, sp, path)
    if top_n == 0:
        return tokens, None
    return tokens, sampling.logprobs(logits, tokens, top_n)


def _prompt_lanes_batched(params, state, batch: M.PrefillBatch, cfg: ModelConfig, backend: M.Backend,
                          taps: tuple[int, ...] = (), embeds=None):
    if embeds is None:
        return M.prefill(params, state, batch, cfg, backend, taps=taps)
    return M.prefill(params, state, batch, cfg, backend, taps=taps, embeds=embeds)


def _prompt_lanes_mapped(params, state, batch: M.PrefillBatch, cfg: ModelConfig, backend: M.Backend,
                         taps: tuple[int, ...] = (), embeds=None):
    """Every lane through the one-lane forward, in order; an empty lane (length 0) is skipped (its taps zeros)."""
    vocab = cfg.text.vocab_size
    lanes = dataclasses.replace(batch, rope_positions=jnp.moveaxis(batch.rope_positions, 1, 0))
    dtype = M.compute_dtype(state)
    tap_shape = (batch.tokens.shape[1], len(taps), cfg.text.hidden_size)

    def lane(state, xs):
        one, emb = jax.tree.map(lambda x: x[None], xs)
        one = dataclasses.replace(one, rope_positions=jnp.moveaxis(one.rope_positions, 0, 1))

        def run(state):
            logits, state, tapped = _prompt_lanes_batched(params, state, one, cfg, backend, taps, emb)
            return state, (logits[0], tapped[0] if taps else None)

        def skip(state):
            return state, (jnp.zeros((vocab,), jnp.float32), jnp.zeros(tap_shape, dtype) if taps else None)

        return jax.lax.cond(one.lengths[0] > 0, run, skip, state)

    state, (logits, tapped) = jax.lax.scan(lane, state, (lanes, embeds))
    return logits, state, tapped


def prompt_lanes(packing: Packing) -> Callable:
    """The prompt call's forward for a packing: (params, state, batch, cfg, backend, taps=(), embeds=None) ->
    (logits [S, V] of each lane's last real row, state, taps [S, T, n, H] or None)."""
    return _prompt_lanes_batched if packing == Packing.BATCHED else _prompt_lanes_mapped


def media_embeds(media: jax.Array | None, embed_rows: jax.Array | None):
    """The prompt's embedding overrides from the media pool [M, H] and the rows pointing into it [S, T] (-1: none)
    -> (mask [S, T], rows [S, T, H]) for `model.prefill`, or None without a pool."""
    if embed_rows is None:
        return None
    return embed_rows >= 0, media[jnp.maximum(embed_rows, 0)]


def prompt_penalties(pen: sampling.Penalties, hist: History, slot: jax.Array) -> tuple:
    """`sample_rows`' penalties for the first token of each lane's stream: nothing generated yet, its prompt seen."""
    seen = hist.seen[slot]
    return pen, jnp.zeros(seen.shape, jnp.int32), seen, hist.bias[slot]


def prompt_program(cfg: ModelConfig, backend: M.Backend, packing: Packing, top_n: int) -> Callable:
    """(params, state, batch [S x T], sample params [S], media [M, H] or None, embed rows [S, T] or None, penalties
    [S], history) -> (state, tokens [S], logprobs or None). Rows with an embed row take that media pool row as their
    embedding."""
    lanes_fn = prompt_lanes(packing)

    def program(params, state, batch, sp, media, embed_rows, pen, hist):
        with jax.named_scope("prompt"):
            logits, state, _ = lanes_fn(params, state, batch, cfg, backend, embeds=media_embeds(media, embed_rows))
        tokens, lp = sample_rows(logits, sp, top_n, penalties=prompt_penalties(pen, hist, batch.slot))
        return state, tokens, lp

    return program


def decode_program(cfg: ModelConfig, backend: M.Backend, top_n: int, path: str) -> Callable:
    """(params, state, last [slots], history, window [S x 1], sample params [S], penalties [S]) -> (state, last,
    history, tokens [S], logprobs or None): one fused serial step (`model.step`: bit for bit verify + commit of the
    row, GDN states read once). Dummy streams (slot 0) commit nothing. `last` holds each slot's most recently
    sampled token: a window token of `FROM_LAST` reads it, and every row writes its sampled token back (dummies
    into slot 0, never read). The token fed in is counted in the slot's history before the penalties read it.
    path: the sampling path, fixed per variant ("decode" plain, "decode_sorted" sorted; the host picks per call),
    so the program has no device-side branch whose predicate the host would have to wait for."""

    def program(params, state, last, hist, window, sp, pen):
        fed = jnp.where(window.tokens < 0, last[window.slot][:, None], window.tokens)
        counts = hist.counts.at[window.slot, fed[:, 0]].add(1)
        with jax.named_scope("step"):
            logits, state = M.step(params, state, dataclasses.replace(window, tokens=fed), cfg, backend)
        tokens, lp = sample_rows(logits[:, 0], sp, top_n, path,
                                 penalties=(pen, counts[window.slot], hist.seen[window.slot], hist.bias[window.slot]))
        return state, last.at[window.slot].set(tokens), dataclasses.replace(hist, counts=counts), tokens, lp

    return program


def verify_program(cfg: ModelConfig, backend: M.Backend, top_n: int, taps: tuple[int, ...] = ()) -> Callable:
    """(params, state, window [S x R], sample params [S*R]) -> (tokens [S, R], logprobs or None, kept, taps).
    State is read-only; `kept` feeds `commit_program`."""

    def program(params, state, window, sp):
        with jax.named_scope("verify"):
            logits, kept, tapped = M.verify(params, state, window, cfg, backend, taps=taps)
        s, r = window.tokens.shape
        tokens, lp = sample_rows(logits.reshape(s * r, -1), sp, top_n)
        return tokens.reshape(s, r), lp, kept, tapped

    return program


def chain_accepted(window: M.VerifyWindow, tokens: jax.Array) -> jax.Array:
    """Rows of each chain that stand, [S] int32: row 0 (the pending token) always, then row r while it is a chain
    row (parent r - 1; padding rows hang off the root's parent) whose token is row r - 1's sample. Dummy streams
    (slot 0): none."""
    s, r = window.tokens.shape
    rows = jnp.arange(1, r, dtype=jnp.int32)
    hit = (window.tokens[:, 1:] == tokens[:, :-1]) & (window.parents[:, 1:] == rows - 1)
    took = 1 + jnp.sum(jnp.cumprod(hit.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)
    return jnp.where(window.slot == 0, 0, took)


def tree_accepted(window: M.VerifyWindow, tokens: jax.Array, anc: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """The rows of each tree that stand: (path [S, R] root-first row indices (0 past its length), length [S]). Row 0
    (the pending token) always; then, from the newest row on the path, its child whose token is that row's sample
    (the lowest-numbered one, should two children hold the same token). A chain's path is `chain_accepted`'s rows.
    Dummy streams (slot 0): none. Whole-window array operations, no loop over the rows: a row is a match when its
    token is its parent's sample and no earlier sibling's token is the same; it stands when it and all its
    ancestors are matches (the matches then form one path), and the path is the standing rows by depth. anc: the
    parents' `model.window_ancestors`, where the caller has them."""
    s, r = window.tokens.shape
    anc = M.window_ancestors(window.parents) if anc is None else anc  # [S, R, R]
    depth = M.depth_of(anc)
    par = jnp.maximum(window.parents, 0)
    row = jnp.arange(r)
    hit = (window.parents >= 0) & (window.tokens == jnp.take_along_axis(tokens, par, axis=1)) & (row[None] > 0)
    same = ((window.parents[:, :, None] == window.parents[:, None, :])
            & (window.tokens[:, :, None] == window.tokens[:, None, :]) & (row[None, None, :] < row[None, :, None]))
    hit = hit & ~jnp.any(same & hit[:, None, :], axis=2)
    stands = hit & ~jnp.any(anc & ~hit[:, None, :] & (row[None, None, :] > 0), axis=2)
    stands = stands & (window.slot > 0)[:, None]
    took = jnp.where(window.slot > 0, 1 + jnp.sum(stands, axis=1, dtype=jnp.int32), 0)
    # the standing row at depth d + 1 is path entry d (entry 0: the root)
    at = stands[:, None, :] & (depth[:, None, :] == row[None, 1:, None] + 1)  # [S, R - 1, R]
    path = jnp.sum(jnp.where(at, row[None, None, :], 0), axis=2, dtype=jnp.int32)
    return jnp.concatenate([jnp.zeros((s, 1), jnp.int32), path], axis=1), took


# `path_ranks` entries past the accepted rows
MISSED = -1  # the path's last row has children and the sample matched none of them
UNSEEN = -2  # nothing was drafted there (the path ended at a leaf), or past that


def path_ranks(parents: jax.Array, path: jax.Array, took: jax.Array) -> jax.Array:
    """What a landed window says about its drafts, for the draft policy (`Acceptance.landed_ranks`): [S, R] whose
    entry i, for 1 <= i < took, is the sibling rank of the path's row i (0: its parent's first child, which the tree
    builder finds first, the drafter's likeliest; a chain's drafts are all first children), entry took (when < R)
    MISSED or UNSEEN, and UNSEEN past it; entry 0 is the root's 0. Siblings are rows with the same parent row."""
    s, r = parents.shape
    row = jnp.arange(r)
    earlier = (parents[:, :, None] == parents[:, None, :]) & (parents >= 0)[:, None, :] & (row[None, None, :]
                                                                                        < row[None, :, None])
    ranks = jnp.take_along_axis(jnp.sum(earlier, axis=2, dtype=jnp.int32), path, axis=1)
    last = jnp.take_along_axis(path, jnp.maximum(took - 1, 0)[:, None], axis=1)  # [S, 1]
    missed = jnp.any(parents == last, axis=1)[:, None]  # the last row on the path has a child
    after = jnp.where((row[None] == took[:, None]) & missed, MISSED, UNSEEN)
    return jnp.where(row[None] < took[:, None], ranks, after).astype(jnp.int32)


def window_penalties(hist: History, window: M.VerifyWindow, anc: jax.Array, pen: sampling.Penalties) -> tuple:
    """`sample_rows`' penalties for a window's rows [S*R] (window tokens resolved, anc its `model.window_ancestors`):
    a row's counts are its slot's plus the tokens fed along its path, its ancestors' and its own, as the serial
    steps up to it would have counted them; its seen row is its slot's."""
    s, r = window.tokens.shape
    on_path = (anc | jnp.eye(r, dtype=jnp.bool_)[None]).astype(jnp.int32)  # [S, R (row), R (fed row)]
    counts = jnp.broadcast_to(hist.counts[window.slot][:, None, :], (s, r, hist.counts.shape[1]))
    fed = jnp.broadcast_to(window.tokens[:, None, :], (s, r, r))
    counts = counts.at[jnp.arange(s)[:, None, None], jnp.arange(r)[None, :, None], fed].add(on_path)
    return (pen, counts.reshape(s * r, -1), jnp.repeat(hist.seen[window.slot], r, axis=0),
            jnp.repeat(hist.bias[window.slot], r, axis=0))


def window_history(hist: History, window: M.VerifyWindow, path: jax.Array, took: jax.Array) -> History:
    """The slots' counts after a window: the tokens fed at its accepted rows (`path`'s first `took`) counted, as the
    serial steps would have counted them (dummy streams take none)."""
    r = window.tokens.shape[1]
    fed = jnp.take_along_axis(window.tokens, path, axis=1)
    stood = (jnp.arange(r)[None] < took[:, None]).astype(jnp.int32)
    return dataclasses.replace(hist, counts=hist.counts.at[window.slot[:, None], fed].add(stood))


def draft_program(cfg: ModelConfig, backend: M.Backend, top_n: int) -> Callable:
    """(params, state, last [slots], lens [slots], history, window [S x R] of chains, sample params [S*R],
    penalties [S*R], masks [S*R, W] uint32 (`sampling.pack_allowed`: a structured-output stream's grammar masks, a
    row's along its path; all ones elsewhere)) -> (state with the accepted rows committed, last, lens, history, tokens [S, R], logprobs or
    None, accepted rows [S]): `verify_program`
    with every row computed as the serial step at its position (`model.verify(chain=True)`), so its tokens and
    logprobs are the serial ones; then each chain's accepted rows (`chain_accepted`) committed. Rows past them
    leave K/V past the committed length, which nothing reads and the next write there replaces.

    Where each stream stands may come from the device instead of the host, so a window can be enqueued before the
    previous one's tokens are fetched: a token of `FROM_LAST` reads the slot's `last` (its newest sampled token:
    the previous decode call's or window's), and a cache_len below 0 reads the slot's `lens` (its committed length
    after the slot's previous window), with the rope positions and the sampling positions (each row draws at its
    position + 1) computed here from it. Every window writes back each slot's committed length and newest sample
    (dummy streams into slot 0, never read). Also hands back `path_ranks` [S, R] for the draft policy. Each row's
    penalties read its slot's history and the tokens fed along its path (`window_penalties`); the accepted rows'
    tokens are counted after (`window_history`)."""

    def program(params, state, last, lens, hist, window, sp, pen, mask):
        w = chain_window(params, state, last, lens, window, sp, cfg, backend, top_n, hist=hist, pen=pen, mask=mask)
        return w.state, w.last, w.lens, w.hist, w.tokens, w.logprobs, w.took, w.ranks

    return program


@dataclasses.dataclass(frozen=True)
class ChainWindow:
    """What `chain_window` hands back (traced arrays): the state with the accepted rows committed, the slots' last
    samples and committed lengths, tokens [S, R] and logprobs, accepted rows [S], each stream's committed length
    before the window [S] and its newest sample [S], the rows' taps [S, R, n, H] (or None), and `path_ranks`."""
    state: M.ModelState
    last: jax.Array
    lens: jax.Array
    tokens: jax.Array
    logprobs: tuple | None
    took: jax.Array
    cache_len: jax.Array
    newest: jax.Array
    taps: jax.Array | None
    ranks: jax.Array
    hist: History


def chain_window(params, state, last, lens, window: M.VerifyWindow, sp, cfg: ModelConfig, backend: M.Backend,
                 top_n: int, taps: tuple[int, ...] = (), tree: tuple[jax.Array, jax.Array] | None = None, *,
                 hist: History, pen: sampling.Penalties, mask: jax.Array) -> ChainWindow:
    """The body of `draft_program` (inside a jitted program): tokens and lengths from the device where the window
    says so, the chain's rows as serial steps, sampling, acceptance and commit.

    tree: (parents [S, R] made on the device, scratch [S, R, 2] page ids kept for windows): the window is that tree
    in place of the host's chain (`model.verify(tree_scratch=)`, `tree_accepted`); every row's position, rope and
    sampling position then come from the device's depths. The tokens, logprobs and taps handed back are the
    accepted path's rows first, in order, so a tree window reads as a chain window whose first `took` rows stood."""
    s, r = window.tokens.shape
    from_dev = window.cache_len < 0
    cache_len = jnp.where(from_dev, lens[window.slot], window.cache_len)
    anc = M.window_ancestors(window.parents)
    depth = M.depth_of(anc)
    # The host built the rope positions from the cache_len it passed, plus each stream's M-RoPE delta (0 for text):
    # keep the delta, move the rest to the device's length (and, for a tree, to the device's depths).
    delta = window.rope_positions[0] - (window.cache_len[:, None] + depth - 1)
    moved = from_dev
    if tree is not None:
        parents, scratch = tree
        window = dataclasses.replace(window, parents=parents)
        anc = M.window_ancestors(parents)  # the tree's depths here, its acceptance below
        depth = M.depth_of(anc)
        delta = delta[:, :1]  # a stream's delta is the same at every row
        moved = jnp.ones_like(from_dev)
    pos = cache_len[:, None] + depth - 1
    window = dataclasses.replace(
        window, tokens=jnp.where(window.tokens < 0, last[window.slot][:, None], window.tokens),
        cache_len=cache_len,
        rope_positions=jnp.where(moved[None, :, None], text_rope_positions(pos + delta), window.rope_positions))
    sp = dataclasses.replace(sp, position=jnp.where(jnp.repeat(moved, r), (pos + 1).reshape(-1), sp.position))
    with jax.named_scope("draft"):
        logits, kept, tapped, state = M.verify(params, state, window, cfg, backend, taps=taps, chain=tree is None,
                                               tree_scratch=None if tree is None else tree[1])
    tokens, lp = sample_rows(logits.reshape(s * r, -1), sp, top_n, penalties=window_penalties(hist, window, anc, pen),
                             allowed=sampling.allowed_rows(mask, cfg.text.vocab_size))
    tokens = tokens.reshape(s, r)
    if tree is None:
        took = chain_accepted(window, tokens)
        path = jnp.broadcast_to(jnp.arange(r, dtype=jnp.int32), (s, r))
    else:
        path, took = tree_accepted(window, tokens, anc)
        tokens = jnp.take_along_axis(tokens, path, axis=1)
        flat = (path + r * jnp.arange(s, dtype=jnp.int32)[:, None]).reshape(-1)
        lp = None if lp is None else jax.tree.map(lambda a: a[flat], lp)
        tapped = None if tapped is None else jnp.take_along_axis(tapped, path[:, :, None, None], axis=1)
    with jax.named_scope("commit"):
        state = M.commit(state, kept, window, path, took, cfg, backend)
        hist = window_history(hist, window, path, took)
    newest = jnp.take_along_axis(tokens, jnp.maximum(took - 1, 0)[:, None], axis=1)[:, 0]
    return ChainWindow(state, last.at[window.slot].set(newest), lens.at[window.slot].set(cache_len + took), tokens,
                       lp, took, cache_len, newest, tapped, path_ranks(window.parents, path, took), hist)


def media_put_program() -> Callable:
    """(media [M, H], rows [N] int32, values [N, H] fp32) -> media with those rows set (rows >= M dropped)."""

    def program(media, rows, values):
        return media.at[rows].set(values.astype(media.dtype), mode="drop")

    return program


def commit_program(cfg: ModelConfig, backend: M.Backend) -> Callable:
    """(state, kept, window, path [S, R] root-first node indices, path_len [S]) -> state."""

    def program(state, kept, window, path, path_len):
        return M.commit(state, kept, window, path, path_len, cfg, backend)

    return program


def history_reset_program() -> Callable:
    """(history, slot, seen [V] bool, bias [V] f32) -> history with the slot's counts zero and its seen and bias rows
    these."""

    def program(hist, slot, seen, bias):
        return History(hist.counts.at[slot].set(0), hist.seen.at[slot].set(seen), hist.bias.at[slot].set(bias))

    return program


def bias_put_program() -> Callable:
    """(history, slot, bias [V] f32) -> history with the slot's bias row this, its counts and seen rows as they were
    (a structured-output stream's logit bias with its grammar's mask, -inf where a token is forbidden, before each
    step)."""

    def program(hist, slot, bias):
        return dataclasses.replace(hist, bias=hist.bias.at[slot].set(bias))

    return program


def slot_copy_program() -> Callable:
    """(state, src, dst) -> state with slot dst's recurrent states and conv windows set to slot src's."""

    def program(state, src, dst):
        def copy(x):
            return x.at[dst].set(x[src])

        return dataclasses.replace(state, rec=tuple(map(copy, state.rec)), conv=tuple(map(copy, state.conv)))

    return program


def score_program(cfg: ModelConfig, backend: M.Backend) -> Callable:
    """Teacher-forced chunk of one stream: (params, state, batch [1 x T], targets [T]) -> (state,
    logprob of each target [T], argmax [T])."""

    def program(params, state, batch, targets):
        logits, state, _ = M.prefill(params, state, batch, cfg, backend, all_logits=True)
        logits = logits[0]
        chosen, _, _ = sampling.logprobs(logits, targets, 0)
        return state, chosen, jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return program


def _compare(logits_ref: jax.Array, logits_test: jax.Array, targets: jax.Array):
    """logits [T, V] of the same rows from two states, targets [T] -> (kl [T] = KL(p_ref || p_test), top-1 agree
    [T], target logprob ref [T], test [T])."""
    ref, test = jax.nn.log_softmax(logits_ref, axis=-1), jax.nn.log_softmax(logits_test, axis=-1)
    kl = jnp.sum(jnp.exp(ref) * (ref - test), axis=-1)
    agree = jnp.argmax(ref, axis=-1) == jnp.argmax(test, axis=-1)
    tgt = targets[:, None]
    return kl, agree, jnp.take_along_axis(ref, tgt, axis=1)[:, 0], jnp.take_along_axis(test, tgt, axis=1)[:, 0]


def kv_compare_program(cfg: ModelConfig, backend: M.Backend) -> Callable:
    """The same chunk through two states that differ only in their KV pools' dtype: (params, state_ref,
    state_test, batch, targets) -> (state_ref, state_test, kl [T] = KL(p_ref || p_test), top-1 agree [T],
    target logprob ref [T], test [T])."""

    def program(params, state_ref, state_test, batch, targets):
        out = []
        states = []
        for st in (state_ref, state_test):
            logits, st, _ = M.prefill(params, st, batch, cfg, backend, all_logits=True)
            states.append(st)
            out.append(logits[0])
        return states[0], states[1], *_compare(*out, targets)

    return program


def kv_compare_window_program(cfg: ModelConfig, backend: M.Backend) -> Callable:
    """`kv_compare_program` through the decode path: a teacher-forced chain window of one stream (the verify
    program's attention and GDN window kernels, the bits of serial steps) through both states, then the commit of
    its real rows: (params, state_ref, state_test, window [1 x R], targets [R], path [1, R], path_len [1]) ->
    the same outputs, [R] each."""

    def program(params, state_ref, state_test, window, targets, path, path_len):
        out = []
        states = []
        for st in (state_ref, state_test):
            logits, kept, _ = M.verify(params, st, window, cfg, backend)
            states.append(M.commit(st, kept, window, path, path_len, cfg, backend))
            out.append(logits[0])
        return states[0], states[1], *_compare(*out, targets)

    return program


# ------------------------------------------------------------------------------------------ compiled set


class CompileWatch:
    """Counts jaxpr traces and XLA compilations (persistent-cache loads included) while active: the recompile
    counter. `with CompileWatch() as w: ...; w.compiles`."""
    _TRACE = "/jax/core/compile/jaxpr_trace_duration"
    _COMPILE = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.traces = 0
        self.compiles = 0
        self.cache_hits = 0

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event == self._TRACE:
            self.traces += 1
        elif event == self._COMPILE:
            self.compiles += 1

    def _on_event(self, event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.cache_hits += 1

    def __enter__(self) -> "CompileWatch":
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)


def enable_compilation_cache(path: str | None) -> None:
    """Persistent compilation cache in `path` (None: off). Every program is cached, however quick to compile."""
    from jax.experimental.compilation_cache import compilation_cache as cc
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    cc.set_cache_dir(path)
    cc.reset_cache()  # the cache is probed once per process; make the new dir take effect


def init_pools(cfg: ModelConfig, layout: Layout) -> M.ModelState:
    """Zeroed state pools for `layout`, every leaf its own buffer: init_state may hand one zeros array to two
    fields (an fp8 pool's k and v scales), and a program cannot take the same buffer donated twice."""
    dtype = layout.jnp_dtype
    state = M.init_state(cfg.text, num_slots=layout.num_slots, num_pages=layout.num_pages + layout.tree_pages,
                         page_size=layout.page_size, dtype=dtype, kv_dtype=kv_dtype_for(layout.kv_cache, dtype))
    return jax.tree.map(jnp.copy, state)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


class Programs:
    """The compiled bucket set over one params pytree and one set of state pools (owned here, donated to every
    program that writes it). Not thread-safe: one caller (the scheduler thread) at a time."""

    def __init__(self, params, cfg: ModelConfig, layout: Layout, buckets: Buckets, backend: M.Backend | None = None,
                 drafter=None):
        """drafter: a `dflash_programs.Drafter` (DFlash block drafts: the prompt and draft programs take its params
        and state too, `dflash_programs`), or None."""
        from qwen_jax import dflash_programs as D  # it builds on this module
        self.backend = backend or M.Backend.default()
        # the Mosaic GPU decode kernel's scale layout, where it is on (same bits); split over a tensor-parallel mesh
        params = parallel.prepare(params, cfg, self.backend, layout=(
            lambda p: qmm.decode_layout(p, layout.jnp_dtype)) if self.backend.kernels else None)
        self.params, self.cfg, self.layout, self.buckets = params, cfg, layout, buckets
        self.drafter = drafter
        self.dparams = None
        if drafter is not None:
            if buckets.chain_rows and buckets.chain_rows[-1] > drafter.nodes + 1:
                raise ValueError(f"chain windows of {buckets.chain_rows[-1]} rows exceed the drafter's "
                                 + (f"tree of {drafter.tree_rows}" if drafter.tree_rows else
                                    f"block of {drafter.cfg.block_size}"))
            if drafter.tree_rows:
                need = 2 * max((s * r for s in buckets.decode_streams for r in buckets.chain_rows
                                if not buckets.chain_budget or s * r <= buckets.chain_budget), default=0)
                if layout.tree_pages < need:
                    raise ValueError(f"tree windows need {need} scratch pages (Layout.tree_pages), got "
                                     f"{layout.tree_pages}")
            if buckets.prompt_rows[-1] > drafter.window:
                raise ValueError(f"prompt chunks of {buckets.prompt_rows[-1]} rows exceed the draft window of "
                                 f"{drafter.window}")
            self.dparams = qmm.decode_layout(drafter.params, layout.jnp_dtype) if self.backend.kernels else \
                drafter.params
            self.dparams = self._whole(self.dparams)  # (under tensor parallelism, whole on every device)
        self.state = self.fresh_state()
        self.dstate = self._fresh_dstate()
        self.media = self._fresh_media()  # [media_rows, H]: embeddings prompt rows take (an image's), or None
        self.last = self._fresh_last()  # [slots] int32: each slot's last sampled token (decode_program)
        self.lens = self._fresh_last()  # [slots] int32: each slot's committed length after a window (draft_program)
        self.history = self._fresh_history()  # what penalties read (History)
        self._exe: dict[tuple, object] = {}
        self._all_allowed: dict[int, jax.Array] = {}  # `draft_async`'s masks of windows no grammar constrains
        top_n = buckets.logprobs
        be = self.backend
        self._fns = {
            **{kind: jax.jit(decode_program(cfg, be, top_n, path), donate_argnums=(1, 2, 3))
               for kind, path in DECODE_KINDS.items()},
            "history_reset": jax.jit(history_reset_program(), donate_argnums=0),
            "bias_put": jax.jit(bias_put_program(), donate_argnums=0),
            "verify": jax.jit(verify_program(cfg, be, top_n)),
            "commit": jax.jit(commit_program(cfg, be), donate_argnums=0),
            "media_put": jax.jit(media_put_program(), donate_argnums=0),
        }
        if drafter is None:
            self._fns |= {
                "prompt": jax.jit(prompt_program(cfg, be, buckets.packing, top_n), donate_argnums=1),
                "draft": jax.jit(draft_program(cfg, be, top_n), donate_argnums=(1, 2, 3, 4)),
                "slot_copy": jax.jit(slot_copy_program(), donate_argnums=0),
            }
        else:
            self._fns |= {
                "prompt": jax.jit(D.prompt_program(cfg, drafter, be, buckets.packing, top_n),
                                  donate_argnums=(2, 3)),
                "draft": jax.jit(D.window_program(cfg, drafter, be, top_n, layout.num_pages),
                                 donate_argnums=(2, 3, 4, 5, 6)),
                "slot_copy": jax.jit(D.slot_copy_program(), donate_argnums=(0, 1)),
            }

    def _whole(self, tree):
        """tree on the devices every program runs on: as it is on one device, whole on each of a tensor-parallel
        mesh's devices."""
        tp = self.backend.parallel
        return tree if tp is None or tree is None else parallel.replicate(tree, tp)

    def fresh_state(self) -> M.ModelState:
        return parallel.place_state(init_pools(self.cfg, self.layout), self.backend)

    def _fresh_dstate(self):
        if self.drafter is None:
            return None
        from qwen_jax import dflash_programs as D
        return self._whole(D.init_draft_state(self.drafter, self.layout.num_slots, self.layout.jnp_dtype))

    def _fresh_media(self):
        if not self.layout.media_rows:
            return None
        return self._whole(jnp.zeros((self.layout.media_rows, self.cfg.text.hidden_size), self.layout.jnp_dtype))

    def _fresh_last(self) -> jax.Array:
        return self._whole(jnp.zeros((self.layout.num_slots,), jnp.int32))

    def _fresh_history(self) -> History:
        shape = (self.layout.num_slots, self.cfg.text.vocab_size)
        return self._whole(History(jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.bool_),
                                   jnp.zeros(shape, jnp.float32)))

    def state_lost(self) -> bool:
        """True when a failed program consumed the donated pools (callers then `reset_state`)."""
        return any(x.is_deleted() for x in jax.tree.leaves((self.state, self.dstate, self.media, self.last,
                                                             self.lens, self.history)))

    def reset_state(self) -> None:
        self.state = self.fresh_state()
        self.dstate = self._fresh_dstate()
        self.media = self._fresh_media()
        self.last = self._fresh_last()
        self.lens = self._fresh_last()
        self.history = self._fresh_history()

    # Example host inputs per bucket: lowering needs only their shapes and dtypes.
    def _example(self, kind: str, shape: tuple[int, int]):
        lay = self.layout
        s, t = shape
        if kind == "prompt":
            return (prompt_batch(lay, s, t, []), sample_params([], [], s), prompt_embed_rows(lay, s, t, []),
                    penalties([], s))
        if kind in DECODE_KINDS:
            return (decode_window(lay, s, [], [], [], []), sample_params([], [], s), penalties([], s))
        window = tree_window(lay, s, t, [], [], [], [], [])
        if kind == "verify":
            return (window, sample_params([], [], s * t))
        if kind == "draft":
            return (window, sample_params([], [], s * t), penalties([], s * t),
                    sampling.all_allowed(s * t, self.cfg.text.vocab_size))
        kept = jax.eval_shape(lambda p, st, w, sp: self._fns["verify"](p, st, w, sp)[2], self.params, self.state,
                              window, sample_params([], [], s * t))
        return (kept, window, np.zeros((s, t), np.int32), np.zeros(s, np.int32))

    def bucket_keys(self) -> list[tuple[str, tuple[int, int]]]:
        b = self.buckets
        keys = [("prompt", shape) for shape in b.prompt_shapes]
        keys += [(kind, (s, 1)) for kind in DECODE_KINDS for s in b.decode_streams]
        for s in b.decode_streams:
            keys += [("verify", (s, r)) for r in b.window_rows]
            keys += [("draft", (s, r)) for r in b.chain_rows if not b.chain_budget or s * r <= b.chain_budget]
            keys += [("commit", (s, r)) for r in b.window_rows]
        if b.slot_copy:
            keys.append(("slot_copy", (1, 1)))
        keys += [("history_reset", (1, 1)), ("bias_put", (1, 1))]
        keys += [("media_put", (n, 1)) for n in self.media_buckets()]
        return keys

    def compile(self, keys: Sequence[tuple[str, tuple[int, int]]] | None = None, *, progress: bool = False,
                workers: int | None = None) -> dict[tuple, float]:
        """Compile (or load from the persistent cache) every bucket in `keys` (default: all). -> seconds each.

        Tracing and lowering run one bucket after another (Python); XLA's compilation, which releases the GIL,
        runs on `workers` threads (default: half the CPU cores, at most 8), so a model of many layers and many
        buckets compiles in a fraction of the serial time."""
        keys = list(self.bucket_keys() if keys is None else keys)
        if workers is None:
            workers = max(1, min(8, (os.cpu_count() or 2) // 2))
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(keys), desc="compiling programs", unit="program")
        times = {}

        def lower(key):
            kind, shape = key
            fn = self._fns[kind]
            if kind == "slot_copy":
                return fn.lower(*self._with_draft_state(self.state), np.int32(0), np.int32(0))
            if kind == "history_reset":
                v = self.cfg.text.vocab_size
                return fn.lower(self.history, np.int32(0), jax.ShapeDtypeStruct((v,), jnp.bool_),
                                jax.ShapeDtypeStruct((v,), jnp.float32))
            if kind == "bias_put":
                return fn.lower(self.history, np.int32(0), jax.ShapeDtypeStruct((self.cfg.text.vocab_size,),
                                                                                jnp.float32))
            args = self._example(kind, shape)
            if kind == "commit":
                return fn.lower(self.state, *args)
            if kind in DECODE_KINDS:
                window, sp, pen = _abstract(args)
                return fn.lower(self.params, self.state, self.last, self.history, window, sp, pen)
            if kind == "draft":
                return fn.lower(*self._with_drafter(self.state), self.last, self.lens, self.history, *_abstract(args))
            if kind == "prompt":
                batch, sp, rows, pen = _abstract(args)
                return fn.lower(*self._with_drafter(self.state), batch, sp, self.media, rows, pen, self.history)
            if kind == "media_put":
                return fn.lower(self.media, jax.ShapeDtypeStruct((shape[0],), jnp.int32),
                                jax.ShapeDtypeStruct((shape[0], self.cfg.text.hidden_size), jnp.float32))
            return fn.lower(self.params, self.state, *_abstract(args))

        def build(key, lowered, t0):
            exe = lowered.compile()
            return key, exe, time.perf_counter() - t0

        try:
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                futures = []
                for key in keys:
                    t0 = time.perf_counter()
                    futures.append(pool.submit(build, key, lower(key), t0))
                for fut in concurrent.futures.as_completed(futures):
                    key, exe, seconds = fut.result()
                    self._exe[key] = exe
                    times[key] = seconds
                    if bar is not None:
                        bar.set_postfix_str(f"{key[0]} {key[1][0]}x{key[1][1]}")
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return times

    def pool_copies(self) -> dict[tuple, list[str]]:
        """Per compiled program, the HLO lines that copy a whole state pool (none: the donated pools are updated
        in place). For tests and tools/gpu/copies_probe.py."""
        shapes = {",".join(map(str, x.shape)) for x in jax.tree.leaves(self.state)}
        return {key: [ln.strip() for ln in exe.as_text().splitlines()
                      if " copy(" in ln and any(f"[{s}]" in ln for s in shapes)]
                for key, exe in self._exe.items()}

    def _with_draft_state(self, state) -> tuple:
        """The state arguments of the programs the drafter changes: (state,) or (state, draft state)."""
        return (state,) if self.drafter is None else (state, self.dstate)

    def _with_drafter(self, state) -> tuple:
        """The leading arguments of the prompt and draft programs: params and state, and the drafter's."""
        if self.drafter is None:
            return self.params, state
        return self.params, self.dparams, state, self.dstate

    def _get(self, key):
        try:
            return self._exe[key]
        except KeyError:
            raise ValueError(f"program {key[0]} {key[1][0]}x{key[1][1]} is not compiled "
                             f"(compiled: {sorted(self._exe)})") from None

    @staticmethod
    def _host(tokens, lp) -> Sampled:
        if lp is None:
            return Sampled(np.asarray(tokens))
        chosen, top_ids, top_lp = lp
        return Sampled(np.asarray(tokens), np.asarray(chosen), np.asarray(top_ids), np.asarray(top_lp))

    def media_buckets(self) -> tuple[int, ...]:
        """Row counts the media pool is written in (`media_put`): powers of two from 64 up to the pool."""
        m = self.layout.media_rows
        return pow2_buckets(min(64, m), m) if m else ()

    def media_put(self, rows: Sequence[int], values: np.ndarray) -> None:
        """Media pool rows `rows` take `values` [n, H] (dispatched; ordered before later calls)."""
        n = len(rows)
        b = _fit(self.media_buckets(), n, "media rows")
        idx = np.full(b, self.layout.media_rows, np.int32)  # padding rows point past the pool: dropped
        idx[:n] = rows
        vals = np.zeros((b, self.cfg.text.hidden_size), np.float32)
        vals[:n] = values
        self.media = self._get(("media_put", (b, 1)))(self.media, idx, vals)

    def prompt(self, batch: M.PrefillBatch, sp: sampling.SampleParams, embed_rows: np.ndarray | None = None,
               pen: sampling.Penalties | None = None) -> Sampled:
        """embed_rows [S, T] (`prompt_embed_rows`): the media pool row each row takes; None: none (with a pool, every
        row its token's). pen: each lane's penalties (`penalties`; None: none), over its slot's history."""
        if self.media is not None and embed_rows is None:
            embed_rows = np.full(batch.tokens.shape, -1, np.int32)
        if pen is None:
            pen = penalties([], batch.tokens.shape[0])
        exe = self._get(("prompt", batch.tokens.shape))
        out = exe(*self._with_drafter(self.state), batch, sp, self.media, embed_rows, pen, self.history)
        if self.drafter is None:
            self.state, tokens, lp = out
        else:
            self.state, self.dstate, tokens, lp = out
        return self._host(tokens, lp)

    def decode(self, window: M.VerifyWindow, sp: sampling.SampleParams, pen: sampling.Penalties | None = None
               ) -> Sampled:
        return self.fetch(self.decode_async(window, sp, pen))

    def decode_async(self, window: M.VerifyWindow, sp: sampling.SampleParams, pen: sampling.Penalties | None = None):
        """Dispatch a decode round and return at once: -> an opaque handle for `fetch`, which waits for the round.
        The state advances now (the next call is ordered after this one on the device), so the caller can do host
        work while the round runs. pen: each stream's penalties (`penalties`; None: none)."""
        kind = "decode_sorted" if sampling.sorted_path_needed(sp, self.cfg.text.vocab_size) else "decode"
        if pen is None:
            pen = penalties([], window.tokens.shape[0])
        exe = self._get((kind, window.tokens.shape))
        self.state, self.last, self.history, tokens, lp = exe(self.params, self.state, self.last, self.history,
                                                              window, sp, pen)
        for a in jax.tree.leaves((tokens, lp)):
            a.copy_to_host_async()
        return tokens, lp

    def fetch(self, pending) -> Sampled:
        """Wait for a round dispatched by `decode_async` and bring its results to the host."""
        return self._host(*pending)

    def verify(self, window: M.VerifyWindow, sp: sampling.SampleParams):
        """-> (Sampled with tokens [S, R], kept (device rows for `commit`))."""
        exe = self._get(("verify", window.tokens.shape))
        tokens, lp, kept, _ = exe(self.params, self.state, window, sp)
        return self._host(tokens, lp), kept

    def draft(self, window: M.VerifyWindow, sp: sampling.SampleParams, pen: sampling.Penalties | None = None,
              mask: np.ndarray | None = None):
        """A copy-draft chain window (`draft_program`: sampled, accepted and committed in one call) -> (Sampled with
        tokens [S, R], accepted rows [S] on the host)."""
        return self.fetch_draft(self.draft_async(window, sp, pen, mask))

    def draft_async(self, window: M.VerifyWindow, sp: sampling.SampleParams, pen: sampling.Penalties | None = None,
                    mask: np.ndarray | None = None):
        """Dispatch a draft window and return at once (an opaque handle for `fetch_draft`); its tokens, cache
        lengths and positions may come from the device (`draft_program`). pen: each row's penalties (`penalties`,
        a stream's repeated over its rows; None: none); mask: each row's grammar mask [S*R, W] uint32
        (`sampling.pack_allowed`; None: every token allowed)."""
        if pen is None:
            pen = penalties([], window.tokens.size)
        if mask is None:  # kept on the device per row count: no upload when no row is constrained
            rows = window.tokens.size
            if rows not in self._all_allowed:
                # device_put: jnp.asarray would compile a conversion while serving
                self._all_allowed[rows] = jax.device_put(sampling.all_allowed(rows, self.cfg.text.vocab_size))
            mask = self._all_allowed[rows]
        exe = self._get(("draft", window.tokens.shape))
        out = exe(*self._with_drafter(self.state), self.last, self.lens, self.history, window, sp, pen, mask)
        if self.drafter is None:
            self.state, self.last, self.lens, self.history, tokens, lp, took, ranks = out
        else:
            self.state, self.dstate, self.last, self.lens, self.history, tokens, lp, took, ranks = out
        for a in jax.tree.leaves((tokens, lp, took, ranks)):
            a.copy_to_host_async()
        return tokens, lp, took, ranks

    def slot_drafts(self, slot: int) -> np.ndarray:
        """The drafter's next drafts for `slot` (`DraftState.drafts`: made on the device after its last call), on the
        host; waits for that call. A structured-output stream's window reads them here to mask its rows. With tree
        drafts, the tree's likeliest chain: from the pending token, each node's first child found (its likeliest,
        `dflash_programs.propose_tree`), which is the block's likeliest token at each depth."""
        drafts = np.asarray(self.dstate.drafts)[slot]  # the whole (small) array: indexing on the device compiles
        parents = np.asarray(self.dstate.parents)[slot]  # a chain's: draft i hangs off row i, all of them taken
        chain, row = [], 0
        for i, (token, parent) in enumerate(zip(drafts.tolist(), parents.tolist())):
            if parent == row:
                chain.append(token)
                row = i + 1
        return np.array(chain, drafts.dtype)

    def fetch_draft(self, pending):
        """-> (tokens and logprobs on the host, accepted rows [S], `path_ranks` [S, R])."""
        tokens, lp, took, ranks = pending
        return self._host(tokens, lp), np.asarray(took), np.asarray(ranks)

    def history_reset(self, slot: int, prompt_ids: Sequence[int], pen: sampling.RequestPenalties) -> None:
        """A stream with penalties takes `slot`: its counts start at zero, its seen row holds the prompt's tokens and
        its bias row the request's logit bias (dispatched; ordered before later calls)."""
        v = self.cfg.text.vocab_size
        seen = np.zeros(v, np.bool_)
        seen[np.asarray(prompt_ids, np.int64)] = True
        self.history = self._get(("history_reset", (1, 1)))(self.history, np.int32(slot), seen, pen.bias_row(v))

    def bias_put(self, slot: int, row: np.ndarray) -> None:
        """Slot `slot`'s bias row becomes `row` [V] f32 (a grammar's mask with the request's logit bias; dispatched,
        ordered before later calls)."""
        self.history = self._get(("bias_put", (1, 1)))(self.history, np.int32(slot), np.asarray(row, np.float32))

    def slot_copy(self, src: int, dst: int) -> None:
        """Slot dst's GDN states and conv windows become slot src's (dispatched; ordered before later calls)."""
        exe = self._get(("slot_copy", (1, 1)))
        out = exe(*self._with_draft_state(self.state), np.int32(src), np.int32(dst))
        if self.drafter is None:
            self.state = out
        else:
            self.state, self.dstate = out

    def commit(self, kept, window: M.VerifyWindow, path: np.ndarray, path_len: np.ndarray) -> None:
        exe = self._get(("commit", window.tokens.shape))
        self.state = exe(self.state, kept, window, np.asarray(path, np.int32), np.asarray(path_len, np.int32))


def pages_for(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)
