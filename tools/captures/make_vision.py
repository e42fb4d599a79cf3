"""Image references from HF transformers on captures/tiny (its tiny vision tower), float32.

  captures/tiny/preprocessor_config.json   written here by transformers' own `Qwen2VLImageProcessorPil.save_pretrained`
                                           (the tiny checkpoint had none): Qwen3.5's processor settings (patch 16,
                                           merge 2, 2 frames, mean = std = 0.5, bicubic) except the pixel bounds,
                                           4096..8192 instead of 65536..16777216 so the images (and the capture) stay
                                           small and all three smart_resize branches are taken
  captures/refs/hf-tiny-vision-f32.npz     three synthetic RGB images, the processor's patches and grids, the tower's
                                           output rows, a chat prompt with the images (ids, M-RoPE positions,
                                           rope_delta), the full model's logits at every prompt row and 8 greedy
                                           tokens decoded through the cache (positions from rope_delta)

Everything is computed by transformers: the processor is transformers' `Qwen3VLProcessor` (placeholder expansion,
mm_token_type_ids) over `Qwen2VLImageProcessorPil` (the image processor transformers picks for qwen3_5 without
torchvision). Qwen3VLProcessor insists on a video processor, whose class needs torchvision (not installed: no CPU
wheel of it matches /opt/wheels' torch); `ImagesOnlyProcessor` skips that one class check and is given none (images
never reach it). The images are numpy patterns (no files, no downloads), stored in the npz as uint8.

Usage: python make_vision.py MODEL_DIR OUT_NPZ   (writes MODEL_DIR/preprocessor_config.json, then OUT_NPZ)
"""

import os

# Fixed thread counts before torch loads: reductions are then split the same way on every run.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from importlib.metadata import version  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor  # noqa: E402

import refs_hf  # noqa: E402

NEW_TOKENS = 8

# Qwen3.5's preprocessor_config.json values except the pixel bounds (see the module docstring).
PROCESSOR_SETTINGS = dict(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    size={"shortest_edge": 4096, "longest_edge": 8192},
)


def make_images() -> list[np.ndarray]:
    """Three uint8 RGB images [H, W, 3] of different sizes, one per smart_resize branch at 4096..8192 pixels:
    70x100 rounds to 64x96; 30x90 is too small and grows to 64x128; 200x150 is too large and shrinks to 96x64."""
    def grid(h, w):
        y, x = np.mgrid[0:h, 0:w].astype(np.float64)
        return y, x

    y, x = grid(70, 100)
    gradient = np.stack([x * 255 / 99, y * 255 / 69, ((x // 10 + y // 10) % 2) * 200 + 30], axis=-1)
    y, x = grid(30, 90)
    stripes = np.stack([127.5 + 127.5 * np.sin(x / 5), 127.5 + 127.5 * np.cos(y / 4), (x + 2 * y) % 256], axis=-1)
    y, x = grid(200, 150)
    radius = np.hypot(y - 90, x - 60)
    rings = np.stack([(radius * 6) % 256, 255 - y * 255 / 199, np.where(radius < 50, 240.0, 20.0)], axis=-1)
    return [np.round(a).clip(0, 255).astype(np.uint8) for a in (gradient, stripes, rings)]


def messages() -> list[dict]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in these two pictures?"},
                                     {"type": "image"}]},
        {"role": "assistant", "content": "A gradient and some stripes."},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]},
    ]


class ImagesOnlyProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without a video processor (its class needs torchvision); every other check and step is
    transformers' own."""

    def check_argument_for_proper_class(self, attribute_name, arg):
        if attribute_name == "video_processor" and arg is None:
            return None
        return super().check_argument_for_proper_class(attribute_name, arg)


def write_processor_config(model_dir: str) -> None:
    Qwen2VLImageProcessorPil(**PROCESSOR_SETTINGS).save_pretrained(model_dir)


def _max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@torch.no_grad()
def capture(model_dir: str, out_npz: str) -> dict[str, np.ndarray]:
    refs_hf.setup_determinism()
    image_processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
    if not isinstance(image_processor, Qwen2VLImageProcessorPil):
        raise SystemExit(f"expected Qwen2VLImageProcessorPil, got {type(image_processor).__name__}")
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    processor = ImagesOnlyProcessor(image_processor=image_processor, tokenizer=tok, video_processor=None,
                                    chat_template=tok.chat_template)
    model, arch = refs_hf.load_model(model_dir, torch.float32)
    sdpa_model = type(model).from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()

    rgb = make_images()
    pil = [Image.fromarray(a) for a in rgb]
    arrays: dict[str, np.ndarray] = {}
    checks: dict[str, float] = {}

    # Each image alone through the image processor and the tower.
    alone_embeds = []
    for i, image in enumerate(pil):
        one = image_processor(images=[image], return_tensors="pt")
        grid = one["image_grid_thw"]
        rows = model.model.get_image_features(one["pixel_values"], grid).pooler_output[0]
        sdpa_rows = sdpa_model.model.get_image_features(one["pixel_values"], grid).pooler_output[0]
        checks[f"image{i}_tower_eager_vs_sdpa_max_abs"] = _max_abs(rows, sdpa_rows)
        arrays[f"image{i}.rgb"] = rgb[i]
        arrays[f"image{i}.pixel_values"] = one["pixel_values"].numpy().astype(np.float32)
        arrays[f"image{i}.grid_thw"] = grid[0].numpy().astype(np.int32)
        arrays[f"image{i}.embeds"] = rows.numpy().astype(np.float32)
        alone_embeds.append(rows)

    # The chat prompt through the whole processor, and the model on it.
    msgs = messages()
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    template_ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, enable_thinking=False,
                                           return_dict=False)
    inputs = processor(images=pil, text=[text], return_tensors="pt")
    ids = inputs["input_ids"]
    pixel_values, grids, mm_types = inputs["pixel_values"], inputs["image_grid_thw"], inputs["mm_token_type_ids"]
    checks["processor_vs_per_image_pixels_max_abs"] = _max_abs(
        pixel_values, np.concatenate([arrays[f"image{i}.pixel_values"] for i in range(len(pil))]))
    together = model.model.get_image_features(pixel_values, grids).pooler_output
    checks["tower_together_vs_alone_max_abs"] = max(_max_abs(a, b) for a, b in zip(together, alone_embeds))

    positions, rope_deltas = model.model.get_rope_index(ids, mm_token_type_ids=mm_types, image_grid_thw=grids)
    model.model.rope_deltas = None
    logits = model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grids, mm_token_type_ids=mm_types,
                   use_cache=False).logits[0].numpy()
    sdpa_model.model.rope_deltas = None
    sdpa_logits = sdpa_model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grids,
                             mm_token_type_ids=mm_types, use_cache=False).logits[0].numpy()
    checks["logits_eager_vs_sdpa_max_abs"] = _max_abs(logits, sdpa_logits)

    # Greedy decoding through the cache: the prefill sets rope_deltas, each later step sits at cache_len + delta.
    model.model.rope_deltas = None
    out = model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grids, mm_token_type_ids=mm_types,
                use_cache=True)
    cache, row = out.cache, out.logits[0, -1].numpy()
    checks["prefill_cached_vs_full_max_abs"] = _max_abs(row, logits[-1])
    gen_ids, gen_logits = [], []
    for i in range(NEW_TOKENS):
        token = int(np.argmax(row))
        gen_ids.append(token)
        gen_logits.append(row)
        if i + 1 < NEW_TOKENS:
            out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
            cache, row = out.cache, out.logits[0, -1].numpy()
    gen_logits = np.stack(gen_logits).astype(np.float32)
    # The same rows from one no-cache call over prompt + continuation (its positions from get_rope_index).
    full_ids = torch.cat([ids, torch.tensor([gen_ids[:-1]])], dim=1)
    full_types = torch.cat([mm_types, torch.zeros((1, NEW_TOKENS - 1), dtype=mm_types.dtype)], dim=1)
    model.model.rope_deltas = None
    full = model(input_ids=full_ids, pixel_values=pixel_values, image_grid_thw=grids, mm_token_type_ids=full_types,
                 use_cache=False).logits[0].numpy()
    checks["gen_cached_vs_full_max_abs"] = _max_abs(full[ids.shape[1] - 1:], gen_logits)
    top2 = np.sort(gen_logits, axis=-1)[:, -2:]

    arrays.update({
        "prompt.template_ids": np.asarray(template_ids, np.int32),
        "prompt.input_ids": ids[0].numpy().astype(np.int32),
        "prompt.mm_token_type_ids": mm_types[0].numpy().astype(np.int32),
        "prompt.position_ids": positions[:, 0].numpy().astype(np.int32),
        "prompt.rope_delta": np.asarray(int(rope_deltas[0, 0]), np.int32),
        "prompt.logits": logits.astype(np.float32),
        "prompt.gen_ids": np.asarray(gen_ids, np.int32),
        "prompt.gen_logits": gen_logits,
        "prompt.gen_margin": (top2[:, 1] - top2[:, 0]).astype(np.float32),
    })
    meta = {
        "tool": "transformers",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__,
                     "pillow": version("pillow"), "python": platform.python_version()},
        "model_dir": os.path.basename(os.path.normpath(model_dir)),
        "architecture": arch,
        "dtype": "float32",
        "precision": "weights loaded as float32 from the bf16 checkpoint (exact); everything float32",
        "attn_implementation": "eager (text and vision); sdpa only for the recorded noise figures",
        "image_processor": type(image_processor).__name__,
        "processor_settings": PROCESSOR_SETTINGS,
        "prompt_text": text,
        "messages": msgs,
        "new_tokens": NEW_TOKENS,
        "torch_threads": 1,
        "checks": checks,
    }
    arrays["meta"] = np.asarray(json.dumps(meta, sort_keys=True))
    print("  " + " ".join(f"{k}={v:.3g}" for k, v in checks.items()))
    print(f"  T={ids.shape[1]} grids={grids.tolist()} rope_delta={int(rope_deltas[0, 0])} gen={gen_ids}")
    if out_npz:
        np.savez_compressed(out_npz, **arrays)
    return arrays


def main(model_dir: str, out_npz: str) -> None:
    write_processor_config(model_dir)
    print(f"hf vision {os.path.basename(os.path.normpath(model_dir))} float32 -> {out_npz}")
    capture(model_dir, out_npz)


if __name__ == "__main__":
    main(*sys.argv[1:3])
