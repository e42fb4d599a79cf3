"""The draft policy (qwen_jax.engine.policy): the rows of a stream's next window from what its windows kept.

The choice itself, on numbers: the acceptance estimate, the expected tokens of a window, the row counts picked at
high and low acceptance, serial rounds and the probe for copy drafts, never for block drafts, "always". Then in the
engine (captures/tiny-mlx-4bit, kernels interpreted, copy drafts from oracles as in tests/test_drafts.py): drafts
that are never right stop costing windows, drafts that are always right keep the largest window, and the pools
come back. That a reply is the same whichever rounds drafted is the device's gate
(tests/test_engine_gpu.py::test_drafted_equals_serial_on_gpu runs this default policy); on this CPU the interpreted
fused step and a window part ways on some inputs (tests/test_drafts.py's module doc)."""

import jax.numpy as jnp
import pytest

from qwen_jax import programs as P
from qwen_jax.checkpoint import load_checkpoint
from qwen_jax.engine.engine import Engine
from qwen_jax.engine.policy import MEASURE_WINDOWS, Acceptance, DraftPolicy, expected_tokens, expected_tree_tokens
from qwen_jax.model import Backend
from tests.conftest import CAPTURES, first_layers
from tests.test_drafts import _oracle, _prompts, _request
from tests.test_engine import _baseline

ROWS = (2, 4, 8, 16)


def _acc(stood: float, fell: float) -> Acceptance:
    return Acceptance(stood=stood, fell=fell)


def test_estimate_and_expected_tokens():
    a = Acceptance()
    assert a.rate() == 0.5  # the prior: half a draft stood, half fell
    a.landed(proposed=7, kept=7, decay=1.0)  # all stood: no fall observed
    assert (a.stood, a.fell) == (7.0, 0.0)
    a.landed(proposed=7, kept=2, decay=0.5)  # decayed, then 2 stood and the third fell
    assert (a.stood, a.fell) == (5.5, 1.0) and a.rate() == pytest.approx(6.0 / 7.5)
    assert expected_tokens(0.0, 16) == 1.0 and expected_tokens(1.0, 4) == 4.0
    assert expected_tokens(0.5, 3) == 1.75


def test_rows_follow_acceptance():
    p = DraftPolicy()
    # Drafts that nearly always stand: the window that yields the most tokens a round is the largest.
    assert p.rows(_acc(60, 1), ROWS, 16, block=False) == 16
    assert p.rows(_acc(60, 1), ROWS, 16, block=True) == 16
    # Half of them: a short window (E(4) / 1.19 beats E(16) / 1.32 with the copy costs).
    assert p.rows(_acc(2, 2), ROWS, 16, block=False) == 4
    # The round's cap and the stream's budget bound the choice; a bucket past the cap runs at the cap.
    assert p.rows(_acc(60, 1), ROWS, 8, block=False) == 8
    assert p.rows(_acc(60, 1), (4, 16), 6, block=True) == 6
    assert p.rows(_acc(60, 1), ROWS, 1, block=False) == 0


def test_copy_drafts_that_do_not_pay_go_serial_then_probe():
    p = DraftPolicy(probe=3)
    low = _acc(0, 10)
    assert p.rows(low, ROWS, 16, block=False) == 0  # no window beats a serial round
    low.serial_rounds = 3
    assert p.rows(low, ROWS, 16, block=False) == 2  # the probe: the smallest window
    low.landed(proposed=1, kept=1, decay=0.9)
    assert low.serial_rounds == 0
    # Block drafts never go serial (the drafter would miss those rows): the smallest window instead.
    assert p.rows(_acc(0, 10), ROWS, 16, block=True) == 2
    # "always": the largest window whatever the estimate.
    assert DraftPolicy.parse("always").rows(_acc(0, 10), ROWS, 16, block=False) == 16
    with pytest.raises(ValueError, match="--draft-policy"):
        DraftPolicy.parse("sometimes")


def test_costs_between_buckets_take_the_next_larger():
    p = DraftPolicy(copy_costs=((4, 2.0), (16, 2.2)))
    # 6 rows run in the 16-row bucket's call, at its cost: at rate 41/43, E(6) / 2.2 = 2.45 beats E(4) / 2 = 1.91.
    assert p.rows(_acc(40, 1), (4, 16), 6, block=False) == 6
    # At rate 1/3 neither window yields a token a round (E(4) / 2 = 0.74): serial.
    assert p.rows(_acc(1, 3), (4, 16), 6, block=False) == 0


def test_costs_from_json():
    p = DraftPolicy.parse("adaptive", '{"block": {"16": 1.0, "4": 1.0}}')
    assert p.block_costs == ((4, 1.0), (16, 1.0)) and p.copy_costs == DraftPolicy().copy_costs
    # Windows that cost a round whatever their rows: the longest pays at any acceptance above nothing.
    assert p.rows(_acc(1, 3), (4, 16), 16, block=True) == 16
    assert DraftPolicy.parse("always", '{"copy": {"2": 1.5}}').copy_costs == ((2, 1.5),)
    for bad, match in [("{", "not JSON"), ("[]", "an object"), ('{"trees": {"2": 1}}', "an object"),
                       ('{"copy": [1, 2]}', "map row counts"), ('{"copy": {"x": 1}}', "map row counts"),
                       ('{"copy": {"1": 1.0}}', ">= 2"), ('{"block": {"4": 0}}', "rounds > 0"),
                       ('{"copy": {}}', ">= 2")]:
        with pytest.raises(ValueError, match=match):
            DraftPolicy.parse("adaptive", bad)
    # measured on the machine: the engine times its windows when it starts (test_engine_measures_... below)
    m = DraftPolicy.parse("adaptive", "measure")
    assert m.measure == MEASURE_WINDOWS > 0 and m.block_costs == DraftPolicy().block_costs
    assert m.with_costs("tree", {16: 1.2, 4: 1.1}).tree_costs == ((4, 1.1), (16, 1.2))
    with pytest.raises(ValueError, match="only the adaptive"):
        DraftPolicy.parse("always", "measure")
    with pytest.raises(ValueError, match="copy, block or tree"):
        m.with_costs("trees", {2: 1.0})


def test_tree_estimate_and_expected_tokens():
    """Trees: the later children that stood are counted by sibling rank, q_j over the same total as a; a tree of n
    nodes yields 1 + its n likeliest paths' probabilities (one child a node: the chain's E)."""
    a = Acceptance()
    a.landed_ranks([0, 1, 0, P.MISSED, P.UNSEEN], decay=1.0)  # first child, second child, first child, then a miss
    assert (a.stood, a.later, a.fell) == (2.0, (1.0,), 1.0)
    a.landed_ranks([2, P.UNSEEN], decay=0.5)  # a third child, then a leaf: nothing seen fall
    assert (a.stood, a.later, a.fell) == (1.0, (0.5, 1.0), 0.5)
    total = 1.0 + 1.5 + 0.5 + 1.0
    assert a.rates(3) == pytest.approx([1.5 / total, 0.5 / total, 1.0 / total])
    assert a.rates(1) == [a.rate()] and a.rates(5)[3:] == [0.0, 0.0]
    chain = Acceptance()
    chain.landed(proposed=7, kept=2, decay=1.0)
    assert (chain.stood, chain.later, chain.fell) == (2.0, (), 1.0)
    for rate in (0.0, 0.3, 0.9):
        for nodes in (1, 3, 15):
            assert expected_tree_tokens([rate], nodes) == pytest.approx(expected_tokens(rate, nodes + 1))
    # q = (0.5, 0.3): the first child 0.5, its sibling 0.3, then the first child's child 0.25
    assert expected_tree_tokens([0.5, 0.3], 3) == pytest.approx(1 + 0.5 + 0.3 + 0.25)
    assert expected_tree_tokens([0.9], 5, depth=2) == pytest.approx(1 + 0.9 + 0.81)  # no path past the block
    assert expected_tree_tokens([0.0, 0.0], 15) == 1.0


def test_tree_rows_follow_what_later_children_keep():
    costs = ((2, 1.0), (4, 1.1), (8, 1.3), (16, 1.6))
    p = DraftPolicy(tree_costs=costs)
    chain_model = DraftPolicy(block_costs=costs)
    # No later child ever stood: the tree is the chain, and so is the choice.
    assert p.rows(_acc(6, 2), ROWS, 16, block=True, tree=3) == chain_model.rows(_acc(6, 2), ROWS, 16, block=True) == 8
    # Second and third children that stand (q = 0.43, 0.27, 0.13): the chain model would take 4 rows (its a is
    # 0.43); the tree of 7 nodes yields 2.33 tokens, 1.80 a round, against 1.72 for 3 nodes.
    wide = Acceptance(stood=6, fell=2, later=(4.0, 2.0))
    assert chain_model.rows(wide, ROWS, 16, block=True) == 4 and p.rows(wide, ROWS, 16, block=True, tree=3) == 8
    # The tree's depth bounds what a long window can yield: drafts 2 deep leave 16 rows nothing over 4.
    assert p.rows(_acc(60, 1), ROWS, 16, block=True, tree=1, depth=2) == 4
    assert p.rows(_acc(60, 1), ROWS, 16, block=True, tree=1) == 16
    # "always" takes the cap whatever the tree's estimate.
    assert DraftPolicy.parse("always").rows(_acc(0, 10), ROWS, 16, block=True, tree=3) == 16
    assert DraftPolicy.parse("adaptive", '{"tree": {"16": 1.0}}').tree_costs == ((16, 1.0),)


def test_path_ranks():
    """programs.path_ranks: the accepted rows' sibling ranks, then MISSED where the path's last row had children,
    else UNSEEN; a chain's drafts are all first children."""
    tree = [-1, 0, 0, 1, 1, 2, -1, -1]  # rows 6 and 7 pad (off the root's parent)
    chain = [-1, 0, 1, 2, 3, -1, -1, -1]
    parents = jnp.asarray([tree, tree, chain, chain], jnp.int32)
    path = jnp.asarray([[0, 2, 5, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0],
                        [0, 1, 2, 3, 4, 0, 0, 0]], jnp.int32)
    took = jnp.asarray([3, 2, 2, 5], jnp.int32)
    m, u = P.MISSED, P.UNSEEN
    assert P.path_ranks(parents, path, took).tolist() == [
        [0, 1, 0, u, u, u, u, u],  # row 2 is the root's second child; row 5 a leaf
        [0, 0, m, u, u, u, u, u],  # row 1 has children 3 and 4, and neither stood
        [0, 0, m, u, u, u, u, u],
        [0, 0, 0, 0, 0, u, u, u]]  # every draft of the chain stood


def test_bench_prints_costs_the_policy_reads():
    from qwen_jax.engine.bench import BenchResult
    res = BenchResult(decode_forwards_per_s={1: 100.0, 16: 50.0}, decode_tokens_per_s={1: 100.0, 16: 800.0},
                      draft_window_ms={16: {2: 40.0}, 1: {4: 12.0, 16: 9.0}}, draft_pipelined_ms={1: {4: 11.0}},
                      block_drafts=True)
    costs = res.draft_costs()  # the fewest streams; pipelined where timed so; in decode rounds (10 ms at 1 stream)
    assert costs == '{"block": {"4": 1.1, "16": 0.9}}'
    assert f"--draft-costs '{costs}'" in res.lines()
    assert DraftPolicy.parse("adaptive", costs).block_costs == ((4, 1.1), (16, 0.9))
    assert BenchResult(draft_window_ms={1: {4: 1.0}}).draft_costs() is None  # no decode round to compare with
    trees = BenchResult(decode_forwards_per_s={1: 100.0}, draft_window_ms={1: {16: 19.0}}, block_drafts=True,
                        tree_drafts=True)
    assert trees.draft_costs() == '{"tree": {"16": 1.9}}'
    assert DraftPolicy.parse("adaptive", trees.draft_costs()).tree_costs == ((16, 1.9),)


@pytest.fixture(scope="module")
def ck():
    # the first layers (tests/conftest.py, first_layers): the engine's policy is the subject, not the model
    return first_layers(load_checkpoint(CAPTURES / "tiny-mlx-4bit", dtype=jnp.bfloat16, progress=False))


def _engine(ck, policy: DraftPolicy):
    buckets = P.Buckets(prompt_rows=(64,), prompt_lanes=(1,), decode_streams=(2,), chain_rows=(2, 8),
                        packing=P.Packing.BATCHED, logprobs=0)
    e = Engine(ck.params, ck.config, None, dtype="bfloat16", max_model_len=192, parallel=2, max_queued=8,
               backend=Backend(kernels=True, interpret=True), buckets=buckets, progress=False, copy_drafts=True,
               draft_rows=8, draft_policy=policy)
    # Its requests are greedy: the sorted draw (`decode_sorted`, for top-k / top-p sampling) never runs, and is not
    # compiled (~9 s on this CPU); a request that needed it would fail (`Programs._get`: not compiled), and this
    # test too.
    keys = [k for k in e.programs.bucket_keys() if k[0] != "decode_sorted"]
    compile_all = e.programs.compile
    e.programs.compile = lambda progress=False: compile_all(keys, progress=progress)  # what `start` compiles
    e.start()
    return e


def test_engine_stops_paying_for_wrong_drafts_and_keeps_right_ones(ck, monkeypatch):
    # Started with --draft-costs measure (one window a timing): the copy table is what it timed, a cost for each
    # row bucket, and the scratch stream's slot and pages are free again. The rest runs on the default tables
    # (the measured costs of interpreted kernels say nothing of a device).
    e = _engine(ck, DraftPolicy(probe=8, measure=1))
    try:
        measured = e.measured_costs["copy"]
        assert sorted(measured) == [2, 8] and all(c > 0 for c in measured.values()), measured
        assert e.draft_policy.copy_costs == tuple(sorted(measured.items()))
        assert e.draft_policy.block_costs == DraftPolicy().block_costs
        _baseline(e)
        with pytest.raises(RuntimeError, match="before the scheduler"):
            e.measure_draft_costs()
        e.draft_policy = DraftPolicy(probe=8)
        reqs = [_request(p, None, max_tokens=40) for p in _prompts()]
        replies = {}
        _oracle(monkeypatch, e, replies, 5)  # no replies known: drafts the model never picks
        adaptive = e.draft_policy
        e.draft_policy = DraftPolicy.parse("always")  # a window every round, each keeping its first row only
        before = dict(e._counters)
        always = [e.submit(r).result(600) for r in reqs]
        always_windows = e._counters["draft_windows"] - before["draft_windows"]
        e.draft_policy = adaptive
        before = dict(e._counters)
        wrong = [e.submit(r).result(600) for r in reqs]
        windows = e._counters["draft_windows"] - before["draft_windows"]
        # Three windows to learn that the drafts fail, then a 2-row probe every 8 serial rounds: ~8 a reply, where
        # "always" tries whenever no stale guess is in flight.
        assert 0 < windows <= 2 * 10 < always_windows, (always_windows, windows)
        assert all(len(r.token_ids) == 40 for r in always + wrong)
        _baseline(e)
        # Drafts that stand (the replies of the windows-only run, so every token again from a window; the oracle
        # changes one draft of each of a reply's first windows): windows of 8 rows the budget allows.
        for r, a in zip(reqs, always):
            replies[r.prompt_ids] = a.token_ids
        _oracle(monkeypatch, e, replies, 10_000)
        before = e.stats()
        right = [e.submit(r).result(600) for r in reqs]
        after = e.stats()
        assert [r.token_ids for r in right] == [r.token_ids for r in always]
        proposed = after.draft_proposed_total - before.draft_proposed_total
        accepted = after.draft_accepted_total - before.draft_accepted_total
        landed = after.draft_windows_total - before.draft_windows_total
        assert accepted >= proposed - 2 * 16 and proposed >= 5 * landed, (accepted, proposed, landed)
        _baseline(e)
    finally:
        e.shutdown()
