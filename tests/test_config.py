import json

import pytest

from qwen_jax.config import ConfigError, load_config, parse_config
from qwen_jax.synthetic import QWEN35_27B, synthetic_config
from tests.conftest import CAPTURES


def test_27b_shape_derived_sizes():
    t = synthetic_config("27b").text
    assert (t.key_dim, t.value_dim, t.conv_dim, t.rotary_dim) == (2048, 6144, 10240, 64)
    assert len(t.gdn_layers) == 48 and len(t.attn_layers) == 16
    assert t.attn_layers[:3] == (3, 7, 11)


def test_multimodal_and_text_and_mlx_configs_read():
    hf = load_config(CAPTURES / "tiny")
    assert hf.model_type == "qwen3_5" and hf.vision_config is not None and hf.quantization is None
    assert hf.text.layer_types == ("linear_attention",) * 2 + ("full_attention",) + ("linear_attention",) * 2 + (
        "full_attention",)
    assert 493 in hf.eos_token_ids
    tied = load_config(CAPTURES / "tiny-text-tied")
    assert tied.model_type == "qwen3_5_text" and tied.text.tie_word_embeddings
    q4 = load_config(CAPTURES / "tiny-mlx-4bit")
    assert (q4.quantization.bits, q4.quantization.group_size) == (4, 64)
    q8 = load_config(CAPTURES / "tiny-mlx-8bit")
    assert (q8.quantization.bits, q8.quantization.group_size) == (8, 32)


def test_per_module_quantization_overrides():
    raw = {"model_type": "qwen3_5_text", **QWEN35_27B,
           "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                            "language_model.model.embed_tokens": {"group_size": 32, "bits": 8},
                            "language_model.model.layers.0.mlp.gate_proj": False}}
    cfg = parse_config(raw)
    assert cfg.quant_for("language_model.model.embed_tokens").bits == 8
    assert cfg.quant_for("language_model.model.embed_tokens").group_size == 32
    assert cfg.quant_for("language_model.model.layers.0.mlp.gate_proj") is None
    assert cfg.quant_for("language_model.model.layers.1.mlp.gate_proj").bits == 4
    hash(cfg)  # static under jit


@pytest.mark.parametrize("mutate,match", [
    (lambda r: r.update(model_type="llama"), "model_type 'llama' is not supported"),
    (lambda r: r.update(num_key_value_heads=5), "not a multiple of num_key_value_heads"),
    (lambda r: r.update(linear_num_value_heads=40), "not a multiple of"),
    (lambda r: r.update(layer_types=["full_attention"] * 3), "layer_types"),
    (lambda r: r.pop("hidden_size"), "missing `hidden_size`"),
    (lambda r: r.update(hidden_size=-4), "positive integer"),
    (lambda r: r.update(quantization={"bits": 4, "group_size": 64, "mode": "mxfp4"}), "not supported"),
])
def test_bad_configs_raise_one_line_errors(mutate, match):
    raw = {"model_type": "qwen3_5_text", **json.loads(json.dumps(QWEN35_27B))}
    mutate(raw)
    with pytest.raises(ConfigError, match=match) as e:
        parse_config(raw)
    assert "\n" not in str(e.value)


def test_missing_dir_and_config(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        load_config(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
