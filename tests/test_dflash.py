"""The DFlash drafter (qwen_jax.model.dflash) against z-lab's dflash 0.1.0 on the tiny drafter for captures/tiny
(captures/refs/dflash-tiny-f32.npz, made by tools/captures/make_dflash.py; see captures/README.md), its config and
loader, and its cached fixed-shape path against the plain one.

Tolerance 1e-4 on the drafter's normalised hidden states (|h| <= 4) and logits (|logits| <= 9.3), as for the
target's peer tests: the float32 noise of this computation, not a loosening. On the two direct calls, against a
float64 numpy evaluation of the same math on the same weights and features (written for this check, not kept),
our float32 drafter is within 3.1e-5 (hidden) / 4.4e-5 (logits) and dflash's within 3.6e-5 / 5.9e-5 (this
drafter's sharp attention, q/k norms near 4, amplifies rounding); ours and dflash's differ by at most 1.3e-5 /
4.0e-5.
"""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.qweight import dequantize_numpy, quantize_numpy
from qwen_jax import model as M
from qwen_jax.checkpoint import CheckpointError, SafetensorsIndex, load_checkpoint, load_dflash
from qwen_jax.config import ConfigError, default_target_layer_ids, load_config, parse_dflash_config
from qwen_jax.model import dflash as D
from tests.conftest import CAPTURES
from tests.test_checkpoint import _raw, _write_safetensors

REF = CAPTURES / "refs" / "dflash-tiny-f32.npz"
DRAFTER = CAPTURES / "tiny-dflash"
TOL = 1e-4
BACKEND = M.Backend()


@pytest.fixture(scope="module")
def models():
    target = load_checkpoint(CAPTURES / "tiny", dtype=jnp.float32)
    drafter = load_dflash(DRAFTER, target=target.config.text, dtype=jnp.float32)
    return target, drafter, np.load(REF)


# --- config -----------------------------------------------------------------------------------------------------


def _raw_config() -> dict:
    return json.loads((DRAFTER / "config.json").read_text())


def test_config_reads_the_capture_drafter():
    cfg = parse_dflash_config(_raw_config(), load_config(CAPTURES / "tiny").text)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (128, 2, 4, 2, 32)
    assert (cfg.intermediate_size, cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (256, 4, 500, (1, 3))
    assert cfg.rope_theta == 1e7 and cfg.rms_norm_eps == 1e-6 and cfg.num_target_layers == 6
    assert (cfg.input_embedding_scale, cfg.output_multiplier, cfg.final_logit_softcapping) == (1.0, 1.0, None)
    hash(cfg)
    # dflash's build_target_layer_ids: model_spec C.1's 27B and 32-layer examples.
    assert default_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)
    assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)
    assert default_target_layer_ids(6, 2) == (1, 3) and default_target_layer_ids(36, 1) == (18,)


def test_config_older_layout_and_dflash_values():
    """transformers 4 files keep rope_theta at the top level with rope_scaling null; values dflash looks up in
    dflash_config first win over top-level ones; without target_layer_ids they come from num_target_layers."""
    raw = _raw_config()
    del raw["rope_parameters"], raw["layer_types"]
    raw["dflash_config"] = {"mask_token_id": 7, "block_size": 8, "output_multiplier": 0.5,
                            "final_logit_softcapping": 30.0, "input_embedding_scale": 2.0}
    raw.update(rope_theta=5e5, rope_scaling=None, block_size=16, num_target_layers=64, num_hidden_layers=5)
    cfg = parse_dflash_config(raw)
    assert (cfg.rope_theta, cfg.block_size, cfg.mask_token_id) == (5e5, 8, 7)
    assert cfg.target_layer_ids == (1, 16, 31, 46, 61)
    assert (cfg.output_multiplier, cfg.final_logit_softcapping, cfg.input_embedding_scale) == (0.5, 30.0, 2.0)


@pytest.mark.parametrize("mutate,field", [
    (lambda r: r.update(architectures=["DFlash2DraftModel"]), "architectures"),
    (lambda r: r.update(architectures=["Qwen3ForCausalLM"]), "architectures"),
    (lambda r: r.update(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (lambda r: (r.pop("layer_types"), r.update(use_sliding_window=True, sliding_window=64, max_window_layers=1)),
     "layer_types"),
    (lambda r: r.update(is_causal=True), "is_causal"),
    (lambda r: r.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0}), "rope_parameters"),
    (lambda r: r.update(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    (lambda r: r["rope_parameters"].update(partial_rotary_factor=0.5), "rope_parameters"),
    (lambda r: r.update(attention_bias=True), "attention_bias"),
    (lambda r: r.update(hidden_act="gelu"), "hidden_act"),
    (lambda r: r.update(hidden_size=256), "hidden_size"),
    (lambda r: r["dflash_config"].update(target_layer_ids=[1, 6]), "target_layer_ids"),
    (lambda r: r["dflash_config"].update(target_layer_ids=[3, 1]), "target_layer_ids"),
    (lambda r: r.update(num_target_layers=64), "num_target_layers"),
    (lambda r: r["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda r: r["dflash_config"].update(mask_token_id=512), "mask_token_id"),
    (lambda r: r.update(block_size=1), "block_size"),
    (lambda r: r.update(num_key_value_heads=3), "num_key_value_heads"),
])
def test_unsupported_or_mismatched_configs_raise_naming_the_field(mutate, field):
    raw = _raw_config()
    mutate(raw)
    with pytest.raises(ValueError, match=f"`{field}`") as e:
        parse_dflash_config(raw, load_config(CAPTURES / "tiny").text)
    assert isinstance(e.value, ConfigError) and "\n" not in str(e.value)


# --- loader -----------------------------------------------------------------------------------------------------


def test_loader_layout_and_unshifted_norms(models):
    _, drafter, _ = models
    p = drafter.params
    idx = SafetensorsIndex(DRAFTER)
    assert p["fc"].shape == (128, 256) and len(p["layers"]) == 2
    attn = p["layers"][1]["attn"]
    assert attn["q"].shape == (128, 128) and attn["kv"].sizes == (64, 64) and attn["o"].shape == (128, 128)
    np.testing.assert_array_equal(np.asarray(attn["kv"].weight[64:]),
                                  idx.load("layers.1.self_attn.v_proj.weight").astype(np.float32))
    # Qwen3RMSNorm is x * w: the stored weight is the multiplier (no 1 + w).
    np.testing.assert_array_equal(np.asarray(p["layers"][0]["input_norm"]),
                                  idx.load("layers.0.input_layernorm.weight").astype(np.float32))
    np.testing.assert_array_equal(np.asarray(p["hidden_norm"]), idx.load("hidden_norm.weight").astype(np.float32))


def _copy_without(tmp_path, drop: str | None = None, add: dict | None = None):
    d = tmp_path / "drafter"
    d.mkdir(parents=True)
    shutil.copy(DRAFTER / "config.json", d / "config.json")
    idx = SafetensorsIndex(DRAFTER)
    tensors = {n: _raw(r) for n, r in idx.refs.items() if n != drop}
    tensors.update(add or {})
    _write_safetensors(d / "model.safetensors", tensors)
    return d


def test_loader_errors_name_the_tensor(tmp_path):
    with pytest.raises(CheckpointError, match="missing tensor `layers.1.mlp.up_proj.weight`"):
        load_dflash(_copy_without(tmp_path, drop="layers.1.mlp.up_proj.weight"))
    extra = {"candidate_selector.hidden_projection.weight": ("F32", [2, 2], bytes(16))}
    with pytest.raises(CheckpointError, match="candidate_selector"):
        load_dflash(_copy_without(tmp_path / "x", add=extra))
    with pytest.raises(CheckpointError, match="not a directory"):
        load_dflash(tmp_path / "nope")


def test_mlx_quantized_drafter_loads_packed(models, tmp_path):
    """MLX affine weights (`.scales` / `.biases` beside uint32 words, a `quantization` block) go through the same
    loader path as the target's and stay packed; the drafter then equals one with the dequantized dense weights."""
    target, _, z = models
    idx = SafetensorsIndex(DRAFTER)
    packed, dense = {}, {}
    for name, ref in idx.refs.items():
        w = idx.load(name).astype(np.float32)
        if w.ndim == 2:
            words, scales, biases = quantize_numpy(w, 4, 32)
            base = name[: -len(".weight")]
            packed[name] = ("U32", list(words.shape), words.tobytes())
            packed[f"{base}.scales"] = ("F32", list(scales.shape), scales.tobytes())
            packed[f"{base}.biases"] = ("F32", list(biases.shape), biases.tobytes())
            w = dequantize_numpy(words, scales, biases, 4, 32).astype(np.float32)
        else:
            packed[name] = ("F32", list(w.shape), w.tobytes())
        dense[name] = ("F32", list(w.shape), w.tobytes())
    dirs = {}
    for kind, tensors in (("packed", packed), ("dense", dense)):
        d = dirs[kind] = tmp_path / kind
        d.mkdir()
        raw = _raw_config()
        if kind == "packed":
            raw["quantization"] = {"group_size": 32, "bits": 4}
        (d / "config.json").write_text(json.dumps(raw))
        _write_safetensors(d / "model.safetensors", tensors)
    q = load_dflash(dirs["packed"], target=target.config.text, dtype=jnp.float32)
    f = load_dflash(dirs["dense"], target=target.config.text, dtype=jnp.float32)
    assert type(q.params["fc"]).__name__ == "QuantizedWeight" and q.params["layers"][0]["attn"]["kv"].sizes == (64, 64)
    feats = jnp.asarray(z["direct.call1.context_features"])[None]
    block = jnp.asarray(z["direct.call1.block_ids"])[None]
    hq = D.forward(q.params, target.params, q.config, feats, block, BACKEND)
    hf = D.forward(f.params, target.params, f.config, feats, block, BACKEND)
    assert float(jnp.abs(hq - hf).max()) <= 1e-4


# --- against dflash ---------------------------------------------------------------------------------------------


def test_direct_calls_match_dflash(models):
    """Two draft calls over one cache, as dflash_generate makes them: the prompt's 89 context rows then 3 more, each
    followed by a block. Hidden states, logits, argmax drafts and the cache's context K/V after the second call."""
    target, drafter, z = models
    cfg = drafter.config
    cache = D.init_cache(cfg, num_slots=2, window=128, dtype=jnp.float32)
    for call in (1, 2):
        key = f"direct.call{call}"
        feats = z[f"{key}.context_features"]
        block = z[f"{key}.block_ids"]
        batch = D.make_batch([1], [int(z[f"{key}.cache_len"])], feats[None], [len(feats)], [block[0]], cfg)
        np.testing.assert_array_equal(np.asarray(batch.block[0]), block)
        assert int(batch.cache_len[0]) + len(feats) == z[f"{key}.block_positions"][0]
        hidden, cache = D.draft_hidden(drafter.params, target.params, cfg, cache, batch, BACKEND)
        logits = D.logits_of(target.params, cfg, hidden[0], BACKEND)
        assert float(np.abs(np.asarray(hidden[0]) - z[f"{key}.hidden"]).max()) <= TOL, key
        assert float(np.abs(np.asarray(logits) - z[f"{key}.logits"]).max()) <= TOL, key
        np.testing.assert_array_equal(np.argmax(np.asarray(logits[1:]), -1), z[f"{key}.draft_ids"])
    n = z["direct.cache_k"].shape[2]
    for got, want in ((cache.k, z["direct.cache_k"]), (cache.v, z["direct.cache_v"])):
        assert float(np.abs(np.asarray(got[:, 1, :n]).transpose(0, 2, 1, 3) - want).max()) <= TOL


# --- the fixed-shape path ---------------------------------------------------------------------------------------

# The cached, padded path against the plain one is two differently shaped programs (a softmax over 132 keys, 93 of
# them live, against one over 93; XLA vectorises each shape its own way), and this drafter's sharp attention
# amplifies their last-bit differences: measured 4.5e-6 to 7.2e-6 on the hidden states. The gate is our own
# float32's distance from a float64 evaluation (3.1e-5, module docstring); a padding row or another slot leaking
# in moves them by O(0.1). Within one compiled program padding cannot change a live row's bits at all
# (test_padding_never_changes_a_live_row).
PLAIN_TOL = 3e-5


def test_padding_never_changes_a_live_row(models):
    """One compiled draft program, two batches that differ only in what must not matter: the padding feature rows,
    the dummy stream beside the live one, another slot's cache rows and stale rows of the live slot past its
    context. The live stream's hidden states and its cache rows are the same bits."""
    target, drafter, z = models
    cfg = drafter.config
    f1, b1 = z["direct.call1.context_features"], z["direct.call1.block_ids"]
    draft = jax.jit(lambda c, b: D.draft_hidden(drafter.params, target.params, cfg, c, b, BACKEND))
    rng = np.random.default_rng(1)
    clean = np.zeros((2, 96, f1.shape[1]), np.float32)
    clean[1, : len(f1)] = f1
    noisy = rng.normal(size=clean.shape).astype(np.float32) * 3
    noisy[1, : len(f1)] = f1
    fresh = D.init_cache(cfg, num_slots=3, window=128, dtype=jnp.float32)
    # Slot 1 holds another stream's rows, slot 2 a finished stream's 96 rows (a reused slot): its rows past the new
    # stream's 89 stay stale.
    stale = rng.normal(size=clean.shape).astype(np.float32)
    _, used = draft(fresh, D.make_batch([1, 2], [0, 0], stale, [96, 96], [7, 8], cfg))
    out_a, cache_a = draft(fresh, D.make_batch([0, 2], [0, 0], clean, [0, len(f1)], [0, b1[0]], cfg))
    out_b, cache_b = draft(used, D.make_batch([1, 2], [5, 0], noisy, [40, len(f1)], [9, b1[0]], cfg,
                                              block_len=[2, 4]))
    np.testing.assert_array_equal(np.asarray(out_a[1]), np.asarray(out_b[1]))
    n = len(f1)
    np.testing.assert_array_equal(np.asarray(cache_a.k[:, 2, :n]), np.asarray(cache_b.k[:, 2, :n]))
    np.testing.assert_array_equal(np.asarray(cache_a.v[:, 2, :n]), np.asarray(cache_b.v[:, 2, :n]))


def test_padded_cached_path_equals_the_plain_one(models):
    """Jitted draft over a 3-slot cache with a dummy stream beside the real one, padding feature rows full of noise
    and the cache already holding another slot's rows, against `forward` on exactly the live rows (no cache). Then a
    shortened block (block_len 2) against a 2-row block."""
    target, drafter, z = models
    cfg = drafter.config
    rng = np.random.default_rng(0)
    f1, f2 = z["direct.call1.context_features"], z["direct.call2.context_features"]
    b1, b2 = z["direct.call1.block_ids"], z["direct.call2.block_ids"]
    draft = jax.jit(lambda c, b: D.draft_hidden(drafter.params, target.params, cfg, c, b, BACKEND), donate_argnums=0)
    cache = D.init_cache(cfg, num_slots=3, window=128, dtype=jnp.float32)

    def padded(rows, p):
        out = rng.normal(size=(2, p, rows.shape[1])).astype(np.float32) * 3
        out[1, : len(rows)] = rows
        return out

    # Slot 1 first gets unrelated rows, which slot 2's calls must never see.
    _, cache = draft(cache, D.make_batch([1, 2], [0, 0], padded(f2, 96), [50, 0], [5, 0], cfg))
    h1, cache = draft(cache, D.make_batch([0, 2], [0, 0], padded(f1, 96), [0, len(f1)], [0, b1[0]], cfg))
    h2, cache = draft(cache, D.make_batch([0, 2], [0, len(f1)], padded(f2, 4), [0, len(f2)], [0, b2[0]], cfg))
    both = np.concatenate([f1, f2])
    plain1 = D.forward(drafter.params, target.params, cfg, jnp.asarray(f1)[None], jnp.asarray(b1)[None], BACKEND)
    plain2 = D.forward(drafter.params, target.params, cfg, jnp.asarray(both)[None], jnp.asarray(b2)[None], BACKEND)
    assert float(jnp.abs(h1[1] - plain1[0]).max()) <= PLAIN_TOL
    assert float(jnp.abs(h2[1] - plain2[0]).max()) <= PLAIN_TOL
    assert bool(jnp.isfinite(h1).all()) and bool(jnp.isfinite(h2).all())

    short, _ = draft(cache, D.make_batch([0, 2], [0, len(both)], padded(f2[:0], 4), [0, 0], [0, b2[0]], cfg,
                                         block_len=[4, 2]))
    plain = D.forward(drafter.params, target.params, cfg, jnp.asarray(both)[None], jnp.asarray(b2[:2])[None],
                      BACKEND)
    assert float(jnp.abs(short[1, :2] - plain[0]).max()) <= PLAIN_TOL


def test_window_keeps_the_newest_rows(models):
    """A 16-row window after 89 context rows (appended 16 at a time) drafts as the plain drafter does over the last
    16 rows at their own positions."""
    target, drafter, z = models
    cfg = drafter.config
    f1, b1 = z["direct.call1.context_features"], z["direct.call1.block_ids"]
    w = 16
    cache = D.init_cache(cfg, num_slots=2, window=w, dtype=jnp.float32)
    append = jax.jit(lambda c, b: D.append_context(drafter.params, cfg, c, b, BACKEND))
    for start in range(0, len(f1), w):
        chunk = np.zeros((1, w, f1.shape[1]), np.float32)
        rows = f1[start : start + w]
        chunk[0, : len(rows)] = rows
        cache = append(cache, D.make_batch([1], [start], chunk, [len(rows)], [0], cfg))
    hidden, _ = D.draft_hidden(drafter.params, target.params, cfg, cache,
                               D.make_batch([1], [len(f1)], np.zeros((1, 1, f1.shape[1]), np.float32), [0], [b1[0]],
                                            cfg), BACKEND)
    plain = D.forward(drafter.params, target.params, cfg, jnp.asarray(f1[-w:])[None], jnp.asarray(b1)[None], BACKEND,
                      start=len(f1) - w)
    assert float(jnp.abs(hidden[0] - plain[0]).max()) <= PLAIN_TOL
    with pytest.raises(ValueError, match="exceed the draft window"):
        D.append_context(drafter.params, cfg, cache, D.make_batch([1], [0], np.zeros((1, w + 1, 256)), [1], [0], cfg),
                         BACKEND)


def test_kernels_in_interpret_mode_match_the_reference_path(models):
    """The same draft with the Pallas kernels on (interpret mode; the GPU path) over the 4-bit MLX target, whose
    embedding and lm_head are packed (the quantized embed and qmm kernels), against the reference ops."""
    _, drafter, z = models
    target = load_checkpoint(CAPTURES / "tiny-mlx-4bit", dtype=jnp.float32)
    cfg = drafter.config
    f1, b1 = z["direct.call1.context_features"], z["direct.call1.block_ids"]
    out = []
    for backend in (BACKEND, M.Backend(kernels=True, interpret=True)):
        cache = D.init_cache(cfg, num_slots=2, window=128, dtype=jnp.float32)
        logits, _ = jax.jit(lambda c, x, be=backend: D.draft(drafter.params, target.params, cfg, c, x, be))(
            cache, D.make_batch([1], [0], f1[None], [len(f1)], [b1[0]], cfg))
        out.append(np.asarray(logits))
    assert np.isfinite(out[1]).all() and float(np.abs(out[1] - out[0]).max()) <= TOL


def test_logit_scale_and_softcap(models):
    target, drafter, z = models
    cfg = drafter.config
    hidden = jnp.asarray(z["direct.call1.hidden"])
    base = np.asarray(D.logits_of(target.params, cfg, hidden, BACKEND))
    capped = D.logits_of(target.params, dataclasses.replace(cfg, output_multiplier=2.0, final_logit_softcapping=5.0),
                         hidden, BACKEND)
    np.testing.assert_allclose(np.asarray(capped), 5.0 * np.tanh(2.0 * base / 5.0), rtol=1e-6, atol=1e-6)


# --- dflash_generate, greedy, over our target -------------------------------------------------------------------


class GreedyDFlash:
    """dflash_generate at temperature 0 over our float32 target (prefill, verify of the block as a chain, commit;
    taps after target_layer_ids) and the drafter's jitted fixed-shape calls: the loop an engine runs for one
    stream."""

    CHUNK = 64
    PAGES = 8  # 512 positions for every prompt (the longest needs 336 + 24 + 4): one compile of each program

    def __init__(self, target, drafter):
        self.t, self.d = target, drafter
        cfg, dcfg = target.config, drafter.config
        taps = dcfg.target_layer_ids
        self.b = dcfg.block_size
        self.prefill = jax.jit(lambda p, s, x: M.prefill(p, s, x, cfg, BACKEND, taps=taps), donate_argnums=1)
        self.verify = jax.jit(lambda p, s, w: M.verify(p, s, w, cfg, BACKEND, taps=taps))
        self.commit = jax.jit(lambda s, k, w, path, n: M.commit(s, k, w, path, n, cfg, BACKEND), donate_argnums=0)
        self.append = jax.jit(lambda c, x: D.append_context(drafter.params, dcfg, c, x, BACKEND), donate_argnums=0)
        self.draft = jax.jit(lambda c, x: D.draft(drafter.params, target.params, dcfg, c, x, BACKEND),
                             donate_argnums=0)

    def prefill_prompt(self, prompt: list[int]):
        """The prompt through the target in 64-row chunks, each chunk's taps appended to the draft cache ->
        (last row's logits [1, V], target state, draft cache, taps [T, n*H], page table)."""
        dcfg = self.d.config
        page_table = np.arange(1, self.PAGES + 1, dtype=np.int32)[None]
        state = M.init_state(self.t.config.text, num_slots=2, num_pages=self.PAGES + 1, page_size=64,
                             dtype=jnp.float32)
        cache = D.init_cache(dcfg, num_slots=2, window=self.PAGES * 64, dtype=jnp.float32)
        width = dcfg.num_taps * dcfg.hidden_size
        rows = []
        for c0 in range(0, len(prompt), self.CHUNK):
            chunk = prompt[c0 : c0 + self.CHUNK]
            toks = np.zeros((1, self.CHUNK), np.int32)
            toks[0, : len(chunk)] = chunk
            logits, state, taps = self.prefill(self.t.params, state,
                                               M.make_prefill_batch(toks, [c0], [len(chunk)], [1], page_table))
            feats = np.asarray(taps).reshape(1, self.CHUNK, width)
            cache = self.append(cache, D.make_batch([1], [c0], feats, [len(chunk)], [0], dcfg))
            rows.append(feats[0, : len(chunk)])
        return logits, state, cache, np.concatenate(rows), page_table

    def run(self, prompt: list[int], new_tokens: int):
        dcfg, b = self.d.config, self.b
        assert len(prompt) + new_tokens + b <= self.PAGES * 64
        logits, state, cache, prompt_taps, page_table = self.prefill_prompt(prompt)
        width = prompt_taps.shape[1]
        max_length = len(prompt) + new_tokens
        out = list(prompt) + [int(np.argmax(logits[0]))]
        start = cache_len = len(prompt)
        pending = np.zeros((0, width), np.float32)
        steps = []
        while start + 1 < max_length:
            size = min(b, max_length - start)
            block = [out[start]] + [dcfg.mask_token_id] * (b - 1)
            if size > 1:
                feats = np.zeros((1, b, width), np.float32)
                feats[0, : len(pending)] = pending
                drafts, cache = self.draft(cache, D.make_batch([1], [cache_len], feats, [len(pending)], [out[start]],
                                                                dcfg, block_len=[size]))
                cache_len += len(pending)
                block[1:size] = np.argmax(np.asarray(drafts[0, : size - 1]), -1).tolist()
            # The window is always b rows: rows past the block hang off the committed prefix and are ignored.
            parents = [-1] + list(range(size - 1)) + [-1] * (b - size)
            window = M.make_window([block[:size] + [0] * (b - size)], [parents], [start], [1], page_table)
            logits, kept, taps = self.verify(self.t.params, state, window)
            posterior = np.argmax(np.asarray(logits[0]), -1)
            accepted = 0
            while accepted < size - 1 and block[accepted + 1] == posterior[accepted]:
                accepted += 1
            produced = min(accepted + 1, max_length - start - 1)
            state = self.commit(state, kept, window, jnp.arange(b, dtype=jnp.int32)[None], jnp.asarray([produced]))
            pending = np.asarray(taps[0, :produced]).reshape(produced, width)
            steps.append((start, block[:size] + [-1] * (b - size), produced))
            out = out[: start + 1] + block[1 : accepted + 1] + [int(posterior[accepted])]
            start += produced
        return out[len(prompt) : min(start + 1, max_length)], steps


@pytest.fixture(scope="module")
def loop(models):
    target, drafter, _ = models
    return GreedyDFlash(target, drafter)


def test_target_taps_are_the_reference_features(models, loop):
    """Our target's residual taps after target_layer_ids (what the engine will feed the drafter; here from chunked
    prefill) are HF's hidden_states[id + 1] that the reference drafter read."""
    z = models[2]
    taps = loop.prefill_prompt(z["direct.prompt_ids"].tolist())[3]
    assert float(np.abs(taps - z["direct.call1.context_features"]).max()) <= TOL


def test_greedy_loop_proposes_dflashs_drafts(models, loop):
    """For each prompt, the same drafts at the same steps, the same acceptance lengths and output as dflash_generate
    (whose target ran without a cache; ours runs chain verify and commit). The smallest draft margin in the capture
    is 0.0029, far above the drafter's error."""
    z = models[2]
    for name in ("short", "long", "repeat", "chat"):
        prompt = z[f"gen.{name}.prompt_ids"].tolist()
        gen, steps = loop.run(prompt, len(z[f"gen.{name}.gen_ids"]))
        assert gen == z[f"gen.{name}.gen_ids"].tolist(), name
        assert [s for s, _, _ in steps] == z[f"gen.{name}.block_start"].tolist(), name
        assert [a for _, _, a in steps] == z[f"gen.{name}.acceptance_lengths"].tolist(), name
        np.testing.assert_array_equal(np.asarray([blk for _, blk, _ in steps]), z[f"gen.{name}.block_ids"],
                                      err_msg=name)


def test_drafter_quantized_at_load(models):
    """--drafter-bits: a dense drafter's projections packed at load (qweight.quantize, bf16 factors), every value
    within one step of its dense self, the norms kept; the packed drafter equals one with those values dense, and
    it runs on the kernels (interpret mode) as on the reference path."""
    from pallas_kernels.qweight import QuantizedWeight, dequantize, quantize
    target, drafter, z = models
    for bits in (4, 8):
        q = load_dflash(DRAFTER, target=target.config.text, dtype=jnp.float32, bits=bits)
        a, qa = drafter.params["layers"][1]["attn"], q.params["layers"][1]["attn"]
        assert isinstance(q.params["fc"], QuantizedWeight) and q.params["fc"].bits == bits
        assert qa["kv"].sizes == a["kv"].sizes and isinstance(qa["kv"].weight, QuantizedWeight)
        assert np.array_equal(np.asarray(qa["q_norm"]), np.asarray(a["q_norm"]))
        for dense, packed in ((drafter.params["fc"], q.params["fc"]), (a["kv"].weight, qa["kv"].weight),
                              (drafter.params["layers"][0]["mlp"]["down"], q.params["layers"][0]["mlp"]["down"])):
            assert packed.scales.dtype == jnp.bfloat16 and packed.group_size == 64
            step = np.repeat(np.asarray(packed.scales, np.float32), 64, axis=1)
            err = np.abs(np.asarray(dequantize(packed)) - np.asarray(dense))
            assert (err <= step * 1.01).all() and err.mean() < 0.3 * step.mean(), (bits, err.max())
    with pytest.raises(ValueError, match="--drafter-bits"):
        load_dflash(DRAFTER, target=target.config.text, bits=3)
    # the packing: each field where MLX's layout puts it (qweight's module doc), against the numpy quantizer's words
    w = np.random.default_rng(0).normal(size=(8, 128)).astype(np.float32)
    words, _, _ = quantize_numpy(w, 4, 64, np.float32)
    got = quantize(jnp.asarray(w), bits=4, group_size=64, scale_dtype=jnp.float32)
    assert np.array_equal(np.asarray(got.words), words)  # (this input has no value at a float32/float64 tie)
    # the packed drafter is the dense one on its dequantized values, and the kernels agree
    q = load_dflash(DRAFTER, target=target.config.text, dtype=jnp.float32, bits=4)
    deq = jax.tree.map(lambda w: dequantize(w) if isinstance(w, QuantizedWeight) else w, q.params,
                       is_leaf=lambda w: isinstance(w, QuantizedWeight))
    feats = jnp.asarray(z["direct.call1.context_features"])[None]
    block = jnp.asarray(z["direct.call1.block_ids"])[None]
    hq = D.forward(q.params, target.params, q.config, feats, block, BACKEND)
    hf = D.forward(deq, target.params, q.config, feats, block, BACKEND)
    hk = D.forward(q.params, target.params, q.config, feats, block, M.Backend(kernels=True, interpret=True))
    assert float(jnp.abs(hq - hf).max()) <= 1e-4 and float(jnp.abs(hk - hq).max()) <= TOL
