"""Checkpoint dir -> (config, params pytree), and the tokenizer/chat template. The only module that knows file
formats: safetensors (single or sharded), HF key layouts (`model.language_model.*`, `model.*`, `lm_head`) and MLX
conversions (`language_model.model.*`, zero-centred norms with +1 baked in, conv1d as [C, K, 1], affine 4/8-bit
quantization: a module is quantized iff `<path>.scales` exists).

Params layout (norm weights are the effective fp32 multipliers, i.e. 1 + w for HF's zero-centred norms):
    {"embed": W[V, H], "norm": f32[H], "lm_head": W[V, H] | None (tied), "layers": tuple of per-layer dicts}
    GDN layer:  {"input_norm", "post_norm", "mlp": {"gate_up": F(gate, up), "down"},
                 "gdn": {"in_proj": F(qkv, z, b, a), "out", "conv": f32[C, K], "dt_bias": f32[Hv],
                         "A_log": f32[Hv], "norm": f32[dv]}}
    attn layer: {"input_norm", "post_norm", "mlp": {...},
                 "attn": {"qkv": F(q, k, v), "o", "q_norm": f32[D], "k_norm": f32[D]}}
W is a dense [out, in] array in the compute dtype or a packed `QuantizedWeight` (never dequantized at load).
F(...) is `model.ops.fuse` of the projections that read the same input: one weight concatenated along `out`
(one matmul), or the tuple of the parts when their formats differ.

A DFlash drafter dir (`load_dflash`: z-lab `DFlashDraftModel`, bare HF keys `fc.weight`, `layers.{i}.…`; an MLX
conversion with `.scales` / `.biases` is read the same way) gives (norms are plain `x·w` multipliers, not shifted):
    {"fc": W[H, n·H], "hidden_norm": f32[H], "norm": f32[H], "layers": tuple of
     {"input_norm", "post_norm", "mlp": {"gate_up": F(gate, up), "down"},
      "attn": {"q": W, "kv": F(k, v), "o": W, "q_norm": f32[D], "k_norm": f32[D]}}}
q apart from k|v because the context rows need only k and v (`model.dflash`).

The vision tower (`load_vision`, or `load_checkpoint(..., vision=True)`; HF `model.visual.*` / `visual.*` keys or
mlx-vlm's `vision_tower.*` with its channels-last patch conv), dense weights only. A linear is {"w": W[out, in],
"b": f32[out]}, a LayerNorm {"w": f32, "b": f32}; D = hidden_size, I = intermediate_size, M = merge_unit:
    {"patch_embed": {"w": W[D, C·T·P·P] (the Conv3d kernel flattened in (C, T, P, P) order), "b"},
     "pos_embed": W[G·G, D],
     "blocks": tuple of {"norm1", "qkv": [3D, D], "proj": [D, D], "norm2", "fc1": [I, D], "fc2": [D, I]},
     "merger": {"norm" (over D), "fc1": [M·D, M·D], "fc2": [out_hidden, M·D]}}
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.qweight import QuantizedWeight
from qwen_jax.config import (LAYER_GDN, DFlashConfig, ModelConfig, TextConfig, VisionConfig, load_config,
                             load_dflash_config)
from qwen_jax.model.ops import Fused, fuse


class CheckpointError(ValueError):
    pass


_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16,
    "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn,
}


@dataclass
class _TensorRef:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


class SafetensorsIndex:
    """All tensors of a checkpoint dir by name, read lazily through mmap (nothing loaded until asked)."""

    def __init__(self, model_dir: Path):
        self.refs: dict[str, _TensorRef] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from None
            files = sorted({model_dir / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{model_dir}: shard(s) named in the index are missing: {', '.join(missing)}")
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{model_dir}: no *.safetensors file (and no model.safetensors.index.json)")
        for f in files:
            self._read_header(f)

    def _read_header(self, path: Path) -> None:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated safetensors file (header of {n} bytes, file {size})")
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
        base = 8 + n
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            if base + end > size:
                raise CheckpointError(f"{path}: truncated safetensors file ({name} ends at byte {base + end}, "
                                      f"file has {size})")
            if meta["dtype"] not in _DTYPES:
                raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
            self.refs[name] = _TensorRef(path, meta["dtype"], tuple(meta["shape"]), base + start, base + end)

    def load(self, name: str) -> np.ndarray:
        ref = self.refs[name]
        mm = self._maps.get(ref.file)
        if mm is None:
            with open(ref.file, "rb") as fh:
                mm = self._maps[ref.file] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        arr = np.frombuffer(mm, dtype=_DTYPES[ref.dtype], count=int(np.prod(ref.shape, dtype=np.int64)),
                            offset=ref.start)
        return arr.reshape(ref.shape)

    def close(self) -> None:
        for mm in self._maps.values():
            mm.close()
        self._maps.clear()


@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    params: dict[str, Any]
    source_format: str  # "hf" or "mlx"
    # Tensors kept aside for later issues (vision tower, MTP head), by original name -> numpy view.
    aside: dict[str, np.ndarray] = field(default_factory=dict)
    # The vision tower's params (`load_vision`) when asked for with vision=True, else None.
    vision: dict[str, Any] | None = None


def _canonical(name: str) -> tuple[str, str] | None:
    """Original key -> (section, canonical key) where section is text/vision/mtp, or None to ignore."""
    if name.startswith("mtp."):
        return "mtp", name
    for prefix in ("model.visual.", "visual.", "vision_tower.", "model.vision_tower."):
        if name.startswith(prefix):
            return "vision", name
    for prefix, out in (("model.language_model.", ""), ("language_model.model.", ""),
                        ("language_model.lm_head.", "lm_head."), ("language_model.", ""), ("model.", "")):
        if name.startswith(prefix):
            return "text", out + name[len(prefix):]
    if name.startswith("lm_head."):
        return "text", name
    return None


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of every linear module (canonical path without `.weight`)."""
    t = cfg.text
    shapes = {"embed_tokens": (t.vocab_size, t.hidden_size)}
    if not t.tie_word_embeddings:
        shapes["lm_head"] = (t.vocab_size, t.hidden_size)
    h = t.hidden_size
    for i, kind in enumerate(t.layer_types):
        p = f"layers.{i}"
        shapes[f"{p}.mlp.gate_proj"] = (t.intermediate_size, h)
        shapes[f"{p}.mlp.up_proj"] = (t.intermediate_size, h)
        shapes[f"{p}.mlp.down_proj"] = (h, t.intermediate_size)
        if kind == LAYER_GDN:
            shapes[f"{p}.linear_attn.in_proj_qkv"] = (t.conv_dim, h)
            shapes[f"{p}.linear_attn.in_proj_z"] = (t.value_dim, h)
            shapes[f"{p}.linear_attn.in_proj_b"] = (t.linear_num_value_heads, h)
            shapes[f"{p}.linear_attn.in_proj_a"] = (t.linear_num_value_heads, h)
            shapes[f"{p}.linear_attn.out_proj"] = (h, t.value_dim)
        else:
            shapes[f"{p}.self_attn.q_proj"] = (t.num_heads * t.head_dim * 2, h)
            shapes[f"{p}.self_attn.k_proj"] = (t.num_kv_heads * t.head_dim, h)
            shapes[f"{p}.self_attn.v_proj"] = (t.num_kv_heads * t.head_dim, h)
            shapes[f"{p}.self_attn.o_proj"] = (h, t.num_heads * t.head_dim)
    return shapes


class _Builder:
    def __init__(self, cfg: ModelConfig | DFlashConfig, idx: SafetensorsIndex, names: dict[str, str], fmt: str, dtype,
                 bar, shapes: dict[str, tuple[int, int]] | None = None):
        self.cfg, self.idx, self.names, self.fmt, self.dtype, self.bar = cfg, idx, names, fmt, dtype, bar
        self.shapes = _expected_shapes(cfg) if shapes is None else shapes
        self.used: set[str] = set()

    def _raw(self, key: str) -> np.ndarray:
        if key not in self.names:
            raise CheckpointError(f"checkpoint is missing tensor `{key}`")
        self.used.add(key)
        if self.bar is not None:
            self.bar.update(1)
        return self.idx.load(self.names[key])

    def linear(self, module: str):
        want = self.shapes[module]
        if f"{module}.scales" in self.names:
            orig = self.names[f"{module}.scales"][: -len(".scales")]
            q = self.cfg.quant_for(orig)
            if q is None:
                raise CheckpointError(f"`{orig}` has scales but config.json has no quantization params for it")
            words = self._raw(f"{module}.weight")
            scales, biases = self._raw(f"{module}.scales"), self._raw(f"{module}.biases")
            if words.dtype != np.uint32:
                raise CheckpointError(f"`{orig}.weight` is {words.dtype}, expected packed uint32")
            w = QuantizedWeight(jnp.asarray(words), jnp.asarray(scales), jnp.asarray(biases), q.bits, q.group_size)
            if w.shape != want:
                raise CheckpointError(f"shape mismatch: `{orig}` unpacks to {list(w.shape)} at {q.bits} bits, "
                                      f"config.json implies {list(want)}")
            try:
                w.validate(orig)
            except ValueError as e:
                raise CheckpointError(str(e)) from None
            return w
        arr = self._raw(f"{module}.weight")
        if tuple(arr.shape) != want:
            raise CheckpointError(f"shape mismatch: `{self.names[module + '.weight']}` is {list(arr.shape)}, "
                                  f"config.json implies {list(want)}")
        return jnp.asarray(arr.astype(np.float32), dtype=self.dtype)

    def vector(self, key: str, size: int, *, zero_centred: bool = False) -> jnp.ndarray:
        arr = self._raw(key).astype(np.float32)
        if arr.shape != (size,):
            raise CheckpointError(f"shape mismatch: `{self.names[key]}` is {list(arr.shape)}, expected [{size}]")
        # HF stores zero-centred norms as w (multiplier 1 + w); MLX conversions already added the 1.
        if zero_centred and self.fmt == "hf":
            arr = arr + np.float32(1.0)
        return jnp.asarray(arr)

    def conv(self, key: str) -> jnp.ndarray:
        t = self.cfg.text
        arr = self._raw(key).astype(np.float32)
        c, k = t.conv_dim, t.linear_conv_kernel_dim
        if arr.shape == (c, 1, k):
            arr = arr[:, 0, :]
        elif arr.shape == (c, k, 1):
            arr = arr[:, :, 0]
        else:
            raise CheckpointError(f"shape mismatch: `{self.names[key]}` is {list(arr.shape)}, expected "
                                  f"[{c}, 1, {k}] (HF) or [{c}, {k}, 1] (MLX)")
        return jnp.asarray(arr)


def load_checkpoint(model_dir: str | os.PathLike, *, dtype=jnp.bfloat16, progress: bool | None = None,
                    vision: bool = False) -> LoadedCheckpoint:
    """Read a checkpoint dir. `dtype` is the compute dtype dense weights are cast to (bfloat16 or float32);
    packed weights stay packed, norms and GDN scalars stay fp32. vision: also build the vision tower's params
    (`load_vision`; a CheckpointError if the checkpoint has no tower); text-only callers read none of its bytes."""
    d = Path(model_dir)
    cfg = load_config(d)
    idx = SafetensorsIndex(d)
    names: dict[str, str] = {}
    aside: dict[str, np.ndarray] = {}
    fmt = "hf"
    for name in idx.refs:
        c = _canonical(name)
        if c is None:
            continue
        section, key = c
        if section != "text":
            aside[name] = idx.load(name)
            continue
        if name.startswith("language_model."):
            fmt = "mlx"
        names[key] = name
    t = cfg.text
    if progress is None:
        progress = sys.stderr.isatty()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(names), desc=f"loading {d.name}", unit="tensor")
    b = _Builder(cfg, idx, names, fmt, jnp.dtype(dtype), bar)
    try:
        layers = []
        for i, kind in enumerate(t.layer_types):
            p = f"layers.{i}"
            layer = {
                "input_norm": b.vector(f"{p}.input_layernorm.weight", t.hidden_size, zero_centred=True),
                "post_norm": b.vector(f"{p}.post_attention_layernorm.weight", t.hidden_size, zero_centred=True),
                "mlp": {"gate_up": fuse([b.linear(f"{p}.mlp.gate_proj"), b.linear(f"{p}.mlp.up_proj")]),
                        "down": b.linear(f"{p}.mlp.down_proj")},
            }
            if kind == LAYER_GDN:
                la = f"{p}.linear_attn"
                layer["gdn"] = {
                    "in_proj": fuse([b.linear(f"{la}.in_proj_{n}") for n in ("qkv", "z", "b", "a")]),
                    "out": b.linear(f"{la}.out_proj"), "conv": b.conv(f"{la}.conv1d.weight"),
                    "dt_bias": b.vector(f"{la}.dt_bias", t.linear_num_value_heads),
                    "A_log": b.vector(f"{la}.A_log", t.linear_num_value_heads),
                    "norm": b.vector(f"{la}.norm.weight", t.linear_value_head_dim),
                }
            else:
                sa = f"{p}.self_attn"
                layer["attn"] = {
                    "qkv": fuse([b.linear(f"{sa}.{n}_proj") for n in ("q", "k", "v")]),
                    "o": b.linear(f"{sa}.o_proj"),
                    "q_norm": b.vector(f"{sa}.q_norm.weight", t.head_dim, zero_centred=True),
                    "k_norm": b.vector(f"{sa}.k_norm.weight", t.head_dim, zero_centred=True),
                }
            layers.append(layer)
        params = {
            "embed": b.linear("embed_tokens"),
            "norm": b.vector("norm.weight", t.hidden_size, zero_centred=True),
            "lm_head": None if t.tie_word_embeddings else b.linear("lm_head"),
            "layers": tuple(layers),
        }
    finally:
        if bar is not None:
            bar.close()
    unused = sorted(set(names) - b.used)
    if unused and not (t.tie_word_embeddings and all(u.startswith("lm_head.") for u in unused)):
        raise CheckpointError(f"checkpoint has tensors the config does not explain: {', '.join(unused[:5])}"
                              + (" ..." if len(unused) > 5 else ""))
    tower = load_vision(d, cfg, dtype=dtype, index=idx) if vision else None
    return LoadedCheckpoint(cfg, params, fmt, aside, tower)


_VISION_PREFIXES = (("model.visual.", "hf"), ("visual.", "hf"), ("model.vision_tower.", "mlx"),
                    ("vision_tower.", "mlx"))


def _vision_shapes(v: VisionConfig) -> dict[str, tuple[int, int]]:
    d, i, m = v.hidden_size, v.intermediate_size, v.merge_unit * v.hidden_size
    shapes = {"pos_embed": (v.num_position_embeddings, d), "merger.linear_fc1": (m, m),
              "merger.linear_fc2": (v.out_hidden_size, m)}
    for b in range(v.depth):
        shapes.update({f"blocks.{b}.attn.qkv": (3 * d, d), f"blocks.{b}.attn.proj": (d, d),
                       f"blocks.{b}.mlp.linear_fc1": (i, d), f"blocks.{b}.mlp.linear_fc2": (d, i)})
    return shapes


def load_vision(model_dir: str | os.PathLike, cfg: ModelConfig | None = None, *, dtype=jnp.bfloat16,
                index: SafetensorsIndex | None = None) -> dict[str, Any]:
    """The vision tower's params (layout in the module docstring) from a checkpoint dir. `dtype`: the compute dtype
    matrices are cast to (LayerNorms and biases stay fp32). Raises CheckpointError when the config has no
    `vision_config`, a tower tensor is missing, quantized, shaped otherwise or unexplained."""
    d = Path(model_dir)
    cfg = load_config(d) if cfg is None else cfg
    v = cfg.vision
    if v is None:
        raise CheckpointError(f"{d}: config.json has no `vision_config` (a text-only checkpoint: images need the "
                              "original multimodal checkpoint, not an mlx-lm or Qwen3_5ForCausalLM one)")
    idx = SafetensorsIndex(d) if index is None else index
    names: dict[str, str] = {}
    formats = set()
    for name in idx.refs:
        for prefix, fmt in _VISION_PREFIXES:
            if name.startswith(prefix):
                names[name[len(prefix):]] = name
                formats.add(fmt)
                break
    if not names:
        raise CheckpointError(f"{d}: config.json has a `vision_config` but the checkpoint has no vision tower "
                              "tensors (model.visual.* or vision_tower.*)")
    if len(formats) > 1:
        raise CheckpointError(f"{d}: the checkpoint has vision tower tensors under both HF (model.visual.*) and "
                              "mlx-vlm (vision_tower.*) names")
    quantized = sorted(n for k, n in names.items() if k.endswith((".scales", ".biases")))
    if quantized:
        raise CheckpointError(f"{d}: quantized vision tower tensors are not supported ({quantized[0]}): use a "
                              "checkpoint whose tower is stored in floating point")
    b = _Builder(cfg, idx, names, "hf", jnp.dtype(dtype), None, shapes=_vision_shapes(v))
    try:
        params = _vision_params(b, v)
    except CheckpointError as e:
        raise CheckpointError(f"{d}: vision tower: {e}") from None
    unused = sorted(set(names) - b.used)
    if unused:
        raise CheckpointError(f"{d}: vision tower tensors the config does not explain: "
                              f"{', '.join(names[u] for u in unused[:5])}" + (" ..." if len(unused) > 5 else ""))
    return params


def _vision_params(b: _Builder, v: VisionConfig) -> dict[str, Any]:
    def linear(module: str, bias_size: int) -> dict[str, jnp.ndarray]:
        return {"w": b.linear(module), "b": b.vector(f"{module}.bias", bias_size)}

    def norm(module: str, size: int) -> dict[str, jnp.ndarray]:
        return {"w": b.vector(f"{module}.weight", size), "b": b.vector(f"{module}.bias", size)}

    h, inter = v.hidden_size, v.intermediate_size
    return {
        "patch_embed": {"w": _patch_kernel(b, v), "b": b.vector("patch_embed.proj.bias", h)},
        "pos_embed": b.linear("pos_embed"),
        "blocks": tuple({
            "norm1": norm(f"blocks.{i}.norm1", h),
            "qkv": linear(f"blocks.{i}.attn.qkv", 3 * h),
            "proj": linear(f"blocks.{i}.attn.proj", h),
            "norm2": norm(f"blocks.{i}.norm2", h),
            "fc1": linear(f"blocks.{i}.mlp.linear_fc1", inter),
            "fc2": linear(f"blocks.{i}.mlp.linear_fc2", h),
        } for i in range(v.depth)),
        "merger": {"norm": norm("merger.norm", h), "fc1": linear("merger.linear_fc1", v.merge_unit * h),
                   "fc2": linear("merger.linear_fc2", v.out_hidden_size)},
    }


def _patch_kernel(b: _Builder, v: VisionConfig) -> jnp.ndarray:
    """The patch Conv3d kernel as a [D, C·T·P·P] matrix: HF stores [D, C, T, P, P], mlx-vlm channels-last
    [D, T, P, P, C]."""
    key = "patch_embed.proj.weight"
    arr = b._raw(key)
    c, t, p = v.in_channels, v.temporal_patch_size, v.patch_size
    if arr.shape == (v.hidden_size, c, t, p, p):
        pass
    elif arr.shape == (v.hidden_size, t, p, p, c):
        arr = np.moveaxis(arr, 4, 1)
    else:
        raise CheckpointError(f"shape mismatch: `{b.names[key]}` is {list(arr.shape)}, expected "
                              f"[{v.hidden_size}, {c}, {t}, {p}, {p}] (HF) or [{v.hidden_size}, {t}, {p}, {p}, {c}] "
                              "(mlx-vlm)")
    return jnp.asarray(arr.reshape(v.hidden_size, v.patch_dim).astype(np.float32), dtype=b.dtype)


@dataclass
class LoadedDraft:
    config: DFlashConfig
    params: dict[str, Any]


def _dflash_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, int]]:
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"fc": (h, cfg.num_taps * h)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        shapes.update({
            f"{p}.self_attn.q_proj": (cfg.num_heads * d, h), f"{p}.self_attn.k_proj": (cfg.num_kv_heads * d, h),
            f"{p}.self_attn.v_proj": (cfg.num_kv_heads * d, h), f"{p}.self_attn.o_proj": (h, cfg.num_heads * d),
            f"{p}.mlp.gate_proj": (cfg.intermediate_size, h), f"{p}.mlp.up_proj": (cfg.intermediate_size, h),
            f"{p}.mlp.down_proj": (h, cfg.intermediate_size),
        })
    return shapes


def load_dflash(model_dir: str | os.PathLike, *, target: TextConfig | None = None, dtype=jnp.bfloat16,
                bits: int | None = None) -> LoadedDraft:
    """Read a DFlash drafter dir (config.json + safetensors). With `target`, the config is checked against the
    target it will run on (`config.check_dflash_fits`). `dtype`: the compute dtype dense weights are cast to.
    `bits` (4 or 8): its dense projections quantized at load (`quantize_drafter`)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory (pass a DFlash drafter dir)")
    cfg = load_dflash_config(d, target)
    idx = SafetensorsIndex(d)
    names = {name: name for name in idx.refs}
    b = _Builder(cfg, idx, names, "hf", jnp.dtype(dtype), None, shapes=_dflash_shapes(cfg))
    h, hd = cfg.hidden_size, cfg.head_dim
    layers = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        sa = f"{p}.self_attn"
        layers.append({
            "input_norm": b.vector(f"{p}.input_layernorm.weight", h),
            "post_norm": b.vector(f"{p}.post_attention_layernorm.weight", h),
            "mlp": {"gate_up": fuse([b.linear(f"{p}.mlp.gate_proj"), b.linear(f"{p}.mlp.up_proj")]),
                    "down": b.linear(f"{p}.mlp.down_proj")},
            "attn": {"q": b.linear(f"{sa}.q_proj"), "kv": fuse([b.linear(f"{sa}.k_proj"), b.linear(f"{sa}.v_proj")]),
                     "o": b.linear(f"{sa}.o_proj"), "q_norm": b.vector(f"{sa}.q_norm.weight", hd),
                     "k_norm": b.vector(f"{sa}.k_norm.weight", hd)},
        })
    params = {"fc": b.linear("fc"), "hidden_norm": b.vector("hidden_norm.weight", h),
              "norm": b.vector("norm.weight", h), "layers": tuple(layers)}
    unused = sorted(set(names) - b.used)
    if unused:
        raise CheckpointError(f"{d}: drafter checkpoint has tensors a DFlashDraftModel does not have: "
                              f"{', '.join(unused[:5])}" + (" ..." if len(unused) > 5 else ""))
    return LoadedDraft(cfg, quantize_drafter(params, bits) if bits else params)


DRAFTER_GROUP = 64


def quantize_drafter(params: dict, bits: int, group_size: int = DRAFTER_GROUP) -> dict:
    """A drafter's dense projections (fc, q, kv, o, gate_up, down; fused ones as a whole, which quantizes each part
    as it would alone) -> MLX affine packed weights of `bits` with bf16 factors, so its matmuls take the qmm kernels
    and read a quarter (4 bits) of the bytes; already packed ones and the norms are kept. The drafts change (its
    weights do), never a reply: a window keeps only the drafts the target's own samples agree with."""
    from pallas_kernels.qweight import SUPPORTED_BITS, quantize
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"drafter bits (--drafter-bits) must be one of {SUPPORTED_BITS}, got {bits!r}")

    def one(w):
        if isinstance(w, Fused):
            return replace(w, weight=one(w.weight))
        if isinstance(w, QuantizedWeight) or w.ndim != 2:
            return w
        if w.shape[1] % group_size:
            raise ValueError(f"drafter bits: a projection's input size {w.shape[1]} is not a multiple of the "
                             f"group size {group_size}")
        return quantize(w, bits=bits, group_size=group_size)

    return jax.tree.map(one, params, is_leaf=lambda w: isinstance(w, (Fused, QuantizedWeight)))


def load_tokenizer(model_dir: str | os.PathLike):
    """The checkpoint's own tokenizer and chat template (local files only; nothing is fetched)."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises many types for an unusable dir
        raise CheckpointError(f"{model_dir}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
