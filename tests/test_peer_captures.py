"""Our model against the peers' captures (captures/refs, made by HF transformers and mlx-lm; see
captures/README.md): logits at every position and greedy continuations, fp32 and bf16 paths."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax.checkpoint import load_checkpoint
from qwen_jax.model import Backend
from qwen_jax.runner import Runner
from tests.conftest import CAPTURES

PROMPTS = ("short", "long", "repeat", "chat")
REFS = CAPTURES / "refs"


def _run(model: str, dtype, ref: str):
    ck = load_checkpoint(CAPTURES / model, dtype=dtype)
    z = np.load(REFS / ref)
    out = {}
    for name in PROMPTS:
        ids = z[f"{name}.prompt_ids"].tolist()
        runner = Runner(ck.params, ck.config, dtype=dtype, backend=Backend(), max_len=512)
        logits = runner.logits(ids)
        runner = Runner(ck.params, ck.config, dtype=dtype, backend=Backend(), max_len=512)
        gen = runner.generate(ids, len(z[f"{name}.gen_ids"]))
        out[name] = (logits, gen)
    return z, out


@pytest.fixture(scope="module")
def hf_f32():
    return _run("tiny", jnp.float32, "hf-tiny-f32.npz")


@pytest.mark.parametrize("name", PROMPTS)
def test_hf_fp32_logits_and_greedy(hf_f32, name):
    z, out = hf_f32
    logits, gen = out[name]
    assert logits.shape == z[f"{name}.logits"].shape
    assert np.abs(logits - z[f"{name}.logits"]).max() <= 1e-4
    assert gen == z[f"{name}.gen_ids"].tolist()


@pytest.mark.parametrize("name", PROMPTS)
def test_bf16_path_no_worse_than_hf_bf16(name):
    """The bf16 path is gated by the peer's own bf16 error: against HF's fp32 logits, ours must deviate by no
    more than HF's bf16 forward does on the same checkpoint and prompt (both round activations to bf16 at the
    same points; a larger deviation would mean an extra loss of precision on our side)."""
    z32 = np.load(REFS / "hf-tiny-f32.npz")
    z16 = np.load(REFS / "hf-tiny-bf16.npz")
    ck = load_checkpoint(CAPTURES / "tiny", dtype=jnp.bfloat16)
    runner = Runner(ck.params, ck.config, dtype=jnp.bfloat16, backend=Backend(), max_len=512)
    ids = z32[f"{name}.prompt_ids"].tolist()
    ours = runner.logits(ids)
    hf_err = np.abs(z16[f"{name}.logits"] - z32[f"{name}.logits"]).max()
    our_err = np.abs(ours - z32[f"{name}.logits"]).max()
    assert np.isfinite(ours).all()
    assert our_err <= hf_err, f"bf16 deviation {our_err:.4f} exceeds HF bf16's {hf_err:.4f}"


@pytest.mark.parametrize("model,ref", [("tiny-mlx-4bit", "mlx-tiny-mlx-4bit-f32.npz"),
                                       ("tiny-mlx-8bit", "mlx-tiny-mlx-8bit-f32.npz")])
def test_mlx_quantized_logits_and_greedy(model, ref):
    if not (REFS / ref).is_file():
        pytest.fail(f"missing capture {ref}")
    z, out = _run(model, jnp.float32, ref)
    for name in PROMPTS:
        logits, gen = out[name]
        assert np.abs(logits - z[f"{name}.logits"]).max() <= 2e-3, name
        assert gen == z[f"{name}.gen_ids"].tolist(), name


def test_tied_text_only_checkpoint():
    """`Qwen3_5ForCausalLM` (qwen3_5_text, `model.*` keys, tied lm_head). Greedy continuations must equal HF's.
    Logits: 1e-4 except on the 336-token prompt, where this random checkpoint is ill-conditioned in fp32 at a few
    positions (around row 245 the two fp32 evaluations, ours and HF's, differ from a float64 evaluation of the
    same math by 4.9e-4 and 1.0e-4 respectively, errors amplified through the GDN state from 1e-6-level
    rounding differences in layer 0; HF's own full-prompt and cached step-by-step fp32 logits differ by 1.6e-4 on
    this checkpoint, captures/refs meta); there the gate is 1e-3."""
    z, out = _run("tiny-text-tied", jnp.float32, "hf-tiny-text-tied-f32.npz")
    for name in PROMPTS:
        logits, gen = out[name]
        tol = 1e-3 if name == "long" else 1e-4
        assert np.abs(logits - z[f"{name}.logits"]).max() <= tol, name
        assert gen == z[f"{name}.gen_ids"].tolist(), name


def test_prompts_file_matches_references():
    prompts = json.loads((REFS / "prompts.json").read_text())
    z = np.load(REFS / "hf-tiny-f32.npz")
    for name in PROMPTS:
        assert prompts[name]["ids"] == z[f"{name}.prompt_ids"].tolist()
