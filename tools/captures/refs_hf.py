"""Reference logits and greedy continuations from HF transformers (torch, CPU) on an HF capture checkpoint.

Usage: python refs_hf.py MODEL_DIR {float32|bfloat16} PROMPTS_JSON OUT_NPZ
"""

import os

# Fixed thread counts before torch loads: reductions are then split the same way on every run.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from refs_common import capture_all, load_prompts  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(model_dir: str, dtype: torch.dtype):
    with open(os.path.join(model_dir, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    cls = getattr(transformers, arch)
    # eager attention: the plain matmul-softmax reference; the GDN layers use transformers' torch fallback
    # (no flash-linear-attention / causal-conv1d installed): chunked rule for prefill, recurrent rule for 1-token
    # cached steps.
    model = cls.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    model.eval()
    return model, arch


def backend(model) -> dict:
    def logits_of(out) -> np.ndarray:
        return out.logits[0].float().numpy().copy()

    @torch.no_grad()
    def full(ids: list[int]) -> np.ndarray:
        return logits_of(model(input_ids=torch.tensor([ids]), use_cache=False))

    def new_cache():
        return {"cache": None}

    @torch.no_grad()
    def run(ids: list[int], holder: dict) -> np.ndarray:
        out = model(input_ids=torch.tensor([ids]), cache=holder["cache"], use_cache=True)
        holder["cache"] = out.cache
        return logits_of(out)

    return {"full": full, "new_cache": new_cache, "run": run}


def setup_determinism() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    # torch refuses to set the interop threads a second time in one process (check.py runs several captures).
    if torch.get_num_interop_threads() != 1:
        torch.set_num_interop_threads(1)
    torch.use_deterministic_algorithms(True)


def main(model_dir: str, dtype_name: str, prompts_json: str, out_npz: str, only: list[str] | None = None):
    setup_determinism()
    model, arch = load_model(model_dir, DTYPES[dtype_name])
    meta = {
        "tool": "transformers",
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "model_dir": os.path.basename(os.path.normpath(model_dir)),
        "architecture": arch,
        "dtype": dtype_name,
        "precision": (
            f"weights loaded as {dtype_name} from the bf16 checkpoint; activations {dtype_name} except where "
            "transformers upcasts (RMSNorm math, GDN recurrence and gates, softmax: float32); logits cast to "
            "float32 for storage"
        ),
        "attn_implementation": "eager",
        "torch_threads": 1,
    }
    print(f"hf {meta['model_dir']} {dtype_name} -> {out_npz}")
    return capture_all(load_prompts(prompts_json), backend(model), meta, out_npz, only)


if __name__ == "__main__":
    main(*sys.argv[1:5])
