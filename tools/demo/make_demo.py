"""Train the demo model and its DFlash drafter (models/demo, models/demo-dflash).

The demo model has the tiny captures' text shapes (captures/tiny-text-tied: 6 layers, 4 GDN + 2 attention, hidden
128, vocab 512, tied head) and is trained from that checkpoint's random weights on the free-software licence
texts every machine of this kind ships (/usr/share/common-licenses, pinned by sha256 below; the tiny tokenizer was
fitted to three of them). It learns to recite licence text, so greedy replies are predictable and a drafter has
something to get right. The drafter (captures/tiny-dflash's shapes: 2 layers on the target's layers 1 and 3,
blocks of 8) is then trained on the demo model's own greedy continuations of licence passages.

Usage (a GPU: ~5 min at the defaults; this 2-core CPU: hours):
    python tools/demo/make_demo.py models [--steps 3000] [--drafter-steps 25000] [--seed 0] [--target DIR]

Prints the losses as it goes and, at the end, the drafter's teacher-forced acceptance: over anchors in 16 other
greedy sequences (random licence passages, not among those it learnt from, though their text is), how many of a
block's drafts in a row equal the greedy tokens.

The committed models/ came from runs on an H100 (2026-12-06): the target from `--steps 3000` (final loss 0.057;
written then as a Qwen3_5ForCausalLM, re-saved in this layout with the same bits; that run's drafter was replaced),
the drafter from `--target models/demo` at the defaults above (2.98 of 7 drafts by that figure). GPU training is not
bit-reproducible from run to run, so a rerun gives a model of the same quality, not the same bytes."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from qwen_jax import train as T  # noqa: E402
from qwen_jax.checkpoint import load_checkpoint, load_dflash, load_tokenizer  # noqa: E402
from qwen_jax.config import parse_dflash_config  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
CORPUS = {
    "Apache-2.0": "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30",
    "Artistic": "b7fd9b73ea99602016a326e0b62e6646060d18febdd065ceca8bb482208c3d88",
    "BSD": "5d588eb3b157d52112afea935c88a7ff9efddc1e2d95a42c25d3b96ad9055008",
    "CC0-1.0": "a2010f343487d3f7618affe54f789f5487602331c0a8d03f49e9a7c547cf0499",
    "GFDL-1.2": "d8e94ae5fdb5433fcae2961aeb1a8cf17174d6f4a0465d24bf37dd8a038bd439",
    "GFDL-1.3": "110535522396708cea37c72a802c5e7e81391139f5f7985631c93ef242b206a4",
    "GPL-1": "d77d235e41d54594865151f4751e835c5a82322b0e87ace266567c3391a4b912",
    "GPL-2": "8177f97513213526df2cf6184d8ff986c675afb514d4e68a404010521b880643",
    "GPL-3": "3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986",
    "LGPL-2": "681e386e44a19d7d0674b4320272c90e66b6610b741e7e6305f8219c42e85366",
    "LGPL-2.1": "dc626520dcd53a22f727af3ee42c770e56c97a64fe3adb063799d8ab032fe551",
    "LGPL-3": "e3a994d82e644b03a792a930f574002658412f62407f5fee083f2555c5f23118",
    "MPL-1.1": "f849fc26a7a99981611a3a370e83078deb617d12a45776d6c4cada4d338be469",
    "MPL-2.0": "fab3dd6bdab226f1c08630b1dd917e11fcb4ec5e1e020e2c16f83a0a13863e85",
}
TARGET_INIT = ROOT / "captures" / "tiny-text-tied"
DRAFTER_INIT = ROOT / "captures" / "tiny-dflash"
TINY = ROOT / "captures" / "tiny"
ENDOFTEXT = 491
SEQ, BATCH = 256, 16
PROMPT, BLOCK = 32, 8
HELD = 16  # held-out sequences


def corpus(tokenizer) -> np.ndarray:
    """The licence texts' token ids, each text followed by <|endoftext|>."""
    ids: list[int] = []
    for name, want in CORPUS.items():
        data = (LICENSES / name).read_bytes()
        got = hashlib.sha256(data).hexdigest()
        if got != want:
            raise SystemExit(f"{LICENSES / name}: sha256 {got} != pinned {want}; the demo would not be reproducible")
        ids += tokenizer.encode(data.decode("utf-8"), add_special_tokens=False) + [ENDOFTEXT]
    return np.asarray(ids, np.int32)


def windows(ids: np.ndarray, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
    starts = rng.integers(0, len(ids) - length, size=n)
    return np.stack([ids[s:s + length] for s in starts])


def demo_config() -> dict:
    """captures/tiny's config.json (a Qwen3_5ForConditionalGeneration, the layout mlx-lm converts) without its
    vision tower, with the tied head of captures/tiny-text-tied, whose weights the training starts from."""
    raw = json.loads((TINY / "config.json").read_text())
    for key in ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        raw.pop(key)
    raw["tie_word_embeddings"] = raw["text_config"]["tie_word_embeddings"] = True
    return raw


def log(what: str):
    t0 = time.time()
    return lambda i, v: print(f"{what} step {i:5d}  loss {v:.4f}  ({time.time() - t0:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="where models/demo and models/demo-dflash go (their parent dir)")
    ap.add_argument("--steps", type=int, default=3000, help="target training steps (batches of 16 x 256 tokens)")
    ap.add_argument("--drafter-steps", type=int, default=25000, help="drafter steps (16 sequences x 16 blocks)")
    ap.add_argument("--sequences", type=int, default=1024, help="greedy sequences the drafter learns from")
    ap.add_argument("--lr", type=float, default=3e-3, help="the target's peak learning rate")
    ap.add_argument("--drafter-lr", type=float, default=1e-3)
    ap.add_argument("--target", help="a demo model already trained (its dir): only the drafter is trained")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    rng = np.random.default_rng(args.seed)
    tok = load_tokenizer(TINY)
    ids = corpus(tok)
    print(f"corpus: {len(ids)} tokens from {len(CORPUS)} licence texts; backend {jax.default_backend()}", flush=True)

    # The target: next-token loss on licence windows.
    ck = load_checkpoint(TARGET_INIT, dtype=jnp.float32, progress=False)
    cfg = ck.config
    if args.target:
        target_dir = Path(args.target)
    else:
        batches = ((jnp.asarray(windows(ids, rng, BATCH, SEQ)),) for _ in iter(int, 1))
        params = T.adamw(lambda p, x: T.lm_loss(p, cfg, x), ck.params, batches, steps=args.steps, lr=args.lr,
                         log=log("target"))
        raw = demo_config()
        gen = {"eos_token_id": [493, ENDOFTEXT], "pad_token_id": ENDOFTEXT}
        target_dir = T.write_checkpoint(out / "demo", T.model_tensors(params, cfg), raw,
                                        extra_files={"generation_config.json": gen}, copy_from=TINY)
        print(f"wrote {target_dir}", flush=True)

    # Its greedy continuations of licence passages at even offsets over the whole corpus (the drafter learns from
    # these), and of 16 random ones (held out, for the acceptance figure); their taps, from the weights as written.
    written = load_checkpoint(target_dir, dtype=jnp.float32, progress=False).params
    offsets = np.linspace(0, len(ids) - PROMPT, args.sequences).astype(np.int64)
    prompts = np.concatenate([np.stack([ids[o:o + PROMPT] for o in offsets]), windows(ids, rng, HELD, PROMPT)])
    gen_fn = jax.jit(lambda p, x: T.generate_greedy(p, cfg, x, SEQ - PROMPT))
    draw = json.loads((DRAFTER_INIT / "config.json").read_text())
    draw["block_size"] = BLOCK
    dcfg = parse_dflash_config(draw, cfg.text)
    feat_fn = jax.jit(lambda p, x: T.drafter_features(p, cfg, dcfg, x))
    seqs, feats = [], []
    for i in range(0, len(prompts), 64):
        s = gen_fn(written, jnp.asarray(prompts[i:i + 64]))
        seqs.append(s)
        feats.append(feat_fn(written, s))
    seqs, feats = jnp.concatenate(seqs), jnp.concatenate(feats)
    print(f"greedy text: {seqs.shape[0]} sequences of {SEQ} tokens, e.g. {tok.decode(np.asarray(seqs[0]))[:160]!r}",
          flush=True)

    # The drafter: block loss on those sequences.
    train_n = args.sequences
    draft0 = load_dflash(DRAFTER_INIT, dtype=jnp.float32).params

    def draft_batches():
        while True:
            pick = rng.integers(0, train_n, size=BATCH)
            anchors = rng.integers(1, SEQ - BLOCK + 1, size=(BATCH, 16)).astype(np.int32)
            yield feats[pick], seqs[pick], jnp.asarray(anchors)

    dparams = T.adamw(lambda p, f, x, a: T.drafter_loss(p, written, dcfg, f, x, a, decay=4.0), draft0,
                      draft_batches(), steps=args.drafter_steps, lr=args.drafter_lr, log=log("drafter"),
                      log_every=1000)
    anchors = jnp.asarray(rng.integers(PROMPT, SEQ - BLOCK + 1, size=(HELD, 32)).astype(np.int32))
    acc = T.teacher_forced_acceptance(dparams, written, dcfg, feats[train_n:], seqs[train_n:], anchors)
    drafter_dir = T.write_checkpoint(out / "demo-dflash", T.drafter_tensors(dparams, dcfg), draw)
    print(f"wrote {drafter_dir}; teacher-forced acceptance on {HELD} other sequences: {acc:.2f} of {BLOCK - 1} "
          "drafts a block (fp32 weights before the bf16 write)", flush=True)


if __name__ == "__main__":
    main()
