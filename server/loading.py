"""Building the engine the server (and `server.bench --engine`) runs: from a checkpoint dir, or from random weights
at a named shape (`--synthetic 27b`, for benchmarks on a GPU without the checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
EMBEDDED_MODEL = REPO_ROOT / "captures" / "tiny"


# `--shapes`: which compiled shapes serve the streams. "fixed": one decode program of `--parallel` streams and
# one-lane prompt chunks, whatever the load; "batched": power-of-two decode buckets (a lone stream runs in a
# 1-stream program) and several prompts packed in one forward, exact only where every row is computed
# independently of the rows beside it (the Pallas kernels on quantized weights); "auto": the engine's default
# (qwen_jax.programs.default_buckets).
SHAPES = {"auto": None, "fixed": True, "batched": False}


# `--decode-kernel`: the quantized matmul kernel of decode and verify rows (pallas_kernels/qmm.py DECODE_IMPL).
# "auto": the Mosaic GPU kernel on a GPU (faster decode: 88 vs 83 forwards/s on the 27B, H200), "triton": the Triton
# tiles (its programs load from the compilation cache in seconds, where the Mosaic GPU kernels are compiled again
# at every start). One kernel for the whole process, so replies stay exact across batching and drafting. The
# names are qmm.DECODE_IMPLS, spelt out here so that parsing the flags imports no jax (a test keeps them equal).
DECODE_KERNELS = ("auto", "triton", "mgpu")


def set_decode_kernel(name: str) -> str:
    """Set qmm.DECODE_IMPL for this process; -> the kernel decode rows will use. ValueError naming the flag for an
    unknown name, or for mgpu where no GPU is."""
    import jax

    from pallas_kernels import qmm
    if name not in qmm.DECODE_IMPLS:
        raise ValueError(f"--decode-kernel {name!r}: must be one of {', '.join(DECODE_KERNELS)}")
    if name == "mgpu" and jax.default_backend() != "gpu":
        raise ValueError(f"--decode-kernel mgpu needs a GPU (the JAX backend here is {jax.default_backend()})")
    qmm.DECODE_IMPL = name
    return qmm.decode_impl()


def fixed_shapes(shapes: str) -> bool | None:
    if shapes not in SHAPES:
        raise ValueError(f"--shapes {shapes!r}: must be one of {', '.join(SHAPES)}")
    return SHAPES[shapes]


@dataclass
class Loaded:
    engine: object
    model_root: str  # what /v1/models reports as `root`
    defaults: object  # serving.GenerationDefaults


def build_engine(*, model: str | None, synthetic: str | None, dtype: str, kv_cache: str, max_model_len: int,
                 parallel: int, max_queued: int, no_kernels: bool, max_logprobs: int, progress: bool,
                 shapes: str = "auto", decode_kernel: str = "auto", copy_drafts: bool = False,
                 drafter: str | None = None, prompt_cache: int = 0, vision: bool = True,
                 draft_policy: str = "adaptive", draft_costs: str | None = None, draft_tree: int = 0,
                 drafter_bits: int | None = None, tensor_parallel: int = 1,
                 chunked_prefill_size: int = 4096) -> Loaded:
    """Raises ValueError with a message for the user (bad dir, bad config, bad shape name, `--shapes batched`
    where rows are not computed independently of the batch, a decode kernel this machine lacks). shapes: "auto",
    "fixed" or "batched" (SHAPES); decode_kernel: DECODE_KERNELS; drafter: a DFlash drafter dir (block drafts);
    chunked_prefill_size: the largest prompt chunk (rows of one prompt in one call; a multiple of 64)."""
    if isinstance(chunked_prefill_size, bool) or not isinstance(chunked_prefill_size, int) \
            or chunked_prefill_size < 64 or chunked_prefill_size % 64:
        raise ValueError(f"--chunked-prefill-size {chunked_prefill_size}: must be a multiple of 64 (the prompt "
                         "chunks' grid of positions), at least 64")
    set_decode_kernel(decode_kernel)
    from qwen_jax.engine.engine import DEFAULT_CACHE_DIR, Engine
    from qwen_jax.model import Backend
    from server.serving import GenerationDefaults, load_generation_defaults
    from qwen_jax.engine.policy import DraftPolicy
    backend = Backend(kernels=False) if no_kernels else None
    common = dict(dtype=dtype, kv_cache=kv_cache, max_model_len=max_model_len, parallel=parallel,
                  max_queued=max_queued, backend=backend, progress=progress, max_logprobs=max_logprobs,
                  fixed_shapes=fixed_shapes(shapes), copy_drafts=copy_drafts, prompt_cache=prompt_cache,
                  draft_policy=DraftPolicy.parse(draft_policy, draft_costs), tensor_parallel=tensor_parallel,
                  max_prefill_chunk=chunked_prefill_size)
    if synthetic is not None:
        from qwen_jax import programs
        from qwen_jax.engine.bench import synthetic_params
        programs.enable_compilation_cache(DEFAULT_CACHE_DIR)
        params, cfg = synthetic_params(synthetic, dtype=dtype)
        # No tokenizer: replies carry token ids and empty text; chat and string prompts get a 400 saying so.
        engine = Engine(params, cfg, None, model_name=f"synthetic-{synthetic}", **common)
        return Loaded(engine, f"synthetic:{synthetic}", GenerationDefaults())
    model_dir = Path(model) if model is not None else EMBEDDED_MODEL
    if not model_dir.is_dir():
        raise ValueError(f"--model {model_dir}: not a directory")
    defaults = load_generation_defaults(model_dir)
    tree = dict(draft_tree=draft_tree) if draft_tree else {}
    engine = Engine.from_checkpoint(str(model_dir), drafter=drafter, vision=vision, drafter_bits=drafter_bits,
                                    **tree, **common)
    return Loaded(engine, str(model_dir), defaults)
