"""The functional qwen3_5 model: pure functions over the params pytree and explicit state."""

from qwen_jax.model.forward import (ModelState, PrefillBatch, VerifyWindow, commit, compute_dtype, depth_of,
                                    init_state, make_prefill_batch, make_window, prefill, step, verify,
                                    window_ancestors, window_depth)
from qwen_jax.model.ops import Backend

__all__ = ["Backend", "ModelState", "PrefillBatch", "VerifyWindow", "commit", "compute_dtype", "depth_of",
           "init_state", "make_prefill_batch", "make_window", "prefill", "step", "verify", "window_ancestors",
           "window_depth"]
