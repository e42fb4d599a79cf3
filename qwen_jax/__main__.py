"""Offline CLI: `python -m qwen_jax {logits,generate} --model DIR ...`."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

DTYPES = ("bfloat16", "float32")


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --token-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise SystemExit("error: --token-ids is empty")
    return ids


def _load(args):
    import jax.numpy as jnp

    from qwen_jax.checkpoint import CheckpointError, load_checkpoint
    from qwen_jax.model import Backend
    from qwen_jax.runner import Runner
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    try:
        ck = load_checkpoint(args.model, dtype=dtype)
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    vocab = ck.config.text.vocab_size
    backend = Backend(kernels=False) if args.no_kernels else Backend.default()
    return ck, Runner(ck.params, ck.config, dtype=dtype, backend=backend, max_len=args.max_model_len), vocab


def cmd_logits(args) -> int:
    ids = _ids(args.token_ids)
    ck, runner, vocab = _load(args)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise SystemExit(f"error: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    logits = runner.logits(ids).astype(np.float32)
    np.save(args.out, logits)
    print(f"wrote {args.out}: float32 {list(logits.shape)}", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    from qwen_jax.checkpoint import CheckpointError, load_tokenizer
    ck, runner, vocab = _load(args)
    tok = None
    if args.prompt is not None:
        try:
            tok = load_tokenizer(args.model)
        except CheckpointError as e:
            raise SystemExit(f"error: {e}") from None
        if args.raw:
            ids = tok(args.prompt, add_special_tokens=False)["input_ids"]
        else:
            text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        ids = _ids(args.token_ids)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise SystemExit(f"error: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    stop = () if args.ignore_eos else ck.config.eos_token_ids
    try:
        out = runner.generate(ids, args.max_tokens, temperature=args.temperature, seed=args.seed, stop_ids=stop)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if tok is None:
        try:
            tok = load_tokenizer(args.model)
        except Exception:
            tok = None
    text = tok.decode(out, skip_special_tokens=False) if tok is not None else None
    if args.json:
        print(json.dumps({"prompt_token_ids": ids, "token_ids": out, "text": text}))
    else:
        print(text if text is not None else ",".join(map(str, out)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qwen_jax", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--model", required=True, help="local checkpoint directory (HF safetensors or MLX)")
        sp.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="compute dtype (float32 = verification)")
        sp.add_argument("--max-model-len", type=int, default=4096, help="context capacity to allocate")
        sp.add_argument("--no-kernels", action="store_true", help="plain-jnp references instead of Pallas kernels")

    lg = sub.add_parser("logits", help="logits at every position of --token-ids, saved as float32 [T, vocab]")
    common(lg)
    lg.add_argument("--token-ids", required=True, help="comma-separated token ids, e.g. 5,17,300")
    lg.add_argument("--out", required=True, help="output .npy path")
    lg.set_defaults(fn=cmd_logits)

    gen = sub.add_parser("generate", help="generate a continuation")
    common(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text (through the checkpoint's chat template unless --raw)")
    src.add_argument("--token-ids", help="comma-separated prompt token ids (no template)")
    gen.add_argument("--raw", action="store_true", help="encode --prompt as is, without the chat template")
    gen.add_argument("--max-tokens", type=int, required=True)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object with token_ids and text")
    gen.set_defaults(fn=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
