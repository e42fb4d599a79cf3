"""The swap points between the model and the kernels: every matmul, GDN and attention call of the model goes
through one function here, which runs the Pallas kernel when `Backend.kernels` is on and the plain-jnp reference
otherwise (CPU, `--no-kernels`, verification)."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import attention as attn_k
from pallas_kernels import attn_prep as attn_prep_k
from pallas_kernels import gdn as gdn_k
from pallas_kernels import kv_quant
from pallas_kernels import qmm as qmm_k
from pallas_kernels import qmm_mgpu
from pallas_kernels import residual as residual_k
from pallas_kernels import rownorm as rownorm_k
from pallas_kernels import swiglu as swiglu_k
from pallas_kernels.qweight import QuantizedWeight
from qwen_jax.model import parallel

_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Backend:
    """Static under jit. kernels: use the Pallas kernels; interpret: run them in interpret mode (CPU tests).
    parallel: split the text model's layers over a mesh's devices (`parallel.TensorParallel`): the entry points run
    their body under shard_map; sharded: set inside that body (the output projections' partial sums are reduced)."""
    kernels: bool = False
    interpret: bool = False
    parallel: typing.Any = None  # parallel.TensorParallel | None
    sharded: bool = False

    @staticmethod
    def default() -> "Backend":
        return Backend(kernels=jax.default_backend() == "gpu")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fused:
    """Projections that read the same input, concatenated along N once at load: one matmul (one launch, one
    permutation of x, a larger N) instead of several. `sizes` are the parts' output widths, in order."""
    weight: object  # QuantizedWeight or dense [sum(sizes), K]
    sizes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))


def _fusable(a, b) -> bool:
    if isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight):
        return ((a.bits, a.group_size, a.in_features, a.scales.dtype, a.biases.dtype, a.lanes, a.halves) ==
                (b.bits, b.group_size, b.in_features, b.scales.dtype, b.biases.dtype, b.lanes, b.halves))
    if isinstance(a, QuantizedWeight) or isinstance(b, QuantizedWeight):
        return False
    return a.shape[1] == b.shape[1] and jnp.dtype(a.dtype) == jnp.dtype(b.dtype)


def _concat(ws: Sequence) -> Fused:
    sizes = tuple(int(w.shape[0]) for w in ws)
    if isinstance(ws[0], QuantizedWeight):
        cat = lambda name: jnp.concatenate([getattr(w, name) for w in ws], axis=0)
        return Fused(QuantizedWeight(cat("words"), cat("scales"), cat("biases"), ws[0].bits, ws[0].group_size,
                                     lanes=ws[0].lanes, halves=ws[0].halves), sizes)
    return Fused(jnp.concatenate(ws, axis=0), sizes)


def fuse(ws: Sequence) -> Fused | tuple:
    """Concatenate weights along N so they share one matmul: consecutive parts in the same format (packed with
    the same bits, group size, K and dtypes, or dense with the same K and dtype) become one `Fused`. -> the Fused
    when all parts fit together, else a tuple of Fused runs and lone weights, in order (mixed-precision
    checkpoints). A row's bits may differ from the unfused matmuls' (the kernel's tiles follow N), and are fixed
    for the model."""
    runs: list[list] = []
    for w in ws:
        if runs and _fusable(runs[-1][0], w):
            runs[-1].append(w)
        else:
            runs.append([w])
    groups = tuple(_concat(r) if len(r) > 1 else r[0] for r in runs)
    return groups[0] if len(groups) == 1 and isinstance(groups[0], Fused) else groups


def parts(w) -> tuple:
    """The weights behind a `fuse` result (its concatenated weights and lone parts), or a lone weight: for
    inspection, e.g. which layers are quantized."""
    if isinstance(w, Fused):
        return (w.weight,)
    if isinstance(w, (tuple, list)):
        return tuple(x for g in w for x in parts(g))
    return (w,)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["rows"], meta_fields=["lead"])
@dataclasses.dataclass(frozen=True)
class Padded:
    """A norm's output held for the projection that reads it, padded: `rows` [R, D], whose first prod(lead) rows are
    the live ones and the rest zeros, R the rows the decode qmm would pad them to (`pad_rows`), so the qmm reads
    them as they are and the program has no pad of its own between the norm kernel and the qmm (one launch fewer
    a projection). `linear` / `linear_split` take it where they take x [..., D]. A pytree whose only leaf is rows
    (lead is static), so it passes through `optimization_barrier` and jit as it is."""
    rows: jax.Array
    lead: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.lead, self.rows.shape[-1])

    @property
    def dtype(self):
        return self.rows.dtype


def rows_of(x) -> tuple[jax.Array, tuple[int, ...]]:
    """x [..., D] or `Padded` -> (its rows as the decode qmm reads them [M or R, D], the leading shape of its live
    rows)."""
    if isinstance(x, Padded):
        return x.rows, tuple(x.lead)
    return x.reshape(-1, x.shape[-1]), tuple(x.shape[:-1])


ATTN_PREP = True  # attention layers' verify and step rows take `attn_prep.prep` where it applies (`attn_prep_applies`)
DECODE_PREP = True  # verify and step rows take `gdn.decode_prep` where it applies (`decode_prep_applies`)
# The MLP's decode rows take `swiglu.swiglu` between their projections where it applies (`swiglu_applies`)
SWIGLU = True
# The output projections' decode rows reach the residual as `Deferred` and take `residual.residual_add` there
# (`project`, `add_residual`)
RESIDUAL = True
# The residual add after a decode projection and the norm that reads its result run as one launch
# (`residual.residual_add_norm`, `add_residual_norm`) for up to RESIDUAL_NORM_ROWS live rows. Its last program
# normalises the rows one after another (a 5120-wide row is one block of the norm's tiles), ~1.9 us of serial tail
# a row, where the separate norm runs its rows in parallel programs: timed at one row only (BENCHMARKS.md, engine,
# session 31), so one row (the one-stream decode) until more are measured.
RESIDUAL_NORM = True
RESIDUAL_NORM_ROWS = 1
# Who normalises in that launch (`residual.TAILS`): "last", the last add program, the rows one after another (timed
# at one row, shipped); "rows", programs of their own that wait for the add programs, a row each in parallel. Its
# gates pass, but it is the slower tail at both counts timed (session 33, BENCHMARKS.md engine: 661 against 535 us
# a one-stream round, 744 against the separate launches' 631 at 16 streams), so "last" stays.
RESIDUAL_NORM_TAIL = "last"
# The serial step's GDN recurrence and its output norm run as one launch (`gdn.step_norm`, `gdn_step_norm`) for up
# to STEP_NORM_ROWS streams, the same bits as the two launches. Timed in session 33: 336 against 349 us a
# one-stream round and 48 launches fewer; 1638 against 1506 us at 16 streams (the head's last program normalises
# after the others), so one stream only.
STEP_NORM = True
STEP_NORM_ROWS = 1
# Norms (and the attention output's gate) feeding a decode qmm write its padded rows (`pad_rows`); False: the qmm
# pads them
PAD_AT_NORM = True
# Decode rows' projections reach their prep kernels as the decode qmm's pieces, which the prep sums and rounds
# itself (`project_pieces`), in place of XLA's epilogue fusion between them: the serial step's GDN in-projection
# (`gdn.decode_prep`) and the attention layers' qkv projection (`attn_prep.prep`, steps and windows)
PREP_PIECES = True


def pad_rows(backend: Backend, x, w, *, prompt: bool) -> int | None:
    """The rows R > M that the matmul of x [..., D] (M rows) by `w` (a weight or a `fuse` result) pads x to, when
    every part of w goes to the Mosaic GPU decode qmm (which pads to its piece heights, `qmm_mgpu.pieces`); None
    when it does not pad or PAD_AT_NORM is off. Rows past M change no live row's bits there (a row is one column
    of the kernel's MMAs), so a producer may write the padding itself."""
    m = math.prod(x.shape[:-1])
    if not (PAD_AT_NORM and backend.kernels and not prompt and m > 0):
        return None
    xs = jax.ShapeDtypeStruct((m, x.shape[-1]), x.dtype)
    if not all(qmm_k.decode_on_mgpu(xs, p, backend.interpret) for p in parts(w)):
        return None
    r = sum(qmm_mgpu.pieces(m))
    return r if r > m else None


def linear_split(x: jax.Array, w, backend: Backend, *, prompt: bool) -> tuple[jax.Array, ...]:
    """The outputs of a `fuse` result's projections, in order: one matmul per fused run, split along N."""
    if isinstance(w, Fused):
        y = linear(x, w.weight, backend, prompt=prompt)
        cuts = [0]
        for n in w.sizes:
            cuts.append(cuts[-1] + n)
        return tuple(y[..., a:b] for a, b in zip(cuts[:-1], cuts[1:]))
    return tuple(y for g in w for y in (linear_split(x, g, backend, prompt=prompt) if isinstance(g, Fused)
                                        else (linear(x, g, backend, prompt=prompt),)))


def linear(x: jax.Array, w, backend: Backend, *, prompt: bool) -> jax.Array:
    """x [..., K] (or `Padded`) @ w[N, K]^T -> [..., N] in x.dtype with fp32 accumulation; w dense or packed."""
    if isinstance(x, Padded):
        y = linear(x.rows, w, backend, prompt=prompt)
        return y[:math.prod(x.lead)].reshape(*x.lead, y.shape[-1])
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(w, QuantizedWeight):
        if backend.kernels:
            y = qmm_k.qmm(x2, w, prompt=prompt, interpret=backend.interpret)
        else:
            y = qmm_k.reference(x2, w)
    else:
        y = jnp.dot(x2, w.T.astype(x2.dtype), precision=_HI, preferred_element_type=jnp.float32).astype(x.dtype)
    return y.reshape(*lead, y.shape[-1])


def project_pieces(x, w, backend: Backend) -> qmm_mgpu.Pieces | None:
    """`linear(x, w)` of decode rows x [S, R, K] (or `Padded`) before its epilogue, as `qmm_mgpu.Pieces` for a kernel
    that sums and rounds them itself (the same operations as the epilogue): where PREP_PIECES is on and the Mosaic
    GPU decode qmm takes the rows whole in one piece (`qmm_mgpu.pieces`); else None."""
    rows, lead = rows_of(x)
    m = math.prod(lead)
    if not (PREP_PIECES and backend.kernels and isinstance(w, QuantizedWeight) and len(lead) == 2 and m > 0
            and rows.dtype == jnp.bfloat16 and qmm_k.decode_on_mgpu(rows, w, backend.interpret)):
        return None
    heights = qmm_mgpu.pieces(m)
    if len(heights) != 1 or rows.shape[0] > heights[0]:
        return None
    parts, written = qmm_mgpu.qmm_parts(rows, w, rows=heights[0], interpret=backend.interpret)
    return qmm_mgpu.Pieces(parts, jnp.asarray(written), lead)


def embed(w, ids: jax.Array, dtype, backend: Backend) -> jax.Array:
    if isinstance(w, QuantizedWeight):
        if backend.kernels:
            return qmm_k.embed(w, ids, dtype, interpret=backend.interpret)
        return qmm_k.embed_reference(w, ids, dtype)
    return w[ids].astype(dtype)


def _pick(backend: Backend, module, name: str):
    if backend.kernels:
        fn = getattr(module, name)
        return lambda *a, **k: fn(*a, **k, interpret=backend.interpret)
    return getattr(module, f"{name}_reference")


def gdn_prompt(backend: Backend, q, *args):
    """The kernel runs at the shipped tiles for the activation dtype (`gdn.prompt_tiles`): bf16 activations get
    bf16 products like flash-linear-attention's; the fp32 verification path keeps tf32 (fp32 in interpret mode)."""
    if backend.kernels:
        return gdn_k.prompt(q, *args, interpret=backend.interpret, tiles=gdn_k.prompt_tiles(q.dtype))
    return gdn_k.prompt_reference(q, *args)


def gdn_window(backend: Backend, *args, leaves: bool = False):
    """leaves: a tree window's schedule (`gdn.window`)."""
    return _pick(backend, gdn_k, "window")(*args, leaves=leaves)


def gdn_commit(backend: Backend, *args):
    return _pick(backend, gdn_k, "commit")(*args)


def gdn_step(backend: Backend, *args):
    """Serial decode step: (o, rec_pool) bit for bit gdn_window with parents [[-1]] + gdn_commit of the row."""
    return _pick(backend, gdn_k, "step")(*args)


def decode_prep_applies(backend: Backend, in_proj, cfg) -> bool:
    """Whether verify and step rows take `gdn.decode_prep` (kernels on, the in-projection one fused matmul of
    q|k|v, z, b, a, power-of-two head sizes); otherwise the model's separate conv, norm and gate ops."""
    c = 2 * cfg.key_dim + cfg.value_dim
    return (DECODE_PREP and backend.kernels and isinstance(in_proj, Fused)
            and in_proj.sizes == (c, cfg.value_dim, cfg.linear_num_value_heads, cfg.linear_num_value_heads)
            and gdn_k.decode_prep_supports(cfg.linear_num_key_heads, cfg.linear_key_head_dim,
                                           cfg.linear_num_value_heads, cfg.linear_value_head_dim))


def gdn_decode_prep(backend: Backend, y, parents, conv_pool: jax.Array, slot: jax.Array, p: dict, cfg):
    """`gdn.decode_prep` of the in-projection's output y [S, R, N] (or its `qmm_mgpu.Pieces`) with the layer's conv and
    gate parameters."""
    return gdn_k.decode_prep(y, parents, conv_pool, slot, p["conv"], p["A_log"], p["dt_bias"],
                             hk=cfg.linear_num_key_heads, dk=cfg.linear_key_head_dim,
                             hv=cfg.linear_num_value_heads, dv=cfg.linear_value_head_dim, interpret=backend.interpret)


def attn_prep_applies(backend: Backend, qkv, cfg) -> bool:
    """Whether an attention layer's verify and step rows take `attn_prep.prep` (kernels on, the qkv projection one
    fused matmul of q|gate, k, v, power-of-two head and rotary dims); otherwise the model's norm and RoPE ops."""
    d = cfg.head_dim
    return (ATTN_PREP and backend.kernels and isinstance(qkv, Fused)
            and qkv.sizes == (cfg.num_heads * 2 * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d)
            and attn_prep_k.supports(d, cfg.rotary_dim))


def attn_prep(backend: Backend, y: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, cfg,
              packed_rows: int | None = None):
    """`attn_prep.prep` of the qkv projection's output y [S, R, N] with the layer's q and k norm weights (and q
    packed for the window's pass 1 too, with packed_rows: `window_packed_rows`)."""
    return attn_prep_k.prep(y, p["q_norm"], p["k_norm"], cos, sin, hq=cfg.num_heads, hkv=cfg.num_kv_heads,
                            d=cfg.head_dim, rotary_dim=cfg.rotary_dim, eps=cfg.rms_norm_eps,
                            packed_rows=packed_rows, interpret=backend.interpret)


# The attention prep writes q packed as the Mosaic GPU window pass 1 reads it, so no pad launch sits between them
# (session 33: 16 launches a round fewer, the pad's 19.3 us gone for 6.6 more in the prep, at one stream).
PACK_QUERIES = True


def window_packed_rows(backend: Backend, q_shape: tuple[int, ...], q_dtype, pool, page_table) -> int | None:
    """The packed rows (`attention.packed_query_rows`) in which `attn_prep` writes an attention layer's window
    queries [S, R, Hq, D] for its window call, or None where that call reads q as it is (PACK_QUERIES off, no
    kernels, a pass 1 other than the Mosaic GPU one)."""
    if not (PACK_QUERIES and backend.kernels):
        return None
    return attn_k.packed_query_rows(q_shape, q_dtype, pool, page_table.shape[-1], interpret=backend.interpret)


def swiglu_applies(backend: Backend, x, gate_up, *, prompt: bool) -> bool:
    """Whether an MLP's decode rows take `swiglu.swiglu` on the gate/up projection's pieces (kernels on, a decode
    call, gate and up one fused matmul of equal halves on the Mosaic GPU decode qmm); otherwise the projection's
    own epilogue and the model's activation."""
    if not (SWIGLU and backend.kernels and not prompt and isinstance(gate_up, Fused) and len(gate_up.sizes) == 2
            and gate_up.sizes[0] == gate_up.sizes[1]):
        return False
    rows, _ = rows_of(x)
    return rows.shape[0] > 0 and qmm_k.decode_on_mgpu(rows, gate_up.weight, backend.interpret)


def swiglu(backend: Backend, x, gate_up):
    """silu(gate) x up of an MLP's decode rows x [..., D] (or `Padded`), the projection's pieces summed in the
    kernel (`swiglu.swiglu`), one launch a piece of rows (`qmm_mgpu.pieces`) -> `Padded` rows for the down
    projection (its live rows first, zeros after), or [..., N] where no row is padding."""
    rows, lead = rows_of(x)
    m = math.prod(lead)
    out = []
    for start, r in qmm_mgpu.row_pieces(qmm_mgpu.pieces(rows.shape[0])):
        parts, written = qmm_mgpu.qmm_parts(rows[start:start + r], gate_up.weight, rows=r,
                                            interpret=backend.interpret)
        out.append(swiglu_k.swiglu(parts, jnp.asarray(written), live=min(r, m - start), interpret=backend.interpret))
    act = jnp.concatenate(out, axis=0) if len(out) > 1 else out[0]
    if act.shape[0] > m:
        return Padded(act, lead)
    return act.reshape(*lead, act.shape[-1])


class Deferred(typing.NamedTuple):
    """An output projection's decode rows not yet multiplied: `linear(h, w)` for `add_residual` to add to the
    residual stream in one kernel with the projection's epilogue (`residual.residual_add`). Made by `project`
    only where that applies; nothing but `add_residual` reads it."""
    h: typing.Any  # [..., K] or `Padded`
    w: QuantizedWeight


def project(h, w, backend: Backend, *, prompt: bool):
    """An output projection whose result only the residual add reads: `Deferred` where `add_residual` can take
    the decode qmm's pieces itself (RESIDUAL, kernels on, a decode call of bf16 rows that the Mosaic GPU decode qmm
    takes whole, w one packed weight), else `linear(h, w)`; inside tensor-parallel shards, the devices' partial
    products summed (`parallel.reduce`)."""
    if backend.sharded:  # each device holds a slice of the inputs: the partial sums are added across devices
        return parallel.reduce(linear(h, w, backend, prompt=prompt))
    rows, _ = rows_of(h)
    if (RESIDUAL and backend.kernels and not prompt and isinstance(w, QuantizedWeight) and rows.shape[0] > 0
            and rows.dtype == jnp.bfloat16 and qmm_k.decode_on_mgpu(rows, w, backend.interpret)):
        return Deferred(h, w)
    return linear(h, w, backend, prompt=prompt)


def materialize(backend: Backend, y) -> jax.Array:
    """y itself, or a `Deferred` projection multiplied out (`linear`): for readers other than the residual add."""
    if not isinstance(y, Deferred):
        return y
    return linear(y.h, y.w, backend, prompt=False)


def add_residual(backend: Backend, x: jax.Array, y) -> jax.Array:
    """x + y for the residual stream x [..., N]; y an array or a `Deferred` projection, whose pieces
    `residual.residual_add` sums, rounds and adds (the same operations as `x + linear(h, w)`), one launch a piece
    of rows (`qmm_mgpu.pieces`)."""
    if not isinstance(y, Deferred):
        return x + y
    if x.dtype != jnp.bfloat16:
        return x + materialize(backend, y)
    rows, _ = rows_of(y.h)
    x2 = x.reshape(-1, x.shape[-1])
    out = []
    for start, r in qmm_mgpu.row_pieces(qmm_mgpu.pieces(rows.shape[0])):
        parts, written = qmm_mgpu.qmm_parts(rows[start:start + r], y.w, rows=r, interpret=backend.interpret)
        out.append(residual_k.residual_add(parts, jnp.asarray(written), x2[start:start + r],
                                           interpret=backend.interpret))
    return (jnp.concatenate(out, axis=0) if len(out) > 1 else out[0]).reshape(x.shape)


class LaunchCount:
    """A program's launch counters for the kernels whose last program to finish does the rest of the work
    (`residual.residual_add_norm`, `gdn.step_norm`): int32 [size] zeros, made at the first use (none if no such
    kernel runs) and threaded from call to call, each call returning them zero again. Trace-time state of one
    forward (`forward._layers` makes one)."""

    def __init__(self, size: int):
        self.size, self.value = size, None

    def take(self, need: int) -> jax.Array:
        if need > self.size:
            raise ValueError(f"LaunchCount: {need} counters asked of {self.size}")
        if self.value is None:
            self.value = jnp.zeros((self.size,), jnp.int32)
        return self.value

    def give(self, value: jax.Array) -> None:
        self.value = value


def add_residual_norm(backend: Backend, x: jax.Array, y, weight: jax.Array, eps: float, *, then, prompt: bool,
                      counter: LaunchCount):
    """(x + y, `rms_norm(x + y, weight, eps, then=then)`): `add_residual` and the norm that reads its result, in one
    launch (`residual.residual_add_norm`, the same bits) where y is a `Deferred` projection of bf16 rows in one piece
    of at most RESIDUAL_NORM_ROWS live rows; else the two ops. counter: the program's launch counters."""
    m = math.prod(x.shape[:-1])
    if (RESIDUAL_NORM and isinstance(y, Deferred) and x.dtype == jnp.bfloat16 and 0 < m <= RESIDUAL_NORM_ROWS):
        rows, _ = rows_of(y.h)
        heights = qmm_mgpu.pieces(rows.shape[0])
        if len(heights) == 1:
            r = pad_rows(backend, x, then, prompt=prompt)
            parts, written = qmm_mgpu.qmm_parts(rows, y.w, rows=heights[0], interpret=backend.interpret)
            total, h, count = residual_k.residual_add_norm(
                parts, jnp.asarray(written), x.reshape(m, x.shape[-1]), weight, counter.take(1), eps=eps,
                out_rows=r or m, tail=RESIDUAL_NORM_TAIL, interpret=backend.interpret)
            counter.give(count)
            return total.reshape(x.shape), Padded(h, x.shape[:-1]) if r else h.reshape(x.shape)
    x = add_residual(backend, x, y)
    return x, rms_norm(backend, x, weight, eps, then=then, prompt=prompt)


def gdn_step_norm(backend: Backend, q, k, v, g, beta, rec_pool, slot, z, weight, eps: float, *, then,
                  counter: LaunchCount | None):
    """(y, rec_pool): `gdn_step` and GDN's output norm of its o (`gated_rms_norm(o, z, weight, eps, then=then)`,
    y as that returns it) in one launch (`gdn.step_norm`, the same bits) where kernels are on (STEP_NORM) for up to
    STEP_NORM_ROWS streams; None where not."""
    s, _, hv, dv = v.shape
    if not (STEP_NORM and backend.kernels and counter is not None and s <= STEP_NORM_ROWS
            and gdn_k.step_norm_supports(dv)):
        return None
    joined = jax.ShapeDtypeStruct((s, 1, hv * dv), v.dtype)
    r = pad_rows(backend, joined, then, prompt=False)
    y, rec_pool, count = gdn_k.step_norm(q, k, v, g, beta, rec_pool, slot, z, weight, counter.take(s * hv),
                                         eps=eps, out_rows=r or s, interpret=backend.interpret)
    counter.give(count)
    return (Padded(y.reshape(r, hv * dv), (s, 1)) if r else y.reshape(s, 1, hv * dv)), rec_pool


def conv_prompt(backend: Backend, *args):
    return _pick(backend, gdn_k, "conv_prompt")(*args)


def conv_window(backend: Backend, *args):
    return _pick(backend, gdn_k, "conv_window")(*args)


def conv_commit(backend: Backend, *args):
    return _pick(backend, gdn_k, "conv_commit")(*args)


def conv_step(backend: Backend, *args):
    """Serial decode step of the conv: (u, conv_pool) bit for bit conv_window of the row + conv_commit of it."""
    return _pick(backend, gdn_k, "conv_step")(*args)


def rms_norm(backend: Backend, x: jax.Array, weight: jax.Array, eps: float, *, then=None, prompt: bool = False):
    """Normalise over the last axis in fp32, times the fp32 multiplier, cast back. With kernels, a row's bits
    never depend on how many rows share the call (XLA's own row reductions do: pallas_kernels/rownorm.py).
    then: the weight of the projection that reads the result (and prompt, its path): where its matmul pads the
    rows (`pad_rows`), the norm writes them padded and returns a `Padded`."""
    r = None if then is None else pad_rows(backend, x, then, prompt=prompt)
    if r is not None:
        return Padded(rownorm_k.rms_norm(x, weight, eps, interpret=backend.interpret, out_rows=r), x.shape[:-1])
    return _pick(backend, rownorm_k, "rms_norm")(x, weight, eps)


def gated_rms_norm(backend: Backend, x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float, *, then=None,
                   prompt: bool = False):
    """GDN's output norm (not zero-centred): normalise in fp32, cast, scale by w, times silu(gate); over the last
    axis of x [..., H, D]. then: as for `rms_norm`, for the projection that reads the heads joined, [..., H * D]."""
    joined = jax.ShapeDtypeStruct((*x.shape[:-2], x.shape[-2] * x.shape[-1]), x.dtype)
    r = None if then is None else pad_rows(backend, joined, then, prompt=prompt)
    if r is not None:
        y = rownorm_k.gated_rms_norm(x, gate, weight, eps, interpret=backend.interpret, out_rows=r * x.shape[-2])
        return Padded(y.reshape(r, joined.shape[-1]), joined.shape[:-1])
    return _pick(backend, rownorm_k, "gated_rms_norm")(x, gate, weight, eps)


def l2norm(backend: Backend, x: jax.Array) -> jax.Array:
    """x * rsqrt(sum(x^2) + 1e-6) over the last axis, fp32 out (GDN's q/k)."""
    return _pick(backend, rownorm_k, "l2norm")(x, gdn_k.QK_NORM_EPS)


def kv_write(backend: Backend, *args, share: int = 1):
    """`kv_quant.write`; share > 1: k, v hold the streams of the table / share (see `kv_quant.write_reference`)."""
    return _pick(backend, kv_quant, "write")(*args, share=share)


def attention_rows(backend: Backend, q, k, v, pool, page_table, row_tables, row_len, base, *, scale: float):
    """Each window row as a one-row window of its own (`attention.window_rows`: q [S, R, Hq, D]; k, v [S, R, Hkv, D];
    row_tables [S R, Pmax]; row_len [S, R]; base [S]). The kernels read the keys below base once; the reference runs
    the one-row windows as streams of their own."""
    return _pick(backend, attn_k, "window_rows")(q, k, v, pool, page_table, row_tables, row_len, base, scale=scale)


def attention_prompt(backend: Backend, *args, scale: float):
    return _pick(backend, attn_k, "prompt")(*args, scale=scale)


def attention_window(backend: Backend, *args, scale: float, q_packed: jax.Array | None = None):
    """q_packed (kernels only): q as `attn_prep` packed it for the Mosaic GPU pass 1 (`window_packed_rows`)."""
    if q_packed is None:
        return _pick(backend, attn_k, "window")(*args, scale=scale)
    return attn_k.window(*args, scale=scale, q_packed=q_packed, interpret=backend.interpret)
