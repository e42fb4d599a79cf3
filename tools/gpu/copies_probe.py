"""Which whole-pool copies XLA put into each compiled program (run on the device): for every `copy(` of an array
with a state pool's shape, the copy line and the instruction that consumes it, so an in-place update that failed
can be traced to the op that forced it (`test_pools_updated_in_place_on_gpu`)."""

import re
import sys

import jax

from qwen_jax import programs as P
from qwen_jax.checkpoint import load_checkpoint
from qwen_jax.model import Backend
from tests.conftest import CAPTURES


def main() -> None:
    ck = load_checkpoint(CAPTURES / "tiny-mlx-4bit", dtype=jax.numpy.bfloat16, progress=False)
    layout = P.Layout(64, 8, 6 * 8 + 1, 6, "bfloat16")
    buckets = P.Buckets((64,), (1,), (1,), packing=P.Packing.BATCHED, logprobs=4)
    pr = P.Programs(ck.params, ck.config, layout, buckets, Backend.default())
    pr.compile()
    for key, hits in pr.pool_copies().items():
        lines = pr._exe[key].as_text().splitlines()
        print(f"== {key}: {len(hits)} pool copies")
        for h in hits[:12]:
            name = h.split(" = ")[0].split()[-1]
            users = [ln.strip()[:300] for ln in lines if re.search(rf"[(, ]{re.escape(name)}[,)]", ln)
                     and not ln.strip().startswith(name)]
            print("  COPY", h[:300])
            for u in users[:3]:
                print("    USED BY", u)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
