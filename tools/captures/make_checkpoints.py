"""Build the tiny random HF checkpoints (bfloat16 safetensors) with transformers' own Qwen3.5 classes.

  tiny/             Qwen3_5ForConditionalGeneration (model_type qwen3_5: text + tiny vision tower), untied lm_head
  tiny-text-tied/   Qwen3_5ForCausalLM (model_type qwen3_5_text), tie_word_embeddings true (no lm_head tensor)

Every tensor is re-drawn from a seeded torch.Generator (HF's default init leaves norms at 0/1, dt_bias at 1 and
0.02-std weights, which would hide whole classes of loader bugs and give near-constant logits).

Usage: python make_checkpoints.py TOKENIZER_DIR CAPTURES_DIR
"""

import json
import math
import shutil
import sys
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

SEED_TINY = 0
SEED_TEXT_TIED = 1
FULL_ATTENTION_INTERVAL = 3
LM_HEAD_GAIN = 2.5  # logits ~ N(0, 2.5^2) at init: top-1 margins of O(1), no single token dominates

TOKEN_IDS = {
    "<|endoftext|>": 491,
    "<|im_end|>": 493,
    "<|vision_start|>": 496,
    "<|vision_end|>": 497,
    "<|image_pad|>": 498,
    "<|video_pad|>": 499,
}

TEXT_CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=6,
    full_attention_interval=FULL_ATTENTION_INTERVAL,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    # rotary_dim = 64 * 0.25 = 16, so mrope_section (frequency slots per T/H/W axis) must sum to 16 / 2 = 8;
    # [3, 3, 2] is the scaled-down analogue of the real [11, 11, 10] (which sums to 64 / 2 = 32). Interleaved, HF
    # gives frequency j to H if j % 3 == 1 and j < 3*3, to W if j % 3 == 2 and j < 3*2, else to T:
    # T {0, 3, 6}, H {1, 4, 7}, W {2, 5}.
    rope_parameters=dict(
        rope_type="default",
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        mrope_section=[3, 3, 2],
        mrope_interleaved=True,
    ),
    max_position_embeddings=4096,
    attention_bias=False,
    # Not fields of transformers' Qwen3_5TextConfig (it never reads them); kept because the real Qwen3.5
    # config.json carries them and a loader may look at them.
    attn_output_gate=True,
    mtp_num_hidden_layers=0,
    mtp_use_dedicated_embeddings=False,
    mamba_ssm_dtype="float32",
    eos_token_id=TOKEN_IDS["<|endoftext|>"],
)

VISION_CONFIG = dict(
    depth=2,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    hidden_act="gelu_pytorch_tanh",
    in_channels=3,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=128,
    num_position_embeddings=16,  # a 4x4 learned grid, bilinearly resampled to each image's patch grid
)

ZERO_CENTRED_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def _normal(shape, std: float, gen: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean


def redraw_parameters(model: torch.nn.Module, seed: int, tied: bool) -> None:
    """Overwrite every parameter in named_parameters() order from one generator (deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = TEXT_CONFIG["hidden_size"]
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            if name.endswith("embed_tokens.weight"):
                # Tied: the embedding is also the output head, so it takes the head's scale.
                value = _normal(shape, LM_HEAD_GAIN / math.sqrt(hidden) if tied else 1.0, gen)
            elif name == "lm_head.weight":
                value = _normal(shape, LM_HEAD_GAIN / math.sqrt(hidden), gen)
            elif name.endswith(ZERO_CENTRED_NORMS) or name.endswith("language_model.norm.weight") or name == (
                "model.norm.weight"
            ):
                # Qwen3_5RMSNorm computes x * (1 + w): stored weights near 0.
                value = _normal(shape, 0.2, gen)
            elif name.endswith("linear_attn.norm.weight"):
                # Qwen3_5RMSNormGated computes w * x: stored weights near 1 and never shifted by converters.
                value = _normal(shape, 0.2, gen, mean=1.0)
            elif name.endswith("A_log"):
                # A log-uniform in [0.01, 4]: per-token decay exp(-A softplus(.)) spans "forget at once" to memories
                # of ~100 tokens, so the long prompt's state really crosses 64-row chunks.
                value = torch.empty(shape).uniform_(math.log(0.01), math.log(4.0), generator=gen)
            elif name.endswith("dt_bias"):
                value = _normal(shape, 1.0, gen)
            elif name.endswith("conv1d.weight"):
                value = _normal(shape, 1.0 / math.sqrt(shape[-1]), gen)
            elif name.startswith("model.visual."):
                value = _vision_value(name, shape, gen)
            elif param.ndim == 2:
                value = _normal(shape, 1.0 / math.sqrt(shape[1]), gen)
            else:
                raise SystemExit(f"no init rule for {name} {shape}")
            param.copy_(value)


def _vision_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("pos_embed.weight"):
        return _normal(shape, 0.5, gen)
    if name.endswith("bias"):
        return _normal(shape, 0.1, gen)
    if ".norm" in name and len(shape) == 1:  # LayerNorm weights (norm1, norm2, merger.norm)
        return _normal(shape, 0.2, gen, mean=1.0)
    fan_in = math.prod(shape[1:])
    return _normal(shape, 1.0 / math.sqrt(fan_in), gen)


def write_generation_config(out: Path) -> None:
    # Same shape as Qwen's generation_config.json; the sampling fields are illustrative (the captures are greedy).
    GenerationConfig(
        do_sample=True,
        temperature=0.6,
        top_k=20,
        top_p=0.95,
        eos_token_id=[TOKEN_IDS["<|im_end|>"], TOKEN_IDS["<|endoftext|>"]],
        pad_token_id=TOKEN_IDS["<|endoftext|>"],
    ).save_pretrained(out)


def copy_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    for f in sorted(tokenizer_dir.iterdir()):
        shutil.copy(f, out / f.name)


def finish(model, out: Path, tokenizer_dir: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    model.to(torch.bfloat16).save_pretrained(out)
    write_generation_config(out)
    copy_tokenizer(tokenizer_dir, out)
    # transformers pops full_attention_interval into layer_types and does not save it; mlx-lm only reads the
    # interval (default 4), so without it the MLX port would put attention at layer 3 instead of 2 and 5.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    text = cfg.get("text_config", cfg)
    text["full_attention_interval"] = FULL_ATTENTION_INTERVAL
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build_tiny(tokenizer_dir: Path, out: Path) -> None:
    torch.manual_seed(SEED_TINY)
    config = Qwen3_5Config(
        text_config=dict(TEXT_CONFIG, tie_word_embeddings=False),
        vision_config=VISION_CONFIG,
        image_token_id=TOKEN_IDS["<|image_pad|>"],
        video_token_id=TOKEN_IDS["<|video_pad|>"],
        vision_start_token_id=TOKEN_IDS["<|vision_start|>"],
        vision_end_token_id=TOKEN_IDS["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = Qwen3_5ForConditionalGeneration(config)
    redraw_parameters(model, SEED_TINY, tied=False)
    finish(model, out, tokenizer_dir)


def build_text_tied(tokenizer_dir: Path, out: Path) -> None:
    torch.manual_seed(SEED_TEXT_TIED)
    config = Qwen3_5TextConfig(**dict(TEXT_CONFIG, tie_word_embeddings=True))
    model = Qwen3_5ForCausalLM(config)
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise SystemExit("lm_head is not tied to embed_tokens")
    redraw_parameters(model, SEED_TEXT_TIED, tied=True)
    finish(model, out, tokenizer_dir)


def main(tokenizer_dir: str, captures_dir: str) -> None:
    tok = Path(tokenizer_dir)
    root = Path(captures_dir)
    build_tiny(tok, root / "tiny")
    build_text_tied(tok, root / "tiny-text-tied")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
