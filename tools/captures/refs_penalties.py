"""Greedy continuations under a repetition penalty from HF transformers (torch, CPU): the peer reference for the
engine's `repetition_penalty` (transformers' RepetitionPenaltyLogitsProcessor over the prompt and the tokens
generated so far, applied to each step's float32 logits before the argmax).

Usage: python refs_penalties.py MODEL_DIR PROMPTS_JSON OUT_NPZ

Per prompt p and penalty r (PENALTIES), the npz gets:
  {p}.prompt_ids            int32 [T]
  {p}.rep{r}.gen_ids        int32 [N]   greedy continuation under the penalty (EOS ignored, runs to N)
  {p}.rep{r}.gen_margin     float32 [N] top-1 minus top-2 of each penalized row (small = fragile greedy step)
and one `meta` key: a JSON string (tool versions, dtype, the penalties, the processor).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor  # noqa: E402

from refs_common import load_prompts  # noqa: E402
from refs_hf import backend, load_model, setup_determinism  # noqa: E402

PENALTIES = (1.3,)
PROMPTS = ("short", "repeat")
NEW_TOKENS = 24


def continuation(run, new_cache, ids: list[int], penalty: float) -> tuple[list[int], list[float]]:
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    cache = new_cache()
    row = run(ids, cache)[-1]
    seq, margins = list(ids), []
    for i in range(NEW_TOKENS):
        scores = processor(torch.tensor([seq]), torch.from_numpy(row.astype(np.float32))[None])[0].numpy()
        token = int(np.argmax(scores))
        top2 = np.sort(scores)[-2:]
        margins.append(float(top2[1] - top2[0]))
        seq.append(token)
        if i + 1 < NEW_TOKENS:
            row = run([token], cache)[-1]
    return seq[len(ids):], margins


def main(model_dir: str, prompts_json: str, out_npz: str) -> None:
    setup_determinism()
    model, arch = load_model(model_dir, torch.float32)
    fns = backend(model)
    prompts = load_prompts(prompts_json)
    out = {}
    for name in PROMPTS:
        ids = list(prompts[name]["ids"])
        out[f"{name}.prompt_ids"] = np.asarray(ids, np.int32)
        for r in PENALTIES:
            gen, margins = continuation(fns["run"], fns["new_cache"], ids, r)
            out[f"{name}.rep{r}.gen_ids"] = np.asarray(gen, np.int32)
            out[f"{name}.rep{r}.gen_margin"] = np.asarray(margins, np.float32)
            print(f"  {name} repetition_penalty {r}: {gen[:8]}... min margin {min(margins):.3g}")
    meta = {
        "tool": "transformers",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "numpy": np.__version__, "python": platform.python_version()},
        "model_dir": os.path.basename(os.path.normpath(model_dir)),
        "architecture": arch,
        "dtype": "float32",
        "processor": "transformers.generation.logits_process.RepetitionPenaltyLogitsProcessor over prompt + "
                     "generated ids, on each step's float32 logits (cached steps, eager attention), then argmax",
        "penalties": list(PENALTIES),
        "new_tokens": NEW_TOKENS,
    }
    np.savez(out_npz, meta=np.asarray(json.dumps(meta)), **out)
    print(f"hf penalties {meta['model_dir']} -> {out_npz}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
