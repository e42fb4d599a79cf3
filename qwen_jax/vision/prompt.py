"""Images in the prompt: how many placeholder tokens an image takes, the expansion of the chat template's one
`<|image_pad|>` per image to that many, where the tower's rows go, and the prompt's M-RoPE positions (model_spec A.8,
transformers' `Qwen3_5Model.get_rope_index`). Pure functions over host lists and numpy arrays.

Grids are (t, h, w) in patches, as `processing.preprocess_image` returns them; a merge block of merge_size x
merge_size patches becomes one prompt row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def num_image_tokens(grid_thw: Sequence[int], merge_size: int) -> int:
    """Placeholder rows of one image: t·h·w / merge_size² (the tower's merged rows)."""
    t, h, w = grid_thw
    if h % merge_size or w % merge_size:
        raise ValueError(f"patch grid {h}x{w} is not a multiple of the merge size {merge_size}")
    return t * h * w // merge_size ** 2


def image_placeholder(n: int, *, image_token_id: int, vision_start_token_id: int, vision_end_token_id: int
                      ) -> list[int]:
    """One image's ids in a prompt: `<|vision_start|>`, n x `<|image_pad|>`, `<|vision_end|>`."""
    return [vision_start_token_id] + [image_token_id] * n + [vision_end_token_id]


def expand_image_pads(ids: Sequence[int], counts: Sequence[int], image_token_id: int) -> list[int]:
    """A tokenized chat prompt with one `<|image_pad|>` per image (as the chat template writes them) -> the prompt
    with image i's pad repeated counts[i] times (what the processor does to the text before tokenizing). Raises
    ValueError if the prompt's pads and the images do not pair up one to one."""
    pads = sum(1 for t in ids if t == image_token_id)
    if pads != len(counts):
        raise ValueError(f"the prompt has {pads} image placeholders but {len(counts)} images were given")
    out: list[int] = []
    image = 0
    for t in ids:
        if t == image_token_id:
            out.extend([image_token_id] * counts[image])
            image += 1
        else:
            out.append(t)
    return out


def image_token_rows(ids: Sequence[int], image_token_id: int) -> np.ndarray:
    """Indices of the prompt rows the image features replace, in order (transformers' masked scatter: the k-th
    `<|image_pad|>` row takes the k-th feature row of the images' concatenated features). int32 [N]."""
    return np.flatnonzero(np.asarray(ids) == image_token_id).astype(np.int32)


def mrope_positions(ids: Sequence[int], grids: Sequence[Sequence[int]], *, image_token_id: int, merge_size: int
                    ) -> tuple[np.ndarray, int]:
    """M-RoPE positions of a whole prompt: (positions int32 [3, T] as (temporal, height, width) rows, rope_delta).

    Walking the prompt with a running position p (from 0): a text row gets p on all three rows and p += 1; an image
    with merged grid (t', h', w') = (t, h / merge, w / merge) takes its next t'·h'·w' rows, in (frame, row, col)
    order, at (p + frame, p + row, p + col), then p += max(h', w'): the text after an image continues one past its
    largest row or column position, not after its h'·w' rows (as transformers does).

    Every row at sequence index i >= T (the generated tokens) sits at i + rope_delta on all three rows, where
    rope_delta = max(positions) + 1 - T (zero or negative). Raises ValueError if the placeholder rows and the grids
    do not pair up (each image needs exactly its row count of consecutive `<|image_pad|>`)."""
    ids = np.asarray(ids)
    n = len(ids)
    out = np.zeros((3, n), np.int32)
    is_image = ids == image_token_id
    p = 0
    i = 0
    grid_iter = iter(grids)
    while i < n:
        if not is_image[i]:
            out[:, i] = p
            p += 1
            i += 1
            continue
        try:
            t, h, w = next(grid_iter)
        except StopIteration:
            raise ValueError(f"prompt row {i} is an image placeholder but all {len(grids)} images are placed") from None
        hm, wm = h // merge_size, w // merge_size
        rows = num_image_tokens((t, h, w), merge_size)
        if i + rows > n or not is_image[i:i + rows].all():
            raise ValueError(f"the image at prompt row {i} needs {rows} consecutive placeholder rows "
                             f"(grid {t}x{h}x{w}, merge {merge_size})")
        frame, row, col = np.meshgrid(np.arange(t), np.arange(hm), np.arange(wm), indexing="ij")
        out[0, i:i + rows] = p + frame.reshape(-1)
        out[1, i:i + rows] = p + row.reshape(-1)
        out[2, i:i + rows] = p + col.reshape(-1)
        p += max(hm, wm)
        i += rows
    left = sum(1 for _ in grid_iter)
    if left:
        raise ValueError(f"{left} image(s) have no placeholder rows left in the prompt")
    delta = int(out.max()) + 1 - n if n else 0
    return out, delta
