"""Keyed sampling: the hash, the rule against a float64 oracle, row independence, statistics, validation."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.random import threefry_2x32
from scipy import stats

from qwen_jax.sampling import (
    Penalties,
    RequestPenalties,
    RequestSampling,
    SampleParams,
    choice_seed,
    derive_seed,
    keyed_uniform,
    keyed_uniform_numpy,
    logprobs,
    pack_penalties,
    pack_sample_params,
    penalize,
    penalize_reference,
    sample,
    sample_reference,
    sorted_path_needed,
)

# Every statistical test runs on fixed seeds, so it is deterministic; the threshold is the p-value below which a
# correct sampler would fail once in 10^4 seeds, so a failure is evidence, not noise.
P_THRESHOLD = 1e-4
# |Z| above this has two-sided probability ~7e-6 under independence.
Z_BOUND = 4.5
# Tests share these shapes so that the jitted sampler compiles a few times, not once per test.
ROWS, VOCAB, SMALL_BATCH = 3000, 384, 256

sample_jit = jax.jit(sample)


def uniforms(seed: int, position, token_id) -> np.ndarray:
    hi, lo = np.uint32(seed >> 32), np.uint32(seed & 0xFFFFFFFF)
    return np.asarray(keyed_uniform(hi, lo, jnp.asarray(position, jnp.int32), jnp.asarray(token_id, jnp.int32)))


def params_of(requests, positions) -> SampleParams:
    return pack_sample_params(requests, positions, len(requests))


def random_requests(rng: np.random.Generator, n: int, *, cuts: bool = True) -> list[RequestSampling]:
    out = []
    for _ in range(n):
        kind = rng.random()
        temperature = 0.0 if kind < 0.1 else float(rng.choice([1e-3, rng.uniform(0.1, 3.0), 100.0], p=[.1, .8, .1]))
        top_k = top_p = None
        if cuts:
            top_k = int(rng.choice([0, 1, int(rng.integers(2, 100))], p=[.4, .1, .5]))
            top_p = float(rng.choice([1.0, 1e-6, rng.uniform(0.05, 1.0)], p=[.4, .1, .5]))
        min_p = float(rng.choice([0.0, rng.uniform(0.0, 0.5), 1.0], p=[.5, .45, .05]))
        out.append(RequestSampling(seed=int(rng.integers(0, 2**64, dtype=np.uint64)), temperature=temperature,
                                   top_k=top_k or 0, top_p=1.0 if top_p is None else top_p, min_p=min_p))
    return out


def random_logits(rng: np.random.Generator, n: int, v: int) -> np.ndarray:
    logits = (rng.normal(size=(n, v)) * rng.uniform(0.5, 6.0, size=(n, 1))).astype(np.float32)
    for row in range(n):
        kind = row % 4
        if kind == 1:  # heavy ties: few distinct values
            logits[row] = rng.integers(-3, 3, size=v).astype(np.float32)
        elif kind == 2:  # a grammar-style mask
            logits[row, rng.random(v) < 0.7] = -np.inf
            logits[row, rng.integers(v)] = rng.normal()
        elif kind == 3:  # zeros of both signs tie for the max
            logits[row] = -np.abs(logits[row])
            logits[row, rng.integers(0, v, 8)] = np.float32(-0.0)
            logits[row, rng.integers(0, v, 8)] = np.float32(0.0)
    return logits


# ------------------------------------------------------------------------------------------------------ hash


def test_hash_is_threefry_and_numpy_gives_the_same_bits():
    rng = np.random.default_rng(1)
    m = 4096
    seeds = rng.integers(0, 2**64, size=m, dtype=np.uint64)
    seeds[:3] = [0, 2**64 - 1, 2**32]
    positions = rng.integers(0, 2**31, size=m)
    positions[:3] = [0, 2**31 - 1, 1]
    ids = rng.integers(0, 248320, size=m)
    ours = np.asarray(keyed_uniform((seeds >> np.uint64(32)).astype(np.uint32),
                                    (seeds & np.uint64(0xFFFFFFFF)).astype(np.uint32),
                                    positions.astype(np.int32), ids.astype(np.int32)))
    host = keyed_uniform_numpy(seeds, positions, ids)
    assert ours.dtype == host.dtype == np.float32
    np.testing.assert_array_equal(ours.view(np.uint32), host.view(np.uint32))
    # jax's own Threefry-2x32, one (key, counter) at a time: the uniform is built from its first output word.
    for i in range(64):
        key = (jnp.uint32(int(seeds[i]) >> 32), jnp.uint32(int(seeds[i]) & 0xFFFFFFFF))
        word0 = int(threefry_2x32(key, jnp.array([positions[i], ids[i]], jnp.uint32))[0])
        assert ours[i] == np.float32(((word0 >> 9) * 2 + 1) / 2**24)


def test_uniforms_lie_strictly_inside_the_unit_interval_on_the_odd_grid():
    u = uniforms(7, np.arange(512)[:, None], np.arange(2048)[None, :]).astype(np.float64)
    assert u.min() > 0 and u.max() < 1
    grid = u * 2**24
    np.testing.assert_array_equal(grid, np.round(grid))
    assert np.all(grid % 2 == 1)


def test_uniforms_pass_chi_square_over_64_bins():
    u = uniforms(0x9E3779B97F4A7C15, np.arange(1024)[:, None], np.arange(1024)[None, :]).ravel()
    counts = np.bincount((u * 64).astype(int), minlength=64)
    assert counts.sum() == 1024 * 1024
    assert stats.chisquare(counts).pvalue > P_THRESHOLD


@pytest.mark.parametrize("neighbour", ["token id", "position", "seed low word", "seed high word"])
def test_neighbouring_keys_give_independent_uniforms(neighbour):
    seed, n = 0x0123456789ABCDEF, 200_000
    positions = np.repeat(np.arange(200), 1000)
    ids = np.tile(np.arange(1000) * 3, 200)
    base = uniforms(seed, positions, ids).astype(np.float64)
    other = {
        "token id": lambda: uniforms(seed, positions, ids + 1),
        "position": lambda: uniforms(seed, positions + 1, ids),
        "seed low word": lambda: uniforms(seed + 1, positions, ids),
        "seed high word": lambda: uniforms(seed + (1 << 32), positions, ids),
    }[neighbour]().astype(np.float64)
    # Sample correlation of independent pairs: sqrt(n) * r is ~N(0, 1).
    r = np.corrcoef(base, other)[0, 1]
    assert abs(r) * np.sqrt(n) < Z_BOUND
    # Correlation only sees linear dependence; the joint 8x8 histogram sees any.
    joint = np.bincount((base * 8).astype(int) * 8 + (other * 8).astype(int), minlength=64)
    assert stats.chisquare(joint).pvalue > P_THRESHOLD


# ------------------------------------------------------------------------------------------------------ rule


def test_sample_matches_float64_reference_token_for_token():
    rng = np.random.default_rng(2)
    n, v = ROWS, VOCAB
    logits = random_logits(rng, n, v)
    requests = random_requests(rng, n)
    params = params_of(requests, rng.integers(0, 2**31, n))
    ours = np.asarray(sample_jit(logits, params))
    np.testing.assert_array_equal(ours, sample_reference(logits, params))
    # The mix must have exercised what it claims to.
    temperature = params.temperature
    assert (temperature == 0).sum() > 100 and (params.top_k == 1).sum() > 100 and (params.top_p < 1e-5).sum() > 100
    assert (params.min_p > 0).sum() > 1000
    # And the draws were not all forced: most sampled rows with no cuts at moderate temperature leave the argmax.
    loose = (temperature > 0.5) & (temperature < 5) & (params.top_k == 0) & (params.top_p == 1) & (params.min_p == 0)
    assert loose.sum() > 30
    assert (ours[loose] != np.argmax(logits[loose], axis=1)).mean() > 0.5


def test_plain_path_matches_float64_reference():
    """Rows without top-k/top-p take the no-sort path; it must follow the same rule."""
    rng = np.random.default_rng(3)
    n, v = ROWS, VOCAB
    logits = random_logits(rng, n, v)
    params = params_of(random_requests(rng, n, cuts=False), rng.integers(0, 2**31, n))
    np.testing.assert_array_equal(np.asarray(sample_jit(logits, params)), sample_reference(logits, params))


def test_static_paths_match_the_device_choice():
    """The decode programs fix the path when tracing, picked on the host by `sorted_path_needed`: a batch with cuts
    on the sorted path, and one without on either path, gives the same tokens as the device-side choice (and the
    float64 rule), so picking per call cannot change a token."""
    rng = np.random.default_rng(31)
    n, v = SMALL_BATCH, VOCAB
    logits = random_logits(rng, n, v)
    plain = jax.jit(lambda l, p: sample(l, p, "plain"))
    sorted_ = jax.jit(lambda l, p: sample(l, p, "sorted"))
    with_cuts = params_of(random_requests(rng, n), rng.integers(0, 2**31, n))
    without = params_of(random_requests(rng, n, cuts=False), rng.integers(0, 2**31, n))
    assert sorted_path_needed(with_cuts, v) and not sorted_path_needed(without, v)
    np.testing.assert_array_equal(np.asarray(sorted_(logits, with_cuts)), sample_reference(logits, with_cuts))
    want = sample_reference(logits, without)
    for fn in (plain, sorted_, sample_jit):
        np.testing.assert_array_equal(np.asarray(fn(logits, without)), want)
    # Greedy rows with cuts, and cuts that keep everything (top_k >= v, top_p = 1), need no sort.
    keep_all = params_of([RequestSampling(seed=0, temperature=0.0, top_k=5, top_p=0.5),
                          RequestSampling(seed=1, temperature=0.9, top_k=v, top_p=1.0)], [3, 4])
    assert not sorted_path_needed(keep_all, v)
    with pytest.raises(ValueError, match="path"):
        sample(logits, without, "fast")


@pytest.mark.parametrize("cuts", [True, False])
def test_full_vocab_matches_reference(cuts):
    rng = np.random.default_rng(4)
    n, v = 4, 248320
    logits = (rng.normal(size=(n, v)) * 4).astype(np.float32)
    requests = [RequestSampling(seed=1000 + i, temperature=0.7, top_k=[0, 50, 0, v + 1][i] if cuts else 0,
                                top_p=0.8 if cuts else 1.0, min_p=0.01 * i) for i in range(n)]
    params = params_of(requests, [0, 1, 2**31 - 1, 123456])
    np.testing.assert_array_equal(np.asarray(sample_jit(logits, params)), sample_reference(logits, params))


def test_top_k_one_tiny_top_p_and_full_min_p_are_greedy():
    rng = np.random.default_rng(5)
    n, v = SMALL_BATCH, VOCAB
    logits = rng.integers(-2, 3, size=(n, v)).astype(np.float32)  # many tied maxima: lowest id must win
    greedy = np.argmax(logits, axis=1)
    for cut in (dict(top_k=1), dict(top_p=1e-7)):
        requests = [RequestSampling(seed=i, temperature=2.0, **cut) for i in range(n)]
        np.testing.assert_array_equal(np.asarray(sample_jit(logits, params_of(requests, np.arange(n)))), greedy)
    # min_p = 1 keeps exactly the tied maxima, and the keyed noise chooses among them.
    requests = [RequestSampling(seed=i, temperature=2.0, min_p=1.0) for i in range(n)]
    drawn = np.asarray(sample_jit(logits, params_of(requests, np.arange(n))))
    assert np.all(logits[np.arange(n), drawn] == logits.max(axis=1))
    assert (drawn != greedy).mean() > 0.3


@pytest.mark.parametrize("cut", [dict(), dict(top_k=2), dict(top_p=0.9999)])
def test_equal_scores_go_to_the_lowest_id(cut):
    """Two tokens with equal logits and equal keyed uniforms score exactly the same; the lower id must win on
    both paths. With 23-bit uniforms such pairs are common among a few thousand ids (birthday bound)."""
    seed, position, v = 42, 1000, 8192
    u = keyed_uniform_numpy(seed, position, np.arange(v))
    _, first, counts = np.unique(u, return_index=True, return_counts=True)
    low = int(first[np.argmax(counts > 1)])
    high = int(np.flatnonzero(u == u[low])[1])
    logits = np.full((1, v), -np.inf, np.float32)
    logits[0, [low, high]] = 1.5
    params = params_of([RequestSampling(seed=seed, temperature=1.0, **cut)], [position])
    assert int(sample_jit(logits, params)[0]) == low == int(sample_reference(logits, params)[0])


def test_extreme_temperatures_and_masked_rows():
    rng = np.random.default_rng(6)
    n, v = SMALL_BATCH - 3, VOCAB
    logits = np.full((n + 3, v), -np.inf, np.float32)
    logits[:n] = rng.normal(size=(n, v)) * 50
    # A tiny temperature scales the gaps past float32 range; the max-first scaling keeps it greedy, not NaN.
    requests = [RequestSampling(seed=i, temperature=1e-30) for i in range(n)]
    # Only one unmasked token: every rule must take it. An all -inf row still gets a valid id (greedy's).
    logits[n, 17], logits[n + 1, 300] = 3.0, -1e30
    requests += [RequestSampling(seed=9, temperature=100.0, top_p=0.5)] * 3
    drawn = np.asarray(sample_jit(logits, params_of(requests, np.arange(n + 3))))
    np.testing.assert_array_equal(drawn[:n], np.argmax(logits[:n], axis=1))
    np.testing.assert_array_equal(drawn[n:], [17, 300, 0])


def test_row_alone_equals_row_in_any_batch():
    rng = np.random.default_rng(7)
    v = VOCAB
    logits = random_logits(rng, 24, v)
    requests = random_requests(rng, 24)
    # Some rows only need the plain path: alone they take it, in a batch with cut rows the sorted one.
    requests[:8] = random_requests(rng, 8, cuts=False)
    positions = rng.integers(0, 2**31, 24)
    alone = [int(sample_jit(logits[i:i + 1], params_of(requests[i:i + 1], positions[i:i + 1]))[0])
             for i in range(24)]
    for batch_size, padded in ((24, 24), (17, 32), (8, SMALL_BATCH)):
        order = rng.permutation(24)[:batch_size]
        params = pack_sample_params([requests[i] for i in order], positions[order], padded)
        batch_logits = np.concatenate([logits[order], random_logits(rng, padded - batch_size, v)])
        got = np.asarray(sample_jit(batch_logits, params))[:batch_size]
        np.testing.assert_array_equal(got, np.asarray(alone)[order])


def test_seeded_draws_reproduce_and_change_with_seed_and_position():
    rng = np.random.default_rng(8)
    n, v = ROWS, VOCAB
    logits = (rng.normal(size=(n, v)) * 0.1).astype(np.float32)  # nearly flat: draws are spread over ~v tokens

    def draw(seeds, positions):
        requests = [RequestSampling(seed=int(s), temperature=1.0, top_p=0.99) for s in seeds]
        return np.asarray(sample_jit(logits, params_of(requests, positions)))

    seeds, positions = rng.integers(0, 2**63, n), np.arange(n) + 10
    first = draw(seeds, positions)
    np.testing.assert_array_equal(first, draw(seeds, positions))
    # Independent draws collide with probability ~1/v: ~8 expected collisions over the rows, never 100.
    assert (first == draw(seeds + 1, positions)).sum() < 100
    assert (first == draw(seeds, positions + 1)).sum() < 100


def expected_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float):
    """The rule's target distribution over one small row, in float64 from the rule's definition."""
    order = np.lexsort((np.arange(len(logits)), -logits))
    p = np.exp((logits[order] - logits[order].max()) / temperature)
    keep = np.arange(len(p)) < (top_k or len(p))
    p = np.where(keep, p, 0.0)
    if top_p < 1:
        keep &= np.concatenate([[0.0], np.cumsum(p)[:-1]]) < top_p * p.sum()
    keep &= p / p.max() >= min_p
    out = np.zeros(len(p))
    out[order] = np.where(keep, p, 0.0)
    return out / out.sum()


@pytest.mark.parametrize("rule", [
    dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.05),
    dict(temperature=1.0, top_k=5, top_p=0.9, min_p=0.02),
])
def test_sampled_distribution_matches_softmax(rule):
    logits = np.array([2.0, 1.0, 1.0, 0.5, 0.0, -1.0, -2.5, -6.0], np.float32)
    target = expected_distribution(logits.astype(np.float64), **rule)
    draws = 200_000
    requests = [RequestSampling(seed=0xC0FFEE, **rule)] * draws
    ids = np.asarray(sample_jit(np.tile(logits, (draws, 1)), params_of(requests, np.arange(draws))))
    counts = np.bincount(ids, minlength=len(logits))
    assert np.all(counts[target == 0] == 0)
    live = target > 0
    assert live.sum() >= 4  # the cuts left a distribution worth testing
    assert stats.chisquare(counts[live], target[live] * draws).pvalue > P_THRESHOLD


# -------------------------------------------------------------------------------------------------- logprobs


def test_logprobs_match_float64_and_order_ties_by_id():
    rng = np.random.default_rng(9)
    n, v, top_n = 64, 3000, 20
    logits = (rng.normal(size=(n, v)) * 5).astype(np.float32)
    logits[::2] = np.round(logits[::2])  # ties among the top values
    ids = rng.integers(0, v, n)
    chosen, top_ids, top_logprobs = jax.jit(logprobs, static_argnums=2)(logits, ids, top_n)
    chosen, top_ids, top_logprobs = map(np.asarray, (chosen, top_ids, top_logprobs))
    assert (chosen.dtype, top_ids.dtype, top_logprobs.dtype) == (np.float32, np.int32, np.float32)
    exact = logits.astype(np.float64)
    exact = exact - exact.max(axis=1, keepdims=True)
    exact -= np.log(np.exp(exact).sum(axis=1, keepdims=True))
    # float32 error budget: half an ulp for the shift and for the final subtraction (each at most |logprob|), plus
    # the normaliser: a pairwise sum of v terms is off by ~log2(v) eps relatively, and log turns that into absolute.
    eps = np.finfo(np.float32).eps
    bound = eps * (np.abs(exact[np.arange(n), ids]) + np.log2(v) + 1)
    assert np.all(np.abs(chosen - exact[np.arange(n), ids]) <= bound)
    for row in range(n):
        order = np.lexsort((np.arange(v), -exact[row]))[:top_n]
        np.testing.assert_array_equal(top_ids[row], order)
    # The reported values are consistent with the order: non-increasing, equal values in ascending id.
    assert np.all(np.diff(top_logprobs, axis=1) <= 0)
    tied = np.diff(top_logprobs, axis=1) == 0
    assert tied.sum() > 50 and np.all(np.diff(top_ids, axis=1)[tied] > 0)
    # A row's logprob bits do not depend on the rows beside it.
    alone = np.asarray(logprobs(logits[5:6], ids[5:6], top_n)[2])
    np.testing.assert_array_equal(alone[0].view(np.uint32), top_logprobs[5].view(np.uint32))


def test_logprobs_top_n_zero():
    chosen, top_ids, top_logprobs = logprobs(jnp.zeros((2, 4)), jnp.array([1, 3]), 0)
    np.testing.assert_allclose(np.asarray(chosen), np.log(0.25), rtol=1e-6)
    assert top_ids.shape == top_logprobs.shape == (2, 0)


# ------------------------------------------------------------------------------------------- host-side API


def test_pack_pads_with_greedy_rows_and_splits_the_seed():
    requests = [RequestSampling(seed=(5 << 32) | 7, temperature=0.5, top_k=3, top_p=0.25, min_p=0.125),
                RequestSampling(seed=2**64 - 1)]
    params = pack_sample_params(requests, [11, 2**31 - 1], rows=4)
    assert params.temperature.dtype == np.float32 and params.top_k.dtype == np.int32
    assert params.seed_hi.dtype == params.seed_lo.dtype == np.uint32 and params.position.dtype == np.int32
    np.testing.assert_array_equal(params.temperature, [0.5, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(params.top_k, [3, 0, 0, 0])
    np.testing.assert_array_equal(params.top_p, [0.25, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(params.min_p, [0.125, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(params.seed_hi, [5, 0xFFFFFFFF, 0, 0])
    np.testing.assert_array_equal(params.seed_lo, [7, 0xFFFFFFFF, 0, 0])
    np.testing.assert_array_equal(params.position, [11, 2**31 - 1, 0, 0])
    # The pytree goes through jit as data: new values reuse the compiled program.
    traces = []

    def traced_sample(logits, params):
        traces.append(None)
        return sample(logits, params)

    compiled = jax.jit(traced_sample)
    logits = np.zeros((4, 16), np.float32)
    compiled(logits, params)
    compiled(logits, pack_sample_params(requests[::-1], [3, 4], rows=4))
    assert len(traces) == 1


@pytest.mark.parametrize("field, kwargs", [
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=float("inf"))),
    ("temperature", dict(temperature=float("nan"))),
    ("temperature", dict(temperature=1e39)),  # finite in Python, inf in float32
    ("temperature", dict(temperature=True)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p=float("nan"))),
    ("top_p", dict(top_p=1e-50)),  # positive in Python, 0 in float32
    ("min_p", dict(min_p=-0.01)),
    ("min_p", dict(min_p=1.01)),
    ("top_k", dict(top_k=-1)),
    ("top_k", dict(top_k=2.0)),
    ("top_k", dict(top_k=2**31)),
    ("seed", dict(seed=-1)),
    ("seed", dict(seed=2**64)),
    ("seed", dict(seed=1.0)),
])
def test_request_validation_names_the_field(field, kwargs):
    kwargs = {"seed": 1, **kwargs}
    with pytest.raises(ValueError, match=field):
        RequestSampling(**kwargs)


def test_entry_points_validate_shapes_and_ranges():
    request = RequestSampling(seed=1)
    with pytest.raises(ValueError, match="positions"):
        pack_sample_params([request], [1, 2], rows=2)
    with pytest.raises(ValueError, match="positions"):
        pack_sample_params([request], [-1], rows=1)
    with pytest.raises(ValueError, match="positions"):
        pack_sample_params([request], [2**31], rows=1)
    with pytest.raises(ValueError, match="rows"):
        pack_sample_params([request, request], [1, 2], rows=1)
    with pytest.raises(ValueError, match="requests"):
        pack_sample_params([{"seed": 1}], [1], rows=1)
    params = pack_sample_params([request] * 2, [1, 2], rows=2)
    with pytest.raises(ValueError, match="logits"):
        sample(jnp.zeros((2, 4), jnp.int32), params)
    with pytest.raises(ValueError, match="logits"):
        sample(jnp.zeros((8,)), params)
    with pytest.raises(ValueError, match="params.top_p"):
        sample(jnp.zeros((2, 4)), SampleParams(**{**vars(params), "top_p": np.ones(3, np.float32)}))
    with pytest.raises(ValueError, match="top_n"):
        logprobs(jnp.zeros((2, 4)), jnp.array([0, 1]), 5)
    with pytest.raises(ValueError, match="ids"):
        logprobs(jnp.zeros((2, 4)), jnp.array([0]), 1)
    with pytest.raises(ValueError, match="prompt_ids"):
        derive_seed([1, -2])
    with pytest.raises(ValueError, match="salt"):
        derive_seed([1], salt=3)


def test_derive_seed_follows_its_documented_formula():
    prompt = [151644, 872, 198, 0, 9707]
    expected = int.from_bytes(hashlib.sha256(b"151644,872,198,0,9707").digest()[:8], "big")
    assert derive_seed(prompt) == expected
    assert derive_seed(np.array(prompt)) == expected  # numpy ids: same decimal text
    salted = int.from_bytes(hashlib.sha256("151644,872,198,0,9707släp".encode()).digest()[:8], "big")
    assert derive_seed(prompt, salt="släp") == salted
    assert derive_seed([]) == int.from_bytes(hashlib.sha256(b"").digest()[:8], "big")
    seeds = {derive_seed(prompt[:k]) for k in range(len(prompt) + 1)} | {derive_seed([1, 23]), derive_seed([12, 3])}
    assert len(seeds) == len(prompt) + 3
    assert all(0 <= s < 2**64 for s in seeds)
    RequestSampling(seed=derive_seed(prompt))  # always a valid seed


def test_choice_seed_follows_its_documented_formula():
    assert choice_seed(1234, 0) == 1234 and choice_seed(2**64 - 1, 0) == 2**64 - 1
    assert choice_seed(1234, 3) == int.from_bytes(hashlib.sha256(b"1234/3").digest()[:8], "big")
    seeds = {choice_seed(s, i) for s in (0, 1, 12, 2**64 - 1) for i in range(1, 20)}
    assert len(seeds) == 4 * 19 and all(0 <= s < 2**64 for s in seeds)
    for bad, field in (((-1, 1), "seed"), ((2**64, 1), "seed"), ((1, -1), "index"), ((1.0, 1), "seed"),
                       ((1, True), "index")):
        with pytest.raises(ValueError, match=field):
            choice_seed(*bad)


def test_penalize_follows_the_reference_and_leaves_neutral_rows_alone():
    """`penalize` against its float64 oracle (prompt tokens, generated ones with repeats, logits of both signs, a
    logit bias), and rows with neutral penalties: their logits bit for bit, whatever their counts and bias hold."""
    rng = np.random.default_rng(3)
    n, v = 7, 50
    logits = rng.normal(0, 3, (n, v)).astype(np.float32)
    prompts = [rng.integers(0, v, 8).tolist() for _ in range(n)]
    generated = [rng.integers(0, v, 12).tolist() for _ in range(n)]
    rows = [RequestPenalties(0.5, 0.3, 1.4), RequestPenalties(0.0, 0.0, 0.7), RequestPenalties(-1.0, 2.0, 1.0),
            None, RequestPenalties(), RequestPenalties(2.0, -2.0, 10.0),
            RequestPenalties(0.5, 0.0, 1.2, ((3, 100.0), (generated[6][0], -4.5), (7, 0.25)))]
    pen = pack_penalties(rows, n)
    assert pen.biased.tolist() == [False] * 6 + [True]
    counts = np.zeros((n, v), np.int32)
    seen = np.zeros((n, v), bool)
    for i in range(n):
        np.add.at(counts[i], generated[i], 1)
        seen[i, prompts[i]] = True
    bias = rng.normal(0, 5, (n, v)).astype(np.float32)  # stale rows: only a biased row's counts
    bias[6] = rows[6].bias_row(v)
    got = np.asarray(penalize(jnp.asarray(logits), pen, jnp.asarray(counts), jnp.asarray(seen), jnp.asarray(bias)))
    want = penalize_reference(logits, pen, prompts, generated, bias)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    for i in (3, 4):  # neutral: unchanged bits
        assert got[i].tobytes() == logits[i].tobytes()
    assert not np.array_equal(got[0], logits[0]) and not np.array_equal(got[2], logits[2])
    assert np.argmax(got[6]) == 3
    # bf16 logits are widened exactly, as `sample` widens them
    half = jnp.asarray(logits, jnp.bfloat16)
    assert np.asarray(penalize(half, pen, jnp.asarray(counts), jnp.asarray(seen), jnp.asarray(bias)))[3].tobytes() \
        == np.asarray(half.astype(jnp.float32))[3].tobytes()
    assert RequestPenalties(1, -2, 1, ((5, 1), (2, -100))).logit_bias == ((2, -100.0), (5, 1.0))
    assert RequestPenalties().neutral and not RequestPenalties(logit_bias=((1, 0.5),)).neutral
    for kw, field in ((dict(presence=2.5), "presence_penalty"), (dict(frequency=-2.01), "frequency_penalty"),
                      (dict(repetition=0), "repetition_penalty"), (dict(repetition=10.5), "repetition_penalty"),
                      (dict(presence=float("nan")), "presence_penalty"), (dict(frequency=True), "frequency_penalty"),
                      (dict(logit_bias=((1, 100.5),)), "logit_bias"), (dict(logit_bias=((-1, 1.0),)), "logit_bias"),
                      (dict(logit_bias=((1, 1.0), (1, 2.0))), "logit_bias"),
                      (dict(logit_bias=((1.5, 1.0),)), "logit_bias")):
        with pytest.raises(ValueError, match=field):
            RequestPenalties(**kw)
    with pytest.raises(ValueError, match="rows"):
        pack_penalties([None] * 3, 2)
    with pytest.raises(ValueError, match="RequestPenalties"):
        pack_penalties([(0.0, 0.0, 1.0)], 2)
    assert isinstance(pen, Penalties)
