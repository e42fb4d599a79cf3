"""Measure how far the references are from each other, to give tests their error scales.

Compares every committed reference with HF float32 on the same prompts, plus two mlx-lm runs on *unquantized*
float32 conversions made in a temporary dir (not kept):
  - from a float32 copy of captures/tiny: mlx-lm's sanitize adds +1 to the zero-centred norms in float32, so this
    measures mlx-lm vs transformers on identical weights (the float-path agreement);
  - from captures/tiny itself (bf16): sanitize adds +1 in bf16, rounding 1+w to 8 bits, which is what the
    committed MLX conversions carry.
Writes refs/agreement.json.

Usage: python agreement.py CAPTURES_DIR
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import refs_mlx

PROMPT_NAMES = ("short", "long", "repeat", "chat")


def compare(a: dict, b: dict) -> dict:
    out = {}
    for name in PROMPT_NAMES:
        la, lb = a[f"{name}.logits"], b[f"{name}.logits"]
        ga, gb = a[f"{name}.gen_ids"], b[f"{name}.gen_ids"]
        diverge = np.nonzero(ga != gb)[0]
        out[name] = {
            "logits_max_abs": float(np.max(np.abs(la - lb))),
            "logits_rms": float(np.sqrt(np.mean((la - lb) ** 2))),
            "argmax_agree_frac": float(np.mean(la.argmax(-1) == lb.argmax(-1))),
            "gen_first_divergence": int(diverge[0]) if diverge.size else None,
        }
    return out


def float32_copy(src: Path, dst: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(os.path.join(dst, "model.safetensors"))
    save_file({k: v.to(torch.float32) for k, v in weights.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["dtype"] = "float32"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def main(captures_dir: str) -> None:
    root = Path(captures_dir)
    refs = root / "refs"
    prompts = str(refs / "prompts.json")
    load = lambda name: dict(np.load(refs / name))  # noqa: E731
    hf32 = load("hf-tiny-f32.npz")
    result = {
        "reference": "hf-tiny-f32.npz",
        "hf-tiny-bf16.npz": compare(load("hf-tiny-bf16.npz"), hf32),
        "mlx-tiny-mlx-8bit-f32.npz": compare(load("mlx-tiny-mlx-8bit-f32.npz"), hf32),
        "mlx-tiny-mlx-4bit-f32.npz": compare(load("mlx-tiny-mlx-4bit-f32.npz"), hf32),
    }
    with tempfile.TemporaryDirectory() as tmp:
        f32_source = os.path.join(tmp, "tiny-f32")
        float32_copy(root / "tiny", f32_source)
        for label, source in (
            ("mlx-lm, unquantized float32 conversion of a float32 copy of tiny (not kept)", f32_source),
            ("mlx-lm, unquantized float32 conversion of tiny (bf16 source, +1 rounded in bf16; not kept)",
             str(root / "tiny")),
        ):
            mlx_dir = os.path.join(tmp, "mlx-f32")
            subprocess.run(
                [os.path.join(os.path.dirname(sys.executable), "mlx_lm.convert"), "--hf-path", source,
                 "--mlx-path", mlx_dir, "--dtype", "float32"],
                check=True, stdout=subprocess.DEVNULL,
            )
            result[label] = compare(refs_mlx.main(mlx_dir, prompts, ""), hf32)
            shutil.rmtree(mlx_dir)
    (refs / "agreement.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    for name, per_prompt in result.items():
        if isinstance(per_prompt, dict):
            worst = max(v["logits_max_abs"] for v in per_prompt.values())
            print(f"  vs hf f32: {name}: max |dlogits| {worst:.3g}")


if __name__ == "__main__":
    main(sys.argv[1])
