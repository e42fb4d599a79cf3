"""Self-consistency of the functional model on a tiny random config (fp32, reference ops):
prompt pass + window steps ≡ one prompt pass; tree nodes ≡ serial steps along their paths; streams batched ≡ alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax import model as M
from tests.tiny_model import tiny

BE = M.Backend()
TOL = 2e-5  # fp32: chunked vs recurrent GDN and different matmul shapes differ by rounding only


@pytest.fixture(scope="module")
def setup():
    cfg, params = tiny()
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.text.vocab_size, size=150)
    prefill = jax.jit(lambda p, s, b, a: M.prefill(p, s, b, cfg, BE, all_logits=a)[:2], static_argnums=3)
    verify = jax.jit(lambda p, s, w: M.verify(p, s, w, cfg, BE)[:2])
    commit = jax.jit(lambda s, k, w, pa, n: M.commit(s, k, w, pa, n, cfg, BE))
    state = M.init_state(cfg.text, num_slots=4, num_pages=40, page_size=16, dtype=jnp.float32)
    return cfg, params, toks, prefill, verify, commit, state


def _pt(first_page):
    return np.arange(first_page, first_page + 10, dtype=np.int32)[None]


# Window widths of test_prompt_then_window_steps_equal_one_prompt_pass, from 70 to 150 keys: serial steps (1), 2
# rows (a commit keeps one conv row of the state before it) and 6 (wider than the conv kernel), starting at every
# offset in a page, windows of 2 and 6 straddling page boundaries. Each width is a verify and a commit program of its
# own (the reference path's compile time grows with the rows: ~13 s of CPU for a 16-row verify); 1, 2 and 6 are the
# widths the other tests here run (the streams test's 2-row window, the tree and commit tests' 6 nodes), so each
# compiles once in the module.
WIDTHS = [2, 1, 6] * 8 + [6, 2]


def test_prompt_then_window_steps_equal_one_prompt_pass(setup):
    cfg, params, toks, prefill, verify, commit, state = setup
    n = len(toks)
    full, _ = prefill(params, state, M.make_prefill_batch(toks[None], [0], [n], [1], _pt(1)), True)
    full = np.asarray(full[0])
    split = 70  # two GDN prompt chunks before the windows
    last, st = prefill(params, state, M.make_prefill_batch(toks[None, :split], [0], [split], [1], _pt(1)), False)
    np.testing.assert_allclose(np.asarray(last[0]), full[split - 1], atol=TOL, rtol=0)
    assert split + sum(WIDTHS) == n
    pos = split
    for r in WIDTHS:
        w = M.make_window(toks[None, pos:pos + r], [list(range(-1, r - 1))], [pos], [1], _pt(1))
        logits, kept = verify(params, st, w)
        np.testing.assert_allclose(np.asarray(logits[0]), full[pos:pos + r], atol=TOL, rtol=0)
        st = commit(st, kept, w, jnp.asarray([list(range(r))]), jnp.asarray([r]))
        pos += r
    assert pos == n


def test_tree_nodes_equal_serial_steps_along_their_paths(setup):
    cfg, params, toks, prefill, verify, commit, state = setup
    p0 = 40
    _, st = prefill(params, state, M.make_prefill_batch(toks[None, :p0], [0], [p0], [2], _pt(11)), False)
    # A fork and a fan: 0 -> 1 -> 2, 0 -> 3, 3 -> 4, 3 -> 5
    parents = [-1, 0, 1, 0, 3, 3]
    tree_toks = toks[p0:p0 + 6]
    w = M.make_window(tree_toks[None], [parents], [p0], [2], _pt(11))
    logits, _ = verify(params, st, w)
    for node in range(len(parents)):
        path = []
        cur = node
        while cur >= 0:
            path.append(cur)
            cur = parents[cur]
        path.reverse()
        # Serial: one row at a time, committing each.
        s, pos = st, p0
        for i, nd in enumerate(path):
            w1 = M.make_window(tree_toks[None, [nd]], [[-1]], [pos], [2], _pt(11))
            l1, kept = verify(params, s, w1)
            if i == len(path) - 1:
                np.testing.assert_allclose(np.asarray(l1[0, 0]), np.asarray(logits[0, node]), atol=TOL, rtol=0)
            s = commit(s, kept, w1, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))
            pos += 1


def test_commit_of_a_tree_path_equals_serial_commits(setup):
    cfg, params, toks, prefill, verify, commit, state = setup
    p0 = 40  # mid-page, as the tree test's prompt (the same prefill program)
    _, st = prefill(params, state, M.make_prefill_batch(toks[None, :p0], [0], [p0], [1], _pt(1)), False)
    parents = [-1, 0, 0, 2, 3, 1]  # 6 nodes, as the tree test's window (the same verify program)
    tree_toks = toks[p0:p0 + 6]
    w = M.make_window(tree_toks[None], [parents], [p0], [1], _pt(1))
    _, kept = verify(params, st, w)
    accepted = [0, 2, 3, 4]  # nodes 1 and 5 (a branch off the path) not accepted
    st_tree = commit(st, kept, w, jnp.asarray([accepted + [0, 0]]), jnp.asarray([len(accepted)]))
    s, pos = st, p0
    for nd in accepted:
        w1 = M.make_window(tree_toks[None, [nd]], [[-1]], [pos], [1], _pt(1))
        _, k1 = verify(params, s, w1)
        s = commit(s, k1, w1, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))
        pos += 1
    nxt = toks[p0 + 6]
    probe = M.make_window([[nxt]], [[-1]], [pos], [1], _pt(1))
    a, _ = verify(params, st_tree, probe)
    b, _ = verify(params, s, probe)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=0)
    for x, y in zip(st_tree.rec, s.rec):
        np.testing.assert_allclose(np.asarray(x[1]), np.asarray(y[1]), atol=TOL, rtol=0)
    # The reference path's matmuls are not row-invariant across window sizes, so the conv rows (projections of
    # hidden states computed in a 6-row window vs 1-row windows) agree to rounding; bitwise equality is the
    # kernels' property, tested with them.
    for x, y in zip(st_tree.conv, s.conv):
        np.testing.assert_allclose(np.asarray(x[1]), np.asarray(y[1]), atol=TOL, rtol=0)


def test_streams_batched_equal_streams_alone(setup):
    cfg, params, toks, prefill, verify, commit, state = setup
    lens = [50, 17, 64]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.text.vocab_size, size=n) for n in lens]
    t = 70  # (a stream alone is then the prefill program of the window-steps test's prompt)
    padded = np.zeros((3, t), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    pts = np.stack([np.arange(1 + 10 * i, 11 + 10 * i) for i in range(3)]).astype(np.int32)
    batched, st_b = prefill(params, state, M.make_prefill_batch(padded, [0, 0, 0], lens, [1, 2, 3], pts), False)
    for i in range(3):
        alone, _ = prefill(params, state, M.make_prefill_batch(padded[i:i + 1], [0], [lens[i]], [i + 1],
                                                                pts[i:i + 1]), False)
        np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(alone[0]), atol=TOL, rtol=0)
    # and one verify round for all three streams together equals each alone
    nxt = rng.integers(0, cfg.text.vocab_size, size=(3, 2))
    w = M.make_window(nxt, [[-1, 0]] * 3, lens, [1, 2, 3], pts)
    lw, _ = verify(params, st_b, w)
    for i in range(3):
        wi = M.make_window(nxt[i:i + 1], [[-1, 0]], [lens[i]], [i + 1], pts[i:i + 1])
        li, _ = verify(params, st_b, wi)
        np.testing.assert_allclose(np.asarray(lw[i]), np.asarray(li[0]), atol=TOL, rtol=0)


@pytest.mark.parametrize("v_layout", ["rows", "keys"])
def test_fp8_kv_window_equals_serial_steps(setup, v_layout, monkeypatch):
    """With an e4m3 KV cache the window's own rows are seen as they will be stored, so a chain window's rows
    equal serial steps (each of which reads the committed, quantized rows); with v by rows or key-major
    (`kv_quant.FP8_V_LAYOUT`, which the model's pools follow)."""
    from pallas_kernels import kv_quant
    cfg, params, toks, prefill, verify, commit, _ = setup
    monkeypatch.setattr(kv_quant, "FP8_V_LAYOUT", v_layout)
    st = M.init_state(cfg.text, num_slots=2, num_pages=12, page_size=16, dtype=jnp.float32,
                      kv_dtype=jnp.float8_e4m3fn)
    assert all(pool.v_layout == v_layout for pool in st.kv)
    p0 = 20
    _, st = prefill(params, st, M.make_prefill_batch(toks[None, :p0], [0], [p0], [1], _pt(1)), False)
    r = 4
    w = M.make_window(toks[None, p0:p0 + r], [list(range(-1, r - 1))], [p0], [1], _pt(1))
    lw, _ = verify(params, st, w)
    s = st
    for i in range(r):
        w1 = M.make_window(toks[None, p0 + i:p0 + i + 1], [[-1]], [p0 + i], [1], _pt(1))
        l1, k1 = verify(params, s, w1)
        np.testing.assert_allclose(np.asarray(l1[0, 0]), np.asarray(lw[0, i]), atol=TOL, rtol=0)
        s = commit(s, k1, w1, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))


@pytest.mark.parametrize("dtype,kernels,step_norm", [(jnp.float32, False, False), (jnp.float32, True, False),
                                                     (jnp.bfloat16, True, False), (jnp.bfloat16, True, True)])
def test_fused_step_equals_verify_then_commit_bitwise(setup, dtype, kernels, step_norm, monkeypatch):
    """The decode program's fused step ≡ a one-row verify + commit of the row, bit for bit (logits and every
    pool), for two live streams beside a dummy one (slot 0), over several steps. kernels=True runs the Pallas
    kernels in interpret mode (the fused GDN step launch; with step_norm, the step and its output norm in one
    launch, `gdn.step_norm`, checked to be taken); the reference path is verify + commit itself. The prompts go in
    by the reference prefill in every variant (the state the steps start from: one prefill program a dtype)."""
    from pallas_kernels import gdn
    from qwen_jax.model import ops
    cfg, params, toks, _, _, _, _ = setup
    monkeypatch.setattr(ops, "STEP_NORM", step_norm)
    monkeypatch.setattr(ops, "STEP_NORM_ROWS", 8)  # at the test's 3 streams too
    taken = []
    fused = gdn.step_norm
    monkeypatch.setattr(gdn, "step_norm", lambda *a, **k: taken.append(1) or fused(*a, **k))
    _fused_step_equals_verify_then_commit(cfg, params, toks, dtype, kernels, prefill_backend=M.Backend())
    assert bool(taken) == step_norm


@pytest.mark.gpu
def test_gpu_fused_step_on_the_decode_qmm_pieces_equals_verify_then_commit_bitwise(monkeypatch):
    """The same compiled on the GPU with the tiny 4-bit checkpoint's projections on the Mosaic GPU decode qmm,
    where the step's GDN prep reads the in-projection's pieces (`ops.project_pieces`, checked to be taken) and the
    window's its materialized output (both attention preps read pieces); and the step's logits with the preps on
    the materialized outputs (PREP_PIECES off), bit for bit. The residual adds run with the norms after them
    (`residual.residual_add_norm`, checked to be taken) and the GDN steps with their output norms (`gdn.step_norm`,
    STEP_NORM on here); with either apart (RESIDUAL_NORM, STEP_NORM off), and with the window packing its queries
    itself rather than the attention prep (PACK_QUERIES off), the logits are the same bits too. (On the
    CPU the Mosaic GPU interpreter takes ~2 min for it: the pieces' readers are checked there at the kernels
    (`test_gdn.py`, `test_attn_prep.py`) and at `project_pieces` and `add_residual_norm` (`test_residual.py`).)"""
    from pallas_kernels import residual
    from qwen_jax.checkpoint import load_checkpoint
    from qwen_jax.model import ops
    from tests.conftest import CAPTURES
    taken, fused = [], []
    project_pieces = ops.project_pieces
    monkeypatch.setattr(ops, "project_pieces", lambda *a: taken.append(project_pieces(*a)) or taken[-1])
    add_norm = residual.residual_add_norm
    monkeypatch.setattr(residual, "residual_add_norm", lambda *a, **k: fused.append(1) or add_norm(*a, **k))
    from pallas_kernels import gdn
    step_norm = gdn.step_norm
    monkeypatch.setattr(gdn, "step_norm", lambda *a, **k: fused.append(2) or step_norm(*a, **k))
    ck = load_checkpoint(CAPTURES / "tiny-mlx-4bit", dtype=jnp.bfloat16)
    toks = np.random.default_rng(1).integers(0, ck.config.text.vocab_size, size=150)
    monkeypatch.setattr(ops, "STEP_NORM", True)
    monkeypatch.setattr(ops, "PACK_QUERIES", True)
    monkeypatch.setattr(ops, "RESIDUAL_NORM_ROWS", 8)  # the fused add and norm at the test's 3 streams too
    monkeypatch.setattr(ops, "STEP_NORM_ROWS", 8)  # and the step with its norm
    on = _fused_step_equals_verify_then_commit(ck.config, ck.params, toks, jnp.bfloat16, True, interpret=False)
    assert taken and all(t is not None for t in taken) and set(fused) == {1, 2}
    # the preps on the materialized outputs; the adds apart from their norms; the GDN step apart from its norm
    for switch in ("PREP_PIECES", "RESIDUAL_NORM", "STEP_NORM", "PACK_QUERIES"):
        monkeypatch.setattr(ops, switch, False)
        off = _fused_step_equals_verify_then_commit(ck.config, ck.params, toks, jnp.bfloat16, True, interpret=False)
        for a, b in zip(on, off):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
        monkeypatch.setattr(ops, switch, True)


def _fused_step_equals_verify_then_commit(cfg, params, toks, dtype, kernels: bool, interpret: bool | None = None,
                                          prefill_backend: M.Backend | None = None):
    """prefill_backend: the backend whose prefill writes the prompts into the state (None: the steps' own)."""
    BE = M.Backend(kernels=kernels, interpret=kernels if interpret is None else interpret)
    prefill = jax.jit(lambda p, s, b: M.prefill(p, s, b, cfg, prefill_backend or BE)[:2])
    verify = jax.jit(lambda p, s, w: M.verify(p, s, w, cfg, BE)[:2])
    commit = jax.jit(lambda s, k, w, pa, n: M.commit(s, k, w, pa, n, cfg, BE))
    step = jax.jit(lambda p, s, w: M.step(p, s, w, cfg, BE))
    p = jax.tree.map(lambda a: a.astype(dtype) if a.dtype == jnp.float32 and a.ndim == 2 else a, params)
    state = M.init_state(cfg.text, num_slots=4, num_pages=40, page_size=16, dtype=dtype)
    tables = np.stack([_pt(1)[0], _pt(11)[0], np.zeros(10, np.int32)])
    lens = [30, 47]
    # Both streams' prompts in one prefill call (one program to compile; the steps below start from its state).
    prompts = np.stack([np.pad(toks[:lens[0]], (0, lens[1] - lens[0])), toks[:lens[1]]])
    _, state = prefill(p, state, M.make_prefill_batch(prompts, [0, 0], lens, [1, 2], tables[:2]))
    a = b = state
    cache = np.array(lens + [0])
    slots = [1, 2, 0]
    cur = toks[100:103]
    logits = []
    for _ in range(3):
        w = M.make_window(cur[:, None], [[-1]] * 3, cache, slots, tables)
        la, ka = verify(p, a, w)
        a = commit(a, ka, w, jnp.zeros((3, 1), jnp.int32), jnp.asarray([1, 1, 0]))
        lb, b = step(p, b, w)
        np.testing.assert_array_equal(np.asarray(la)[:2], np.asarray(lb)[:2])
        live = lambda t: jax.tree.map(lambda x: np.asarray(x.astype(jnp.float32) if x.dtype != jnp.float32 else x), t)
        for xa, xb in zip(jax.tree.leaves(live(a.rec)), jax.tree.leaves(live(b.rec))):
            np.testing.assert_array_equal(xa[1:3], xb[1:3])
            np.testing.assert_array_equal(xb[0], 0)
        for xa, xb in zip(jax.tree.leaves(live(a.conv)), jax.tree.leaves(live(b.conv))):
            np.testing.assert_array_equal(xa[1:3], xb[1:3])
        for xa, xb in zip(jax.tree.leaves(live(a.kv)), jax.tree.leaves(live(b.kv))):
            np.testing.assert_array_equal(xa, xb)
        cur = np.argmax(np.asarray(lb)[:, 0], axis=-1)
        cache = cache + np.array([1, 1, 0])
        logits.append(np.asarray(lb))
    return logits
