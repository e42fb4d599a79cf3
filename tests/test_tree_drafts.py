"""DFlash tree drafts (`dflash_programs.propose_tree`, `programs.tree_accepted`, `model.verify(tree_scratch=)`): the
tree builder against a heap search over every continuation; acceptance along the samples; a tree window's rows
against one-row windows committed along each row's path, bit for bit (captures/tiny-mlx-4bit's first layers, kernels
in interpret mode, an fp8 and a bf16 pool, a tree that crosses a page); and the engine's tree-drafted replies against
its chain-drafted ones, with the tiny random drafter and with an oracle tree whose right continuation is never the
first child. As in tests/test_dflash_engine.py, that window rows are the fused serial step's bits is the device's
gate."""

import contextlib
import dataclasses
import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# jax defines its `pallas_fuser_disable_nested_fuse` flag, part of every jit's trace context, when this module is
# first imported, which its first lowering of a Pallas kernel does: a function jitted before that is traced and
# compiled again at its next call (test_tree_rows_equal_one_row_windows's one-row window program was, ~10 s here).
with contextlib.suppress(ImportError):
    import jax.experimental.pallas.fuser  # noqa: F401

from qwen_jax import dflash_programs as D
from qwen_jax import model as M
from qwen_jax import programs as P
from qwen_jax.checkpoint import load_checkpoint
from qwen_jax.engine.policy import Acceptance, DraftPolicy
from qwen_jax.model import Backend
from qwen_jax.model.forward import kv_dtype_for
from tests.conftest import CAPTURES, first_layers
from tests.test_dflash_engine import TIMEOUT, _engine, _prompts, _request, _same
from tests.test_engine import _baseline

MODEL = CAPTURES / "tiny-mlx-4bit"


def _heap_tree(logp: np.ndarray, nodes: int, branch: int):
    """The `nodes` likeliest continuations of per-position log-probabilities logp [D, V], each position limited to
    its `branch` likeliest tokens: (scores, token paths), likeliest first, by a heap over prefixes."""
    order = np.argsort(-logp, axis=1, kind="stable")[:, :branch]
    heap = [(-logp[0, order[0, i]], (int(order[0, i]),)) for i in range(branch)]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < nodes:
        neg, path = heapq.heappop(heap)
        out.append((-neg, path))
        d = len(path)
        if d < logp.shape[0]:
            for i in range(branch):
                heapq.heappush(heap, (neg - logp[d, order[d, i]], path + (int(order[d, i]),)))
    return out


def _paths(tokens, parents):
    """Each node's token path from the root (node i is row i + 1; parent row 0 is the root)."""
    paths = {0: ()}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        paths[i + 1] = paths[int(p)] + (int(t),) if p >= 0 else None
    return [paths[i + 1] for i in range(len(tokens))]


@pytest.mark.parametrize("nodes,branch", [(15, 2), (15, 4), (9, 1), (12, 3)])
def test_propose_tree_is_the_likeliest_continuations(nodes, branch):
    rng = np.random.default_rng(nodes * 10 + branch)
    depth, vocab = 7, 40
    logits = rng.normal(size=(3, depth, vocab)).astype(np.float32) * 3
    propose = jax.jit(lambda x: D.propose_tree(x, None, None, nodes, branch))
    tokens, parents = propose(jnp.asarray(logits))
    tokens, parents = np.asarray(tokens), np.asarray(parents)
    assert tokens.shape == parents.shape == (3, nodes)
    for s in range(3):
        logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[s]), axis=-1))
        want = _heap_tree(logp, nodes, branch)
        got = _paths(tokens[s], parents[s])
        assert all(0 <= parents[s, i] <= i or parents[s, i] == -1 for i in range(nodes))
        real = [p for p in got if p is not None]
        assert real == [p for _, p in want], s
        if branch == 1:  # a chain of the argmax, then padding rows off the root's parent
            assert real == [tuple(np.argmax(logp, axis=1)[:d + 1]) for d in range(depth)]
            assert parents[s, depth:].tolist() == [-1] * (nodes - depth)
        for k in range(1, nodes + 1):  # any first k nodes are a tree
            assert all(parents[s, i] < i + 1 for i in range(k))


def test_tree_accepted_follows_the_samples():
    """Row 0 stands; then the child of the newest row on the path whose token is that row's sample; a chain is
    `chain_accepted`'s; padding rows and dummy streams never stand."""
    lay = P.Layout(64, 4, 9, 4)
    tree = [-1, 0, 0, 1, 2, 2, 4]  # root; 1, 2 under it; 3 under 1; 4, 5 under 2; 6 under 4
    toks = [5, 6, 7, 8, 9, 10, 11]
    window = P.tree_window(lay, 4, 7, [toks, toks, toks[:3]], [tree, tree, tree[:3]], [10] * 3, [1, 2, 3],
                           [np.arange(1, 5, dtype=np.int32)] * 3)
    sampled = np.zeros((4, 7), np.int32)
    sampled[0, [0, 2, 4, 6]] = [7, 9, 11, 3]  # 0 -> 2 -> 4 -> 6
    sampled[1, [0, 1]] = [6, 1]  # 0 -> 1, then no child of 1 holds 1
    sampled[2, 0] = 7  # 0 -> 2 (row 2 of a 3-row tree), a leaf
    path, took = P.tree_accepted(window, jnp.asarray(sampled))
    assert np.asarray(took).tolist() == [4, 2, 2, 0]
    assert np.asarray(path)[0, :4].tolist() == [0, 2, 4, 6] and np.asarray(path)[1, :2].tolist() == [0, 1]
    chain = P.tree_window(lay, 1, 4, [[5, 6, 7, 8]], [[-1, 0, 1, 2]], [10], [1], [np.arange(1, 5, dtype=np.int32)])
    s = jnp.asarray([[6, 7, 1, 0]], jnp.int32)
    assert int(P.tree_accepted(chain, s)[1][0]) == int(P.chain_accepted(chain, s)[0]) == 3


def test_tree_accepted_equals_a_walk_on_random_trees():
    """On random trees with few distinct tokens (so siblings repeat tokens and samples often match), padding rows
    and a dummy stream: the path of a walk from the root, taking the lowest-numbered child whose token is the
    newest row's sample, and the window depths of `model.window_depth`."""
    rng = np.random.default_rng(3)
    s, r = 64, 16
    parents = np.full((s, r), -1, np.int32)
    for i in range(s):
        n = rng.integers(1, r + 1)
        parents[i, 1:n] = [rng.integers(0, j) for j in range(1, n)]
    tokens = rng.integers(0, 3, size=(s, r)).astype(np.int32)
    sampled = rng.integers(0, 3, size=(s, r)).astype(np.int32)
    lay = P.Layout(64, 4, 9, 4)
    window = P.tree_window(lay, s + 1, r, tokens.tolist(), parents.tolist(), [10] * s, [1] * s,
                           [np.arange(1, 5, dtype=np.int32)] * s)
    path, took = P.tree_accepted(window, jnp.asarray(np.concatenate([sampled, np.zeros((1, r), np.int32)])))
    path, took = np.asarray(path), np.asarray(took)
    assert took[s] == 0
    depth = np.asarray(M.window_depth(jnp.asarray(parents)))
    for i in range(s):
        walk = [0]
        while True:
            kids = [j for j in range(1, r) if parents[i, j] == walk[-1] and tokens[i, j] == sampled[i, walk[-1]]]
            if not kids:
                break
            walk.append(kids[0])
        assert took[i] == len(walk) and path[i, :len(walk)].tolist() == walk, i
        for j in range(r):
            d, k = 1, j
            while parents[i, k] >= 0:
                d, k = d + 1, parents[i, k]
            assert depth[i, j] == d


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
def test_tree_rows_equal_one_row_windows(kv_cache):
    """`verify(tree_scratch=)` over a 7-row tree at cache_len 61 (its deepest rows past the page at 64), beside a
    dummy stream: each row's logits are those of a one-row verify at its position after its ancestors were
    committed one by one, bit for bit; the commit of a root-to-leaf path leaves those one-row commits' state; the
    stream's own pages are untouched by the window. The stream's 61 tokens before it went in as one-row windows
    too. On the tiny model's first 3 layers (2 GDN, 1 attention: the rows' bits are each layer's;
    tests/conftest.py, first_layers)."""
    ck = first_layers(load_checkpoint(MODEL, dtype=jnp.bfloat16, progress=False))
    cfg, params = ck.config, ck.params
    be = Backend(kernels=True, interpret=True)
    tree_verify = jax.jit(lambda p, s, w, sc: M.verify(p, s, w, cfg, be, tree_scratch=sc))
    verify = jax.jit(lambda p, s, w: M.verify(p, s, w, cfg, be))
    commit = jax.jit(lambda s, k, w, pa, n: M.commit(s, k, w, pa, n, cfg, be))
    rng = np.random.default_rng(7)
    toks = rng.integers(0, cfg.text.vocab_size, size=80)
    table = np.array([[1, 2], [0, 0]], np.int32)
    rows = 8
    scratch_base = 4
    kv = kv_dtype_for(kv_cache, jnp.bfloat16)
    state = M.init_state(cfg.text, num_slots=3, num_pages=scratch_base + 2 * 2 * rows, page_size=64,
                         dtype=jnp.bfloat16, kv_dtype=kv)
    start = 61
    # The stream's first `start` tokens, decoded one by one (one-row windows, each committed) through the programs
    # of the reference rows below: a prefill program of its own cost ~9 s of compiling on this CPU (and chain
    # windows through the tree window's program run ~8x as long as these with an fp8 pool). The properties below
    # hold from any state.
    for t in range(start):
        one = M.make_window(np.array([[toks[t]], [0]]), [[-1], [-1]], [t, 0], [1, 0], table)
        _, k, _ = verify(params, state, one)
        state = commit(state, k, one, jnp.zeros((2, 1), jnp.int32), jnp.asarray([1, 0]))
    tree = [-1, 0, 0, 1, 2, 4, 5, -1]  # the last a padding row
    wt = rng.integers(0, cfg.text.vocab_size, size=rows)
    window = M.make_window(np.stack([wt, np.zeros(rows, np.int64)]), [tree, [-1] * rows], [start, 0], [1, 0], table)
    scratch = jnp.asarray(scratch_base + np.arange(2 * rows * 2, dtype=np.int32).reshape(2, rows, 2))
    logits, kept, _, after = tree_verify(params, state, window, scratch)
    for a, b in zip(after.kv, state.kv):  # the stream's pages 1 and 2 hold what they held
        for x, y in ((a.k, b.k), (a.v, b.v)):
            assert np.array_equal(np.asarray(x)[:, 1:3], np.asarray(y)[:, 1:3])

    def path_of(r):
        p = [r]
        while tree[p[-1]] >= 0:
            p.append(tree[p[-1]])
        return p[::-1]

    states = {}
    for r in range(rows - 1):
        path = path_of(r)
        serial = states.get(path[-2]) if len(path) > 1 else state
        one = M.make_window(np.array([[wt[r]], [0]]), [[-1], [-1]], [start + len(path) - 1, 0], [1, 0], table)
        lr, kr, _ = verify(params, serial, one)
        assert np.array_equal(np.asarray(lr[0, 0]), np.asarray(logits[0, r])), f"row {r}"
        states[r] = commit(serial, kr, one, jnp.zeros((2, 1), jnp.int32), jnp.asarray([1, 0]))
    leaf = path_of(6)
    pad = lambda p: jnp.asarray([p + [0] * (rows - len(p)), [0] * rows])  # noqa: E731
    drafted = commit(after, kept, window, pad(leaf), jnp.asarray([len(leaf), 0]))
    want = states[6]
    for name in ("rec", "conv"):
        for a, b in zip(getattr(drafted, name), getattr(want, name)):
            assert np.array_equal(np.asarray(a[1]), np.asarray(b[1])), name
    live = start + len(leaf) - 64
    for a, b in zip(drafted.kv, want.kv):
        for x, y in ((a.k, b.k), (a.v, b.v)) + (((a.k_scale, b.k_scale),) if kv_cache == "fp8" else ()):
            x, y = np.asarray(x), np.asarray(y)
            assert np.array_equal(x[:, 1], y[:, 1]) and np.array_equal(x[:, 2, :live], y[:, 2, :live])


# --- the engine ----------------------------------------------------------------------------------------------------


def test_tree_windows_refuse_bad_settings():
    with pytest.raises(ValueError, match="drafter"):
        _engine_no_drafter(draft_tree=2)
    with pytest.raises(ValueError, match="draft_tree"):
        _engine(draft_tree=9)


def _engine_no_drafter(**kw):
    from qwen_jax.engine.engine import Engine
    ck = load_checkpoint(MODEL, dtype=jnp.bfloat16, progress=False)
    return Engine(ck.params, ck.config, None, max_model_len=192, parallel=2, progress=False,
                  backend=Backend(kernels=True, interpret=True), **kw)


PERIOD = 4
# The oracle's request starts past every position the other requests here reach (a 70-token prompt and 24 tokens):
# from this anchor position on, the engine's trees are the oracle's; below it, propose_tree's own.
ORACLE_FROM = 100


def ladder_oracle(table: np.ndarray, propose_tree):
    """propose_tree's place: from anchor position ORACLE_FROM on, a ladder whose right continuation (table [slot,
    absolute position]: each stream's reply with some positions changed) is always the second child, under a wrong
    first child; windows are kept whole, in part and not at all, and never through a first child. Below it, the
    trees of `propose_tree` (the real one), picked whole by jnp.where: their bits. The table enters the program as
    a numpy constant (tests/test_dflash_engine.py says why)."""

    def oracle(logits, slot, anchor_position, nodes, branch):
        s = logits.shape[0]
        toks, pars = [], []
        for i in range(nodes):
            d = i // 2
            pos = jnp.clip(anchor_position + 1 + d, 0, table.shape[1] - 1)
            right = jnp.asarray(table)[slot, pos]
            toks.append(right + 1 if i % 2 == 0 else right)
            pars.append(jnp.full((s,), 2 * d, jnp.int32))  # the right node one level up is row 2d (the root: 0)
        own_toks, own_pars = propose_tree(logits, slot, anchor_position, nodes, branch)
        ladder = (anchor_position >= ORACLE_FROM)[:, None]
        return (jnp.where(ladder, jnp.stack(toks, 1).astype(jnp.int32), own_toks),
                jnp.where(ladder, jnp.stack(pars, 1), own_pars))

    return oracle


def test_tree_drafted_replies_equal_chain_drafted(monkeypatch):
    """Greedy and seeded replies (the seeded one with penalties that favour repeats), two streams at once, drafted as
    chains, as trees of branch 3 (the penalized one also serially), and a penalized one as an oracle's ladders that
    keep windows through second children only: the same bits; the pools back to baseline; the oracle's
    trees accept drafts. The oracle's request (a prompt of its own) runs in the branch-3 engine, its trees the
    oracle's past ORACLE_FROM, where the other requests never reach (its ladders take no branch; an engine of its
    own, of branch 2, cost ~40 s of compiling on this CPU).
    (Until session 45 trees of branch 1, chains through the tree path, ran here too: an engine of their own cost
    ~35 s of compiling on the CPU suite's machine, and the tree path is the one branch 3 takes; branch 1's tree
    builder is propose_tree's (9, 1) case above.)"""
    prompts = _prompts()

    def penalize(req):
        return dataclasses.replace(req, sampling=dataclasses.replace(
            req.sampling, presence_penalty=-2.0, frequency_penalty=-2.0, repetition_penalty=1.3))

    penalized = penalize(_request(prompts[1], 11, max_tokens=24))
    reqs = [_request(prompts[0], None, max_tokens=24), penalized]
    laddered = penalize(_request(prompts[0] + prompts[1], 11, max_tokens=24))
    assert max(len(r.prompt_ids) + r.max_tokens for r in reqs) < ORACLE_FROM <= len(laddered.prompt_ids)
    replies = {}
    e = _engine(draft_policy=DraftPolicy("always"))
    try:
        base = _baseline(e)
        hs = [e.submit(r) for r in reqs]
        replies[0] = [h.result(TIMEOUT) for h in hs]
        got = e.submit(laddered).result(TIMEOUT)  # the oracle's reply, drafted as chains
        assert _baseline(e) == base
    finally:
        e.shutdown()
    # the oracle: that reply, periodically corrupted (its rows' penalties count the ladders' paths)
    reply = np.asarray(list(laddered.prompt_ids) + list(got.token_ids) + [0] * 16, np.int32)
    reply[np.arange(len(reply)) % PERIOD == 1] += 1
    table = np.stack([reply] * 3)  # a lone request decodes on slot 1
    monkeypatch.setattr(D, "propose_tree", ladder_oracle(table, D.propose_tree))
    e = _engine(draft_tree=3, draft_policy=DraftPolicy("always"))
    try:
        base = _baseline(e)
        hs = [e.submit(r) for r in reqs]
        replies[3] = [h.result(TIMEOUT) for h in hs]
        assert _baseline(e) == base
        # the penalized stream's tree windows: its serial reply (its rows count their paths' tokens)
        _same(e.submit(dataclasses.replace(penalized, draft=False)).result(TIMEOUT), replies[3][1])
        for a, b in zip(replies[0], replies[3]):
            _same(a, b)
        # what the oracle's windows tell the draft policy (programs.path_ranks): every draft that stood a second
        # child
        seen = []
        landed = Acceptance.landed_ranks
        monkeypatch.setattr(Acceptance, "landed_ranks", lambda self, ranks, decay: (seen.append(list(ranks)),
                                                                                   landed(self, ranks, decay)))
        before = e.stats()
        out = e.submit(laddered).result(TIMEOUT)
        after = e.stats()
        _same(got, out)
        accepted = after.draft_accepted_total - before.draft_accepted_total
        assert accepted >= 6
        stood = [x for ranks in seen for x in ranks if x >= 0]
        assert stood == [1] * accepted, seen
        assert any(P.MISSED in ranks for ranks in seen)  # windows kept in part or not at all
        assert _baseline(e) == base
    finally:
        e.shutdown()
