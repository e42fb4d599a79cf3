"""The model with the Pallas kernels switched on (interpret mode on CPU) against the peer captures and against the
reference ops: the wiring of qmm, GDN and paged attention into the model's swap points."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import calls
from qwen_jax import model as M
from qwen_jax.checkpoint import load_checkpoint
from qwen_jax.runner import Runner
from tests.conftest import CAPTURES

KERNELS = M.Backend(kernels=True, interpret=True)


@pytest.fixture(scope="module")
def mlx4():
    ck = load_checkpoint(CAPTURES / "tiny-mlx-4bit", dtype=jnp.float32)
    z = np.load(CAPTURES / "refs" / "mlx-tiny-mlx-4bit-f32.npz")
    return ck, z


def test_kernels_match_mlx_capture_prompt_and_steps(mlx4):
    ck, z = mlx4
    ids = z["repeat.prompt_ids"].tolist()[:70]
    ref = z["repeat.logits"][:70]
    runner = Runner(ck.params, ck.config, dtype=jnp.float32, backend=KERNELS, max_len=256)
    split = 64
    first = runner.prefill(ids[:split], all_logits=True)
    assert np.abs(first - ref[:split]).max() <= 2e-3
    for i in range(split, len(ids)):
        row = runner.step(ids[i], i)
        assert np.abs(row - ref[i]).max() <= 2e-3, i


def test_kernels_tree_window_matches_reference_ops(mlx4):
    ck, z = mlx4
    ids = z["short.prompt_ids"].tolist()
    cfg = ck.config
    outs = []
    for backend in (M.Backend(), KERNELS):
        st = M.init_state(cfg.text, num_slots=2, num_pages=8, page_size=16, dtype=jnp.float32)
        pt = np.arange(1, 8, dtype=np.int32)[None]
        prefill = jax.jit(lambda p, s, b: M.prefill(p, s, b, cfg, backend)[1])
        verify = jax.jit(lambda p, s, w: M.verify(p, s, w, cfg, backend)[0])
        st = prefill(ck.params, st, M.make_prefill_batch(np.array([ids[:6]]), [0], [6], [1], pt))
        w = M.make_window(np.array([ids[6:10]]), [[-1, 0, 0, 2]], [6], [1], pt)
        logits = verify(ck.params, st, w)
        outs.append(np.asarray(logits))
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-4, rtol=0)


def test_27b_decode_program_launch_budget(h200_lowering):
    """The 27B decode program (first 4 layers: 3 GDN + 1 attention) lowered for an H200 on this CPU: every Pallas
    call counted, so a change that adds launches to a decode round shows here. A layer: 4 quantized projections
    (the GDN's in/out, the MLP's gate+up and down; attention's qkv and o) and 2 RMS norms, plus the mixer's own:
    GDN's rows' prep (`gdn.decode_prep`: conv, q/k l2 norm, gates) and the fused step with its gated norm
    (`gdn.step_norm`); attention's rows' prep (`attn_prep`: q/k norms and RoPE, q packed for the window's pass 1),
    the KV write and the window's merge (its pass 1 is a Mosaic GPU kernel, `attention.WINDOW_IMPL`). Then the
    final norm and the lm_head. With `x_natural` decode tiles, no transpose of x precedes a projection."""
    from qwen_jax import programs as P
    from qwen_jax.synthetic import random_params, synthetic_config
    cfg = synthetic_config("27b", 4)
    params = jax.eval_shape(lambda k: random_params(cfg.text, k, dtype=jnp.bfloat16, quant=cfg.quantization),
                            jax.random.key(0))
    lay = P.Layout(64, 4, 5, 2, "bfloat16", "bf16")
    pr = P.Programs(params, cfg, lay, P.Buckets((P.GRID,), (1,), (1,)), M.Backend(kernels=True))
    args = P._abstract(pr._example("decode", (1, 1)))
    with calls.sharing(False):  # one Triton custom call a launch in the text (XLA inlines the shared ones)
        lowered = pr._fns["decode"].trace(params, jax.eval_shape(lambda: pr.state), pr.last, pr.history,
                                          *args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    kinds = [n.split('"')[0].split("_")[0] for n in text.split('name = "')[1:]]
    gdn_layer, attn_layer = 4 + 2 + 2, 4 + 2 + 3
    assert text.count("__gpu$xla.gpu.triton") == 3 * gdn_layer + attn_layer + 2
    assert text.count("custom_call @mosaic_gpu") == 1  # the attention layer's window pass 1
    assert (kinds.count("qmm"), kinds.count("rownorm")) == (4 * 4 + 1, 3 * 2 + 2 + 1)  # gated norms: in the steps
    assert text.count('name = "gdn_step_norm"') == 3  # `ops.STEP_NORM` at one stream
    assert text.count('name = "attn_prep"') == 1  # the q and k norms and their RoPE
    assert "-> tensor<1x4x64x256xbf16>" not in text  # the prep packs q for the pass 1 (`ops.PACK_QUERIES`): no pad
    assert kinds.count("gdn") == 3 * 2  # gdn_decode_prep and gdn_step
    from pallas_kernels import qmm
    if qmm.DECODE_TILES.x_natural:
        assert "qmm_decode/transpose" not in lowered.as_text(debug_info=True)


def _decode_program_text(layers: int) -> str:
    from qwen_jax import programs as P
    from qwen_jax.synthetic import random_params, synthetic_config
    cfg = synthetic_config("27b", layers)
    params = jax.eval_shape(lambda k: random_params(cfg.text, k, dtype=jnp.bfloat16, quant=cfg.quantization),
                            jax.random.key(0))
    pr = P.Programs(params, cfg, P.Layout(64, 4, 5, 2, "bfloat16", "bf16"), P.Buckets((P.GRID,), (1,), (1,)),
                    M.Backend(kernels=True))
    args = P._abstract(pr._example("decode", (1, 1)))
    return pr._fns["decode"].trace(params, jax.eval_shape(lambda: pr.state), pr.last, pr.history, *args).lower(
        lowering_platforms=("cuda",)).as_text()


def test_kernel_calls_lowered_once_per_program(h200_lowering):
    """`pallas_kernels.calls`: the 27B decode program at 8 layers lowers each distinct kernel once (a shared
    function the call sites call), not once a call site: the same kernels, far fewer Triton modules, and the
    count does not grow with depth (8 and 12 layers: the same 13 modules)."""
    import re
    names = lambda text: re.findall(r'name = "([a-z0-9_]+?)(?:__\d+)?"', text)
    with calls.sharing(False):
        plain = _decode_program_text(8)
    shared = _decode_program_text(8)
    assert plain.count("__gpu$xla.gpu.triton") == 6 * (4 + 2 + 2) + 2 * (4 + 2 + 3) + 2  # one a launch
    assert set(names(shared)) == set(names(plain))
    # one module a distinct (kernel, shapes): 11 names, the split-4 qmm at two N, and gdn_step_norm twice: the last
    # GDN layer's launch counter is not read after it, so its call drops that result (the RMS norm has one width
    # left: the q/k norms are in attn_prep; the gated norm is in gdn_step_norm)
    assert len(set(names(plain))) == 11
    assert shared.count("__gpu$xla.gpu.triton") == len(set(names(plain))) + 2
    assert _decode_program_text(12).count("__gpu$xla.gpu.triton") == shared.count("__gpu$xla.gpu.triton")


def test_kernel_calls_shared_same_bits(mlx4):
    """Sharing the kernels' lowering changes nothing computed: the tiny model's prompt logits with kernels on
    (interpret mode) are bit-identical with sharing on and off."""
    ck, z = mlx4
    ids = z["repeat.prompt_ids"].tolist()[:40]
    outs = []
    for enabled in (True, False):
        with calls.sharing(enabled):
            runner = Runner(ck.params, ck.config, dtype=jnp.float32, backend=KERNELS, max_len=128)
            outs.append(np.asarray(runner.prefill(ids, all_logits=True)))
    np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


def test_attention_window_pass_reads_q_packed_by_the_prep(monkeypatch):
    """`ops.PACK_QUERIES`: a tiny 4-bit attention layer's window rows (bf16, kernels in interpret mode, the window's
    pass 1 forced onto Mosaic GPU's interpreter) take q packed by `attn_prep` (checked to be asked for), and the
    layer's output and kept K/V are the bits of the same pass with q packed by the window itself, for 3 streams at
    1 row and 1 stream at a 4-row tree."""
    from pallas_kernels import attention as at
    from pallas_kernels import attn_prep as ap
    from qwen_jax.config import LAYER_GDN
    from qwen_jax.model import attention as attn_mixer
    from qwen_jax.model import ops
    monkeypatch.setattr(at, "WINDOW_IMPL", "mgpu")
    ck = load_checkpoint(CAPTURES / "tiny-mlx-4bit", dtype=jnp.bfloat16)
    cfg = ck.config.text
    layer = next(lay["attn"] for i, lay in enumerate(ck.params["layers"]) if cfg.layer_types[i] != LAYER_GDN)
    rng = np.random.default_rng(11)
    pool = M.init_state(cfg, num_slots=4, num_pages=24, page_size=16, dtype=jnp.bfloat16).kv[0]
    pool = pool.with_arrays(*(jnp.asarray(rng.normal(size=a.shape), a.dtype) for a in (pool.k, pool.v)))
    asked = []
    prep = ap.prep
    monkeypatch.setattr(ap, "prep", lambda *a, **k: asked.append(k.get("packed_rows")) or prep(*a, **k))
    for parents, cache_len in (([[-1]] * 3, [5, 40, 17]), ([[-1, 0, 0, 1]], [33])):
        s, t = len(parents), len(parents[0])
        table = np.arange(1, 1 + 5 * s, dtype=np.int32).reshape(s, 5)
        window = M.make_window(np.zeros((s, t)), parents, cache_len, np.arange(1, s + 1), table)
        x = jnp.asarray(rng.normal(size=(s, t, cfg.hidden_size)), jnp.bfloat16)
        outs = []
        for on in (True, False):
            monkeypatch.setattr(ops, "PACK_QUERIES", on)
            asked.clear()
            outs.append(jax.jit(lambda x, p, pool, w: attn_mixer.window_pass(x, p, pool, w, cfg, KERNELS))(
                x, layer, pool, window))
            assert asked == ([64] if on else [None])
        for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
            assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
