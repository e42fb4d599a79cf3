"""A tiny random DFlash block drafter for captures/tiny and the z-lab reference's outputs on it.

  captures/tiny-dflash/             DFlashDraftModel (dflash 0.1.0, a Qwen3Config stack), bf16 safetensors
  captures/refs/dflash-tiny-f32.npz drafter and target both float32:
      direct.*   two drafter forwards in sequence over one DynamicCache, as dflash_generate makes them
      gen.{p}.*  dflash_generate, greedy, on each capture prompt: output, acceptance lengths, drafts per step

The drafter's math (DFlashDraftModel.forward, compute_logits, dflash_generate) is dflash's own; this script only
builds weights, feeds inputs and records. One thing is replaced: the target's cache. transformers 5.24 cannot roll a
Qwen3.5 target back: `DynamicCache.crop` crops the linear-attention layers' conv states but leaves their GDN recurrent
states as they are after the whole verified block, so dflash_generate with the HF cache is not lossless on this
target (on `short` its greedy output leaves plain greedy decoding at the 4th token). Here every target call instead
runs the HF model once without a cache over the committed tokens plus the call's new ones (`RecomputingTarget`), so
each verify step sees exactly the target's no-cache logits and hidden states; dflash_generate's own crops then only
shorten a token list. The capture records that the result equals plain greedy decoding (meta `checks`).

Usage: python make_dflash.py TARGET_DIR DRAFTER_DIR PROMPTS_JSON OUT_NPZ   (writes DRAFTER_DIR, then OUT_NPZ)
"""

import os

# Fixed thread counts before torch loads: reductions are then split the same way on every run.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from importlib.metadata import version  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from dflash import model as dflash_model  # noqa: E402
from dflash.model import (  # noqa: E402
    DFlashDraftModel,
    build_target_layer_ids,
    dflash_generate,
    extract_context_feature,
)
from transformers import DynamicCache, Qwen3Config  # noqa: E402

import refs_hf  # noqa: E402
from refs_common import load_prompts  # noqa: E402

SEED = 2
NUM_TARGET_LAYERS = 6
NUM_DRAFT_LAYERS = 2
BLOCK_SIZE = 4
MASK_TOKEN_ID = 500  # the first padding row of the tiny vocab: no text maps to it, as Qwen3.5's 248070 is unused
NEW_TOKENS = 24
DIRECT_PROMPT = "chat"
DIRECT_ACCEPTED = 3  # rows committed between the two direct calls: the anchor and two accepted drafts

DRAFT_CONFIG = dict(
    vocab_size=512,
    hidden_size=128,  # the target's hidden size: the drafter reads its embeddings and feeds its lm_head
    intermediate_size=256,
    num_hidden_layers=NUM_DRAFT_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7},
    max_position_embeddings=4096,
    attention_bias=False,
    tie_word_embeddings=False,
)
# Fields Qwen3Config does not declare; DFlashDraftModel reads them (dflash_config first, then the top level).
DFLASH_FIELDS = dict(
    architectures=["DFlashDraftModel"],
    num_target_layers=NUM_TARGET_LAYERS,
    block_size=BLOCK_SIZE,
    dflash_config={"mask_token_id": MASK_TOKEN_ID,
                   "target_layer_ids": build_target_layer_ids(NUM_TARGET_LAYERS, NUM_DRAFT_LAYERS)},
)
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "hidden_norm.weight")
QK_NORMS = ("q_norm.weight", "k_norm.weight")
QK_NORM_GAIN = 4.0
OUT_PROJS = ("o_proj.weight", "down_proj.weight")
OUT_PROJ_GAIN = 2.0


def draft_config() -> Qwen3Config:
    config = Qwen3Config(**DRAFT_CONFIG)
    for key, value in DFLASH_FIELDS.items():
        setattr(config, key, value)
    return config


def build_drafter(out: Path) -> None:
    """Seeded random weights, every tensor re-drawn in named_parameters() order, saved as bf16."""
    torch.manual_seed(SEED)
    model = DFlashDraftModel(draft_config())
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            if name.endswith(QK_NORMS):
                # Sharper attention: with q_norm/k_norm near 1 the block rows average the context into one
                # vector and the drafts hardly depend on it (a few distinct tokens a prompt).
                value = (torch.randn(shape, generator=gen) * 0.2 + 1.0) * QK_NORM_GAIN
            elif name.endswith(NORMS) or name == "norm.weight":
                # Qwen3RMSNorm computes w * x (not zero-centred): weights near 1, varied so a swapped or skipped
                # norm shows.
                value = torch.randn(shape, generator=gen) * 0.2 + 1.0
            elif param.ndim == 2:
                # Output projections at twice the 1/sqrt(fan_in) scale, so attention and MLP outweigh the block's
                # input embeddings (the target's, N(0, 1)) in the residual stream.
                gain = OUT_PROJ_GAIN if name.endswith(OUT_PROJS) else 1.0
                value = torch.randn(shape, generator=gen) * (gain / math.sqrt(shape[1]))
            else:
                raise SystemExit(f"no init rule for {name} {shape}")
            param.copy_(value)
    if out.exists():
        shutil.rmtree(out)
    model.to(torch.bfloat16).save_pretrained(out)
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()), indent=2, sort_keys=True) + "\n")


def load_drafter(drafter_dir: str) -> DFlashDraftModel:
    model = DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32)
    model.eval()
    return model


class TokenCache:
    """The target's "cache" under RecomputingTarget: the tokens fed so far. dflash_generate's crops shorten it."""

    def __init__(self):
        self.tokens: list[int] = []

    def get_seq_length(self) -> int:
        return len(self.tokens)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count, as DynamicCache.crop does")
        if tokens_to_remove:
            del self.tokens[tokens_to_remove:]

    def activate_past_recording(self) -> None:
        pass


class RecomputingTarget(torch.nn.Module):
    """The HF target as dflash_generate calls it, each call one no-cache forward over the whole committed prefix plus
    the new tokens, returning the new rows only (see the module docstring). Records every call's new tokens and
    first position (the prefill, then one block a step)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config
        self.lm_head = model.lm_head
        self.calls: list[tuple[int, list[int]]] = []

    @property
    def device(self):
        return torch.device("cpu")

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    @torch.no_grad()
    def forward(self, input_ids, position_ids, past_key_values, use_cache=True, logits_to_keep=0,
                output_hidden_states=False):
        cache = past_key_values
        if not isinstance(cache, TokenCache):
            raise TypeError("RecomputingTarget needs the TokenCache that make_cache gives it")
        new = input_ids[0].tolist()
        first = int(position_ids[0, 0])
        if first != cache.get_seq_length() or position_ids[0].tolist() != list(range(first, first + len(new))):
            raise RuntimeError(f"call at positions {position_ids[0].tolist()} after {cache.get_seq_length()} tokens")
        self.calls.append((first, new))
        cache.tokens.extend(new)
        out = self.model(input_ids=torch.tensor([cache.tokens]), use_cache=False,
                         output_hidden_states=output_hidden_states)
        n = len(new)
        logits = out.logits[:, -n:]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        hidden = tuple(h[:, -n:] for h in out.hidden_states) if output_hidden_states else None
        return SimpleNamespace(logits=logits, hidden_states=hidden)


def _margins(logits: torch.Tensor) -> np.ndarray:
    top2 = torch.topk(logits.float(), 2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]).numpy().astype(np.float32)


@torch.no_grad()
def target_features(target, ids: list[int], layer_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """One no-cache forward: (taps [T, n*H] = hidden_states[id + 1] concatenated, logits [T, V])."""
    out = target(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True)
    return extract_context_feature(out.hidden_states, layer_ids)[0].numpy(), out.logits[0].numpy()


@torch.no_grad()
def drafter_call(drafter, target, cache, features: np.ndarray, context_positions: list[int], block: list[int]):
    """One drafter forward as dflash_generate makes it: context rows then block rows, one DynamicCache, then the
    cache cropped to the block's start (its own K/V are never kept). -> (hidden [B, H], logits [B, V])."""
    noise = dflash_model._raw_input_embeddings(
        target, torch.tensor([block]), float(dflash_model._draft_value(drafter.config, "input_embedding_scale", 1.0)))
    start = context_positions[-1] + 1
    positions = torch.tensor([context_positions + list(range(start, start + len(block)))])
    hidden = drafter(target_hidden=torch.from_numpy(features)[None], noise_embedding=noise, position_ids=positions,
                     past_key_values=cache, use_cache=True)
    dflash_model._crop_to(cache, start)
    logits = drafter.compute_logits(hidden, dflash_model._output_head(target))
    return hidden[0].numpy(), logits[0].numpy()


def capture_direct(drafter, target, prompt_ids: list[int]) -> tuple[dict[str, np.ndarray], dict]:
    layer_ids = list(drafter.target_layer_ids)
    bs = drafter.block_size
    mask = int(drafter.mask_token_id)
    t = len(prompt_ids)
    feats, logits = target_features(target, prompt_ids, layer_ids)
    # The committed continuation is the target's own greedy one (no-cache argmax), as a verify would commit it.
    committed = list(prompt_ids)
    for _ in range(DIRECT_ACCEPTED + 1):
        committed.append(int(np.argmax(target_features(target, committed, layer_ids)[1][-1])))
    longer_feats, _ = target_features(target, committed[: t + DIRECT_ACCEPTED], layer_ids)

    cache = DynamicCache(config=drafter.config)
    cache.activate_past_recording()
    calls = [
        (feats, list(range(t)), [committed[t]] + [mask] * (bs - 1)),
        (longer_feats[t:], list(range(t, t + DIRECT_ACCEPTED)), [committed[t + DIRECT_ACCEPTED]] + [mask] * (bs - 1)),
    ]
    arrays = {"direct.prompt_ids": np.asarray(prompt_ids, np.int32)}
    checks = {}
    for i, (features, context_positions, block) in enumerate(calls, start=1):
        cache_len = cache.get_seq_length()
        hidden, block_logits = drafter_call(drafter, target, cache, features, context_positions, block)
        start = context_positions[-1] + 1
        key = f"direct.call{i}"
        arrays.update({
            f"{key}.cache_len": np.asarray(cache_len, np.int32),
            f"{key}.context_features": features.astype(np.float32),
            f"{key}.context_positions": np.asarray(context_positions, np.int32),
            f"{key}.block_ids": np.asarray(block, np.int32),
            f"{key}.block_positions": np.arange(start, start + bs, dtype=np.int32),
            f"{key}.hidden": hidden.astype(np.float32),
            f"{key}.logits": block_logits.astype(np.float32),
            f"{key}.draft_ids": np.argmax(block_logits[1:], axis=-1).astype(np.int32),
            f"{key}.draft_margin": _margins(torch.from_numpy(block_logits[1:])),
        })
        checks[key] = {"cache_len_after": cache.get_seq_length(), "logits_std": float(np.std(block_logits)),
                       "min_draft_margin": float(np.min(arrays[f"{key}.draft_margin"]))}
    arrays["direct.cache_k"] = np.stack([layer.keys[0].numpy() for layer in cache.layers]).astype(np.float32)
    arrays["direct.cache_v"] = np.stack([layer.values[0].numpy() for layer in cache.layers]).astype(np.float32)
    return arrays, checks


def capture_generate(drafter, target, name: str, prompt_ids: list[int]) -> tuple[dict[str, np.ndarray], dict]:
    bs = drafter.block_size
    recording = RecomputingTarget(target)
    margins: list[np.ndarray] = []
    compute_logits = drafter.compute_logits

    def recorded_logits(hidden, head):
        logits = compute_logits(hidden, head)
        margins.append(_margins(logits[0]))
        return logits

    drafter.compute_logits = recorded_logits
    make_cache = dflash_model._make_cache
    dflash_model._make_cache = lambda config: TokenCache() if config is target.config else make_cache(config)
    try:
        out = dflash_generate(drafter, recording, torch.tensor([prompt_ids]), NEW_TOKENS, None, temperature=0.0,
                              return_stats=True)
    finally:
        dflash_model._make_cache = make_cache
        del drafter.compute_logits
    gen = out.output_ids[0, len(prompt_ids):].tolist()
    steps = recording.calls[1:]  # the first call is the prefill
    if len(steps) != len(out.acceptance_lengths) or len(margins) != sum(len(b) > 1 for _, b in steps):
        raise RuntimeError(f"{name}: {len(steps)} verify calls, {len(out.acceptance_lengths)} acceptance lengths, "
                           f"{len(margins)} drafter calls")
    block_ids = np.full((len(steps), bs), -1, np.int32)
    draft_margin = np.full((len(steps), bs - 1), np.nan, np.float32)
    drafted = iter(margins)
    for i, (_, block) in enumerate(steps):
        block_ids[i, : len(block)] = block
        if len(block) > 1:
            draft_margin[i, : len(block) - 1] = next(drafted)
    prefix = f"gen.{name}"
    arrays = {
        f"{prefix}.prompt_ids": np.asarray(prompt_ids, np.int32),
        f"{prefix}.gen_ids": np.asarray(gen, np.int32),
        f"{prefix}.acceptance_lengths": np.asarray(out.acceptance_lengths, np.int32),
        f"{prefix}.block_start": np.asarray([first for first, _ in steps], np.int32),
        f"{prefix}.block_ids": block_ids,
        f"{prefix}.draft_margin": draft_margin,
    }
    accepted = [a - 1 for a in out.acceptance_lengths]
    checks = {"steps": len(steps), "accepted_drafts": int(sum(accepted)), "max_acceptance": max(out.acceptance_lengths),
              "min_draft_margin": float(np.nanmin(draft_margin)) if np.isfinite(draft_margin).any() else None,
              "distinct_drafts": len({int(x) for x in block_ids[:, 1:].ravel() if x >= 0})}
    return arrays, checks


def plain_greedy(target, prompt_ids: list[int]) -> list[int]:
    """Greedy decoding with one no-cache forward a token: what a lossless dflash_generate must reproduce."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(torch.argmax(target(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1])))
    return ids[len(prompt_ids):]


def setup_determinism() -> None:
    """refs_hf's settings; torch refuses to set the interop threads twice, so a second capture in one process (check.py
    runs refs_hf first) only confirms them."""
    if torch.get_num_interop_threads() == 1 and torch.are_deterministic_algorithms_enabled():
        torch.manual_seed(0)
        torch.set_num_threads(1)
    else:
        refs_hf.setup_determinism()


def capture(target_dir: str, drafter_dir: str, prompts_json: str, out_npz: str, only: list[str] | None = None
            ) -> dict[str, np.ndarray]:
    setup_determinism()
    target, arch = refs_hf.load_model(target_dir, torch.float32)
    drafter = load_drafter(drafter_dir)
    # dflash_generate times itself with torch.cuda.synchronize when asked for its stats (acceptance lengths);
    # this is the CPU build.
    dflash_model._cuda_time = time.perf_counter
    prompts = load_prompts(prompts_json)
    meta = {
        "tool": "dflash",
        "versions": {
            "dflash": version("dflash"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "target_dir": os.path.basename(os.path.normpath(target_dir)),
        "target_architecture": arch,
        "drafter_dir": os.path.basename(os.path.normpath(drafter_dir)),
        "dtype": "float32",
        "precision": "target and drafter weights upcast bf16 -> float32 (exact); everything in float32; target "
                     "attention eager, drafter attention torch sdpa (dflash's choice)",
        "block_size": drafter.block_size,
        "mask_token_id": int(drafter.mask_token_id),
        "target_layer_ids": list(drafter.target_layer_ids),
        "new_tokens": NEW_TOKENS,
        "direct_prompt": DIRECT_PROMPT,
        "direct_accepted": DIRECT_ACCEPTED,
        "target_cache": "RecomputingTarget: each target call is one no-cache forward over the committed tokens and "
                        "the new ones (HF's DynamicCache cannot roll back GDN states; see make_dflash.py)",
        "torch_threads": 1,
        "checks": {},
    }
    arrays: dict[str, np.ndarray] = {}
    if only is None or DIRECT_PROMPT in only:
        direct, checks = capture_direct(drafter, target, prompts[DIRECT_PROMPT]["ids"])
        arrays.update(direct)
        meta["checks"]["direct"] = checks
        print(f"  direct ({DIRECT_PROMPT}): {checks}")
    for name, prompt in prompts.items():
        if only is not None and name not in only:
            continue
        gen, checks = capture_generate(drafter, target, name, prompt["ids"])
        checks["equals_plain_greedy"] = gen[f"gen.{name}.gen_ids"].tolist() == plain_greedy(target, prompt["ids"])
        if not checks["equals_plain_greedy"]:
            raise RuntimeError(f"{name}: dflash_generate's greedy output differs from plain greedy decoding")
        arrays.update(gen)
        meta["checks"][f"gen.{name}"] = checks
        print(f"  gen {name}: {checks}")
    arrays["meta"] = np.asarray(json.dumps(meta, sort_keys=True))
    if out_npz:
        np.savez_compressed(out_npz, **arrays)
    return arrays


def main(target_dir: str, drafter_dir: str, prompts_json: str, out_npz: str) -> None:
    build_drafter(Path(drafter_dir))
    print(f"dflash {drafter_dir} on {target_dir} -> {out_npz}")
    capture(target_dir, drafter_dir, prompts_json, out_npz)


if __name__ == "__main__":
    main(*sys.argv[1:5])
