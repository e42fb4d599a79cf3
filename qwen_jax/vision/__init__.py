"""Host-side image work for the Qwen3.5 vision tower (plain numpy and Pillow, no jax): `processing` turns an RGB
image into the tower's patches and patch grid, `prompt` sizes and places the image's placeholder tokens and gives a
prompt's M-RoPE positions. The tower itself is `qwen_jax.model.vision`."""

from qwen_jax.vision.processing import ProcessedImage, patchify, preprocess_image, smart_resize, to_rgb
from qwen_jax.vision.prompt import (expand_image_pads, image_placeholder, image_token_rows, mrope_positions,
                                    num_image_tokens)

__all__ = ["ProcessedImage", "expand_image_pads", "image_placeholder", "image_token_rows", "mrope_positions",
           "num_image_tokens", "patchify", "preprocess_image", "smart_resize", "to_rgb"]
