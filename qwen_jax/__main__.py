"""Offline CLI: `python -m qwen_jax {logits,generate,eval,bench} ...`.

  logits    --model DIR --token-ids IDS --out FILE.npy     logits at every position, float32 [T, vocab]
  generate  --model DIR (--prompt TEXT | --token-ids IDS) --max-tokens N [--json]    on the engine
  eval ppl  --model DIR --text FILE                         teacher-forced perplexity (compiled, chunked)
  eval kv   --model DIR [--text FILE]                       fp8 vs bf16 KV cache: top-1 agreement, mean KL
  eval drafts --model DIR (--drafter DIR | --copy-drafts) --text FILE    drafted vs serial: acceptance, speed-up
  bench     (--model DIR | --synthetic 27b)                 prompt tok/s, decode forwards/s, compile cold/warm
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

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


def _jnp_dtype(name: str):
    import jax.numpy as jnp
    return jnp.float32 if name == "float32" else jnp.bfloat16


def _backend(args):
    from qwen_jax.model import Backend
    from qwen_jax.model.parallel import TensorParallel
    backend = Backend(kernels=False) if args.no_kernels else Backend.default()
    size = getattr(args, "tensor_parallel_size", 1)
    if size == 1:
        return backend
    try:
        return dataclasses.replace(backend, parallel=TensorParallel.over(size))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def _checkpoint(args):
    from qwen_jax.checkpoint import CheckpointError, load_checkpoint
    try:
        return load_checkpoint(args.model, dtype=_jnp_dtype(args.dtype))
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


def _tokenizer(args, *, required: bool):
    from qwen_jax.checkpoint import CheckpointError, load_tokenizer
    try:
        return load_tokenizer(args.model)
    except CheckpointError as e:
        if required:
            raise SystemExit(f"error: {e}") from None
        return None


def _check_vocab(ids: list[int], vocab: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise SystemExit(f"error: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")


def _cache(args) -> None:
    from qwen_jax import programs as P
    if args.compile_cache:
        P.enable_compilation_cache(args.compile_cache)


def cmd_logits(args) -> int:
    from qwen_jax.runner import Runner
    ids = _ids(args.token_ids)
    ck = _checkpoint(args)
    _check_vocab(ids, ck.config.text.vocab_size)
    runner = Runner(ck.params, ck.config, dtype=_jnp_dtype(args.dtype), backend=_backend(args),
                    max_len=args.max_model_len)
    try:
        logits = runner.logits(ids).astype(np.float32)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    np.save(args.out, logits)
    print(f"wrote {args.out}: float32 {list(logits.shape)}", file=sys.stderr)
    return 0


def _grammar(args, tok, in_think: bool):
    """--json-schema: "object" (any JSON object), a schema's JSON text, or a file holding one; --regex: a pattern
    the whole reply matches; --grammar: a GBNF grammar's text or a file holding one -> (grammar, the token after
    which it starts: `</think>` when the prompt opened a think block), or (None, None)."""
    given = [flag for flag, value in (("--json-schema", args.json_schema), ("--regex", args.regex),
                                      ("--grammar", args.grammar)) if value is not None]
    if not given:
        return None, None
    from qwen_jax import structured
    if len(given) > 1:
        raise SystemExit(f"error: give one of {', '.join(given)}")
    after = tok.convert_tokens_to_ids("</think>") if in_think else None
    if args.regex is not None or args.grammar is not None:
        try:
            if args.regex is not None:
                return structured.compile_regex(args.regex), after
            text = args.grammar if "::=" in args.grammar else Path(args.grammar).read_text()
            return structured.compile_grammar(text), after
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: {given[0]}: {e}") from None
    spec = args.json_schema
    try:
        if spec == "object":
            schema = None
        elif spec.lstrip().startswith(("{", "true")):
            schema = json.loads(spec)
        else:
            schema = json.loads(Path(spec).read_text())
        grammar = structured.compile_json_schema(schema)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise SystemExit(f"error: --json-schema: {e}") from None
    return grammar, after


def cmd_generate(args) -> int:
    from qwen_jax import programs as P
    from qwen_jax.engine.api import ContextLengthExceeded, GenerationRequest, SamplingOptions
    from qwen_jax.engine.engine import Engine
    _cache(args)
    ck = _checkpoint(args)
    tok = None
    in_think = False  # the chat template's generation prompt opened a think block
    if args.prompt is not None:
        tok = _tokenizer(args, required=True)
        if args.raw:
            ids = tok(args.prompt, add_special_tokens=False)["input_ids"]
        else:
            text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            in_think = text.rstrip().endswith("<think>")
    else:
        ids = _ids(args.token_ids)
        tok = _tokenizer(args, required=any(v is not None for v in (args.json_schema, args.regex, args.grammar)))
    grammar, after = _grammar(args, tok, in_think)
    _check_vocab(ids, ck.config.text.vocab_size)
    if args.max_tokens < 1:
        raise SystemExit(f"error: --max-tokens must be at least 1, got {args.max_tokens}")
    backend = _backend(args)
    # One request: compile only the prompt bucket it needs and a one-stream decode.
    chunk = min(P.pages_for(max(len(ids), 1), P.GRID) * P.GRID, 4096)
    buckets = P.Buckets((chunk,), (1,), (1,), packing=P.default_buckets(ck.params, backend, parallel=1).packing)
    try:
        engine = Engine(ck.params, ck.config, tok, dtype=args.dtype, max_model_len=args.max_model_len, parallel=1,
                        max_queued=1, backend=backend, buckets=buckets, max_prefill_chunk=chunk,
                        progress=sys.stderr.isatty())
        req = GenerationRequest(tuple(ids), args.max_tokens,
                                SamplingOptions(temperature=args.temperature, seed=args.seed,
                                                presence_penalty=args.presence_penalty,
                                                frequency_penalty=args.frequency_penalty,
                                                repetition_penalty=args.repetition_penalty),
                                ignore_eos=args.ignore_eos, request_id="cli", grammar=grammar, grammar_after=after)
        handle = engine.submit(req)  # validates (and queues) before anything compiles
        with engine:
            done = handle.result()
    except (ContextLengthExceeded, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    if done.finish_reason == "error":
        raise SystemExit(f"error: generation failed: {done.error}")
    out = list(done.token_ids)
    text = tok.decode(out, skip_special_tokens=False) if tok is not None else None
    if args.json:
        print(json.dumps({"prompt_token_ids": ids, "token_ids": out, "text": text}))
    else:
        print(text if text is not None else ",".join(map(str, out)))
    return 0


def _eval_tokens(args, tok) -> list[int]:
    from qwen_jax.engine.evaluate import DEFAULT_TEXT
    if args.text is not None:
        try:
            with open(args.text, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise SystemExit(f"error: --text {args.text}: {e.strerror}") from None
    else:
        text = DEFAULT_TEXT
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if args.max_tokens is not None:
        ids = ids[:args.max_tokens]
    return ids


def cmd_eval_drafts(args) -> int:
    """Drafted against serial generation of prompts cut from --text, on one engine."""
    from qwen_jax.engine import evaluate
    from qwen_jax.engine.engine import Engine
    from qwen_jax.engine.policy import DraftPolicy
    if args.text is None:
        raise SystemExit("error: eval drafts needs --text FILE (prompts are cut from it)")
    if (args.drafter is None) == (not args.copy_drafts):
        raise SystemExit("error: eval drafts needs one of --drafter DIR (block drafts) or --copy-drafts")
    try:
        engine = Engine.from_checkpoint(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                                        parallel=max(args.streams, 1), backend=_backend(args),
                                        progress=sys.stderr.isatty(), compile_cache=args.compile_cache or None,
                                        max_logprobs=0, drafter=args.drafter, copy_drafts=args.copy_drafts,
                                        drafter_bits=args.drafter_bits,
                                        vision=False, draft_tree=args.draft_tree,
                                        draft_policy=DraftPolicy.parse(args.draft_policy, args.draft_costs))
        prompts = evaluate.draft_prompts(_eval_tokens(args, engine.tokenizer), args.prompts, args.prompt_tokens)
        with engine:
            if engine.measured_costs:
                print(f"--draft-costs '{json.dumps(engine.measured_costs)}' (measured)", file=sys.stderr)
            res = evaluate.draft_speedup(engine, prompts, max_tokens=args.gen_tokens, streams=args.streams)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(res.as_dict()) if args.json else res.line())
    return 0 if res.mismatched == 0 else 1


def cmd_eval(args) -> int:
    from qwen_jax.engine import evaluate
    if args.what == "drafts":
        return cmd_eval_drafts(args)
    if args.what == "ppl" and args.text is None:
        raise SystemExit("error: eval ppl needs --text FILE")
    if args.what == "ppl" and args.path != "prompt":
        raise SystemExit("error: --path decode is for eval kv (eval ppl reads its cache through prompt chunks)")
    _cache(args)
    ck = _checkpoint(args)
    tok = _tokenizer(args, required=True)
    ids = _eval_tokens(args, tok)
    context = args.context or args.max_model_len
    from pallas_kernels import attention_window_mgpu as awm
    shipped_window = awm.FP8
    awm.FP8 = _fp8_window(args, shipped_window)
    try:
        if args.what == "ppl":
            res = evaluate.perplexity(ck.params, ck.config, ids, backend=_backend(args), dtype=args.dtype,
                                      kv_cache=args.kv_cache, context=context, chunk=args.chunk)
            line = (f"perplexity {res.ppl:.4f} (mean NLL {res.nll:.4f} nats) over {res.tokens} tokens, "
                    f"{res.tokens / res.seconds:.1f} tok/s")
        else:
            res = evaluate.kv_agreement(ck.params, ck.config, ids, backend=_backend(args), dtype=args.dtype,
                                        context=context, chunk=args.chunk, path=args.path, rows=args.window_rows)
            line = (f"fp8 vs bf16 KV over {res.tokens} tokens ({res.path} path): "
                    f"top-1 agreement {res.top1_agreement:.4f}, "
                    f"mean KL {res.mean_kl:.3e} nats (max {res.max_kl:.3e}), "
                    f"ppl bf16 {res.ppl_bf16:.4f} / fp8 {res.ppl_fp8:.4f}")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    finally:
        awm.FP8 = shipped_window
    print(json.dumps(res.as_dict()) if args.json else line)
    return 0


def _fp8_window(args, shipped: bool) -> bool:
    """`attention_window_mgpu.FP8` for --fp8-window (read when the programs are traced)."""
    return shipped if args.fp8_window is None else args.fp8_window == "mgpu"


def cmd_bench(args) -> int:
    from qwen_jax.engine import bench
    if (args.model is None) == (args.synthetic is None):
        raise SystemExit("error: bench needs exactly one of --model DIR or --synthetic 27b")
    if args.drafter_bits and args.drafter is None:
        raise SystemExit("error: --drafter-bits quantizes a drafter: give --drafter")
    try:
        if args.streams is None:
            args.streams = "1,16" if args.synthetic else "1,2,4,8,16"
        streams = bench._parse_sizes(args.streams, "--streams")
        lengths = bench._parse_sizes(args.prompt_lengths, "--prompt-lengths") if args.prompt_lengths else ()
        draft_rows = bench._parse_sizes(args.draft_rows, "--draft-rows") if args.draft_rows else ()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    log = (lambda m: print(m, file=sys.stderr))
    if args.synthetic is not None:
        import time
        t0 = time.perf_counter()
        try:
            params, cfg = bench.synthetic_params(args.synthetic, dtype=args.dtype)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        log(f"synthetic {args.synthetic}: random weights built on the device in {time.perf_counter() - t0:.1f} s")
    else:
        ck = _checkpoint(args)
        params, cfg = ck.params, ck.config
    drafter = None
    if args.drafter is not None:
        import jax.numpy as jnp
        dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
        try:
            if args.drafter == "synthetic":
                import jax

                from qwen_jax.synthetic import synthetic_drafter
                from qwen_jax.checkpoint import quantize_drafter
                drafter = synthetic_drafter(cfg.text, jax.random.key(1), dtype=dtype)
                if args.drafter_bits:
                    drafter = (quantize_drafter(drafter[0], args.drafter_bits), drafter[1])
            else:
                from qwen_jax.checkpoint import load_dflash
                d = load_dflash(args.drafter, target=cfg.text, dtype=dtype, bits=args.drafter_bits)
                drafter = (d.params, d.config)
        except ValueError as e:
            raise SystemExit(f"error: --drafter: {e}") from None
    if not args.compile_timing and args.compile_cache:
        _cache(args)
    from pallas_kernels import attention_window_mgpu as awm, kv_quant, qmm, qmm_mgpu
    shipped_impl, shipped_decode = qmm.PROMPT_IMPL, qmm.DECODE_IMPL
    shipped_mgpu = qmm_mgpu.STAGES, qmm_mgpu.WIDE_ROWS
    shipped_layout = kv_quant.FP8_V_LAYOUT
    kv_quant.FP8_V_LAYOUT = args.fp8_v_layout or shipped_layout  # read when the pools are made
    shipped_window = awm.FP8
    awm.FP8 = _fp8_window(args, shipped_window)
    qmm.PROMPT_IMPL = args.qmm_prompt_impl or shipped_impl  # read when the prompt programs are traced
    qmm.DECODE_IMPL = args.qmm_decode_impl or shipped_decode  # ... and the decode ones
    qmm_mgpu.STAGES = args.mgpu_stages or qmm_mgpu.STAGES
    qmm_mgpu.WIDE_ROWS = args.mgpu_wide_rows or qmm_mgpu.WIDE_ROWS
    log(f"qmm prompt implementation: {qmm.PROMPT_IMPL}, decode: {qmm.decode_impl()}"
        + (f" (stages {qmm_mgpu.STAGES}, pieces of up to {qmm_mgpu.WIDE_ROWS} rows)"
           if qmm.decode_impl() == "mgpu" else ""))
    if args.kv_cache == "fp8":
        keys = kv_quant.FP8_V_LAYOUT == "keys"
        log(f"fp8 KV cache, V {'key-major' if keys else 'by rows'}, window pass 1 "
            f"{'Mosaic GPU e4m3' if awm.FP8 and keys else 'Triton'}")
    try:
        res = bench.run(params, cfg, backend=_backend(args), dtype=args.dtype, kv_cache=args.kv_cache,
                        streams=streams, prompt_lengths=lengths, context=args.context, rounds=args.rounds,
                        repeats=args.repeats,
                        max_chunk=args.max_chunk, compile_timing=args.compile_timing, warm=not args.no_warm,
                        logprobs=args.logprobs, progress=sys.stderr.isatty(), draft_rows=draft_rows,
                        drafter=drafter, draft_tree=args.draft_tree, log=log)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    finally:
        used, qmm.PROMPT_IMPL = qmm.PROMPT_IMPL, shipped_impl
        used_decode, qmm.DECODE_IMPL = qmm.decode_impl(), shipped_decode
        used_mgpu, (qmm_mgpu.STAGES, qmm_mgpu.WIDE_ROWS) = (qmm_mgpu.STAGES, qmm_mgpu.WIDE_ROWS), shipped_mgpu
        used_layout, kv_quant.FP8_V_LAYOUT = kv_quant.FP8_V_LAYOUT, shipped_layout
        used_window, awm.FP8 = ("mgpu" if awm.FP8 else "triton"), shipped_window
    fp8 = args.kv_cache == "fp8"
    print(json.dumps(dict(res.as_dict(), qmm_prompt_impl=used, qmm_decode_impl=used_decode,
                          mgpu_stages=used_mgpu[0], mgpu_wide_rows=used_mgpu[1],
                          fp8_v_layout=used_layout if fp8 else None, fp8_window=used_window if fp8 else None))
          if args.json
          else "\n".join(res.lines()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from qwen_jax.engine.engine import DEFAULT_CACHE_DIR
    p = argparse.ArgumentParser(prog="python -m qwen_jax", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp, *, model_required=True, context=True):
        sp.add_argument("--model", required=model_required, help="local checkpoint directory (HF safetensors or MLX)")
        sp.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="compute dtype (float32 = verification)")
        if context:
            sp.add_argument("--max-model-len", type=int, default=4096, help="context capacity to allocate")
        sp.add_argument("--no-kernels", action="store_true", help="plain-jnp references instead of Pallas kernels")

    def fp8_window(sp):
        sp.add_argument("--fp8-window", choices=("triton", "mgpu"), default=None,
                        help="an fp8 cache's window pass 1 (default: the shipped one, pallas_kernels/"
                             "attention_window_mgpu.py FP8): mgpu = the Mosaic GPU one with both MMAs on the e4m3 "
                             "codes, for V key-major (V by rows keeps Triton); the two differ in the last bits of "
                             "decode rows")

    def tensor_parallel(sp):
        sp.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                        help="split the text model's layers by head over the first N devices (model/parallel.py)")

    def cache(sp):
        sp.add_argument("--compile-cache", default=DEFAULT_CACHE_DIR,
                        help="persistent compilation cache dir ('' = off; env QWEN_JAX_CACHE_DIR)")

    lg = sub.add_parser("logits", help="logits at every position of --token-ids, saved as float32 [T, vocab]")
    common(lg)
    lg.add_argument("--token-ids", required=True, help="comma-separated token ids, e.g. 5,17,300")
    lg.add_argument("--out", required=True, help="output .npy path")
    lg.set_defaults(fn=cmd_logits)

    gen = sub.add_parser("generate", help="generate a continuation (on the engine)")
    common(gen)
    tensor_parallel(gen)
    cache(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text (through the checkpoint's chat template unless --raw)")
    src.add_argument("--token-ids", help="comma-separated prompt token ids (no template)")
    gen.add_argument("--raw", action="store_true", help="encode --prompt as is, without the chat template")
    gen.add_argument("--max-tokens", type=int, required=True)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="transformers'/vLLM's, over prompt and reply, in (0, 10] (1 = off)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json-schema", metavar="SCHEMA",
                     help="structured output: the reply is JSON following SCHEMA (a JSON Schema's text or a file "
                          "holding one; 'object': any JSON object), after the think block when the template opens one")
    gen.add_argument("--regex", metavar="PATTERN",
                     help="structured output: the whole reply matches PATTERN (qwen_jax.regex's syntax), after the "
                          "think block when the template opens one")
    gen.add_argument("--grammar", metavar="GBNF",
                     help="structured output: the reply is a text of the GBNF grammar's root rule (its text, or a "
                          "file holding it; qwen_jax.ebnf's syntax), after the think block when the template opens one")
    gen.add_argument("--json", action="store_true", help="print one JSON object with token_ids and text")
    gen.set_defaults(fn=cmd_generate)

    ev = sub.add_parser("eval", help="ppl (perplexity), kv (fp8 vs bf16 KV cache), drafts (drafted vs serial)")
    ev.add_argument("what", choices=("ppl", "kv", "drafts"))
    common(ev)
    tensor_parallel(ev)
    cache(ev)
    ev.add_argument("--text", help="UTF-8 text file, tokenized as is (kv: a built-in paragraph when omitted)")
    ev.add_argument("--context", type=int, default=0,
                    help="tokens per window, each scored from an empty cache (default --max-model-len)")
    ev.add_argument("--chunk", type=int, default=512, help="prompt rows per compiled call (multiple of 64)")
    ev.add_argument("--kv-cache", choices=("bf16", "fp8"), default="bf16", help="ppl: KV cache dtype")
    ev.add_argument("--path", choices=("prompt", "decode"), default="prompt",
                    help="kv: read the caches through prompt chunks, or through the decode path's verify windows "
                         "(chains of --window-rows teacher-forced tokens, each committed before the next)")
    ev.add_argument("--window-rows", type=int, default=16, help="kv --path decode: rows a verify window (1..16)")
    fp8_window(ev)
    ev.add_argument("--max-tokens", type=int, help="score at most this many tokens of the text")
    ev.add_argument("--drafter", metavar="DIR", help="drafts: a DFlash drafter dir (block drafts)")
    ev.add_argument("--drafter-bits", type=int, choices=(4, 8), default=None,
                    help="drafts: the drafter's dense projections quantized at load")
    ev.add_argument("--copy-drafts", action="store_true", help="drafts: copy drafts (n-gram lookup) instead")
    ev.add_argument("--prompts", type=int, default=8, help="drafts: prompts cut from --text at even offsets")
    ev.add_argument("--prompt-tokens", type=int, default=32, help="drafts: tokens a prompt")
    ev.add_argument("--gen-tokens", type=int, default=128, help="drafts: greedy tokens a reply (EOS ignored)")
    ev.add_argument("--streams", type=int, default=1, help="drafts: requests in flight at once")
    ev.add_argument("--draft-policy", choices=("adaptive", "always"), default="adaptive",
                    help="drafts: the rows of each window (qwen_jax/engine/policy.py)")
    ev.add_argument("--draft-costs", metavar="JSON|measure", default=None,
                    help='drafts: window costs in decode rounds for the adaptive policy, {"copy": {"2": 1.1, ...}, '
                         '"block": {...}, "tree": {...}}, or "measure" (the engine times its windows at start)')
    ev.add_argument("--draft-tree", type=int, default=0, metavar="K",
                    help="drafts, with --drafter: windows verify trees of the drafter's likeliest continuations, "
                         "up to K children a node (0: chains)")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.set_defaults(fn=cmd_eval)

    be = sub.add_parser("bench", help="prompt tok/s, decode forwards/s at 1..16 streams, compile time cold/warm")
    common(be, model_required=False, context=False)
    tensor_parallel(be)
    cache(be)
    be.add_argument("--synthetic", choices=("27b",), help="the model's shapes with random 4-bit weights built on "
                    "the device (no checkpoint)")
    be.add_argument("--streams", help="decode stream counts, comma-separated ('' = none; default 1,2,4,8,16, "
                    "and 1,16 with --synthetic)")
    be.add_argument("--prompt-lengths", default="4096,32768", help="prompt lengths to time ('' = none)")
    be.add_argument("--context", type=int, default=1024, help="cached tokens per stream while decoding")
    be.add_argument("--rounds", type=int, default=64, help="timed decode rounds per stream count")
    be.add_argument("--repeats", type=int, default=3,
                    help="times the decode rounds are timed per stream count (the median is reported, each one "
                         "beside it)")
    be.add_argument("--max-chunk", type=int, default=4096, help="prompt chunk rows")
    be.add_argument("--kv-cache", choices=("bf16", "fp8"), default="bf16")
    be.add_argument("--fp8-v-layout", choices=("rows", "keys"), default=None,
                    help="an fp8 cache's V layout: by rows, or key-major (default: the shipped one, "
                         "pallas_kernels/kv_quant.py FP8_V_LAYOUT; the same values and bits either way)")
    fp8_window(be)
    be.add_argument("--logprobs", type=int, default=0, help="top logprobs computed every round (the server's cost)")
    be.add_argument("--draft-rows", default="",
                    help="copy-draft chain windows to time, rows comma-separated (e.g. 2,4,8,16; at most 16): ms a "
                         "window (drafted, accepted and committed in one call; fetched one by one, then enqueued "
                         "back to back) at each stream count and --context, beside the decode round")
    be.add_argument("--drafter", metavar="DIR|synthetic", default=None,
                    help="time --draft-rows as DFlash block-draft windows instead: the drafter's next block made on "
                         "the device after each window (a drafter dir, or 'synthetic': random bf16 weights at the "
                         "27B drafter's shapes)")
    be.add_argument("--drafter-bits", type=int, choices=(4, 8), default=None,
                    help="with --drafter: its dense projections quantized at load (checkpoint.quantize_drafter)")
    be.add_argument("--draft-tree", type=int, default=0, metavar="K",
                    help="with --drafter: time tree windows of the drafter's likeliest continuations (up to K "
                         "children a node; --draft-rows rows), each row read through its own scratch pages")
    be.add_argument("--no-compile-timing", dest="compile_timing", action="store_false",
                    help="compile once with --compile-cache instead of timing cold and warm compiles")
    be.add_argument("--no-warm", action="store_true", help="time the cold compile only")
    be.add_argument("--qmm-prompt-impl", choices=("fused", "dequant"), default=None,
                    help="the quantized matmul's prompt implementation to time (default: the shipped one; "
                         "pallas_kernels/qmm.py PROMPT_IMPL). The two differ in the last bits of prompt rows")
    be.add_argument("--qmm-decode-impl", choices=("auto", "triton", "mgpu"), default=None,
                    help="the quantized matmul's decode implementation (default: the shipped one, pallas_kernels/"
                         "qmm.py DECODE_IMPL: auto = mgpu on a GPU, triton elsewhere; mgpu = the Mosaic GPU "
                         "kernel, GPU only). The two differ in the last bits of decode rows")
    be.add_argument("--mgpu-stages", type=int, choices=range(2, 9), metavar="{2..8}", default=None,
                    help="the Mosaic GPU decode kernel's pipeline stages (default: pallas_kernels/qmm_mgpu.py "
                         "STAGES; capped by shared memory at wide pieces). Same bits at every count")
    be.add_argument("--mgpu-wide-rows", type=int, choices=(16, 32, 64), default=None,
                    help="the Mosaic GPU decode kernel's widest piece of rows (default: qmm_mgpu.WIDE_ROWS; 16 = "
                         "16-row pieces only). Same bits at every height")
    be.add_argument("--json", action="store_true", help="print one JSON object")
    be.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
