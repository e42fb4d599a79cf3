"""Exact keyed sampling: one token per row, drawn so that a row's token depends only on its own logits and params.

Letters: n rows (one token drawn per row), v vocabulary.

The rule, per row (filter order as in SGLang and TensorFold's keyed sampler):

1. temperature == 0: greedy, the argmax of the logits, lowest id on ties.
2. Order the candidates by (logit desc, id asc); top_k > 0 keeps the first top_k (0 or >= v keeps all).
3. Scale: r_i = (l_i - l_max) / T. softmax(r) is softmax(l / T); subtracting the max first keeps r <= 0 and
   finite, so a tiny temperature degrades to greedy instead of overflowing.
4. top-p: with e_i = exp(r_i) over the top-k survivors, the token at rank j stays iff
   sum_{rank < j} e < top_p * sum e, i.e. the smallest prefix whose mass reaches top_p (rank 0 always stays).
   top_p == 1 keeps every top-k survivor, even where float rounding makes the running sum reach the total early.
5. min-p: keep iff e_i >= min_p, i.e. p_i >= min_p * p_max. p_max is the rank-0 token's, which every cut keeps,
   so renormalising after top-k/top-p does not change this ratio.
6. Draw: argmax over the survivors of r_i + G_i, lowest id on ties, with G_i = -log(-log(u_i)) and
   u_i = keyed_uniform(seed, position, i). Gumbel-max gives P(i) = softmax(r) restricted to the survivors, up to
   the 2^-24 grid of u (it truncates the Gumbel tails at -2.81 and 16.6, mass ~1e-7).

Keyed uniform. Threefry-2x32 with 20 rounds (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3",
SC 2011), all arithmetic on uint32 words mod 2^32, key (k0, k1) = (seed >> 32, seed & 0xFFFFFFFF), counter
(c0, c1) = (position, token id):

    ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA);  x0 = c0 + ks[0];  x1 = c1 + ks[1]
    for s in 1..5:
        for R in ((13, 15, 26, 6) if s is odd else (17, 29, 16, 24)):
            x0 = x0 + x1;  x1 = rotl32(x1, R) ^ x0
        x0 = x0 + ks[s % 3];  x1 = x1 + ks[(s + 1) % 3] + s
    u = (2 * (x0 >> 9) + 1) / 2^24

u is an odd multiple of 2^-24 in [2^-24, 1 - 2^-24]: never 0 or 1, exact in float32, and a pure function of
(seed, position, token id). `keyed_uniform` (jnp, uint32) and `keyed_uniform_numpy` (numpy, masked uint64, written
separately) give the same bits; the hash is the Threefry-2x32 of `jax.extend.random.threefry_2x32`, which the tests
check word for word.

Requests without a seed: `derive_seed(prompt_ids, salt)` = the first 8 bytes, read big-endian, of
SHA-256(",".join(decimal ids) + salt) in UTF-8. The same prompt gives the same reply; a server salt (e.g. from an
environment variable) makes the choice private to that server.

Why every row is independent of its neighbours: everything a decision reads is elementwise in the row, an exact
order-free reduction (max, min), the sort (a total order on (value, id)), or a prefix sum of fixed structure
(`lax.associative_scan` over the vocab, whose association order is set by v alone, never by n or by XLA's choice of
reduction kernel). A pure-temperature row decides the same token on the sorted path as on the plain one, so the
batch-wide choice between them (below) cannot reach it.

Cost at v = 248,320 (n up to 256): one lax.cond picks, for the whole batch, between
- the plain path, when no sampled row has a top-k or top-p cut: Gumbel-max over the full vocab is already exact
  for temperature and min-p (min-p is elementwise against the row max), so there is no sort; the cost is the hash,
  ~100 uint32 ops per (row, token), plus a few passes over the logits;
- the sorted path, otherwise: a stable radix-sortable sort of an int32 order key with the ids as payload per row,
  an O(v) associative scan, then the same hash. The logit values come back out of the order key (a bijection on
  non-NaN float32), so there is no gather.
The cond's predicate lives on the device; on GPU XLA reads it back to pick the branch (a sync inside the program,
which would stall a caller that dispatches the next program before fetching this one). So `path` can instead be
fixed when tracing, chosen on the host from the packed params (`sorted_path_needed`), one compiled variant per
path: the decode programs do that; no row's token changes. The sorted path hashes the whole vocab too:
how many tokens survive is data-dependent and shapes are static. Temporaries are a handful of n x v 32-bit arrays
(about 250 MB each at n = 256). None of this has been timed on a GPU yet.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SEED_LIMIT = 1 << 64
POSITION_LIMIT = 1 << 31
_INT32_MAX = (1 << 31) - 1
_WORD = 0xFFFFFFFF
_KEY_PARITY = 0x1BD11BDA
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


# ----------------------------------------------------------------------------------------------- parameters


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["temperature", "top_k", "top_p", "min_p", "seed_hi", "seed_lo", "position"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SampleParams:
    """Per-row sampling parameters, one entry per row (numpy on the host, jax.Array inside programs)."""

    temperature: jax.Array  # [n] f32; 0 = greedy
    top_k: jax.Array  # [n] i32; 0 = off
    top_p: jax.Array  # [n] f32; 1 = off
    min_p: jax.Array  # [n] f32; 0 = off
    seed_hi: jax.Array  # [n] u32; seed >> 32
    seed_lo: jax.Array  # [n] u32; seed & 0xFFFFFFFF
    position: jax.Array  # [n] i32; absolute position of the token being drawn


@dataclasses.dataclass(frozen=True)
class RequestSampling:
    """A request's sampling settings from Python values, validated; the values are those the device will see
    (float32 for the real-valued fields), so a value that only becomes invalid in float32 is refused here."""

    seed: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        seed = _integer("seed", self.seed)
        if not 0 <= seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        top_k = _integer("top_k", self.top_k)
        if not 0 <= top_k <= _INT32_MAX:
            raise ValueError(f"top_k must be 0 (off) or a positive count below 2**31, got {top_k}")
        temperature = _float32("temperature", self.temperature)
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature!r}")
        top_p = _float32("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        min_p = _float32("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        for name, value in (("seed", seed), ("top_k", top_k), ("temperature", temperature), ("top_p", top_p),
                            ("min_p", min_p)):
            object.__setattr__(self, name, value)


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _float32(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def pack_sample_params(requests: Sequence[RequestSampling], positions: Sequence[int] | np.ndarray,
                       rows: int) -> SampleParams:
    """Host arrays for one program call: requests[i] and positions[i] describe row i (a stream's window repeats
    its request, one absolute position per row); rows past the end are greedy padding at position 0, whose draws
    the caller discards. -> SampleParams of numpy arrays with `rows` entries."""
    if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows < 1:
        raise ValueError(f"rows must be a positive integer, got {rows!r}")
    if len(requests) != len(positions):
        raise ValueError(f"positions must have one entry per request row: {len(positions)} positions for "
                         f"{len(requests)} requests")
    if len(requests) > rows:
        raise ValueError(f"rows ({rows}) is smaller than the number of request rows ({len(requests)})")
    for i, request in enumerate(requests):
        if not isinstance(request, RequestSampling):
            raise ValueError(f"requests[{i}] must be a RequestSampling, got {type(request).__name__}")
    position = np.zeros(rows, np.int32)
    for i, p in enumerate(positions):
        p = _integer(f"positions[{i}]", p)
        if not 0 <= p < POSITION_LIMIT:
            raise ValueError(f"positions[{i}] must be in [0, 2**31), got {p}")
        position[i] = p
    params = SampleParams(
        temperature=np.zeros(rows, np.float32),
        top_k=np.zeros(rows, np.int32),
        top_p=np.ones(rows, np.float32),
        min_p=np.zeros(rows, np.float32),
        seed_hi=np.zeros(rows, np.uint32),
        seed_lo=np.zeros(rows, np.uint32),
        position=position,
    )
    for i, request in enumerate(requests):
        params.temperature[i] = request.temperature
        params.top_k[i] = request.top_k
        params.top_p[i] = request.top_p
        params.min_p[i] = request.min_p
        params.seed_hi[i] = request.seed >> 32
        params.seed_lo[i] = request.seed & _WORD
    return params


# ------------------------------------------------------------------------------------------------ penalties


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["presence", "frequency", "repetition", "biased"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Penalties:
    """Per-row changes to the logits before the draw (`penalize`; numpy on the host, jax.Array in programs); logprobs
    stay those of the raw logits.

    presence [n] f32: subtracted once from every token generated so far (OpenAI's presence_penalty; neutral 0).
    frequency [n] f32: subtracted once per time a token was generated (frequency_penalty; neutral 0).
    repetition [n] f32: for every token of the prompt or generated so far, a positive logit divided by it and a
    negative one multiplied (the repetition_penalty of transformers and vLLM; neutral 1).
    biased [n] bool: the row's slot's logit_bias row is added first (OpenAI's logit_bias; neutral False)."""

    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    biased: jax.Array


PENALTY_LIMIT = 2.0  # |presence|, |frequency| at most this (OpenAI's range)
REPETITION_LIMIT = 10.0
BIAS_LIMIT = 100.0  # |logit_bias| values at most this (OpenAI's range)


@dataclasses.dataclass(frozen=True)
class RequestPenalties:
    """A request's penalties and logit bias as the device will see them (float32), validated. logit_bias: (token
    id, bias) pairs, ids distinct and non-negative (the engine checks them against its vocabulary). masked: the
    slot's bias row also carries a token mask (-inf where a grammar forbids a token: structured outputs), rewritten
    by the engine before each step, so the row is read even without a logit bias."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    masked: bool = False

    def __post_init__(self) -> None:
        widened = {}
        for field, name in (("presence", "presence_penalty"), ("frequency", "frequency_penalty")):
            value = getattr(self, field)
            widened[field] = x = _float32(name, value)
            if not (math.isfinite(x) and abs(x) <= PENALTY_LIMIT):
                raise ValueError(f"{name} must be in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}], got {value!r}")
        widened["repetition"] = x = _float32("repetition_penalty", self.repetition)
        if not (math.isfinite(x) and 0 < x <= REPETITION_LIMIT):
            raise ValueError(f"repetition_penalty must be in (0, {REPETITION_LIMIT}], got {self.repetition!r}")
        bias = []
        for entry in self.logit_bias:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise ValueError(f"logit_bias must be (token id, bias) pairs, got {entry!r}")
            token = _integer("logit_bias token id", entry[0])
            value = _float32("logit_bias value", entry[1])
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            if not (math.isfinite(value) and abs(value) <= BIAS_LIMIT):
                raise ValueError(f"logit_bias values must be in [-{BIAS_LIMIT}, {BIAS_LIMIT}], got {entry[1]!r}")
            bias.append((token, value))
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token id twice")
        if not isinstance(self.masked, bool):
            raise ValueError(f"masked must be a bool, got {self.masked!r}")
        for name, value in {**widened, "logit_bias": tuple(sorted(bias))}.items():
            object.__setattr__(self, name, value)

    @property
    def neutral(self) -> bool:
        return (self.presence == 0 and self.frequency == 0 and self.repetition == 1 and not self.logit_bias
                and not self.masked)

    def bias_row(self, vocab: int) -> np.ndarray:
        """The logit bias as a [vocab] float32 row (zeros elsewhere)."""
        row = np.zeros(vocab, np.float32)
        for token, value in self.logit_bias:
            row[token] = value
        return row


def pack_penalties(rows_penalties: Sequence[RequestPenalties | None], rows: int) -> Penalties:
    """Host arrays for one program call: rows_penalties[i] is row i's, None for none; rows past the end are neutral.
    -> Penalties of numpy arrays with `rows` entries."""
    if len(rows_penalties) > rows:
        raise ValueError(f"rows ({rows}) is smaller than the number of penalty rows ({len(rows_penalties)})")
    out = Penalties(np.zeros(rows, np.float32), np.zeros(rows, np.float32), np.ones(rows, np.float32),
                    np.zeros(rows, np.bool_))
    for i, p in enumerate(rows_penalties):
        if p is None:
            continue
        if not isinstance(p, RequestPenalties):
            raise ValueError(f"rows_penalties[{i}] must be a RequestPenalties or None, got {type(p).__name__}")
        out.presence[i], out.frequency[i], out.repetition[i] = p.presence, p.frequency, p.repetition
        out.biased[i] = bool(p.logit_bias) or p.masked
    return out


def mask_words(vocab: int) -> int:
    """uint32 words a row of a packed token mask takes (`pack_allowed`)."""
    return (vocab + 31) // 32


def pack_allowed(allowed: np.ndarray, words: int | None = None) -> np.ndarray:
    """allowed [V] bool -> [words] uint32: token t's bit is bit t % 32 of word t // 32 (bits past V are 0)."""
    allowed = np.asarray(allowed, np.bool_)
    words = mask_words(len(allowed)) if words is None else words
    out = np.zeros(words * 32, np.bool_)
    out[:len(allowed)] = allowed
    return np.packbits(out, bitorder="little").view("<u4").astype(np.uint32)


def all_allowed(rows: int, vocab: int) -> np.ndarray:
    """[rows, mask_words(vocab)] uint32 with every bit set: rows no grammar constrains."""
    return np.full((rows, mask_words(vocab)), 0xFFFFFFFF, np.uint32)


def allowed_rows(mask: jax.Array, vocab: int) -> jax.Array:
    """Packed masks [N, W] uint32 (`pack_allowed`) -> [N, vocab] bool."""
    ids = jnp.arange(vocab, dtype=jnp.uint32)
    return ((mask[:, ids >> 5] >> (ids & 31)) & 1).astype(jnp.bool_)


def penalize(logits: jax.Array, pen: Penalties, counts: jax.Array, seen: jax.Array, bias: jax.Array) -> jax.Array:
    """logits [n, v]; pen with [n] fields; counts [n, v] int32 (how often each token was generated so far); seen
    [n, v] bool (the prompt's tokens); bias [n, v] f32 (the rows' logit bias) -> float32 logits [n, v]: the bias
    added (vLLM's order: bias, then penalties), the repetition penalty on tokens seen or generated, then frequency x
    count and presence subtracted. A row whose penalties are all neutral is its logits unchanged, bit for bit
    (widened to float32 exactly, as `sample` does), whatever its counts and bias rows hold."""
    x = logits.astype(jnp.float32)
    with jax.named_scope("penalties"):
        generated = counts > 0
        y = jnp.where(pen.biased[:, None], x + bias, x)
        rep = pen.repetition[:, None]
        y = jnp.where(seen | generated, jnp.where(y > 0, y / rep, y * rep), y)
        y = y - pen.frequency[:, None] * counts.astype(jnp.float32) - pen.presence[:, None] * generated
        active = (pen.presence != 0) | (pen.frequency != 0) | (pen.repetition != 1) | pen.biased
        return jnp.where(active[:, None], y, x)


def penalize_reference(logits: np.ndarray, pen: Penalties, prompts: Sequence[Sequence[int]],
                       generated: Sequence[Sequence[int]], bias: np.ndarray | None = None) -> np.ndarray:
    """`penalize` in numpy float64 from each row's prompt and generated token lists and bias row, one token at a
    time (the test oracle) -> [n, v] float64."""
    out = np.array(logits, np.float64)
    for row in range(out.shape[0]):
        if bool(pen.biased[row]):
            out[row] += np.asarray(bias[row], np.float64)
        rep = float(pen.repetition[row])
        for t in set(prompts[row]) | set(generated[row]):
            out[row, t] = out[row, t] / rep if out[row, t] > 0 else out[row, t] * rep
        for t in set(generated[row]):
            out[row, t] -= float(pen.frequency[row]) * list(generated[row]).count(t) + float(pen.presence[row])
    return out


def derive_seed(prompt_ids: Sequence[int], salt: str = "") -> int:
    """The seed of a request that gave none: first 8 bytes (big-endian) of SHA-256 over the comma-joined decimal
    prompt ids followed by `salt`, UTF-8 encoded. -> int in [0, 2**64)."""
    if not isinstance(salt, str):
        raise ValueError(f"salt must be a string, got {type(salt).__name__}")
    ids = []
    for i, token in enumerate(prompt_ids):
        token = _integer(f"prompt_ids[{i}]", token)
        if token < 0:
            raise ValueError(f"prompt_ids[{i}] must be a non-negative token id, got {token}")
        ids.append(str(token))
    digest = hashlib.sha256((",".join(ids) + salt).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def choice_seed(seed: int, index: int) -> int:
    """The seed of a reply's choice `index` (OpenAI's `n`) drawn from one request's `seed`: choice 0 keeps it, so
    its tokens are those of the same request with n=1; choice i > 0 takes the first 8 bytes (big-endian) of SHA-256
    over "<seed>/<i>" in ASCII. -> int in [0, 2**64)."""
    seed, index = _integer("seed", seed), _integer("index", index)
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    if index == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{index}".encode("ascii")).digest()[:8], "big")


# ------------------------------------------------------------------------------------------------ keyed draw


def _rotl32(x: jax.Array, r: int) -> jax.Array:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def keyed_uniform(seed_hi: jax.Array, seed_lo: jax.Array, position: jax.Array, token_id: jax.Array) -> jax.Array:
    """u = hash(seed, position, token id) in (0, 1) (module docstring); arguments broadcast together.

    seed_hi, seed_lo: uint32 words of the seed; position, token_id: int32 (>= 0) or uint32 -> f32.
    """
    k0, k1 = jnp.asarray(seed_hi, jnp.uint32), jnp.asarray(seed_lo, jnp.uint32)
    x0 = lax.convert_element_type(jnp.asarray(position), jnp.uint32)
    x1 = lax.convert_element_type(jnp.asarray(token_id), jnp.uint32)
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(_KEY_PARITY))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for s in range(1, 6):
        for r in _ROTATIONS[(s - 1) % 2]:
            x0 = x0 + x1
            x1 = _rotl32(x1, r) ^ x0
        x0 = x0 + ks[s % 3]
        x1 = x1 + ks[(s + 1) % 3] + np.uint32(s)
    odd = (x0 >> np.uint32(9)) * np.uint32(2) + np.uint32(1)
    # odd < 2^24, so the conversion and the power-of-two scale are exact.
    return odd.astype(jnp.float32) * np.float32(2.0 ** -24)


def keyed_uniform_numpy(seed: int | np.ndarray, position: np.ndarray | int,
                        token_id: np.ndarray | int) -> np.ndarray:
    """The same uniforms as `keyed_uniform`, bit for bit, on the host: seed a Python int or uint64 array in
    [0, 2**64), position and token_id non-negative integers; arguments broadcast -> float32."""
    seed = np.asarray(seed, dtype=np.uint64)
    k0, k1 = seed >> np.uint64(32), seed & np.uint64(_WORD)
    # Words live in uint64 and are masked after every add/shift: a separate formulation from the uint32 jnp one.
    mask = np.uint64(_WORD)
    ks = (k0, k1, k0 ^ k1 ^ np.uint64(_KEY_PARITY))
    x0 = (np.asarray(position).astype(np.uint64) + ks[0]) & mask
    x1 = (np.asarray(token_id).astype(np.uint64) + ks[1]) & mask
    for s in range(1, 6):
        for r in _ROTATIONS[(s - 1) % 2]:
            x0 = (x0 + x1) & mask
            x1 = (((x1 << np.uint64(r)) & mask) | (x1 >> np.uint64(32 - r))) ^ x0
        x0 = (x0 + ks[s % 3]) & mask
        x1 = (x1 + ks[(s + 1) % 3] + np.uint64(s)) & mask
    odd = (x0 >> np.uint64(9)) * np.uint64(2) + np.uint64(1)
    return (odd.astype(np.float64) * 2.0 ** -24).astype(np.float32)


def _gumbel(params: SampleParams, token_ids: jax.Array) -> jax.Array:
    """token_ids [n, v] -> G [n, v] f32 at each row's own seed and position."""
    u = keyed_uniform(params.seed_hi[:, None], params.seed_lo[:, None], params.position[:, None], token_ids)
    return -jnp.log(-jnp.log(u))


# --------------------------------------------------------------------------------------------------- sampler


def _descending_key(x: jax.Array) -> jax.Array:
    """f32 -> i32 whose ascending order is x's descending order (a bijection on non-NaN f32 once -0.0 is folded
    into 0.0, which it compares equal to and so must tie with)."""
    x = jnp.where(x == 0, jnp.float32(0), x)
    bits = lax.bitcast_convert_type(x, jnp.int32)
    ascending = bits ^ ((bits >> 31) & _INT32_MAX)  # negatives: flip the magnitude so larger magnitude sorts lower
    return ~ascending


def _value_of_key(key: jax.Array) -> jax.Array:
    ascending = ~key
    return lax.bitcast_convert_type(ascending ^ ((ascending >> 31) & _INT32_MAX), jnp.float32)


def _lowest_id_argmax(score: jax.Array, token_ids: jax.Array, v: int) -> jax.Array:
    """score, token_ids [n, v] -> [n] i32: the id of the best score, lowest id on ties; v where nothing is finite
    (the caller falls back to greedy, so an all -inf row still yields a valid id)."""
    best = jnp.max(score, axis=-1, keepdims=True)
    chosen = jnp.min(jnp.where(score == best, token_ids, v), axis=-1)
    return jnp.where(best[:, 0] > -jnp.inf, chosen, v).astype(jnp.int32)


def _draw_plain(logits: jax.Array, params: SampleParams) -> jax.Array:
    n, v = logits.shape
    token_ids = lax.broadcasted_iota(jnp.int32, (n, v), 1)
    r = (logits - jnp.max(logits, axis=-1, keepdims=True)) / params.temperature[:, None]
    keep = jnp.exp(r) >= params.min_p[:, None]
    score = jnp.where(keep, r + _gumbel(params, token_ids), -jnp.inf)
    return _lowest_id_argmax(score, token_ids, v)


def _draw_sorted(logits: jax.Array, params: SampleParams) -> jax.Array:
    n, v = logits.shape
    with jax.named_scope("sort"):
        token_ids = lax.broadcasted_iota(jnp.int32, (n, v), 1)
        # Stable sort of one int32 key with the ids as payload: ties keep ascending id order, and this shape of
        # sort (one integer key, plain less-than) is the one XLA hands to CUB's radix sort on GPU.
        key, sorted_ids = lax.sort((_descending_key(logits), token_ids), dimension=1, num_keys=1, is_stable=True)
        sorted_logits = _value_of_key(key)
    with jax.named_scope("cuts"):
        r = (sorted_logits - sorted_logits[:, :1]) / params.temperature[:, None]
        e = jnp.exp(r)
        rank = lax.broadcasted_iota(jnp.int32, (n, v), 1)
        top_k = params.top_k[:, None]
        in_top_k = (top_k <= 0) | (rank < top_k)
        mass = jnp.where(in_top_k, e, 0.0)
        inclusive = lax.associative_scan(jnp.add, mass, axis=1)
        exclusive = jnp.concatenate([jnp.zeros((n, 1), jnp.float32), inclusive[:, :-1]], axis=1)
        top_p = params.top_p[:, None]
        in_top_p = (top_p >= 1) | (exclusive < top_p * inclusive[:, -1:])
        keep = in_top_k & in_top_p & (e >= params.min_p[:, None])
    with jax.named_scope("draw"):
        score = jnp.where(keep, r + _gumbel(params, sorted_ids), -jnp.inf)
        return _lowest_id_argmax(score, sorted_ids, v)


def _check_rows(logits: jax.Array, params: SampleParams) -> tuple[int, int]:
    if logits.ndim != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if not jnp.issubdtype(logits.dtype, jnp.floating) or jnp.dtype(logits.dtype).itemsize > 4:
        raise ValueError(f"logits must be float32 (or a narrower float, widened exactly), got {logits.dtype}")
    n, v = logits.shape
    if v > POSITION_LIMIT:
        raise ValueError(f"logits vocab {v} does not fit int32 token ids")
    for field in dataclasses.fields(SampleParams):
        shape = tuple(jnp.shape(getattr(params, field.name)))
        if shape != (n,):
            raise ValueError(f"params.{field.name} must have shape ({n},) to match logits, got {shape}")
    return n, v


def _as_device_params(params: SampleParams) -> SampleParams:
    return SampleParams(
        temperature=jnp.asarray(params.temperature, jnp.float32),
        top_k=jnp.asarray(params.top_k, jnp.int32),
        top_p=jnp.asarray(params.top_p, jnp.float32),
        min_p=jnp.asarray(params.min_p, jnp.float32),
        seed_hi=jnp.asarray(params.seed_hi, jnp.uint32),
        seed_lo=jnp.asarray(params.seed_lo, jnp.uint32),
        position=jnp.asarray(params.position, jnp.int32),
    )


PATHS = ("plain", "sorted")


def _needs_sort(xp, sampled, top_k, top_p, vocab: int):
    """Whether any sampled row has a top-k or top-p cut (the sorted path's business), in numpy or jnp (xp)."""
    return xp.any(sampled & (((top_k > 0) & (top_k < vocab)) | (top_p < 1)))


def sorted_path_needed(params: SampleParams, vocab: int) -> bool:
    """Host side: whether these (numpy) params need the sorted path; otherwise the plain path decides every row
    exactly."""
    return bool(_needs_sort(np, np.asarray(params.temperature) > 0, np.asarray(params.top_k),
                            np.asarray(params.top_p), vocab))


def sample(logits: jax.Array, params: SampleParams, path: str | None = None) -> jax.Array:
    """One token per row by the module's rule; jittable, no dependence between rows.

    logits [n, v] f32 (finite or -inf, at least one finite per row); params: SampleParams with [n] fields
    -> ids [n] i32. path: None chooses the plain or sorted path on the device for the whole batch; "plain" or
    "sorted" fixes it when tracing ("plain" only for params where `sorted_path_needed` is False).
    """
    if path is not None and path not in PATHS:
        raise ValueError(f"sample: path must be None or one of {PATHS}, got {path!r}")
    n, v = _check_rows(logits, params)
    params = _as_device_params(params)
    logits = logits.astype(jnp.float32)
    with jax.named_scope("sample"):
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        sampled = params.temperature > 0
        # Greedy rows would divide by 0; their draw is discarded, any positive temperature keeps it NaN-free.
        params = dataclasses.replace(params, temperature=jnp.where(sampled, params.temperature, 1.0))
        if path is None:
            needs_sort = _needs_sort(jnp, sampled, params.top_k, params.top_p, v)
            drawn = lax.cond(needs_sort, _draw_sorted, _draw_plain, logits, params)
        else:
            drawn = (_draw_sorted if path == "sorted" else _draw_plain)(logits, params)
        return jnp.where(sampled & (drawn < v), drawn, greedy)


# -------------------------------------------------------------------------------------------------- logprobs


def _tree_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis in a pairwise order fixed by its length alone, so a row's bits never depend on the
    batch shape or on the reduction kernel XLA picks. [n, v] -> [n]"""
    width = 1 << max(0, (x.shape[-1] - 1).bit_length())
    x = jnp.pad(x, ((0, 0), (0, width - x.shape[-1])))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[:, :half] + x[:, half:]
    return x[:, 0]


def logprobs(logits: jax.Array, ids: jax.Array, top_n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities under log_softmax of the raw logits (no temperature or cuts: vLLM's default).

    logits [n, v] f32; ids [n] i32; top_n static, 0..v
    -> chosen_logprob [n] f32, top_ids [n, top_n] i32, top_logprobs [n, top_n] f32,
       top ids ordered by (logprob desc, id asc)
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    n, v = logits.shape
    if tuple(jnp.shape(ids)) != (n,):
        raise ValueError(f"ids must have shape ({n},) to match logits, got {tuple(jnp.shape(ids))}")
    if isinstance(top_n, bool) or not isinstance(top_n, numbers.Integral) or not 0 <= top_n <= v:
        raise ValueError(f"top_n must be an integer in [0, {v}], got {top_n!r}")
    with jax.named_scope("logprobs"):
        logits = logits.astype(jnp.float32)
        shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
        log_probs = shifted - jnp.log(_tree_sum(jnp.exp(shifted)))[:, None]
        chosen = jnp.take_along_axis(log_probs, jnp.asarray(ids, jnp.int32)[:, None], axis=1)[:, 0]
        if top_n == 0:
            return chosen, jnp.zeros((n, 0), jnp.int32), jnp.zeros((n, 0), jnp.float32)
        # lax.top_k puts the lower index first among equal values: the (logprob desc, id asc) order.
        top_logprobs, top_ids = lax.top_k(log_probs, int(top_n))
        return chosen, top_ids.astype(jnp.int32), top_logprobs


# ------------------------------------------------------------------------------------------------ reference


def sample_reference(logits: np.ndarray, params: SampleParams) -> np.ndarray:
    """The rule in numpy float64, one row at a time, written for reading rather than speed (the test oracle).

    logits [n, v]; params with [n] numpy fields -> ids [n] int32
    """
    logits = np.asarray(logits, np.float64)
    n, v = logits.shape
    out = np.zeros(n, np.int32)
    for row in range(n):
        values = logits[row]
        temperature = float(params.temperature[row])
        if temperature == 0:
            out[row] = int(np.argmax(values))
            continue
        order = np.lexsort((np.arange(v), -values))  # last key is primary: value desc, then id asc
        r = (values[order] - values[order[0]]) / temperature
        e = np.exp(r)
        keep = np.ones(v, bool)
        top_k = int(params.top_k[row])
        if 0 < top_k < v:
            keep[top_k:] = False
        mass = np.where(keep, e, 0.0)
        before = np.concatenate([[0.0], np.cumsum(mass)[:-1]])
        top_p = float(params.top_p[row])
        if top_p < 1:
            keep &= before < top_p * mass.sum()
        keep &= e >= float(params.min_p[row])
        seed = (int(params.seed_hi[row]) << 32) | int(params.seed_lo[row])
        u = keyed_uniform_numpy(seed, int(params.position[row]), order).astype(np.float64)
        score = np.where(keep, r - np.log(-np.log(u)), -np.inf)
        out[row] = order[score == score.max()].min()
    return out
