"""One frozen, hashable model config read from a checkpoint dir's `config.json` (static under jit).

Accepted: HF `Qwen3_5ForConditionalGeneration` (`model_type` `qwen3_5`, fields under `text_config`),
`Qwen3_5ForCausalLM` (`qwen3_5_text`, fields at the top level), and MLX conversions of either (the same fields
plus a `quantization` / `quantization_config` block with per-module overrides).
"""

from __future__ import annotations

import dataclasses
import json
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
class ModelConfig:
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

    def quant_for(self, module_path: str) -> QuantConfig | None:
        """Quantization params of a module: its per-path override if any, else the global block."""
        for path, q in self.quant_overrides:
            if path == module_path:
                return q
        return self.quantization

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
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    d = Path(model_dir)
    if not d.is_dir():
        raise ConfigError(f"{d}: not a directory (pass a checkpoint dir with --model)")
    path = d / "config.json"
    if not path.is_file():
        raise ConfigError(f"{d}: no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    gen = None
    gpath = d / "generation_config.json"
    if gpath.is_file():
        try:
            gen = json.loads(gpath.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{gpath}: not valid JSON ({e})") from None
    return parse_config(raw, gen)
