"""Reference logits and greedy continuations from mlx-lm's own Qwen3.5 model code (mlx CPU) on an MLX conversion.

Every floating-point parameter is cast to float32 after loading (norms, conv1d, A_log, dt_bias, and the
quantization scales/biases: bf16 -> f32 is exact, so the dequantized weights are bit-for-bit the stored ones);
the packed uint32 weights are untouched, so the model computes the exact dequantized network in float32.

Usage: python refs_mlx.py MODEL_DIR PROMPTS_JSON OUT_NPZ
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from importlib.metadata import version  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from refs_common import capture_all, load_prompts  # noqa: E402


def load_float32(model_dir: str):
    mx.set_default_device(mx.cpu)
    model, _tokenizer = load(model_dir)
    stored = {k: str(v.dtype) for k, v in tree_flatten(model.parameters())}
    model.set_dtype(mx.float32)
    cast = {k: v.dtype for k, v in tree_flatten(model.parameters())}
    bad = {k: str(d) for k, d in cast.items() if d not in (mx.float32, mx.uint32)}
    if bad:
        raise SystemExit(f"parameters not float32/uint32 after the cast: {bad}")
    return model, stored


def backend(model) -> dict:
    def to_np(logits: mx.array) -> np.ndarray:
        if logits.dtype != mx.float32:
            raise SystemExit(f"mlx logits are {logits.dtype}, expected float32")
        return np.array(logits[0], dtype=np.float32)

    def full(ids: list[int]) -> np.ndarray:
        return to_np(model(mx.array([ids])))

    def new_cache():
        return make_prompt_cache(model)

    def run(ids: list[int], cache) -> np.ndarray:
        out = model(mx.array([ids]), cache=cache)
        mx.eval(out, [c.state for c in cache])
        return to_np(out)

    return {"full": full, "new_cache": new_cache, "run": run}


def main(model_dir: str, prompts_json: str, out_npz: str, only: list[str] | None = None):
    model, stored = load_float32(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        quantization = json.load(f).get("quantization")
    stored_dtypes = sorted(set(stored.values()))
    meta = {
        "tool": "mlx-lm",
        "versions": {
            "mlx": mx.__version__,
            "mlx-lm": version("mlx-lm"),
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "model_dir": os.path.basename(os.path.normpath(model_dir)),
        "quantization": quantization,
        "dtype": "float32",
        "stored_param_dtypes": stored_dtypes,
        "precision": (
            "mlx CPU; all floating parameters (norm weights, conv1d, A_log, dt_bias, quantization scales and "
            "biases, stored as " + "/".join(d for d in stored_dtypes if d != "mlx.core.uint32") + ") cast to float32 "
            "exactly; packed uint32 weights unchanged; activations, quantized matmuls and the GDN recurrence in "
            "float32"
        ),
        "device": "cpu",
    }
    print(f"mlx {meta['model_dir']} -> {out_npz}")
    return capture_all(load_prompts(prompts_json), backend(model), meta, out_npz, only)


if __name__ == "__main__":
    main(*sys.argv[1:4])
