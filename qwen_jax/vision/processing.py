"""An RGB image -> the vision tower's input: Qwen's image processor (transformers' `Qwen2VLImageProcessorPil`, which
Qwen3.5 checkpoints name through `Qwen3VLProcessor`) restated as pure functions over numpy arrays, with Pillow for
the alpha composite and the bicubic resize. Bit for bit that processor's output (tests/test_vision.py against
captures/refs/hf-tiny-vision-f32.npz).

Steps: RGB (alpha composited on white) -> `smart_resize` both sides to multiples of patch_size * merge_size (area
within [min_pixels, max_pixels], aspect kept) with Pillow's bicubic filter on the uint8 image -> x * rescale_factor
(float64, then float32) -> (x - mean) / std per channel (float32) -> `patchify`: the still image repeated to
temporal_patch_size frames and cut into patches ordered merge block by merge block.

transformers' torchvision backend (`Qwen2VLImageProcessor`, the default where torchvision is installed) resizes in
float with antialiasing instead of Pillow's integer bicubic; its pixels differ from these by a level or two where an
image is resized, not where it already has the target size.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from PIL import Image

from qwen_jax.config import ImageProcessorConfig

MAX_ASPECT_RATIO = 200


@dataclasses.dataclass(frozen=True)
class ProcessedImage:
    """One image as the tower reads it.

    patches: float32 [t·h·w, C·T·P·P], each row one patch's values in (channel, frame, row, col) order, rows in
        merge-block order: (block_row, block_col, row_in_block, col_in_block) over the h x w patch grid.
    grid_thw: (t, h, w) patches per frame group, row and column (t = 1 for a still image).
    """
    patches: np.ndarray
    grid_thw: tuple[int, int, int]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) Qwen's processor resizes an image to: both multiples of `factor`, the area within
    [min_pixels, max_pixels] as far as the multiples allow, the aspect ratio kept as closely as possible.

    Each side is first rounded to the nearest multiple (Python's round: halves to even). If the area is then above
    max_pixels, both sides shrink by beta = sqrt(h·w / max_pixels) and round down (to at least `factor`); if below
    min_pixels, both grow by beta = sqrt(min_pixels / (h·w)) and round up. Raises ValueError for an empty image or
    one whose long side is more than 200 times its short side."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image of {width}x{height} pixels is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image of {width}x{height} pixels: the aspect ratio must be at most {MAX_ASPECT_RATIO}, got "
                         f"{max(height, width) / min(height, width):.1f}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image | np.ndarray) -> np.ndarray:
    """A decoded image -> uint8 [H, W, 3]. A Pillow image with transparency is composited on white (as transformers'
    `convert_to_rgb`); other modes are converted by Pillow. An array must be uint8 [H, W, 3] (taken as RGB),
    [H, W, 4] (RGBA, composited on white) or [H, W] (grey)."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise ValueError(f"image array must be uint8, got {image.dtype}")
        if image.ndim == 3 and image.shape[2] == 3:
            return np.ascontiguousarray(image)
        if image.ndim == 2 or (image.ndim == 3 and image.shape[2] == 4):
            image = Image.fromarray(image)
        else:
            raise ValueError(f"image array must be [H, W, 3] RGB, [H, W, 4] RGBA or [H, W] grey, got {image.shape}")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.asarray(image.convert("RGB"))


def patchify(pixels: np.ndarray, pcfg: ImageProcessorConfig) -> np.ndarray:
    """pixels float32 [C, H, W] (H, W multiples of patch_size * merge_size) -> float32 [h·w, C·T·P·P] patches in
    merge-block order, the still image repeated to T = temporal_patch_size frames."""
    c, height, width = pixels.shape
    p, m, t = pcfg.patch_size, pcfg.merge_size, pcfg.temporal_patch_size
    if height % (p * m) or width % (p * m):
        raise ValueError(f"pixels of {width}x{height} are not multiples of patch_size * merge_size = {p * m}")
    gh, gw = height // p, width // p
    blocks = pixels.reshape(c, gh // m, m, p, gw // m, m, p)
    # (block_row, block_col, row_in_block, col_in_block, channel, pixel_row, pixel_col)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], blocks.shape[:5] + (t, p, p))
    return np.ascontiguousarray(frames.reshape(gh * gw, c * t * p * p), dtype=np.float32)


def preprocess_image(image: Image.Image | np.ndarray, pcfg: ImageProcessorConfig) -> ProcessedImage:
    """A decoded image (Pillow, or a uint8 array as `to_rgb` takes) -> the tower's patches and grid_thw (1, h, w),
    with h·w / merge_size² placeholder tokens in the prompt (`prompt.num_image_tokens`)."""
    rgb = to_rgb(image)
    height, width = rgb.shape[:2]
    if pcfg.do_resize:
        new_h, new_w = smart_resize(height, width, pcfg.factor, pcfg.min_pixels, pcfg.max_pixels)
        if (new_h, new_w) != (height, width):
            rgb = np.asarray(Image.fromarray(rgb).resize((new_w, new_h), resample=Image.Resampling.BICUBIC))
    pixels = rgb.transpose(2, 0, 1)  # [C, H, W]
    if pcfg.do_rescale:
        # transformers rescales in float64 and rounds once to float32.
        pixels = (pixels.astype(np.float64) * pcfg.rescale_factor).astype(np.float32)
    else:
        pixels = pixels.astype(np.float32)
    if pcfg.do_normalize:
        mean = np.asarray(pcfg.image_mean, np.float32)[:, None, None]
        std = np.asarray(pcfg.image_std, np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    patches = patchify(pixels, pcfg)
    return ProcessedImage(patches, (1, pixels.shape[1] // pcfg.patch_size, pixels.shape[2] // pcfg.patch_size))
