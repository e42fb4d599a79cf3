"""The engine: a bounded request queue, admission against the state pools, and a scheduler thread that runs
rounds of compiled programs (qwen_jax.programs). Plain Python; it packs host arrays and calls programs.

A round of the scheduler (one loop iteration):
  1. take new requests and cancellations (a queued request that is cancelled never starts);
  2. admit queued requests in arrival order while a GDN slot and the request's KV pages are free (pages for its
     prompt plus max_tokens, capped at the context, are reserved up front, so a running stream never runs out;
     kept prompt states give theirs up when that makes a request fit). With the prompt cache on
     (`prompt_cache`, qwen_jax.engine.prefix), a prompt that extends a kept prefix starts past it: its slot takes
     a copy of the kept GDN state and its page table begins with the kept prefix's pages (shared, never written);
  3. one prompt call: the next chunk of one or more prompting streams (chunks cut on the 64-grid of
     absolute positions, at most `prefill_step` rows a lane while other streams decode, so they keep going);
     a lane whose prompt ends there yields its first token at once; a chunk also ends at each of the prompt's keep
     points, and the state there is kept (a kept slot takes a copy; the entry shares the pages);
  4. copy drafts (`copy_drafts`, qwen_jax.engine.drafts): a stream whose recent tokens repeat an earlier stretch of
     its history verifies the tokens that followed it as a chain window (one draft call for all such streams,
     acceptance and commit on the device), and may take several tokens from one forward; those streams sit out
     this round's decode call. Windows are pipelined like decode calls: a drafting stream's next window is
     dispatched behind its previous one, its first token and length read on the device and its drafts guessed
     past what the previous window yields if it stands (`_window_call`);
  5. one decode call for every (other) decoding stream: verify + commit the pending token, sample the next. Decode calls
     are pipelined: a call is dispatched before the previous call's tokens reach the host (each row reads its
     input token on the device, where the slot's previous call left it: programs.FROM_LAST), and only then is
     the previous call fetched and its tokens delivered (events, detokenization, stop strings), so the device
     never waits for the host between calls. A stream that max_tokens or the context end stops (known from the
     count) sits out the calls after its last token; one that a stop id or stop string ends had one more row
     computed in the call already running, whose token is dropped (rows never depend on each other, and its slot
     and pages are reused only by calls dispatched later). A round that runs a prompt call first fetches and
     delivers every call in flight (the prompt call syncs anyway), so no token waits on a prompt.
Every decided token becomes an event on its request's handle; a stream ends on a stop id (the checkpoint's EOS
unless ignore_eos, plus stop_token_ids), a stop string, max_tokens or the end of the context, and its pages and
slot go back at once. An exception while handling one stream fails that stream only; a failed program fails the
streams in it (and, if it consumed the donated pools, every running stream, on fresh pools).

Exactness: a request's tokens do not depend on what else runs (programs docstring): its prompt chunks are cut on
the grid whatever the lane count or bucket, each row is sampled with the keyed sampler at its absolute position,
and the seed of a request without one comes from its prompt (sampling.derive_seed), so replies reproduce.
Drafting: copy drafts when the engine has `copy_drafts` on (off by default), or DFlash block drafts with a
`drafter` (qwen_jax.dflash_programs): every drafting stream then runs a chain window each round, the pending token
and the drafter's next block, which the drafter made on the device after the stream's previous call, so its windows
are enqueued back to back like decode calls (no guesses: each reads its first token, length and drafts on the
device). A chain window's rows are sampled with the same keyed rule at their own positions and accepted up to the first
draft that differs from its predecessor row's sample, so a drafted reply is the serial one token for token,
provided each row's logits have the bits of the serial step at its position. The draft program computes each row's
attention as that step's (`model.verify(chain=True)`); the rest holds where every op is row-invariant
(`programs.row_invariant`: the kernels on quantized weights), and drafting is refused elsewhere.
With `draft_tree` (a node's most children), a block-drafting stream's window is a tree of the drafter's likeliest
continuations instead (`dflash_programs.propose_tree`), each row again computed as the serial step at its position
(`model.verify(tree_scratch=)`) and the path of samples followed from the root; the window hands back that path's
rows first, so the host lands it as a chain whose first rows stood.
`GenerationRequest.draft` False keeps a request serial.

Structured outputs (`GenerationRequest.grammar`, qwen_jax.structured): the stream's matcher says which tokens may
come next; before each of its steps (the prompt call's first token included) the engine writes the slot's bias row
as the request's logit bias with -inf where the grammar forbids a token (`Programs.bias_put`), which the programs'
penalties add before the draw, so other rows are untouched and the reply is the same alone or among others. Its
own calls are not pipelined: its next mask needs its last token on the host, so while its last call is in flight it
sits the next one out (the other streams' calls stay pipelined, and its mask is made while that call runs); alone,
the engine waits for its token. A drafting one (copy drafts, or chains of the drafter's blocks, read back to the
host) runs chain windows whose rows carry their masks (`Engine._row_masks`: the grammar advanced along the drafts
before each row, the drafts cut at the first one it refuses; the draft program applies each row's mask before the
penalties, with the slot's bias row back to the plain logit bias), so a drafted constrained reply is its serial one;
with tree windows it drafts the tree's likeliest chain (`Programs.slot_drafts`) as a chain window. Its windows sit
out rounds the same way. It ends with
"stop" once the grammar's document is whole and nothing may follow it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from qwen_jax import dflash_programs as D
from qwen_jax import programs as P
from qwen_jax import sampling
from qwen_jax.config import ModelConfig
from qwen_jax.engine.api import (ContextLengthExceeded, EngineOverloaded, EngineStats, GenerationRequest, TokenEvent,
                                 TokenLogprob)
from qwen_jax.engine.handle import RequestHandle
from qwen_jax.engine.policy import MEASURE_MAX_WINDOWS, MEASURE_WINDOWS, DraftPolicy
from qwen_jax.engine.prefix import PrefixCache, user_marker
from qwen_jax.engine.state import IndexPool
from qwen_jax.engine.stream import Phase, Stream

log = logging.getLogger(__name__)

# Copy drafts: a chain window's rows by default (the pending token and up to DRAFT_ROWS - 1 drafts), and the most
# an engine may ask for (the decode path's largest window; each row of a chain reads its whole context).
DRAFT_ROWS = 16
MAX_DRAFT_ROWS = 16

# Image rows the media pool holds at once by default with a vision tower (16384 x hidden in the compute dtype:
# 168 MB at the 27B's shapes): four images of 4096 rows, the most one image may take.
MEDIA_ROWS = 16384
# The most patches an image may have (before the 2x2 merge: 4096 prompt rows), as the seed server allows.
MAX_IMAGE_PATCHES = 16384


@dataclasses.dataclass
class Vision:
    """A loaded vision tower: its params (`checkpoint.load_vision`), config, and the image processor's settings."""
    params: dict
    cfg: object  # config.VisionConfig
    processor: object  # config.ImageProcessorConfig


DEFAULT_CACHE_DIR = os.environ.get("QWEN_JAX_CACHE_DIR", str(Path.home() / ".cache" / "qwen_jax" / "jax"))


class Engine:
    """See the module docstring and qwen_jax/engine/api.py for the contract.

    params / config: the model (qwen_jax.checkpoint.load_checkpoint); tokenizer: for text and stop strings (None:
    events carry ids only and stop strings are refused). max_model_len: context per request; parallel: streams
    decoding at once (GDN slots); max_queued: requests waiting beyond those. num_pages: KV pool pages (default:
    every stream can hold a full context). buckets: the compiled shapes (default: programs.default_buckets).
    max_prefill_chunk: largest prompt chunk; prefill_step: rows per prompt lane while other streams decode.
    max_logprobs: the most top logprobs a request may ask for (0: logprobs off, programs skip them).
    seed_salt: mixed into the seeds derived for requests without one. fixed_shapes: see
    programs.default_buckets (None: `programs.BATCHED_BY_DEFAULT` where every matmul runs through the
    row-invariant qmm kernel, else fixed; False where that does not hold is a ValueError).
    """

    def __init__(self, params, config: ModelConfig, tokenizer=None, *, model_name: str = "qwen",
                 dtype: str = "bfloat16", kv_cache: str = "bf16", max_model_len: int = 4096, parallel: int = 16,
                 max_queued: int = 64, backend=None, page_size: int = 64, num_pages: int | None = None,
                 buckets: P.Buckets | None = None, max_prefill_chunk: int = 4096, prefill_step: int = 1024,
                 max_logprobs: int = 0, seed_salt: str = "", fixed_shapes: bool | None = None,
                 progress: bool = True, copy_drafts: bool = False, draft_rows: int = DRAFT_ROWS,
                 prompt_cache: int = 0, drafter=None, media_rows: int | None = None, vision: Vision | None = None,
                 draft_policy: DraftPolicy | None = None, draft_tree: int = 0, tensor_parallel: int = 1):
        from qwen_jax.model import Backend
        from qwen_jax.model import parallel as tp_
        for name, v, lo in (("max_model_len", max_model_len, 2), ("parallel", parallel, 1),
                            ("max_queued", max_queued, 0), ("page_size", page_size, 1),
                            ("max_prefill_chunk", max_prefill_chunk, P.GRID), ("prefill_step", prefill_step, P.GRID)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if media_rows is None:
            media_rows = MEDIA_ROWS if vision is not None else 0
        if isinstance(media_rows, bool) or not isinstance(media_rows, int) or media_rows < 0:
            raise ValueError(f"media_rows must be an integer >= 0 (image embedding rows), got {media_rows!r}")
        if isinstance(prompt_cache, bool) or not isinstance(prompt_cache, int) or prompt_cache < 0:
            raise ValueError(f"prompt_cache must be an integer >= 0 (kept prompt states), got {prompt_cache!r}")
        if isinstance(draft_rows, bool) or not isinstance(draft_rows, int) or not 2 <= draft_rows <= MAX_DRAFT_ROWS:
            raise ValueError(f"draft_rows must be an integer in [2, {MAX_DRAFT_ROWS}], got {draft_rows!r}")
        if prefill_step % P.GRID or max_prefill_chunk % P.GRID:
            raise ValueError(f"max_prefill_chunk and prefill_step must be multiples of {P.GRID}")
        self.model_config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.parallel = parallel
        self.max_queued = max_queued
        self.max_logprobs = max_logprobs
        self.seed_salt = seed_salt
        self.progress = progress
        self.backend = backend or Backend.default()
        if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
            raise ValueError(f"tensor_parallel (--tensor-parallel-size) must be an integer >= 1, "
                             f"got {tensor_parallel!r}")
        if tensor_parallel > 1:  # the text model's heads split over that many devices (model/parallel.py)
            tp_.check(config, tensor_parallel)
            self.backend = dataclasses.replace(self.backend, parallel=tp_.TensorParallel.over(tensor_parallel))
        pages_per_stream = P.pages_for(max_model_len, page_size)
        if num_pages is None:
            num_pages = parallel * pages_per_stream + 1
        # GDN slots: 0 the dummy, 1..parallel the streams', then the prompt cache's kept states
        # media_rows: the pool of embeddings prompt rows take in place of their tokens' (images), row 0 the dummy
        # tree windows read their rows' ancestors through scratch pages past the streams' (two a window row)
        tree_pages = 2 * max(P.CHAIN_ROW_BUDGET, draft_rows) if draft_tree else 0
        self.layout = P.Layout(page_size, pages_per_stream, num_pages, parallel + 1 + prompt_cache, dtype, kv_cache,
                               media_rows=media_rows + 1 if media_rows else 0, tree_pages=tree_pages)
        if buckets is None and fixed_shapes is False and not P.row_invariant(params, self.backend):
            raise ValueError("batched shapes (fixed_shapes=False; the server's --shapes batched): a row's bits "
                             "would depend on the rows beside it with this backend and weights (only the Pallas "
                             "qmm kernel on quantized weights is row-invariant), so concurrent replies could "
                             "differ from solo ones; use fixed shapes")
        for name, on in (("copy_drafts (the server's --copy-drafts)", copy_drafts),
                         ("drafter (the server's --drafter)", drafter is not None)):
            if on and not P.row_invariant(params, self.backend):
                raise ValueError(f"{name}: a drafted window's rows would not have the bits of serial steps with this "
                                 "backend and weights (only the Pallas kernels on quantized weights compute a row "
                                 "alone), so drafted replies could differ from serial ones; run without drafts")
        if copy_drafts and drafter is not None:
            raise ValueError("copy_drafts and drafter: pick one source of drafts")
        if isinstance(draft_tree, bool) or not isinstance(draft_tree, int) or not 0 <= draft_tree <= 8:
            raise ValueError(f"draft_tree (the server's --draft-tree) must be 0 (chains) or a node's most children, "
                             f"1 to 8, got {draft_tree!r}")
        if draft_tree and drafter is None:
            raise ValueError("draft_tree (--draft-tree): tree windows draft from a DFlash drafter (--drafter)")
        if drafter is not None and not draft_tree:
            # The window's rows: the pending token and up to block_size - 1 of the drafter's proposals.
            draft_rows = min(draft_rows, drafter.config.block_size)
            if draft_rows < 2:
                raise ValueError(f"drafter: a block of {drafter.config.block_size} rows drafts nothing")
        drafting = copy_drafts or drafter is not None
        if buckets is None:
            buckets = P.default_buckets(params, self.backend, parallel=parallel,
                                        max_chunk=min(max_prefill_chunk, P.pages_for(max_model_len, P.GRID) * P.GRID),
                                        logprobs=max_logprobs, fixed_shapes=fixed_shapes,
                                        chain_rows=P.chain_row_buckets(draft_rows) if drafting else (),
                                        chain_budget=P.CHAIN_ROW_BUDGET,
                                        slot_copy=prompt_cache > 0)
        if drafting and not buckets.chain_rows:
            raise ValueError("copy_drafts / drafter: the buckets compile no chain window (chain_rows is empty)")
        if prompt_cache and not buckets.slot_copy:
            raise ValueError("prompt_cache: the buckets compile no slot copy (slot_copy is False)")
        if buckets.logprobs < max_logprobs:
            raise ValueError(f"buckets compute {buckets.logprobs} top logprobs; max_logprobs={max_logprobs}")
        if buckets.decode_streams[-1] < parallel:
            raise ValueError(f"the largest decode bucket ({buckets.decode_streams[-1]}) is below parallel={parallel}")
        self.buckets = buckets
        self.copy_drafts = copy_drafts
        # the rows of each drafting stream's windows, from what its windows kept (engine.policy)
        self.draft_policy = DraftPolicy() if draft_policy is None else draft_policy
        self.drafter = None
        if drafter is not None:
            # Its draft cache keeps the newest DRAFT_WINDOW positions of each slot (more where a prompt chunk is
            # longer: a chunk's rows go in together), not more than a context holds.
            window = max(min(D.DRAFT_WINDOW, self.layout.max_len), buckets.prompt_rows[-1])
            self.drafter = D.Drafter(drafter.params, drafter.config, window,
                                     tree_rows=buckets.chain_rows[-1] if draft_tree else 0,
                                     tree_branch=draft_tree or 2)
        self.draft_rows = buckets.chain_rows[-1] if drafting else 1
        # tree windows: a node's most children, and how deep a tree reaches (the drafter's block past the anchor)
        self.draft_tree = draft_tree
        self._tree_depth = drafter.config.block_size - 1 if drafter is not None else None
        # "batched" (power-of-two decode buckets, prompts packed in lanes) or "fixed" (one shape whatever the load)
        self.shape_policy = "batched" if buckets.packing is P.Packing.BATCHED else "fixed"
        self.chunk_cap = min(buckets.prompt_rows[-1], max_prefill_chunk)
        self.step_cap = min(self.chunk_cap, prefill_step)
        self.programs = P.Programs(params, config, self.layout, buckets, self.backend, drafter=self.drafter)
        self.stop_ids = frozenset(config.eos_token_ids)
        self.vocab_size = config.text.vocab_size
        self._pages = IndexPool(num_pages, "KV pages")
        self._slots = IndexPool(parallel + 1, "GDN slots")
        self._media = IndexPool(media_rows + 1, "media rows") if media_rows else None
        self.vision = vision
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[RequestHandle] = []
        self._cancels: list[RequestHandle] = []
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._n_waiting = 0  # inbox + waiting, for the queue bound
        self._running: list[Stream] = []
        self._inflight: collections.deque[tuple[list[Stream], object]] = collections.deque()  # decode calls
        self._stop = False
        self._thread: threading.Thread | None = None
        # draft_windows: windows dispatched; draft_windows_chained: those enqueued behind a stream's previous
        # window (its first token and length from the device); draft_landed: windows fetched, one a stream
        self._counters = {"prompt": 0, "generation": 0, "draft_proposed": 0, "draft_accepted": 0, "cache_queried": 0,
                          "draft_windows": 0, "draft_windows_chained": 0, "draft_landed": 0}
        self._token_bytes = None  # `token_bytes()`, built at the first structured-output request
        self._token_bytes_lock = threading.Lock()
        # Kept prompt states (qwen_jax.engine.prefix), on grid points that are whole pages
        self._cache = (PrefixCache(range(parallel + 1, parallel + 1 + prompt_cache), max(P.GRID, page_size),
                                   user_marker(tokenizer)) if prompt_cache else None)
        self.compile_times: dict = {}
        self.measured_costs: dict | None = None  # {kind: {rows: decode rounds}} once `measure_draft_costs` ran

    @classmethod
    def from_checkpoint(cls, model_dir: str, *, dtype: str = "bfloat16", kv_cache: str = "bf16",
                        max_model_len: int = 4096, parallel: int = 16, max_queued: int = 64, backend=None,
                        progress: bool = True, compile_cache: str | None = DEFAULT_CACHE_DIR, max_logprobs: int = 20,
                        drafter: str | None = None, vision: bool = True, drafter_bits: int | None = None,
                        **kwargs) -> "Engine":
        """Load a checkpoint dir (weights, tokenizer, generation_config EOS ids) into an engine. compile_cache:
        the persistent compilation cache dir (None: off); default $QWEN_JAX_CACHE_DIR or ~/.cache/qwen_jax/jax.
        drafter: a DFlash drafter dir (block drafts), checked against the model; drafter_bits: its dense weights
        quantized at load (4 or 8; `checkpoint.quantize_drafter`). vision: load the checkpoint's vision
        tower where it has one (image prompts), else images are refused."""
        import jax.numpy as jnp

        from qwen_jax.checkpoint import load_checkpoint, load_dflash, load_tokenizer
        if dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be bfloat16 or float32, got {dtype!r}")
        if compile_cache:
            P.enable_compilation_cache(compile_cache)
        from qwen_jax.config import load_config, load_image_processor_config
        cfg = load_config(model_dir)
        vision = vision and cfg.vision is not None
        ck = load_checkpoint(model_dir, dtype=jnp.float32 if dtype == "float32" else jnp.bfloat16,
                             progress=progress or None, vision=vision)
        if vision:
            kwargs["vision"] = Vision(ck.vision, cfg.vision, load_image_processor_config(model_dir, cfg.vision))
        tokenizer = load_tokenizer(model_dir)
        if drafter is not None:
            kwargs["drafter"] = load_dflash(drafter, target=ck.config.text,
                                            dtype=jnp.float32 if dtype == "float32" else jnp.bfloat16,
                                            bits=drafter_bits)
        elif drafter_bits:
            raise ValueError("drafter_bits (--drafter-bits) quantizes a drafter: give --drafter DIR")
        return cls(ck.params, ck.config, tokenizer, model_name=Path(model_dir).resolve().name, dtype=dtype,
                   kv_cache=kv_cache, max_model_len=max_model_len, parallel=parallel, max_queued=max_queued,
                   backend=backend, progress=progress, max_logprobs=max_logprobs, **kwargs)

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Compile every bucket (a progress bar when `progress`), then start the scheduler thread."""
        if self._thread is not None:
            return
        self.compile_times = self.programs.compile(progress=self.progress)
        if self.vision is not None:
            self._compile_vision()
        if self.draft_rows > 1 and self.draft_policy.adaptive and self.draft_policy.measure:
            self.measure_draft_costs()
        self._thread = threading.Thread(target=self._run, name="qwen-jax-scheduler", daemon=True)
        self._thread.start()

    def draft_kind(self) -> str | None:
        """Which of the draft policy's cost tables this engine's windows use: "copy", "block", "tree" or None."""
        if self.drafter is not None:
            return "tree" if self.draft_tree else "block"
        return "copy" if self.copy_drafts else None

    def measure_draft_costs(self, windows: int | None = None, repeats: int = 5) -> dict[int, float]:
        """Time a lone stream's windows of each compiled row bucket against its decode round, on this machine and
        model (`bench.window_costs`: at least `windows` calls a timing and about 50 ms of decode rounds, the median
        of `repeats`), and decide from them from now on (the draft policy's table for this engine's kind of
        drafts) -> {rows: decode rounds}. The stream is a scratch one at up to 1024 cached tokens of whatever the
        pool holds, in a free slot and free pages that are free again after; call it before serving (`start` does,
        with --draft-costs measure)."""
        from qwen_jax.engine import bench
        kind = self.draft_kind()
        if kind is None:
            raise ValueError("measure_draft_costs: this engine drafts nothing (copy_drafts or a drafter)")
        if self._thread is not None:
            raise RuntimeError("measure_draft_costs runs before the scheduler starts")
        windows = windows or self.draft_policy.measure or MEASURE_WINDOWS
        cap = self.buckets.chain_cap(1)
        rows = tuple(r for r in self.buckets.chain_rows if 2 <= r <= cap)
        # A timing starts from `context`; each of its calls (and the two untimed windows before it) adds at most
        # `cap` rows. Up to MEASURE_MAX_WINDOWS calls a timing, fewer where the context would not hold them.
        max_len = self.layout.max_len
        context = max(1, min(1024, max_len - (MEASURE_MAX_WINDOWS + 3) * cap - 8))
        most = max(1, min(MEASURE_MAX_WINDOWS, (max_len - context - 8) // cap - 3))
        with self._lock:
            slot = self._slots.take(1)
            pages = self._pages.take(P.pages_for(max_len, self.layout.page_size))
        if slot is None or pages is None:
            raise RuntimeError("measure_draft_costs: no free slot or pages (call it before serving)")
        try:
            table = np.zeros(self.layout.pages_per_stream, np.int32)
            table[:len(pages)] = pages
            costs = bench.window_costs(self.programs, slot[0], table, context, rows, block=self.drafter is not None,
                                       rounds=min(windows, most), max_windows=most, repeats=repeats)
        finally:
            self._release(slot, pages)
        costs = {r: round(c, 3) for r, c in costs.items()}
        self.draft_policy = self.draft_policy.with_costs(kind, costs)
        self.measured_costs = {kind: costs}
        log.info("draft costs measured (%s windows, one stream at %d cached tokens, decode rounds): %s", kind,
                 context, costs)
        return costs

    def image_buckets(self) -> list[int]:
        """The tower's compiled patch buckets (`model.vision.patch_bucket`): up to the largest image the processor
        makes, at most MAX_IMAGE_PATCHES patches."""
        from qwen_jax.model.vision import patch_bucket
        p = self.vision.processor
        most = patch_bucket(min(MAX_IMAGE_PATCHES, p.max_pixels // p.patch_size ** 2))
        return [b for b in (1 << k for k in range(6, most.bit_length())) if b <= most]

    def _compile_vision(self) -> None:
        """Run the tower once on an empty image of every bucket, so serving an image compiles nothing."""
        from qwen_jax.model import vision as V
        from qwen_jax.vision.processing import ProcessedImage
        m = self.vision.cfg.spatial_merge_size
        for b in self.image_buckets():
            grid = (1, m, max(m, b // m // m * m))
            empty = ProcessedImage(np.zeros((grid[1] * grid[2], self.vision.cfg.patch_dim), np.float32), grid)
            V.encode_images(self.vision.params, [empty], self.vision.cfg)

    def encode_images(self, images) -> list[np.ndarray]:
        """Processed images (`qwen_jax.vision.preprocess_image`) -> each one's prompt rows [n, hidden] fp32 on the
        host, through the vision tower (callable from any thread; raises ValueError without a tower, or for an image
        past MAX_IMAGE_PATCHES)."""
        from qwen_jax.model import vision as V
        if self.vision is None:
            raise ValueError("images: this model has no vision tower (or the engine was started without it)")
        for im in images:
            if im.patches.shape[0] > MAX_IMAGE_PATCHES:
                raise ValueError(f"an image of {im.patches.shape[0]} patches exceeds {MAX_IMAGE_PATCHES}")
        return [np.asarray(r, np.float32) for r in V.encode_images(self.vision.params, images, self.vision.cfg)]

    def shutdown(self) -> None:
        """Stop the scheduler; requests still queued or running end with finish_reason "error"."""
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._land(keep=0)
        with self._lock:
            left = list(self._inbox) + list(self._waiting)
            self._inbox.clear()
            self._waiting.clear()
            self._n_waiting = 0
        for h in left:
            h._push(TokenEvent((), "", finish_reason="error", error="the engine shut down"))
        for s in list(self._running):
            self._end(s, TokenEvent((), "", finish_reason="error", error="the engine shut down"))

    def __enter__(self) -> "Engine":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------------------------------ requests

    def _sampling_rule(self, req: GenerationRequest) -> sampling.RequestSampling:
        s = req.sampling
        seed = s.seed if s.seed is not None else sampling.derive_seed(req.prompt_ids, self.seed_salt)
        return sampling.RequestSampling(seed=seed, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                        min_p=s.min_p)

    def _penalties(self, req: GenerationRequest) -> sampling.RequestPenalties | None:
        """The request's penalties and logit bias as the device sees them, or None when all are neutral."""
        s = req.sampling
        bias = s.logit_bias.items() if isinstance(s.logit_bias, dict) else s.logit_bias
        pen = sampling.RequestPenalties(s.presence_penalty, s.frequency_penalty, s.repetition_penalty,
                                        tuple(tuple(x) for x in bias),
                                        masked=req.grammar is not None or req.min_tokens > 0
                                        or req.thinking_budget is not None)
        bad = [t for t, _ in pen.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return None if pen.neutral else pen

    def _reserve(self, req: GenerationRequest) -> int:
        """KV pages a request holds while it runs: its prompt and max_tokens, capped at the context."""
        return P.pages_for(min(len(req.prompt_ids) + req.max_tokens, self.max_model_len), self.layout.page_size)

    def validate(self, req: GenerationRequest) -> None:
        """Raise ValueError (or ContextLengthExceeded) naming the field, for a request this engine can't take."""
        if not isinstance(req, GenerationRequest):
            raise ValueError(f"expected a GenerationRequest, got {type(req).__name__}")
        ids = req.prompt_ids
        if len(ids) == 0:
            raise ValueError("prompt_ids: the prompt is empty")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))
               or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: {bad[:5]} are not token ids of this model "
                             f"(vocabulary 0..{self.vocab_size - 1})")
        if isinstance(req.max_tokens, bool) or not isinstance(req.max_tokens, int) or req.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {req.max_tokens!r}")
        if isinstance(req.min_tokens, bool) or not isinstance(req.min_tokens, int) or \
                not 0 <= req.min_tokens <= req.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens = {req.max_tokens}], got "
                             f"{req.min_tokens!r}")
        budget = req.thinking_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise ValueError(f"thinking_budget must be None or an integer >= 0, got {budget!r}")
            end = req.think_end
            if isinstance(end, bool) or not isinstance(end, (int, np.integer)) or not 0 <= end < self.vocab_size:
                raise ValueError(f"thinking_budget: think_end must be the token id that closes a think block, got "
                                 f"{end!r}")
        if req.min_tokens and req.grammar is not None:
            raise ValueError("min_tokens: not supported with structured outputs (the grammar decides where the "
                             "reply may end)")
        if len(ids) + 1 > self.max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has {len(ids)} "
                f"tokens, which leaves no room for a reply. Shorten the prompt.")
        if self._reserve(req) > self._pages.total:
            raise ContextLengthExceeded(
                f"The request needs {self._reserve(req)} KV pages (prompt {len(ids)} + max_tokens "
                f"{req.max_tokens}) but the cache holds {self._pages.total}; lower max_tokens or shorten the prompt.")
        self._penalties(req)
        if req.logprobs is not None:
            if isinstance(req.logprobs, bool) or not isinstance(req.logprobs, int) or req.logprobs < 0:
                raise ValueError(f"logprobs must be None or a non-negative integer, got {req.logprobs!r}")
            if self.max_logprobs == 0:
                raise ValueError("logprobs: this engine was started without logprobs (max_logprobs=0)")
            if req.logprobs > self.max_logprobs:
                raise ValueError(f"logprobs: at most {self.max_logprobs} top logprobs, got {req.logprobs}")
        if any(not isinstance(s, str) for s in req.stop):
            raise ValueError(f"stop must be strings, got {req.stop!r}")
        if any(req.stop) and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; this engine has none")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0 for t in req.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {req.stop_token_ids!r}")
        self._sampling_rule(req)  # ValueError naming the sampling field
        if req.media is not None:
            self._validate_media(req)
        if req.grammar is not None or req.grammar_after is not None:
            self._validate_grammar(req)

    def _validate_grammar(self, req: GenerationRequest) -> None:
        from qwen_jax import structured
        if not isinstance(req.grammar, structured.Grammar):
            raise ValueError(f"grammar must be a qwen_jax.structured.Grammar (grammar_after needs one), got "
                             f"{type(req.grammar).__name__}")
        if self.tokenizer is None:
            raise ValueError("grammar: structured outputs need the tokenizer's token texts; this engine has none")
        text = [t for t in req.stop_token_ids if t < self.vocab_size and self.token_bytes().is_text[t]]
        if text:
            raise ValueError(f"stop_token_ids: {text[:5]} are text tokens, which a grammar's document may hold; with "
                             f"response_format, stop ids must be special tokens")
        after = req.grammar_after
        if after is not None and (isinstance(after, bool) or not isinstance(after, (int, np.integer))
                                  or not 0 <= after < self.vocab_size):
            raise ValueError(f"grammar_after must be None or a token id of this model, got {after!r}")

    def token_bytes(self):
        """Each token id's bytes (`structured.TokenBytes`), what grammars' masks are computed over; built once."""
        from qwen_jax import structured
        with self._token_bytes_lock:  # not the scheduler's lock: building takes a while at a real vocabulary
            if self._token_bytes is None:
                self._token_bytes = structured.TokenBytes.from_tokenizer(self.tokenizer, self.vocab_size)
            return self._token_bytes

    @staticmethod
    def _bias_row(stream: Stream, masked: bool = True) -> np.ndarray:
        """A structured-output stream's bias row for its next step: its logit bias (`Stream.base_bias`), -inf where
        its grammar (when on, and `masked`) forbids a token. Below min_tokens: -inf at its stop ids. Where a thinking
        budget comes due with the think block open: -inf everywhere but the block's end."""
        if stream.think_due():
            row = np.full_like(stream.base_bias, -np.inf)
            row[stream.request.think_end] = 0.0
            return row
        if stream.sampled < stream.request.min_tokens:
            row = stream.base_bias.copy()
            row[[t for t in stream.stop_ids if t < len(row)]] = -np.inf
            return row
        if not (masked and stream.grammar_on):
            return stream.base_bias
        return np.where(stream.matcher.allowed(), stream.base_bias, np.float32(-np.inf))

    def _validate_media(self, req: GenerationRequest) -> None:
        m, t = req.media, len(req.prompt_ids)
        if self._media is None:
            raise ValueError("media: this engine takes no image embeddings (started with media_rows=0)")
        rows = np.asarray(m.rows)
        if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer) or len(rows) == 0:
            raise ValueError("media.rows must be a non-empty 1-D integer array of prompt rows")
        if rows[0] < 0 or rows[-1] >= t or np.any(np.diff(rows) <= 0):
            raise ValueError(f"media.rows must be strictly ascending prompt rows in [0, {t})")
        if len(rows) > self._media.total:
            raise ValueError(f"media: {len(rows)} embedding rows; this engine holds {self._media.total} at once")
        embeds = np.asarray(m.embeds)
        if embeds.shape != (len(rows), self.model_config.text.hidden_size) or not np.all(np.isfinite(embeds)):
            raise ValueError(f"media.embeds must be finite, [{len(rows)}, {self.model_config.text.hidden_size}]; "
                             f"got {embeds.shape}")
        rope = np.asarray(m.rope_positions)
        if rope.shape != (3, t) or not np.issubdtype(rope.dtype, np.integer) or rope.min() < 0:
            raise ValueError(f"media.rope_positions must be non-negative integers, [3, {t}]; got {rope.shape}")

    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Queue a request -> its handle. Raises ValueError / ContextLengthExceeded for a request that can never
        run, EngineOverloaded when max_queued requests are already waiting."""
        return self.submit_all([req])[0]

    def submit_all(self, reqs: Sequence[GenerationRequest]) -> list[RequestHandle]:
        """Queue several requests at once (a reply's `n` choices) -> their handles, in order: all of them or none.
        Raises ValueError when there are more than max_queued (they could never wait together), and otherwise what
        `submit` raises; EngineOverloaded when the queue has no room for all of them now."""
        if not reqs:
            raise ValueError("submit_all: no requests")
        if len(reqs) > self.max_queued:
            raise ValueError(f"submit_all: {len(reqs)} requests can never wait together; this engine queues at most "
                             f"{self.max_queued} (max_queued)")
        for req in reqs:
            self.validate(req)
        handles = [RequestHandle(req, self._cancel) for req in reqs]
        with self._lock:
            if self._stop:
                raise RuntimeError("the engine is shut down")
            if self._n_waiting + len(handles) > self.max_queued:
                raise EngineOverloaded(f"{self._n_waiting} requests are already waiting (max_queued={self.max_queued})"
                                       + (f"; {len(handles)} more do not fit" if len(handles) > 1 else ""))
            self._n_waiting += len(handles)
            self._inbox.extend(handles)
            self._wake.notify_all()
        return handles

    def _cancel(self, handle: RequestHandle) -> None:
        with self._lock:
            self._cancels.append(handle)
            self._wake.notify_all()

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(running=len(self._running), waiting=self._n_waiting, free_pages=self._pages.free,
                               total_pages=self._pages.total, free_slots=self._slots.free,
                               total_slots=self._slots.total, prompt_tokens_total=self._counters["prompt"],
                               generation_tokens_total=self._counters["generation"],
                               draft_proposed_total=self._counters["draft_proposed"],
                               draft_accepted_total=self._counters["draft_accepted"],
                               draft_windows_total=self._counters["draft_landed"],
                               prompt_cache_entries=len(self._cache.entries) if self._cache else 0,
                               prompt_cache_hits_total=self._cache.hits if self._cache else 0,
                               prompt_cache_hit_tokens_total=self._cache.hit_tokens if self._cache else 0,
                               prompt_cache_queried_tokens_total=self._counters["cache_queried"])

    def clear_prompt_cache(self) -> int:
        """Drop every kept prompt state (their slots and pages are free again) -> how many there were. Safe from
        any thread: streams resumed from an entry hold their own share of its pages."""
        with self._lock:
            return self._drop_entries()

    def _drop_entries(self) -> int:
        """(Lock held.) Drop every prompt cache entry."""
        if self._cache is None:
            return 0
        n = len(self._cache.entries)
        for e in list(self._cache.entries):
            self._pages.give_back(self._cache.remove(e))
        return n

    # ------------------------------------------------------------------------------------------ scheduler

    def _run(self) -> None:
        while True:
            with self._lock:
                # Queued requests count as work: with nothing running, every pool is free and the head fits.
                self._wake.wait_for(lambda: self._stop or self._inbox or self._cancels or self._running
                                    or self._waiting or self._inflight)
                if self._stop:
                    return
                self._waiting.extend(self._inbox)
                self._inbox.clear()
                cancels, self._cancels = self._cancels, []
            try:
                self._round(cancels)
            except Exception as e:  # a bug in the scheduler itself: fail what runs, keep serving
                log.exception("scheduler round failed")
                for s in list(self._running):
                    self._fail(s, e)

    def _round(self, cancels: list[RequestHandle]) -> None:
        for h in cancels:
            self._cancel_now(h)
        self._admit()
        if any(s.phase is Phase.PROMPT for s in self._running):
            self._land(keep=0)
            self._prompt_call()
        drafted: set[Stream] = set()
        sitting: set[Stream] = set()
        if self.copy_drafts or self.drafter is not None:
            if self.copy_drafts and any(self._may_draft(s) for s in self._running if not s.drafting):
                self._land(keep=0)  # a stream starts drafting from its whole history, the pending token included
            drafted = self._window_call()
            # Structured-output streams sitting this round out (`_sits_out`) keep drafting next round.
            sitting = {s for s in self._running if s not in drafted and self._sits_out(s)}
            if any(s.drafting and s not in drafted and s not in sitting for s in self._running):
                # A stream whose copy ran out decodes again, from a length the host must know: its windows land.
                self._land(keep=0)
                sitting = set()
                for s in self._running:
                    if s not in drafted:
                        s.drafting = False
        dispatched = self._decode_call(skip=drafted)
        for s in self._running:
            if s.copies is not None and s not in drafted and s not in sitting:
                s.acceptance.serial_rounds += 1
        # This round's calls stay in flight while there is more to do; older ones are fetched and delivered.
        self._land(keep=int(bool(drafted)) + int(dispatched))

    def _cancel_now(self, handle: RequestHandle) -> None:
        with self._lock:
            if handle in self._waiting:
                self._waiting.remove(handle)
                self._n_waiting -= 1
                queued = True
            else:
                queued = False
        if queued:
            handle._push(TokenEvent((), "", finish_reason="cancelled"))
            return
        for s in self._running:
            if s.handle is handle:
                self._end(s, TokenEvent((), "", finish_reason="cancelled"))
                return

    def _admit(self) -> None:
        while True:
            with self._lock:
                # the first waiting request that does not wait for a twin's kept state (`_follows`)
                handle = next((h for h in self._waiting if not self._follows(h)), None)
                if handle is None:
                    return
            req = handle.request
            slot = self._slots.take(1)
            if slot is None:
                return
            prompt = np.asarray(req.prompt_ids, np.int32)
            media_rows = []
            if req.media is not None:
                # An image's rows are pad tokens whatever the image: such prompts neither resume nor keep states.
                with self._lock:
                    media_rows = self._media.take(len(req.media.rows))
                if media_rows is None:
                    self._slots.give_back(slot)
                    return
            with self._lock:
                cached = self._cache is not None and req.media is None
                entry = self._cache.lookup(prompt) if cached else None
                shared = entry.pages if entry is not None else []
                pages = self._take_pages(self._reserve(req) - len(shared), keep=entry)
                if pages is None:
                    self._slots.give_back(slot)
                    if media_rows:
                        self._media.give_back(media_rows)
                    return
                self._waiting.remove(handle)
                self._n_waiting -= 1
                if self._cache is not None:
                    self._counters["cache_queried"] += len(prompt)
                if entry is not None:
                    self._pages.share(shared)
                    self._cache.hit(entry)
            pages = shared + pages
            pen = self._penalties(req)  # validated at submit: no error here
            try:
                if entry is not None:
                    self.programs.slot_copy(entry.slot, slot[0])
                if pen is not None:
                    self.programs.history_reset(slot[0], req.prompt_ids, pen)
                if media_rows:
                    self.programs.media_put(media_rows, np.asarray(req.media.embeds, np.float32))
            except Exception as e:
                self._release(slot, pages, media_rows)
                self._program_failed([], e)
                handle._push(TokenEvent((), "", finish_reason="error", error=f"{type(e).__name__}: {e}"))
                continue
            try:
                stop_ids = frozenset(req.stop_token_ids) | (frozenset() if req.ignore_eos else self.stop_ids)
                matcher = None
                if req.grammar is not None:
                    from qwen_jax import structured
                    matcher = structured.Matcher(req.grammar, self.token_bytes(), stop_ids)
                stream = Stream(handle, slot=slot[0], pages=pages, pages_per_stream=self.layout.pages_per_stream,
                                sampling_rule=self._sampling_rule(req), stop_ids=stop_ids,
                                max_model_len=self.max_model_len, tokenizer=self.tokenizer,
                                copy_drafts=self.copy_drafts,
                                block_drafts=self.drafter is not None,
                                resumed=len(entry) if entry is not None else 0, media_rows=media_rows,
                                penalties=pen, matcher=matcher, grammar_after=req.grammar_after)
                if pen is not None and pen.masked:
                    stream.base_bias = pen.bias_row(self.vocab_size)  # once: every step's row starts from it
                if stream.grammar_on or req.min_tokens or stream.think_due():
                    self._put_bias(stream)  # its first token's mask
                if cached:
                    with self._lock:
                        stream.keep_at = self._cache.keep_points(prompt, after=stream.prefilled)
            except Exception as e:
                self._release(slot, pages, media_rows)
                if self.programs.state_lost():
                    self._program_failed([], e)
                handle._push(TokenEvent((), "", finish_reason="error", error=f"{type(e).__name__}: {e}"))
                continue
            handle.cached_tokens = stream.prefilled
            with self._lock:
                self._running.append(stream)

    def _follows(self, handle: RequestHandle) -> bool:
        """Whether a waiting request waits for a running stream with the same prompt whose prompt pass will still
        keep a state in the prompt cache: it then resumes from that state instead of running the same prompt beside
        it (a reply's `n` choices, queued together, prefill once), while the requests queued behind it are admitted
        as usual. Replies are the same either way (resumed = fresh); the wait ends at the twin's last keep point,
        or when it ends."""
        req = handle.request
        if self._cache is None or req.media is not None:
            return False
        return any(s.phase is Phase.PROMPT and s.keep_at and s.handle.prompt_key == handle.prompt_key
                   and s.request.prompt_ids == req.prompt_ids for s in self._running)

    def _release(self, slot: list[int], pages: list[int], media_rows: list[int] = ()) -> None:
        with self._lock:
            self._slots.give_back(slot)
            self._pages.give_back(pages)
            if media_rows:
                self._media.give_back(list(media_rows))

    def _release_media(self, stream: Stream) -> None:
        """(Lock held.) The stream's media pool rows, once its prompt has run (or it ended)."""
        if stream.media_rows:
            self._media.give_back(stream.media_rows)
            stream.media_rows = []

    def _take_pages(self, n: int, keep=None) -> list[int] | None:
        """(Lock held.) n free KV pages, evicting prompt cache entries (never `keep`) when that makes them fit; None
        (nothing evicted) when it would not."""
        got = self._pages.take(n)
        if got is not None or self._cache is None:
            return got
        # pages only entries hold (evicting them all frees these)
        held = collections.Counter(p for e in self._cache.entries if e is not keep for p in e.pages)
        freeable = sum(1 for p, k in held.items() if self._pages.holders(p) == k)
        if self._pages.free + freeable < n:
            return None
        while self._pages.free < n:
            self._pages.give_back(self._cache.remove(self._cache.victim(keep)))
        return self._pages.take(n)

    def _keep(self, stream: Stream, n: int) -> None:
        """Keep the stream's state after its first n prompt tokens (its prompt pass has just reached n) in the
        prompt cache: a kept slot (the least worth keeping entry gives its own up when none is free) takes a copy
        of the stream's GDN slot, and the entry takes a share of the pages of positions 0 .. n - 1."""
        tokens = stream.prompt[:n]
        with self._lock:
            if self._cache.find(tokens) is not None:
                return  # kept meanwhile by another stream with the same prefix
            slot = self._cache.take_slot()
            if slot is None:
                victim = self._cache.victim()
                if victim is None:
                    return
                self._pages.give_back(self._cache.remove(victim))
                slot = self._cache.take_slot()
        try:
            self.programs.slot_copy(stream.slot, slot)
        except Exception:
            with self._lock:
                self._cache.give_slot(slot)
            raise
        pages = stream.pages[:n // self.layout.page_size]
        with self._lock:
            self._pages.share(pages)
            self._cache.add(tokens, slot, pages)

    def _end(self, stream: Stream, event: TokenEvent) -> None:
        """Release a stream's slot and pages, then hand its last event over."""
        with self._lock:
            if stream not in self._running:
                return
            self._running.remove(stream)
            self._slots.give_back([stream.slot])
            self._pages.give_back(stream.pages)
            self._release_media(stream)
        stream.handle._push(event)

    def _fail(self, stream: Stream, exc: BaseException) -> None:
        log.warning("request %r failed: %s: %s", stream.request.request_id, type(exc).__name__, exc)
        self._end(stream, TokenEvent((), "", finish_reason="error", error=f"{type(exc).__name__}: {exc}"))

    def _program_failed(self, streams: list[Stream], exc: BaseException) -> None:
        log.exception("program failed")
        for s in streams:
            self._fail(s, exc)
        if self.programs.state_lost():
            self.programs.reset_state()
            with self._lock:
                self._drop_entries()  # their states were in the lost pools
            self._inflight.clear()  # computed on the lost pools
            for s in list(self._running):
                self._fail(s, RuntimeError("the state pools were lost to another request's failure; retry"))

    def _deliver(self, stream: Stream, token: int, sampled: P.Sampled, row: int) -> None:
        """One decided token of one stream: event out, finish if it ends the reply. Errors stay with the stream."""
        try:
            lp = None
            n = stream.request.logprobs
            if n is not None and sampled.logprob is not None:
                top = tuple((int(i), float(v)) for i, v in zip(sampled.top_ids[row, :n], sampled.top_logprobs[row, :n]))
                lp = TokenLogprob(token, float(sampled.logprob[row]), top)
            self.on_token(stream, token)
            event = stream.token_event(token, lp)
            with self._lock:
                self._counters["generation"] += 1
        except Exception as e:
            self._fail(stream, e)
            return
        if event.finish_reason is not None:
            self._end(stream, event)
        else:
            stream.handle._push(event)

    def on_token(self, stream: Stream, token: int) -> None:
        """Called for every decided token before its event is built (a subclass hook: tracing, fault injection
        in tests). An exception here fails that stream only."""

    def _prompt_call(self) -> None:
        prompting = [s for s in self._running if s.phase is Phase.PROMPT]
        decoding = any(s.phase is Phase.DECODE for s in self._running)
        cap = self.step_cap if decoding else self.chunk_cap
        lanes: list[tuple[Stream, int, int]] = []
        rows = 0
        for s in prompting:
            start, n = s.next_chunk(cap)
            t = self.buckets.prompt_bucket(1, n)[1]
            if lanes:
                # Lanes share one row bucket; a lane joins while a compiled shape holds the call and the padded
                # rows stay within the row budget.
                grown = max(rows, t)
                if grown * (len(lanes) + 1) > max(cap, rows) or not self._prompt_fits(len(lanes) + 1, grown):
                    continue
            lanes.append((s, start, n))
            rows = max(rows, t)
        n_lanes, rows = self.buckets.prompt_bucket(len(lanes), rows)
        chunks = [P.PromptChunk(s.prompt[start:start + n], start, s.slot, s.page_table,
                                *s.media_chunk(start, n)) for s, start, n in lanes]
        sp = P.sample_params([s.sampling for s, _, _ in lanes], [start + n for _, start, n in lanes], n_lanes)
        pen = P.penalties([s.penalties for s, _, _ in lanes], n_lanes)
        try:
            out = self.programs.prompt(P.prompt_batch(self.layout, n_lanes, rows, chunks), sp,
                                       P.prompt_embed_rows(self.layout, n_lanes, rows, chunks), pen)
        except Exception as e:
            self._program_failed([s for s, _, _ in lanes], e)
            return
        with self._lock:
            self._counters["prompt"] += sum(n for _, _, n in lanes)
        for i, (s, start, n) in enumerate(lanes):
            s.prefilled = start + n
            if s.keep_at and s.prefilled == s.keep_at[0]:
                s.keep_at.pop(0)
                try:
                    self._keep(s, s.prefilled)
                except Exception as e:
                    self._program_failed([s], e)
                    continue
            if s.prefilled == s.prompt_len:
                with self._lock:
                    self._release_media(s)  # the call has run (its tokens are on the host): the rows are free
                s.phase = Phase.DECODE
                s.cache_len = s.prompt_len
                s.next_input = int(out.tokens[i])
                s.sampled = 1
                self._deliver(s, s.next_input, out, i)

    def _prompt_fits(self, lanes: int, rows: int) -> bool:
        try:
            self.buckets.prompt_bucket(lanes, rows)
        except ValueError:
            return False
        return True

    def _decode_call(self, skip: set | frozenset = frozenset()) -> bool:
        """Dispatch one decode call for every decoding stream not yet at its last token (but those in `skip`, whose
        window this round decided their tokens). -> whether it did."""
        def decoding():
            return [s for s in self._running if s.phase is Phase.DECODE and not s.finishing and s not in skip]

        streams = decoding()
        if any(self._sits_out(s) for s in streams):
            # A structured-output stream's next mask follows from its last token, still in flight: it sits this call
            # out (its token lands at the end of this round, and its mask is made while this call runs), so the
            # other streams' calls (this call, or this round's window in `skip`) stay pipelined; alone, it waits
            # for its token.
            streams = [s for s in streams if not self._sits_out(s)]
            if not streams:
                if skip:
                    return False
                self._land(keep=0)
                streams = decoding()
        if not streams:
            return False
        n = self.buckets.decode_bucket(len(streams))
        window = P.decode_window(self.layout, n, [s.next_input for s in streams], [s.cache_len for s in streams],
                                 [s.slot for s in streams], [s.page_table for s in streams],
                                 [s.rope_delta for s in streams])
        sp = P.sample_params([s.sampling for s in streams], [s.cache_len + 1 for s in streams], n)
        pen = P.penalties([s.penalties for s in streams], n)
        try:
            for s in streams:
                # (min_tokens: its stop ids back; a thinking budget: its end forced, then every id back)
                if s.grammar_on or s.sampled == s.request.min_tokens > 0 or s.think_due() or s.think_forced:
                    self._put_bias(s)
            pending = self.programs.decode_async(window, sp, pen)
        except Exception as e:
            self._land(keep=0)
            self._program_failed(streams, e)
            return False
        for s in streams:
            s.next_input = None  # from now on the device feeds the slot's last sampled token
            s.inflight += 1
            s.cache_len += 1
            s.sampled += 1
            s.finishing = s.budget() <= 0
        self._inflight.append((streams, pending))
        return True

    def _put_bias(self, s: Stream) -> None:
        """Write the stream's bias row for its next token (`_bias_row`) to its slot on the device."""
        self.programs.bias_put(s.slot, self._bias_row(s))
        s.think_forced = s.think_due()

    @staticmethod
    def _sits_out(s: Stream) -> bool:
        """A structured-output stream with a call in flight: its next mask (or window's masks) needs that call's
        tokens on the host, so it sits out this round's calls while other streams run theirs. So does a stream whose
        thinking budget comes due: whether its end is forced depends on the tokens in flight."""
        return s.inflight > 0 and (s.matcher is not None or s.think_due())

    def _land(self, keep: int) -> None:
        """Fetch the oldest calls in flight (decode calls and draft windows), leaving `keep`, and deliver their
        tokens in order."""
        while len(self._inflight) > keep:
            streams, pending = self._inflight.popleft()
            if isinstance(pending, _Window):
                self._land_window(streams, pending)
                continue
            for s in streams:
                s.inflight -= 1
            try:
                out = self.programs.fetch(pending)
            except Exception as e:
                self._program_failed([s for s in streams if s in self._running], e)
                continue
            for i, s in enumerate(streams):
                if s in self._running:  # not ended meanwhile (cancel, stop id or string, error): else dropped
                    self._deliver(s, int(out.tokens[i]), out, i)

    # ------------------------------------------------------------------------------------------ copy drafts

    @staticmethod
    def _draftable(s: Stream) -> bool:
        """A decoding stream with drafts on (copy or block drafts) and room for a window of two rows."""
        return ((s.copies is not None or s.block_drafts) and s.phase is Phase.DECODE and not s.finishing
                and s.budget() >= 2 and s.sampled >= s.request.min_tokens and not (s.think_open or s.think_forced))

    def _may_draft(self, s: Stream) -> bool:
        """Whether a decoding stream that is not drafting may have a copy to verify this round: its history known
        on the host (the pending token included, or not yet when a decode call is in flight) repeats an earlier
        stretch."""
        if not self._draftable(s) or not self._window_rows(s, self.draft_rows):
            return False
        if s.inflight:
            return s.copies.may_propose()
        return bool(s.copies.propose(1))

    def _window_rows(self, s: Stream, cap: int) -> int:
        """The rows of a stream's next window (`DraftPolicy.rows`), at most cap and its budget; 0: a serial round."""
        return self.draft_policy.rows(s.acceptance, self.buckets.chain_rows, min(cap, s.budget()),
                                      block=s.block_drafts, tree=self.draft_tree, depth=self._tree_depth)

    def _window_call(self) -> set:
        """One draft window call (`programs.draft_program`: each row computed as the serial step at its position,
        acceptance and commit on the device) over the streams that have a copy to try, dispatched without waiting.

        A stream with nothing in flight starts its window from what the host knows: its pending token and length.
        A drafting stream whose previous window is still on the device takes its first token and its length from
        the device, and its drafts from its history followed by what that window yields if every draft in it
        stands and its last sample is the copy's next token (`Stream.assumed`); when that guess is wrong the
        window still yields its first row's token, as a decode step would. A stream is left out when its copy
        runs out, or when a window of its own in flight is known to have gone another way (its guess is then
        stale). A window call's rows are capped by how many streams may draft (`Buckets.chain_cap`: with the default
        `programs.CHAIN_ROW_BUDGET`, 16 rows for one stream, 8 each for two, ... none past eight, whose windows would
        cost several decode rounds). -> the streams it ran."""
        candidates = [s for s in self._running if self._draftable(s) and (not s.inflight or s.drafting)]
        if any(self._sits_out(s) for s in candidates):
            # A structured-output stream's window masks its rows along its drafts from where its grammar stands,
            # which needs its tokens so far on the host. While its last call is in flight it sits this round out
            # (that call lands at the round's end) when another stream runs a call this round; alone, every call
            # in flight lands first.
            if any(s.phase is Phase.DECODE and not s.finishing and not self._sits_out(s) for s in self._running):
                candidates = [s for s in candidates if not self._sits_out(s)]
            else:
                self._land(keep=0)
                candidates = [s for s in self._running if self._draftable(s) and (not s.inflight or s.drafting)]
        # Fewer rows a stream as more streams draft (`Buckets.chain_cap`); none when too many do.
        cap = self.buckets.chain_cap(len(candidates)) if candidates else 0
        tries, masks = [], {}
        for s in candidates if cap else ():
            rows = self._window_rows(s, cap)
            if rows < 2:
                continue  # a serial round: its windows have not been paying (copy drafts)
            if s.matcher is not None:
                # Drafts on the host (a copy, or the drafter's block read back: with trees, the tree's likeliest
                # chain), cut where the grammar refuses one; a chain window whatever the engine's windows are.
                got = ([int(t) for t in self.programs.slot_drafts(s.slot)[:rows - 1]] if s.block_drafts
                       else s.copies.propose(rows - 1))
                if not got and not s.block_drafts:
                    continue
                masks[s] = self._row_masks(s, got)
                tries.append((s, got[:len(masks[s]) - 1], None))
                continue
            if s.block_drafts:
                # Block drafts: the drafter's proposals, on the device where the slot's previous call left them.
                tries.append((s, [D.FROM_DRAFT] * (rows - 1), None))
                continue
            if s.inflight and not all(ok for _, ok in s.windows):
                continue
            got = s.copies.propose_after(s.assumed(), rows)  # rows - 1 drafts, then the guess of the last sample
            if not got:
                continue
            k = min(rows - 1, len(got) - 1) or 1  # the last token proposed is kept as the guess when it can be
            drafts, guess = got[:k], got[k:k + 1]
            tries.append((s, drafts, guess))
        if not tries:
            return set()
        streams = [s for s, _, _ in tries]
        n, rows = self.buckets.chain_bucket(len(tries), max(1 + len(d) for _, d, _ in tries))
        chains, lens, reqs, positions, pens = [], [], [], [], []
        for s, d, _ in tries:
            first = P.FROM_LAST if s.inflight else s.generated[-1]
            chains.append([first] + d)
            lens.append(-1 if s.inflight else s.cache_len)
            reqs += [s.sampling] * rows
            pens += [s.penalties] * rows
            # Row r samples the token at position cache_len + r + 1 (the serial step's rule; with the length on the
            # device, the program computes it); rows past the window repeat the last (never read).
            base = 0 if s.inflight else s.cache_len
            positions += [base + min(r, len(d)) + 1 for r in range(rows)]
        window = P.tree_window(self.layout, n, rows, chains, [list(range(-1, len(c) - 1)) for c in chains], lens,
                               [s.slot for s in streams], [s.page_table for s in streams],
                               [s.rope_delta for s in streams])
        sp = P.sample_params(reqs, positions, n * rows)
        mask = None
        if masks:
            mask = sampling.all_allowed(n * rows, self.vocab_size)
            for i, s in enumerate(streams):
                for r, allowed in enumerate(masks.get(s, ())):
                    if allowed is not None:
                        mask[i * rows + r] = sampling.pack_allowed(allowed, mask.shape[1])
        try:
            for s in masks:
                if s.grammar_on:  # the rows carry the masks: the slot's bias row back to the request's logit bias
                    self.programs.bias_put(s.slot, self._bias_row(s, masked=False))
            pending = self.programs.draft_async(window, sp, P.penalties(pens, n * rows), mask)
        except Exception as e:
            self._land(keep=0)
            self._program_failed(streams, e)
            return set(streams)
        with self._lock:
            self._counters["draft_windows"] += 1
            self._counters["draft_windows_chained"] += int(any(s.inflight for s in streams))
        for s, d, guess in tries:
            s.drafting = True
            s.inflight += 1
            s.next_input = None
            s.windows.append((None, True) if guess is None else (d + guess, len(guess) == 1))
            s.cache_len += 1 + len(d)  # as if every draft stands (the most it can take); corrected on landing
            s.sampled += 1 + len(d)
            s.finishing = s.budget() <= 0
        self._inflight.append((streams, _Window(pending, rows, [1 + len(d) for _, d, _ in tries])))
        return set(streams)

    def _row_masks(self, s: Stream, drafts: list[int]) -> list:
        """A structured-output stream's window rows along `drafts`: row r's mask is its grammar's after the pending
        token and the first r drafts (None while the grammar has not started: free text), as the serial step at that
        row would have it. The rows stop at the first draft its row's mask refuses (it could never be accepted) ->
        the masks, one a row (1 + the drafts that may stand)."""
        m, on = s.matcher.copy(), s.grammar_on
        out = []
        for d in drafts:
            allowed = m.allowed() if on else None
            out.append(allowed)
            if on:
                if not allowed[d]:
                    return out
                m.advance(d)
            elif d == s.grammar_after and d not in s.stop_ids:
                on = True
        out.append(m.allowed() if on else None)
        return out

    def _land_window(self, streams: list[Stream], w: "_Window") -> None:
        """Fetch a draft window and deliver each stream's accepted rows' samples; correct the lengths that its
        dispatch took as if every draft stood."""
        for s in streams:
            s.inflight -= 1
        try:
            out, took, ranks = self.programs.fetch_draft(w.pending)
        except Exception as e:
            self._program_failed([s for s in streams if s in self._running], e)
            return
        with self._lock:
            self._counters["draft_proposed"] += sum(n - 1 for n in w.real)
            self._counters["draft_accepted"] += int(took[:len(streams)].sum()) - len(streams)
            self._counters["draft_landed"] += len(streams)
        for i, s in enumerate(streams):
            if s not in self._running:
                continue  # ended meanwhile: its window's tokens are dropped
            k, n = int(took[i]), w.real[i]
            s.acceptance.landed_ranks(ranks[i, 1:n], self.draft_policy.decay)
            s.cache_len -= n - k
            s.sampled -= n - k
            s.finishing = s.budget() <= 0
            assumed, _ = s.windows.popleft()
            yielded = [int(t) for t in out.tokens[i, :k]]
            if assumed is not None and yielded != assumed:  # later windows guessed from what it did not yield
                s.windows = collections.deque((a, False) for a, _ in s.windows)
            if not s.inflight:
                s.next_input = yielded[-1]
            for r, t in enumerate(yielded):
                if s not in self._running:
                    break  # a stop id or string ended it: the rest of its window is dropped
                self._deliver(s, t, out, i * w.rows + r)


@dataclasses.dataclass
class _Window:
    """A draft window call in flight: the program's pending outputs, its row bucket, each stream's real rows."""
    pending: object
    rows: int
    real: list[int]
