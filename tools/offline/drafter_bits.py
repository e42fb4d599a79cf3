"""What quantizing a drafter at load (`--drafter-bits`) costs its acceptance, on the CPU: the demo model and its
trained drafter (models/), the kernels interpreted, each prompt's greedy reply drafted (`evaluate.draft_speedup`,
policy "always") with the drafter in bf16 and at each bit width, one engine each -> drafts accepted a window and
whether every drafted reply equals the serial one (it must: a window keeps only drafts the target's own samples
agree with). The speed-up it prints is the interpreted CPU's, not a device's.

    python tools/offline/drafter_bits.py [--prompts 4] [--gen-tokens 64] [--bits 8,4] [--draft-tree 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--draft-tree", type=int, default=0)
    args = ap.parse_args()
    from qwen_jax.engine import evaluate
    from qwen_jax.engine.engine import Engine
    from qwen_jax.engine.policy import DraftPolicy
    from qwen_jax.model import Backend

    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    for bits in [None] + [int(b) for b in args.bits.split(",") if b]:
        t0 = time.perf_counter()
        e = Engine.from_checkpoint(str(ROOT / "models/demo-mlx-8bit"), drafter=str(ROOT / "models/demo-dflash"),
                                   drafter_bits=bits, max_model_len=256, parallel=1, max_logprobs=0,
                                   backend=Backend(kernels=True, interpret=True), progress=False,
                                   compile_cache=None, vision=False, draft_tree=args.draft_tree,
                                   draft_policy=DraftPolicy.parse("always"))
        prompts = evaluate.draft_prompts(e.tokenizer.encode(text), args.prompts, args.prompt_tokens)
        with e:
            res = evaluate.draft_speedup(e, prompts, max_tokens=args.gen_tokens)
        print(f"drafter {bits or 'bf16'}: {res.line()}; {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
