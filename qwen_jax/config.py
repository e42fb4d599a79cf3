"""One frozen, hashable model config read from a checkpoint dir's `config.json` (static under jit).

Accepted: HF `Qwen3_5ForConditionalGeneration` (`model_type` `qwen3_5`, fields under `text_config`),
`Qwen3_5ForCausalLM` (`qwen3_5_text`, fields at the top level), and MLX conversions of either (the same fields
plus a `quantization` / `quantization_config` block with per-module overrides). Also the config of a z-lab DFlash
block drafter (`DFlashConfig`, `load_dflash_config`), the vision tower's (`VisionConfig`, from `vision_config`; None
for checkpoints without a tower) and the image processor's (`ImageProcessorConfig`, from `preprocessor_config.json`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

MULTIMODAL_TYPES = ("qwen3_5",)
TEXT_TYPES = ("qwen3_5_text",)
LAYER_GDN = "linear_attention"
LAYER_ATTN = "full_attention"


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    bits: int
    group_size: int
    mode: str = "affine"


class QuantLookup:
    """`quant_for` over a config's `quantization` block and its per-module `quant_overrides`."""
    quantization: QuantConfig | None
    quant_overrides: tuple[tuple[str, QuantConfig | None], ...]

    def quant_for(self, module_path: str) -> QuantConfig | None:
        """Quantization params of a module: its per-path override if any, else the global block."""
        for path, q in self.quant_overrides:
            if path == module_path:
                return q
        return self.quantization


@dataclasses.dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    attn_output_gate: bool = True

    # Derived sizes (27B: key_dim 2048, value_dim 6144, conv_dim 10240, rotary_dim 64).
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LAYER_GDN)

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LAYER_ATTN)


@dataclasses.dataclass(frozen=True)
class ModelConfig(QuantLookup):
    text: TextConfig
    model_type: str
    architecture: str
    quantization: QuantConfig | None = None
    # (module path, QuantConfig or None for "not quantized") pairs from the quantization block.
    quant_overrides: tuple[tuple[str, QuantConfig | None], ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    # The vision tower's config as sorted JSON (hashable); None when the checkpoint has no tower.
    vision_config_json: str | None = None
    # The same, parsed and checked (`parse_vision_config`); None without a tower (mlx-lm conversions, qwen3_5_text).
    vision: VisionConfig | None = None

    @property
    def vision_config(self) -> dict[str, Any] | None:
        return None if self.vision_config_json is None else json.loads(self.vision_config_json)


class ConfigError(ValueError):
    pass


def _need(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"config.json: missing `{key}` in {where}")
    return d[key]


def _int(d: dict[str, Any], key: str, where: str) -> int:
    v = _need(d, key, where)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"config.json: `{key}` in {where} must be a positive integer, got {v!r}")
    return v


def _quant_block(raw: dict[str, Any]) -> tuple[QuantConfig | None, tuple[tuple[str, QuantConfig | None], ...]]:
    block = raw.get("quantization", raw.get("quantization_config"))
    if block is None:
        return None, ()
    if not isinstance(block, dict):
        raise ConfigError(f"config.json: `quantization` must be an object, got {block!r}")
    mode = block.get("mode", "affine")
    if mode != "affine":
        raise ConfigError(f"config.json: quantization mode {mode!r} is not supported (only MLX 'affine')")
    glob = None
    if "bits" in block or "group_size" in block:
        glob = QuantConfig(int(_need(block, "bits", "quantization")), int(_need(block, "group_size", "quantization")))
    overrides = []
    for key, val in block.items():
        if isinstance(val, dict):
            overrides.append((key, QuantConfig(int(val.get("bits", glob.bits if glob else 0)),
                                               int(val.get("group_size", glob.group_size if glob else 0)),
                                               val.get("mode", "affine"))))
        elif val is False:
            overrides.append((key, None))
    return glob, tuple(sorted(overrides))


def _as_ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


def parse_text_config(t: dict[str, Any], where: str = "text_config") -> TextConfig:
    n_layers = _int(t, "num_hidden_layers", where)
    layer_types = t.get("layer_types")
    if layer_types is None:
        interval = int(t.get("full_attention_interval", 4))
        layer_types = [LAYER_ATTN if (i + 1) % interval == 0 else LAYER_GDN for i in range(n_layers)]
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers:
        raise ConfigError(f"config.json: `layer_types` has {len(layer_types)} entries but num_hidden_layers is {n_layers}")
    bad = sorted(set(layer_types) - {LAYER_GDN, LAYER_ATTN})
    if bad:
        raise ConfigError(f"config.json: unknown layer types {bad} (expected {LAYER_GDN!r} or {LAYER_ATTN!r})")
    rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
    rope_theta = float(rope.get("rope_theta", t.get("rope_theta", 1e7)))
    prf = float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25)))
    mrope_section = tuple(int(x) for x in rope.get("mrope_section", (11, 11, 10)))
    cfg = TextConfig(
        vocab_size=_int(t, "vocab_size", where),
        hidden_size=_int(t, "hidden_size", where),
        intermediate_size=_int(t, "intermediate_size", where),
        num_layers=n_layers,
        layer_types=layer_types,
        num_heads=_int(t, "num_attention_heads", where),
        num_kv_heads=_int(t, "num_key_value_heads", where),
        head_dim=int(t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]),
        linear_num_key_heads=_int(t, "linear_num_key_heads", where),
        linear_num_value_heads=_int(t, "linear_num_value_heads", where),
        linear_key_head_dim=_int(t, "linear_key_head_dim", where),
        linear_value_head_dim=_int(t, "linear_value_head_dim", where),
        linear_conv_kernel_dim=_int(t, "linear_conv_kernel_dim", where),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        partial_rotary_factor=prf,
        mrope_section=mrope_section,
        mrope_interleaved=bool(rope.get("mrope_interleaved", t.get("mrope_interleaved", True))),
        tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
        max_position_embeddings=int(t.get("max_position_embeddings", 262144)),
        attn_output_gate=bool(t.get("attn_output_gate", True)),
    )
    _check_shapes(cfg)
    return cfg


def _check_shapes(c: TextConfig) -> None:
    problems = []
    if c.num_heads % c.num_kv_heads:
        problems.append(f"num_attention_heads {c.num_heads} is not a multiple of num_key_value_heads {c.num_kv_heads}")
    if c.linear_num_value_heads % c.linear_num_key_heads:
        problems.append(f"linear_num_value_heads {c.linear_num_value_heads} is not a multiple of "
                        f"linear_num_key_heads {c.linear_num_key_heads}")
    rd = c.rotary_dim
    if rd <= 0 or rd > c.head_dim or rd % 2:
        problems.append(f"rotary dim {rd} (head_dim {c.head_dim} x partial_rotary_factor {c.partial_rotary_factor}) "
                        "must be even and within head_dim")
    elif not c.mrope_interleaved and sum(c.mrope_section) != rd // 2:
        # Contiguous sections split the rotary frequencies; the interleaved layout only indexes them.
        problems.append(f"mrope_section {list(c.mrope_section)} sums to {sum(c.mrope_section)}, expected rotary_dim/2 = {rd // 2}")
    if not c.attn_output_gate:
        problems.append("attn_output_gate false is not a qwen3_5 layout")
    if problems:
        raise ConfigError("config.json: inconsistent shapes: " + "; ".join(problems))


def parse_config(raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type in MULTIMODAL_TYPES:
        text_raw = raw.get("text_config")
        if not isinstance(text_raw, dict):
            raise ConfigError("config.json: model_type 'qwen3_5' needs a `text_config` object")
        text_raw = dict(text_raw)
        # Some conversions keep tie_word_embeddings at the top level only.
        if "tie_word_embeddings" not in text_raw and "tie_word_embeddings" in raw:
            text_raw["tie_word_embeddings"] = raw["tie_word_embeddings"]
        where = "text_config"
    elif model_type in TEXT_TYPES:
        text_raw, where = raw, "the top level"
    else:
        raise ConfigError(f"config.json: model_type {model_type!r} is not supported "
                          f"(expected one of {MULTIMODAL_TYPES + TEXT_TYPES})")
    text = parse_text_config(text_raw, where)
    quant, overrides = _quant_block(raw)
    eos = list(_as_ids(raw.get("eos_token_id"))) + list(_as_ids(text_raw.get("eos_token_id")))
    if generation_config:
        eos = list(_as_ids(generation_config.get("eos_token_id"))) + eos
    eos_unique = tuple(dict.fromkeys(eos))
    vision = raw.get("vision_config")
    vision_cfg = None
    if isinstance(vision, dict):
        vision_cfg = parse_vision_config(vision, text)
        _check_vision_tokens(raw, text)
    archs = raw.get("architectures") or []
    return ModelConfig(
        text=text,
        model_type=model_type,
        architecture=archs[0] if archs else "",
        quantization=quant,
        quant_overrides=overrides,
        eos_token_ids=eos_unique,
        image_token_id=raw.get("image_token_id"),
        video_token_id=raw.get("video_token_id"),
        vision_start_token_id=raw.get("vision_start_token_id"),
        vision_end_token_id=raw.get("vision_end_token_id"),
        vision_config_json=json.dumps(vision, sort_keys=True) if isinstance(vision, dict) else None,
        vision=vision_cfg,
    )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    d = Path(model_dir)
    if not d.is_dir():
        raise ConfigError(f"{d}: not a directory (pass a checkpoint dir with --model)")
    path = d / "config.json"
    if not path.is_file():
        raise ConfigError(f"{d}: no config.json")
    raw = _read_json(path)
    gen = None
    gpath = d / "generation_config.json"
    if gpath.is_file():
        gen = _read_json(gpath)
    return parse_config(raw, gen)


# --- Vision tower and image processor (model_spec A.8) --------------------------------------------------------------

VISION_TYPES = ("qwen3_5_vision", "qwen3_5")  # HF writes the former; mlx-vlm conversions may repeat the latter
# The Qwen3.5 processor's values (its preprocessor_config.json), used where a checkpoint dir has none.
QWEN35_MIN_PIXELS = 65536
QWEN35_MAX_PIXELS = 16777216
BICUBIC = 3  # PIL's resample code, the only filter Qwen's processor uses


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The Qwen3.5 ViT: patch embed (a Conv3d with stride = kernel), a learned position table bilinearly resampled
    to each image's patch grid, `depth` pre-LN blocks with 2-D RoPE over the whole head, and a 2x2 patch merger to
    the text model's width. Static under jit."""
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float
    layer_norm_eps: float = 1e-6  # fixed in HF's modeling code, not a config field

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch, in (channel, frame, row, col) order: 3 * 2 * 16 * 16 = 1536."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def grid_side(self) -> int:
        """Side of the learned square position table (48 for the 27B's 2304 entries)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def merge_unit(self) -> int:
        """Patches merged into one text-model row (4)."""
        return self.spatial_merge_size ** 2

    @property
    def factor(self) -> int:
        """Image sides are resized to multiples of this (patch_size * spatial_merge_size = 32)."""
        return self.patch_size * self.spatial_merge_size


def parse_vision_config(v: dict[str, Any], text: TextConfig) -> VisionConfig:
    """A qwen3_5 `vision_config` -> VisionConfig. Raises ConfigError naming the field for what the tower here does
    not implement (another activation or RoPE type, DeepStack, an output width other than the text model's)."""
    where = "vision_config"
    kind = v.get("model_type", "qwen3_5_vision")
    if kind not in VISION_TYPES:
        raise ConfigError(f"config.json: `vision_config.model_type` {kind!r} is not supported (expected one of "
                          f"{VISION_TYPES})")
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"config.json: `vision_config.hidden_act` {act!r} is not supported (only "
                          "'gelu_pytorch_tanh')")
    if v.get("deepstack_visual_indexes"):
        raise ConfigError(f"config.json: `vision_config.deepstack_visual_indexes` {v['deepstack_visual_indexes']} is "
                          "not supported (Qwen3.5 has no DeepStack mergers)")
    rope = v.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"config.json: `vision_config.rope_parameters` {rope!r} is not supported (only "
                          "rope_type 'axial')")
    heads = _int(v, "num_heads", where)
    hidden = _int(v, "hidden_size", where)
    cfg = VisionConfig(
        depth=_int(v, "depth", where),
        hidden_size=hidden,
        num_heads=heads,
        intermediate_size=_int(v, "intermediate_size", where),
        in_channels=int(v.get("in_channels", 3)),
        patch_size=_int(v, "patch_size", where),
        temporal_patch_size=_int(v, "temporal_patch_size", where),
        spatial_merge_size=_int(v, "spatial_merge_size", where),
        out_hidden_size=_int(v, "out_hidden_size", where),
        num_position_embeddings=_int(v, "num_position_embeddings", where),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )
    if cfg.in_channels != 3:
        raise ConfigError(f"config.json: `vision_config.in_channels` {cfg.in_channels} is not supported (RGB only)")
    if hidden % heads or cfg.head_dim % 4:
        raise ConfigError(f"config.json: `vision_config.hidden_size` {hidden} / `num_heads` {heads} must give a head "
                          "dim that is a multiple of 4 (the 2-D RoPE splits it into row and column halves, each "
                          "rotated half-split)")
    if cfg.grid_side ** 2 != cfg.num_position_embeddings:
        raise ConfigError(f"config.json: `vision_config.num_position_embeddings` {cfg.num_position_embeddings} is "
                          "not a square (the learned position table is a square grid)")
    if cfg.out_hidden_size != text.hidden_size:
        raise ConfigError(f"config.json: `vision_config.out_hidden_size` {cfg.out_hidden_size} differs from the text "
                          f"model's hidden_size {text.hidden_size} (image rows replace token embeddings)")
    return cfg


def _check_vision_tokens(raw: dict[str, Any], text: TextConfig) -> None:
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        tid = raw.get(key)
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < text.vocab_size:
            raise ConfigError(f"config.json: `{key}` must be a token id below vocab_size {text.vocab_size} when "
                              f"`vision_config` is given, got {tid!r}")


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """What Qwen's image processor (`Qwen2VLImageProcessor`) does to an RGB image: resize both sides to multiples
    of patch_size * merge_size with the area in [min_pixels, max_pixels] (bicubic), scale by rescale_factor,
    normalise per channel, and cut patches of temporal_patch_size repeated frames."""
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def default_image_processor_config(vision: VisionConfig) -> ImageProcessorConfig:
    """Qwen3.5's published processor settings for this tower (mean = std = 0.5, 65536..16777216 pixels)."""
    return ImageProcessorConfig(vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size,
                                QWEN35_MIN_PIXELS, QWEN35_MAX_PIXELS, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))


def parse_image_processor_config(raw: dict[str, Any], vision: VisionConfig) -> ImageProcessorConfig:
    """A `preprocessor_config.json` (transformers' Qwen2VLImageProcessor fields; `size` {shortest_edge,
    longest_edge} or the older `min_pixels` / `max_pixels`). Raises ConfigError naming the field where it does not
    fit the tower or asks for something this processor does not do."""
    where = "preprocessor_config.json"
    base = default_image_processor_config(vision)
    size = raw.get("size") or {}
    if not isinstance(size, dict):
        raise ConfigError(f"{where}: `size` must be an object, got {size!r}")
    min_pixels = size.get("shortest_edge", raw.get("min_pixels", base.min_pixels))
    max_pixels = size.get("longest_edge", raw.get("max_pixels", base.max_pixels))
    for key, value in (("size.shortest_edge", min_pixels), ("size.longest_edge", max_pixels)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{where}: `{key}` must be a positive pixel count, got {value!r}")
    if min_pixels > max_pixels:
        raise ConfigError(f"{where}: `size.shortest_edge` (min pixels) {min_pixels} exceeds `size.longest_edge` "
                          f"(max pixels) {max_pixels}")
    tower = {"patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
             "merge_size": vision.spatial_merge_size}
    for key, want in tower.items():
        got = raw.get(key, want)
        if got != want:
            raise ConfigError(f"{where}: `{key}` {got!r} does not match the vision tower's {want} (config.json "
                              "vision_config)")
    resample = raw.get("resample", BICUBIC)
    if resample != BICUBIC:
        raise ConfigError(f"{where}: `resample` {resample!r} is not supported (only 3, bicubic)")
    stats = {}
    for key in ("image_mean", "image_std"):
        value = raw.get(key, getattr(base, key))
        if isinstance(value, (int, float)):
            value = [value] * 3
        if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(
                isinstance(x, (int, float)) for x in value):
            raise ConfigError(f"{where}: `{key}` must be 3 numbers (one per RGB channel), got {value!r}")
        stats[key] = tuple(float(x) for x in value)
    if any(s == 0 for s in stats["image_std"]):
        raise ConfigError(f"{where}: `image_std` {list(stats['image_std'])} has a zero")
    return ImageProcessorConfig(
        patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size, min_pixels=min_pixels, max_pixels=max_pixels,
        image_mean=stats["image_mean"], image_std=stats["image_std"],
        rescale_factor=float(raw.get("rescale_factor", base.rescale_factor)),
        do_resize=bool(raw.get("do_resize", True)), do_rescale=bool(raw.get("do_rescale", True)),
        do_normalize=bool(raw.get("do_normalize", True)))


def load_image_processor_config(model_dir: str | Path, vision: VisionConfig) -> ImageProcessorConfig:
    """The checkpoint dir's `preprocessor_config.json`, or Qwen3.5's defaults where the dir has none."""
    path = Path(model_dir) / "preprocessor_config.json"
    if not path.is_file():
        return default_image_processor_config(vision)
    raw = _read_json(path)
    return parse_image_processor_config(raw, vision)


# --- DFlash block drafter (z-lab `DFlashDraftModel`; model_spec Part C) ---------------------------------------------

DFLASH_ARCH = "DFlashDraftModel"


@dataclasses.dataclass(frozen=True)
class DFlashConfig(QuantLookup):
    """A DFlash drafter: a Qwen3 decoder stack over the target's embeddings, conditioned on the target's hidden
    states at `target_layer_ids` and read out through the target's lm_head. Static under jit."""
    hidden_size: int  # = the target's hidden size
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float  # full-head rotate-half RoPE (no partial rotary, no M-RoPE, no scaling)
    block_size: int  # rows a draft call runs: the anchor, then block_size - 1 mask rows (the drafts)
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # strictly increasing target layers whose outputs are the context features
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0  # the block's target embeddings are multiplied by this
    output_multiplier: float = 1.0  # and the logits by this
    final_logit_softcapping: float | None = None  # then cap * tanh(logits / cap) where set
    quantization: QuantConfig | None = None
    quant_overrides: tuple[tuple[str, QuantConfig | None], ...] = ()

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """dflash's `build_target_layer_ids`: one tap in the middle, else evenly from layer 1 to layer L - 3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


def parse_dflash_config(raw: dict[str, Any], target: TextConfig | None = None) -> DFlashConfig:
    """A DFlash drafter's config.json. Values that dflash reads from `dflash_config` are looked up there first,
    then at the top level, with dflash's defaults (block_size 16, target_layer_ids from num_target_layers).
    Raises ConfigError naming the field for what is not supported (DFlash2, sliding-window or causal attention,
    RoPE scaling, biases) and, with `target`, for a drafter that does not fit it."""
    where = "the drafter's config"
    extra = raw.get("dflash_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"config.json: `dflash_config` must be an object, got {extra!r}")

    def draft_value(key: str, default: Any = None) -> Any:
        return extra.get(key, raw.get(key, default))

    archs = raw.get("architectures") or []
    if "DFlash2DraftModel" in archs or any(draft_value(k) for k in ("conv_kernel_size", "selector_rank")):
        raise ConfigError("config.json: `architectures` DFlash2DraftModel (dynamic convolutions and a candidate "
                          "selector) is not supported, only DFlashDraftModel")
    if archs and DFLASH_ARCH not in archs:
        raise ConfigError(f"config.json: `architectures` {archs} is not a DFlash drafter (expected {DFLASH_ARCH!r})")
    n_layers = _int(raw, "num_hidden_layers", where)
    layer_types = raw.get("layer_types")
    if layer_types is None:
        # Qwen3Config's rule when the file has no layer_types: sliding layers from max_window_layers on.
        sliding = raw.get("use_sliding_window") and raw.get("sliding_window") is not None
        window_from = int(raw.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if sliding and i >= window_from else LAYER_ATTN for i in range(n_layers)]
    if len(layer_types) != n_layers or any(t != LAYER_ATTN for t in layer_types):
        raise ConfigError(f"config.json: `layer_types` {list(layer_types)} is not supported: the drafter's "
                          f"{n_layers} layers must all be {LAYER_ATTN!r} (no sliding window)")
    if raw.get("is_causal"):
        raise ConfigError("config.json: `is_causal` true is not supported (the block attends non-causally)")
    if raw.get("attention_bias"):
        raise ConfigError("config.json: `attention_bias` true is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: `hidden_act` {raw['hidden_act']!r} is not supported (only 'silu')")
    for key in ("rope_parameters", "rope_scaling"):
        rope = raw.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ConfigError(f"config.json: `{key}` must be an object, got {rope!r}")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default" or float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ConfigError(f"config.json: `{key}` {rope} is not supported (only default full-head RoPE)")
    rope_theta = float((raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 10000.0)))

    heads, kv_heads = _int(raw, "num_attention_heads", where), _int(raw, "num_key_value_heads", where)
    if heads % kv_heads:
        raise ConfigError(f"config.json: `num_attention_heads` {heads} is not a multiple of `num_key_value_heads` "
                          f"{kv_heads}")
    num_target = draft_value("num_target_layers")
    ids = draft_value("target_layer_ids")
    if ids is None:
        if num_target is None:
            raise ConfigError("config.json: neither `target_layer_ids` nor `num_target_layers` is given")
        ids = default_target_layer_ids(int(num_target), n_layers)
    ids = tuple(int(i) for i in ids)
    if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0:
        raise ConfigError(f"config.json: `target_layer_ids` {list(ids)} must be non-negative and strictly increasing "
                          "(the taps are concatenated in target layer order)")
    mask = draft_value("mask_token_id")
    if mask is None or isinstance(mask, bool) or not isinstance(mask, int) or mask < 0:
        raise ConfigError(f"config.json: `mask_token_id` must be a token id (in `dflash_config`), got {mask!r}")
    block = draft_value("block_size", 16)
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise ConfigError(f"config.json: `block_size` must be an integer >= 2, got {block!r}")
    softcap = draft_value("final_logit_softcapping")
    quant, overrides = _quant_block(raw)
    cfg = DFlashConfig(
        hidden_size=_int(raw, "hidden_size", where),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_int(raw, "head_dim", where),
        intermediate_size=_int(raw, "intermediate_size", where),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        block_size=block,
        mask_token_id=mask,
        target_layer_ids=ids,
        num_target_layers=None if num_target is None else int(num_target),
        input_embedding_scale=float(draft_value("input_embedding_scale", 1.0)),
        output_multiplier=float(draft_value("output_multiplier", 1.0)),
        final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
        quantization=quant,
        quant_overrides=overrides,
    )
    if target is not None:
        check_dflash_fits(cfg, target)
    return cfg


def check_dflash_fits(cfg: DFlashConfig, target: TextConfig) -> None:
    """Raise ConfigError naming the field where the drafter cannot run on `target`."""
    if cfg.hidden_size != target.hidden_size:
        raise ConfigError(f"config.json: the drafter's `hidden_size` {cfg.hidden_size} differs from the target's "
                          f"{target.hidden_size} (it reads the target's embeddings and feeds its lm_head)")
    if cfg.target_layer_ids[-1] >= target.num_layers:
        raise ConfigError(f"config.json: `target_layer_ids` {list(cfg.target_layer_ids)} reach past the target's "
                          f"{target.num_layers} layers")
    if cfg.num_target_layers is not None and cfg.num_target_layers != target.num_layers:
        raise ConfigError(f"config.json: `num_target_layers` {cfg.num_target_layers} differs from the target's "
                          f"{target.num_layers} layers (a drafter made for another target)")
    if cfg.mask_token_id >= target.vocab_size:
        raise ConfigError(f"config.json: `mask_token_id` {cfg.mask_token_id} is outside the target's vocabulary of "
                          f"{target.vocab_size}")


def load_dflash_config(model_dir: str | Path, target: TextConfig | None = None) -> DFlashConfig:
    d = Path(model_dir)
    path = d / "config.json"
    if not path.is_file():
        raise ConfigError(f"{d}: no config.json (pass a DFlash drafter dir)")
    raw = _read_json(path)
    return parse_dflash_config(raw, target)
