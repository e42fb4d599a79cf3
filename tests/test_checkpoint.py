"""Checkpoint loading: HF and MLX layouts, sharded files, per-module quantization, and one-line errors for bad dirs."""

import json
import shutil
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.qweight import QuantizedWeight
from qwen_jax.checkpoint import CheckpointError, SafetensorsIndex, load_checkpoint
from qwen_jax.config import ConfigError
from qwen_jax.model.ops import Fused
from tests.conftest import CAPTURES, ROOT


def _copy(src, dst):
    shutil.copytree(CAPTURES / src, dst)
    return dst


def _write_safetensors(path, tensors: dict[str, tuple[str, list[int], bytes]]):
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def _raw(ref) -> tuple[str, list[int], bytes]:
    """A stored tensor as (dtype, shape, bytes), for writing it into another safetensors file."""
    with open(ref.file, "rb") as fh:
        fh.seek(ref.start)
        return ref.dtype, list(ref.shape), fh.read(ref.end - ref.start)


def _leaves_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_hf_layout_keeps_vision_aside_and_shifts_norms():
    ck = load_checkpoint(CAPTURES / "tiny", dtype=jnp.float32)
    assert ck.source_format == "hf"
    assert ck.aside and all(k.startswith("model.visual.") for k in ck.aside)
    idx = SafetensorsIndex(CAPTURES / "tiny")
    raw = idx.load("model.language_model.layers.0.input_layernorm.weight").astype(np.float32)
    np.testing.assert_array_equal(np.asarray(ck.params["layers"][0]["input_norm"]), raw + 1.0)
    gated = idx.load("model.language_model.layers.0.linear_attn.norm.weight").astype(np.float32)
    np.testing.assert_array_equal(np.asarray(ck.params["layers"][0]["gdn"]["norm"]), gated)  # not zero-centred
    assert ck.params["layers"][0]["gdn"]["conv"].shape == (256, 4)


def test_mlx_layout_stays_packed_and_norms_unshifted():
    ck = load_checkpoint(CAPTURES / "tiny-mlx-4bit", dtype=jnp.bfloat16)
    assert ck.source_format == "mlx"
    emb = ck.params["embed"]
    assert isinstance(emb, QuantizedWeight) and emb.words.dtype == jnp.uint32 and emb.shape == (512, 128)
    idx = SafetensorsIndex(CAPTURES / "tiny-mlx-4bit")
    # The projections reading the same input are fused at load: their packed rows, concatenated in order.
    in_proj = ck.params["layers"][0]["gdn"]["in_proj"]
    assert isinstance(in_proj, Fused) and isinstance(in_proj.weight, QuantizedWeight)
    pre = "language_model.model.layers.0.linear_attn.in_proj_"
    for part in ("weight", "scales", "biases"):
        want = np.concatenate([idx.load(f"{pre}{n}.{part}") for n in ("qkv", "z", "b", "a")], axis=0)
        got = {"weight": in_proj.weight.words, "scales": in_proj.weight.scales, "biases": in_proj.weight.biases}[part]
        np.testing.assert_array_equal(np.asarray(got).view(want.dtype), want)
    assert sum(in_proj.sizes) == in_proj.weight.out_features and len(in_proj.sizes) == 4
    raw = idx.load("language_model.model.norm.weight").astype(np.float32)
    np.testing.assert_array_equal(np.asarray(ck.params["norm"]), raw)  # MLX baked the +1 in already


def test_tied_text_only_has_no_lm_head():
    ck = load_checkpoint(CAPTURES / "tiny-text-tied", dtype=jnp.float32)
    assert ck.params["lm_head"] is None and ck.config.text.tie_word_embeddings


def test_sharded_checkpoint_loads_the_same(tmp_path):
    src = CAPTURES / "tiny"
    idx = SafetensorsIndex(src)
    names = sorted(idx.refs)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    d = tmp_path / "sharded"
    d.mkdir()
    for f in ("config.json", "generation_config.json"):
        shutil.copy(src / f, d / f)
    weight_map = {}
    for i, part in enumerate(halves):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        tensors = {}
        for n in part:
            tensors[n] = _raw(idx.refs[n])
            weight_map[n] = fname
        _write_safetensors(d / fname, tensors)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a = load_checkpoint(src, dtype=jnp.float32).params
    b = load_checkpoint(d, dtype=jnp.float32).params
    _leaves_equal(a, b)


def test_per_module_override_drives_bits_and_group(tmp_path):
    """An 8-bit/g32 conversion described as global 4-bit/g64 with per-module overrides loads identically."""
    d = _copy("tiny-mlx-8bit", tmp_path / "q")
    cfg = json.loads((d / "config.json").read_text())
    idx = SafetensorsIndex(d)
    block = {"group_size": 64, "bits": 4, "mode": "affine"}
    for n in idx.refs:
        if n.endswith(".scales"):
            block[n[: -len(".scales")]] = {"group_size": 32, "bits": 8}
    cfg["quantization"] = cfg["quantization_config"] = block
    (d / "config.json").write_text(json.dumps(cfg))
    _leaves_equal(load_checkpoint(CAPTURES / "tiny-mlx-8bit", dtype=jnp.float32).params,
                  load_checkpoint(d, dtype=jnp.float32).params)


def _one_line(exc_info):
    msg = str(exc_info.value)
    assert msg and "\n" not in msg
    return msg


def test_missing_weights_file(tmp_path):
    d = _copy("tiny", tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors") as e:
        load_checkpoint(d)
    _one_line(e)


def test_missing_shard_named_by_index(tmp_path):
    d = _copy("tiny-mlx-4bit", tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing: model.safetensors") as e:
        load_checkpoint(d)
    _one_line(e)


def test_wrong_model_type(tmp_path):
    d = _copy("tiny", tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "qwen2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type 'qwen2' is not supported") as e:
        load_checkpoint(d)
    _one_line(e)


def test_shape_mismatch(tmp_path):
    d = _copy("tiny", tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["intermediate_size"] = 384
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape mismatch: .*mlp.gate_proj.weight.* is \\[256, 128\\]") as e:
        load_checkpoint(d)
    _one_line(e)


def test_truncated_safetensors(tmp_path):
    d = _copy("tiny", tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated safetensors") as e:
        load_checkpoint(d)
    _one_line(e)
    (d / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(d)


def test_missing_tensor(tmp_path):
    d = _copy("tiny-text-tied", tmp_path / "m")
    idx = SafetensorsIndex(d)
    keep = {}
    for n, ref in idx.refs.items():
        if n == "model.layers.1.linear_attn.A_log":
            continue
        keep[n] = _raw(ref)
    idx.close()
    _write_safetensors(d / "model.safetensors", keep)
    with pytest.raises(CheckpointError, match="missing tensor `layers.1.linear_attn.A_log`") as e:
        load_checkpoint(d)
    _one_line(e)


def test_cli_reports_bad_dir_in_one_line(tmp_path):
    d = _copy("tiny", tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x00" * 3)
    r = subprocess.run([sys.executable, "-m", "qwen_jax", "logits", "--model", str(d), "--token-ids", "1,2",
                        "--out", str(tmp_path / "x.npy")], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: ") and "truncated" in lines[-1]
    assert "Traceback" not in r.stderr
