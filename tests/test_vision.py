"""Images, model side: the config and loader, our image processor, the vision tower, the prompt's placeholder rows and
M-RoPE positions, and the whole model on a chat prompt with three images, against transformers' capture
(captures/refs/hf-tiny-vision-f32.npz, tools/captures/make_vision.py; float32 on captures/tiny).

Tolerances (float32 against float32; the figures are in the capture's `meta.checks` and measured here):
- pixels, grids, placeholder ids, M-RoPE positions and rope_delta: equal.
- tower rows: 1e-5. Ours differ from HF's by 2.1e-6 (rows of magnitude up to 2.5); HF's own eager and sdpa
  attention give rows 9.5e-7 apart. A wrong op moves them by far more: tanh instead of exact GELU in the merger
  5e-4, align_corners off 0.28, row and column angles swapped 0.79.
- logits with HF's own image rows: 1e-4, the gate of the text-only peer tests (here 3.7e-5; HF's eager and sdpa
  evaluations of this prompt are 3.6e-5 apart). With our tower's rows: 2e-4, since the rows' 2e-6 differences
  reach the logits amplified (7.9e-5 at worst, position 50; logits up to 12.9). Greedy ids equal (min margin 0.12).
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import save_file

from qwen_jax import model as M
from qwen_jax.checkpoint import CheckpointError, SafetensorsIndex, load_checkpoint, load_vision
from qwen_jax.config import (ConfigError, default_image_processor_config, load_config, load_image_processor_config,
                             parse_config, parse_image_processor_config)
from qwen_jax.model import vision as V
from qwen_jax.vision import (expand_image_pads, image_placeholder, image_token_rows, mrope_positions,
                             num_image_tokens, preprocess_image, smart_resize, to_rgb)
from tests.conftest import CAPTURES

TINY = CAPTURES / "tiny"
REF = CAPTURES / "refs" / "hf-tiny-vision-f32.npz"
IMAGES = 3


@pytest.fixture(scope="module")
def ref():
    return np.load(REF)


@pytest.fixture(scope="module")
def tiny():
    ck = load_checkpoint(TINY, dtype=jnp.float32, vision=True)
    return ck, load_image_processor_config(TINY, ck.config.vision)


@pytest.fixture(scope="module")
def processed(ref, tiny):
    _, pcfg = tiny
    return [preprocess_image(ref[f"image{i}.rgb"], pcfg) for i in range(IMAGES)]


# --- image processor ----------------------------------------------------------------------------------------------

def test_preprocessing_equals_the_processor(ref, tiny, processed):
    for i, im in enumerate(processed):
        assert im.grid_thw == tuple(ref[f"image{i}.grid_thw"].tolist())
        assert im.patches.dtype == np.float32
        np.testing.assert_array_equal(im.patches, ref[f"image{i}.pixel_values"])
    # A Pillow image gives the same patches as its array.
    pil = preprocess_image(Image.fromarray(ref["image1.rgb"]), tiny[1])
    np.testing.assert_array_equal(pil.patches, processed[1].patches)


def test_smart_resize_branches_and_limits():
    # The capture's three images: rounded, grown to min_pixels, shrunk to max_pixels (4096..8192, factor 32).
    assert smart_resize(70, 100, 32, 4096, 8192) == (64, 96)
    assert smart_resize(30, 90, 32, 4096, 8192) == (64, 128)
    assert smart_resize(200, 150, 32, 4096, 8192) == (96, 64)
    # Qwen3.5's own bounds (65536..16777216): a 1080p frame keeps its size up to the multiples of 32.
    assert smart_resize(1080, 1920, 32, 65536, 16777216) == (1088, 1920)
    assert smart_resize(10, 10, 32, 65536, 16777216) == (256, 256)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2010, 32, 4096, 8192)
    with pytest.raises(ValueError, match="empty"):
        smart_resize(0, 10, 32, 4096, 8192)


def test_to_rgb_composites_alpha_on_white():
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[:2, :, 3] = 255  # top half opaque red-ish, bottom half transparent
    out = to_rgb(rgba)
    assert out.shape == (4, 4, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out[0, 0], [200, 0, 0])
    np.testing.assert_array_equal(out[3, 3], [255, 255, 255])
    assert to_rgb(np.full((3, 5), 7, np.uint8)).shape == (3, 5, 3)
    with pytest.raises(ValueError, match="uint8"):
        to_rgb(np.zeros((4, 4, 3), np.float32))


# --- prompt: placeholders and M-RoPE --------------------------------------------------------------------------------

def test_placeholders_and_mrope_positions_equal_transformers(ref, tiny, processed):
    ck, _ = tiny
    cfg = ck.config
    ids = ref["prompt.input_ids"].tolist()
    counts = [num_image_tokens(im.grid_thw, cfg.vision.spatial_merge_size) for im in processed]
    assert counts == [6, 8, 6]
    assert expand_image_pads(ref["prompt.template_ids"].tolist(), counts, cfg.image_token_id) == ids
    assert image_placeholder(2, image_token_id=9, vision_start_token_id=7, vision_end_token_id=8) == [7, 9, 9, 8]
    rows = image_token_rows(ids, cfg.image_token_id)
    np.testing.assert_array_equal(rows, np.flatnonzero(ref["prompt.mm_token_type_ids"] == 1))
    positions, delta = mrope_positions(ids, [im.grid_thw for im in processed], image_token_id=cfg.image_token_id,
                                       merge_size=cfg.vision.spatial_merge_size)
    assert positions.dtype == np.int32 and positions.shape == (3, len(ids))
    np.testing.assert_array_equal(positions, ref["prompt.position_ids"])
    assert delta == int(ref["prompt.rope_delta"]) == -10


def test_placeholder_mismatches_raise():
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        expand_image_pads([1, 5, 2, 5], [3], 5)
    with pytest.raises(ValueError, match="needs 4 consecutive placeholder rows"):
        mrope_positions([1, 5, 5, 5, 2], [(1, 4, 4)], image_token_id=5, merge_size=2)
    with pytest.raises(ValueError, match="no placeholder rows left"):
        mrope_positions([1, 2], [(1, 2, 2)], image_token_id=5, merge_size=2)
    with pytest.raises(ValueError, match="all 0 images are placed"):
        mrope_positions([1, 5], [], image_token_id=5, merge_size=2)


# --- the tower ------------------------------------------------------------------------------------------------------

def test_tower_rows_match_transformers(ref, tiny, processed):
    ck, _ = tiny
    rows = V.encode_images(ck.vision, processed, ck.config.vision)
    for i, r in enumerate(rows):
        want = ref[f"image{i}.embeds"]
        assert r.shape == want.shape and r.dtype == jnp.float32
        assert np.abs(np.asarray(r) - want).max() <= 1e-5, i


def _encode(params, images, cfg, bucket, slots):
    return np.asarray(V._encode_jit(params, V.make_vision_batch(images, cfg, bucket, slots), cfg=cfg))


def test_an_image_gets_the_same_bits_beside_others(tiny, processed):
    ck, _ = tiny
    cfg = ck.config.vision
    a, b, c = processed
    rows = 6  # image 0's prompt rows
    alone = _encode(ck.vision, [a], cfg, 64, 3)[0, :rows]
    np.testing.assert_array_equal(_encode(ck.vision, [a, b], cfg, 64, 3)[0, :rows], alone)
    np.testing.assert_array_equal(_encode(ck.vision, [b, c, a], cfg, 64, 3)[2, :rows], alone)
    np.testing.assert_array_equal(_encode(ck.vision, [a], cfg, 64, 1)[0, :rows], alone)
    together = V.encode_images(ck.vision, [c, a, b], cfg)
    np.testing.assert_array_equal(np.asarray(together[1]), alone)
    np.testing.assert_array_equal(np.asarray(V.encode_images(ck.vision, [a], cfg)[0]), alone)


def test_padding_never_changes_a_live_row(tiny, processed):
    ck, _ = tiny
    cfg = ck.config.vision
    a = processed[0]
    batch = V.make_vision_batch([a], cfg, 64, slots=2)
    clean = np.asarray(V._encode_jit(ck.vision, batch, cfg=cfg))
    patches = np.array(batch.patches)
    live = a.patches.shape[0]
    patches[0, live:] = np.random.default_rng(0).normal(scale=100.0, size=patches[0, live:].shape)
    patches[0, live + 3] = np.nan
    patches[1] = np.nan  # the empty slot
    dirty = np.asarray(V._encode_jit(ck.vision, V.VisionBatch(jnp.asarray(patches), batch.grid_hw), cfg=cfg))
    np.testing.assert_array_equal(dirty[0, :live // cfg.merge_unit], clean[0, :live // cfg.merge_unit])
    assert np.isfinite(dirty).all()


def test_large_buckets_attend_in_query_blocks(ref, tiny, processed):
    """Above 2 x ATTN_BLOCK patch rows the attention runs in query blocks; the rows stay HF's."""
    ck, _ = tiny
    cfg = ck.config.vision
    big = _encode(ck.vision, [processed[1]], cfg, 4 * V.ATTN_BLOCK, 1)[0, :8]
    assert np.abs(big - ref["image1.embeds"]).max() <= 1e-5


def test_vision_batch_refuses_what_it_cannot_run(tiny, processed):
    cfg = tiny[0].config.vision
    a = processed[0]
    with pytest.raises(ValueError, match="exceed the bucket"):
        V.make_vision_batch([a], cfg, 16)
    with pytest.raises(ValueError, match="only still images"):
        V.make_vision_batch([dataclasses.replace(a, grid_thw=(2, 4, 6))], cfg, 64)
    with pytest.raises(ValueError, match="do not fit 1 slots"):
        V.make_vision_batch([a, a], cfg, 64, slots=1)
    with pytest.raises(ValueError, match="multiple of the merge unit"):
        V.make_vision_batch([a], cfg, 66)
    assert [V.patch_bucket(n) for n in (1, 64, 65, 1000, 4096)] == [64, 64, 128, 1024, 4096]


# --- the whole model on the image prompt -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _programs(cfg):
    backend = M.Backend()
    prefill = jax.jit(lambda p, s, b, e: M.prefill(p, s, b, cfg, backend, all_logits=True, embeds=e)[:2])
    verify = jax.jit(lambda p, s, w: M.verify(p, s, w, cfg, backend)[:2])
    commit = jax.jit(lambda s, k, w, path, count: M.commit(s, k, w, path, count, cfg, backend))
    return prefill, verify, commit


def _prefill_with_images(ck, ref, features, grids):
    """Our prefill of the capture's prompt with the image rows in place and M-RoPE positions, then 8 greedy steps
    at cache_len + rope_delta. -> (prompt logits [T, V], generated ids, their logits [8, V])."""
    cfg = ck.config
    ids = ref["prompt.input_ids"]
    n, t = len(ids), 128
    positions, delta = mrope_positions(ids, grids, image_token_id=cfg.image_token_id,
                                       merge_size=cfg.vision.spatial_merge_size)
    state = M.init_state(cfg.text, num_slots=2, num_pages=5, page_size=64, dtype=jnp.float32)
    page_table = np.arange(1, 5, dtype=np.int32)[None]
    tokens = np.zeros((1, t), np.int32)
    tokens[0, :n] = ids
    rope = np.zeros((3, 1, t), np.int32)
    rope[:, 0, :n] = positions
    rope[:, 0, n:] = np.arange(n, t) + delta
    batch = dataclasses.replace(M.make_prefill_batch(tokens, [0], [n], [1], page_table),
                                rope_positions=jnp.asarray(rope))
    mask = jnp.asarray(tokens == cfg.image_token_id)
    rows = V.image_rows(mask, jnp.asarray(features)[None], jnp.zeros((1,), jnp.int32))
    prefill, verify, commit = _programs(cfg)
    logits, state = prefill(ck.params, state, batch, (mask, rows))
    logits = np.asarray(logits[0, :n])
    row, gen, gen_logits = logits[-1], [], []
    for i in range(len(ref["prompt.gen_ids"])):
        token = int(np.argmax(row))
        gen.append(token)
        gen_logits.append(row)
        window = M.make_window([[token]], [[-1]], [n + i], [1], page_table)
        window = dataclasses.replace(window, rope_positions=window.rope_positions + delta)
        step_logits, kept = verify(ck.params, state, window)
        state = commit(state, kept, window, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))
        row = np.asarray(step_logits[0, 0])
    return logits, gen, np.stack(gen_logits)


def test_whole_model_logits_and_greedy_with_images(ref, tiny, processed):
    ck, _ = tiny
    grids = [im.grid_thw for im in processed]
    hf_rows = np.concatenate([ref[f"image{i}.embeds"] for i in range(IMAGES)])
    logits, _, _ = _prefill_with_images(ck, ref, hf_rows, grids)
    assert np.abs(logits - ref["prompt.logits"]).max() <= 1e-4
    ours = np.concatenate([np.asarray(r) for r in V.encode_images(ck.vision, processed, ck.config.vision)])
    logits, gen, gen_logits = _prefill_with_images(ck, ref, ours, grids)
    assert np.abs(logits - ref["prompt.logits"]).max() <= 2e-4
    assert gen == ref["prompt.gen_ids"].tolist()
    assert np.abs(gen_logits - ref["prompt.gen_logits"]).max() <= 2e-4


def test_image_rows_follow_chunks():
    """A prompt cut into chunks inside an image: each chunk's rows continue from `first`."""
    feats = jnp.arange(5 * 2, dtype=jnp.float32).reshape(1, 5, 2)
    mask = np.array([[0, 1, 1, 1, 0, 1, 1, 0]], bool)
    whole = np.asarray(V.image_rows(jnp.asarray(mask), feats, jnp.zeros((1,), jnp.int32)))
    first = np.asarray(V.image_rows(jnp.asarray(mask[:, :3]), feats, jnp.zeros((1,), jnp.int32)))
    second = np.asarray(V.image_rows(jnp.asarray(mask[:, 3:]), feats, jnp.asarray([2], jnp.int32)))
    np.testing.assert_array_equal(np.concatenate([first, second], axis=1), whole)
    np.testing.assert_array_equal(whole[0, mask[0]], np.asarray(feats[0]))
    assert not whole[0, ~mask[0]].any()


# --- config and loader ----------------------------------------------------------------------------------------------

def _raw_tiny() -> dict:
    return json.loads((TINY / "config.json").read_text())


def test_vision_config_read_and_absent_where_no_tower():
    cfg = load_config(TINY)
    v = cfg.vision
    assert (v.depth, v.hidden_size, v.num_heads, v.head_dim, v.patch_dim, v.grid_side, v.merge_unit, v.factor) == (
        2, 32, 2, 16, 1536, 4, 4, 32)
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (498, 496, 497)
    hash(cfg)
    assert load_config(CAPTURES / "tiny-text-tied").vision is None
    assert load_config(CAPTURES / "tiny-mlx-4bit").vision is None
    assert default_image_processor_config(v).min_pixels == 65536


@pytest.mark.parametrize("mutate,field", [
    (lambda v: v.update(hidden_act="silu"), "vision_config.hidden_act"),
    (lambda v: v.update(deepstack_visual_indexes=[3]), "vision_config.deepstack_visual_indexes"),
    (lambda v: v.update(rope_parameters={"rope_type": "default"}), "vision_config.rope_parameters"),
    (lambda v: v.update(num_position_embeddings=15), "vision_config.num_position_embeddings"),
    (lambda v: v.update(out_hidden_size=64), "vision_config.out_hidden_size"),
    (lambda v: v.update(num_heads=3), "vision_config.hidden_size"),
    (lambda v: v.update(in_channels=4), "vision_config.in_channels"),
    (lambda v: v.update(model_type="siglip"), "vision_config.model_type"),
    (lambda v: v.pop("depth"), "missing `depth` in vision_config"),
])
def test_unsupported_vision_configs_name_the_field(mutate, field):
    raw = _raw_tiny()
    mutate(raw["vision_config"])
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
        parse_config(raw)
    assert "\n" not in str(e.value)


def test_vision_token_ids_are_checked():
    raw = _raw_tiny()
    raw.pop("image_token_id")
    with pytest.raises(ConfigError, match="image_token_id"):
        parse_config(raw)
    raw = _raw_tiny()
    raw["vision_end_token_id"] = 4096
    with pytest.raises(ConfigError, match="vision_end_token_id"):
        parse_config(raw)


@pytest.mark.parametrize("change,field", [
    ({"patch_size": 14}, "patch_size"),
    ({"merge_size": 3}, "merge_size"),
    ({"resample": 2}, "resample"),
    ({"image_mean": [0.5, 0.5]}, "image_mean"),
    ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
    ({"size": {"shortest_edge": 9000, "longest_edge": 8192}}, "size.shortest_edge"),
    ({"size": {"shortest_edge": 4096, "longest_edge": 0}}, "size.longest_edge"),
])
def test_processor_config_errors_name_the_field(change, field):
    vision = load_config(TINY).vision
    raw = json.loads((TINY / "preprocessor_config.json").read_text())
    assert parse_image_processor_config(raw, vision).max_pixels == 8192
    raw.update(change)
    with pytest.raises(ConfigError, match=f"`{field}`"):
        parse_image_processor_config(raw, vision)


def test_text_only_loading_pays_nothing_for_the_tower():
    ck = load_checkpoint(TINY, dtype=jnp.float32)
    assert ck.vision is None


def test_text_only_checkpoints_have_no_tower():
    for name in ("tiny-text-tied", "tiny-mlx-4bit"):
        with pytest.raises(CheckpointError, match="no `vision_config`"):
            load_vision(CAPTURES / name)


def _tower_tensors() -> dict[str, np.ndarray]:
    idx = SafetensorsIndex(TINY)
    return {k: idx.load(k).astype(np.float32) for k in idx.refs if k.startswith("model.visual.")}


def _write(tmp_path, tensors: dict[str, np.ndarray]):
    (tmp_path / "config.json").write_text((TINY / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_mlx_vlm_names_and_channels_last_conv_load_the_same(tmp_path, tiny):
    ck, _ = tiny
    renamed = {}
    for k, a in _tower_tensors().items():
        key = "vision_tower." + k[len("model.visual."):]
        renamed[key] = np.ascontiguousarray(np.moveaxis(a, 1, 4)) if k.endswith("patch_embed.proj.weight") else a
    params = load_vision(_write(tmp_path, renamed), dtype=jnp.float32)
    same = jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), params, ck.vision)
    assert all(jax.tree.leaves(same))


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("model.visual.blocks.1.attn.qkv.bias"), "missing tensor `blocks.1.attn.qkv.bias`"),
    (lambda t: t.update({"model.visual.blocks.2.norm1.weight": np.ones(32, np.float32)}),
     "does not explain: model.visual.blocks.2.norm1.weight"),
    (lambda t: t.update({"model.visual.merger.linear_fc1.scales": np.ones((128, 2), np.float32)}), "quantized"),
    (lambda t: t.update({"model.visual.pos_embed.weight": np.ones((9, 32), np.float32)}),
     "model.visual.pos_embed.weight` is \\[9, 32\\]"),
    (lambda t: t.update({"model.visual.patch_embed.proj.weight": np.ones((32, 3, 2, 16, 8), np.float32)}),
     "patch_embed.proj.weight"),
])
def test_bad_tower_tensors_are_named(tmp_path, edit, match):
    tensors = _tower_tensors()
    edit(tensors)
    with pytest.raises(CheckpointError, match=match):
        load_vision(_write(tmp_path, tensors), dtype=jnp.float32)
