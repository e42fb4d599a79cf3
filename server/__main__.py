"""`python -m server`: the OpenAI-compatible HTTP server (uvicorn) over the qwen-jax engine.

With no --model it serves the embedded default, captures/tiny: a tiny qwen3_5 checkpoint with RANDOM weights,
for smoke tests; it answers quickly on any machine, and its text is gibberish.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from server.loading import DECODE_KERNELS, EMBEDDED_MODEL, REPO_ROOT, SHAPES

API_KEY_ENV = "QWEN_JAX_API_KEY"


def _int_at_least(lo: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {value}")
        return value
    return parse


_positive = _int_at_least(1, "positive")
_non_negative = _int_at_least(0, "non-negative")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (OpenAI's Responses "
               "API), POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), GET /v1/models, "
               "POST /tokenize, POST /detokenize, POST /reset_prefix_cache, GET /health, GET /metrics, "
               "GET /version. Sampling fields a request leaves out "
               "take the checkpoint's generation_config.json values (else temperature 1.0, top_p 1, no top_k).")
    m = p.add_argument_group("model")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", default=None,
                     help="local checkpoint directory (HF safetensors or MLX conversion). Default: the embedded "
                          f"tiny random model at {EMBEDDED_MODEL.relative_to(REPO_ROOT)} (smoke tests only: its "
                          "text is gibberish)")
    src.add_argument("--synthetic", choices=("27b",), default=None,
                     help="random 4-bit weights at a model's shapes, built on the device, for benchmarks without "
                          "the checkpoint; no tokenizer, so only token-id prompts on /v1/completions")
    m.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the model id clients send and /v1/models lists (default: the engine's model name)")
    m.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="compute dtype (float32 = verification runs)")
    m.add_argument("--kv-cache", choices=("bf16", "fp8"), default="bf16", help="KV cache storage (fp8 = e4m3)")
    m.add_argument("--max-model-len", type=_positive, default=4096, metavar="N",
                   help="context length served: prompt + completion tokens per request (default 4096)")
    m.add_argument("--max-logprobs", type=int, default=20, metavar="N",
                   help="most top logprobs a request may ask for (default 20; 0 turns logprobs off and skips "
                        "their computation in every round)")
    m.add_argument("--no-vision", action="store_true",
                   help="do not load the checkpoint's vision tower: image_url parts are refused (a checkpoint "
                        "without a tower, such as an mlx-lm conversion, refuses them anyway)")
    m.add_argument("--no-kernels", action="store_true",
                   help="plain-jnp reference ops instead of the Pallas kernels (the default on CPU anyway)")
    m.add_argument("--tensor-parallel-size", "-tp", type=_positive, default=1, metavar="N",
                   help="split the text model's layers by head over the first N devices (default 1): each device "
                        "holds 1/N of every layer's weights and KV / GDN state; replies are exact under N (concurrent "
                        "= solo, drafted = serial) and may differ from one device's where two tokens nearly tie")
    d = m.add_mutually_exclusive_group()
    d.add_argument("--drafter", metavar="DIR", default=None,
                   help="a DFlash block drafter checkpoint dir for the model (z-lab DFlashDraftModel; bf16 or MLX "
                        "quantized): each round every stream verifies the drafter's next block as a chain window, "
                        "each row computed as the serial step at its position, so replies equal serial decoding's; "
                        "needs the row-invariant kernels, so refused with --no-kernels or on the CPU"),
    d.add_argument("--no-drafts", action="store_true",
                   help="serial decoding only (the default for now; accepted so scripts can pin it)")
    d.add_argument("--copy-drafts", action="store_true",
                   help="copy drafts (off by default): a stream whose last tokens repeat an earlier stretch of its "
                        "prompt or reply verifies the tokens that followed it in one forward, each row computed as "
                        "the serial step at its position (replies equal serial decoding's; not yet faster on the "
                        "27B, see BENCHMARKS.md); needs the row-invariant kernels, so refused with --no-kernels or "
                        "on the CPU")

    m.add_argument("--draft-policy", choices=("adaptive", "always"), default="adaptive",
                   help="the rows of a drafting stream's windows: 'adaptive' (default) from what its windows kept and "
                        "what a window costs (copy drafts that do not pay give way to serial rounds, with a short "
                        "window now and then to check again), 'always' the most the round allows; either way "
                        "replies equal serial decoding's")
    m.add_argument("--draft-tree", type=int, default=0, metavar="K",
                   help="with --drafter: verify each window as a tree of the drafter's likeliest continuations, each "
                        "node with up to K children (1..8; 0, the default: a chain of its argmax). The tree has as "
                        "many rows as a window may (--draft-rows's 16 for one stream), each computed as the serial "
                        "step at its position, so replies equal serial decoding's")
    m.add_argument("--drafter-bits", type=int, choices=(4, 8), default=None,
                   help="with --drafter: quantize the drafter's dense projections at load (MLX affine, group 64, bf16 "
                        "factors), so its matmuls read a quarter (4) or half (8) of the bytes; changes the drafts, "
                        "never a reply (on the demo's trained drafter 8 bits kept its acceptance, 4 bits lost two "
                        "thirds of it: docs/drafting.md)")
    m.add_argument("--draft-costs", metavar="JSON|measure", default=None,
                   help='what a window costs in decode rounds, for --draft-policy adaptive: {"copy": {"2": 1.15, '
                        '"4": 1.19, ...}, "block": {...}, "tree": {...}} (default: an H100\'s at the 27B\'s shapes; '
                        'measure with `python -m qwen_jax bench --draft-rows`), or "measure": time this model\'s '
                        'windows on this machine at start-up (five timings of each row bucket and of the decode '
                        'round, each at least 8 calls and ~50 ms)')

    s = p.add_argument_group("scheduling")
    s.add_argument("--parallel", type=_positive, default=16, metavar="N",
                   help="streams decoded together in one round (default 16)")
    s.add_argument("--shapes", choices=tuple(SHAPES), default="auto",
                   help="compiled shapes: 'fixed' decodes every stream in one --parallel-stream program and runs "
                        "prompts one per forward; 'batched' adds 1, 2, 4, ... stream programs (a lone stream does "
                        "not pay for idle ones) and packs concurrent prompts, and needs the row-invariant kernels "
                        "(refused with --no-kernels); 'auto' (default) is the engine's choice (batched where the "
                        "kernels make rows independent of the batch)")
    s.add_argument("--decode-kernel", choices=DECODE_KERNELS, default="auto",
                   help="quantized matmul kernel for decode rows: 'auto' (default) is the Mosaic GPU kernel on a GPU "
                        "(fastest decode; compiled again at every start), 'triton' the Triton kernel (starts faster "
                        "from the compilation cache), 'mgpu' the Mosaic GPU kernel (GPU only)")
    s.add_argument("--chunked-prefill-size", type=_positive, default=4096, metavar="N",
                   help="the largest prompt chunk: rows of one prompt in one call (default 4096; a multiple of 64). "
                        "Smaller compiles fewer prompt programs and bounds a call's activations")
    s.add_argument("--prompt-cache", type=_non_negative, default=4, metavar="N",
                   help="prompt states kept for reuse (default 4; 0 = off): a prompt that extends a kept one (a "
                        "shared system prompt, an earlier turn) runs only its rest, with the same reply bits as run "
                        "whole. Each keeps one GDN state slot and shares KV pages until a request needs them; "
                        "usage.prompt_tokens_details.cached_tokens says how many tokens were resumed")
    s.add_argument("--max-queued", type=_positive, default=64, metavar="N",
                   help="requests allowed to wait for admission; beyond it requests get 503 + Retry-After "
                        "(default 64)")
    s.add_argument("--max-tokens", type=_positive, default=None, metavar="N",
                   help="completion budget of a chat request that sets no max_tokens (default: the rest of the "
                        "context). /v1/completions keeps OpenAI's default of 16")

    c = p.add_argument_group("chat")
    c.add_argument("--reasoning-parser", choices=("auto", "none", "qwen3"), default="auto",
                   help="split a chat reply's think block into the message's `reasoning_content` and `reasoning` "
                        "(both names; the answer after `</think>` is `content`): 'qwen3' for Qwen's <think> blocks, "
                        "'none' leaves the text whole in `content`, 'auto' (default) is qwen3 when the checkpoint's "
                        "chat template writes think blocks. Tool calls are parsed whenever a request sends `tools`")
    c.add_argument("--default-chat-template-kwargs", metavar="JSON", default=None,
                   help="template variables every chat request gets unless it sets them in its own "
                        "`chat_template_kwargs`, e.g. '{\"enable_thinking\": false}' (Qwen3.5 without thinking)")

    h = p.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; 0.0.0.0 exposes it)")
    h.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    h.add_argument("--api-key", metavar="KEY", default=None,
                   help=f"require `Authorization: Bearer KEY` on the API routes (default: env {API_KEY_ENV}; "
                        "unset = open). /health, /metrics and /version stay open for probes and scrapers")
    h.add_argument("--max-request-bytes", type=_positive, default=32 * 1024 * 1024, metavar="N",
                   help="largest request body accepted, checked before parsing (default 32 MiB); larger gets 413")
    h.add_argument("--responses-store", type=_non_negative, default=256, metavar="N",
                   help="how many /v1/responses replies to keep in memory for GET, input_items and "
                        "previous_response_id (default 256; the oldest goes first; 0 stores none)")
    h.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    h.add_argument("--no-progress", action="store_true", help="no progress bars while loading and compiling")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if not 0 <= args.max_logprobs <= 20:
        print("error: --max-logprobs must be in [0, 20]", file=sys.stderr)
        return 2
    for flag, path in (("--model", args.model), ("--drafter", args.drafter)):
        if path is not None and not Path(path).is_dir():
            print(f"error: {flag} {path}: not a directory", file=sys.stderr)
            return 2
    if args.draft_tree and args.drafter is None:
        print("error: --draft-tree: tree windows draft from a DFlash drafter (--drafter DIR)", file=sys.stderr)
        return 2
    if args.drafter_bits and args.drafter is None:
        print("error: --drafter-bits quantizes a drafter: give --drafter DIR", file=sys.stderr)
        return 2
    if args.drafter is not None and args.synthetic is not None:
        print("error: --drafter: a drafter needs a checkpoint's model, not --synthetic", file=sys.stderr)
        return 2
    template_kwargs = {}
    if args.default_chat_template_kwargs is not None:
        from server.serving import check_template_kwargs
        try:
            template_kwargs = check_template_kwargs(json.loads(args.default_chat_template_kwargs))
        except json.JSONDecodeError as e:
            print(f"error: --default-chat-template-kwargs: not JSON ({e})", file=sys.stderr)
            return 2
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from server.app import build_app
    from server.loading import build_engine
    from server.serving import Serving

    try:
        loaded = build_engine(model=args.model, synthetic=args.synthetic, dtype=args.dtype, kv_cache=args.kv_cache,
                              max_model_len=args.max_model_len, parallel=args.parallel, max_queued=args.max_queued,
                              no_kernels=args.no_kernels, max_logprobs=args.max_logprobs,
                              progress=not args.no_progress, shapes=args.shapes, decode_kernel=args.decode_kernel,
                              copy_drafts=args.copy_drafts, drafter=args.drafter, prompt_cache=args.prompt_cache,
                              vision=not args.no_vision, draft_policy=args.draft_policy,
                              draft_costs=args.draft_costs, draft_tree=args.draft_tree,
                              drafter_bits=args.drafter_bits, tensor_parallel=args.tensor_parallel_size,
                              chunked_prefill_size=args.chunked_prefill_size)
    except ValueError as e:  # checkpoint and config errors are ValueErrors with a message for the user
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = loaded.engine
    engine.start()
    serving = Serving(engine, served_model_name=args.served_model_name or engine.model_name,
                      model_root=loaded.model_root, defaults=loaded.defaults, default_max_tokens=args.max_tokens,
                      reasoning_parser=args.reasoning_parser, default_template_kwargs=template_kwargs)
    app = build_app(serving, api_key=api_key, max_body_bytes=args.max_request_bytes,
                    responses_store=args.responses_store)
    log = logging.getLogger("server")
    from pallas_kernels import qmm
    log.info("serving %s as %r on http://%s:%d (max_model_len %d, parallel %d, %s shapes, decode kernel %s, "
             "reasoning parser %s, api key %s)", loaded.model_root, serving.model_name, args.host, args.port,
             serving.max_model_len, args.parallel, engine.shape_policy,
             qmm.decode_impl() if engine.backend.kernels else "none (jnp)", serving.reasoning_parser,
             "required" if api_key else "off")
    try:
        # Streams still open at shutdown are cut after a few seconds; their requests are cancelled as they close.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                    access_log=args.log_level == "debug")
    finally:
        serving.close()
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
