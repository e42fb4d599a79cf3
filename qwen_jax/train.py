"""Training for small models: the next-token loss of a qwen3_5 text model and the block loss of its DFlash drafter,
greedy generation with the model's own decode step, the drafter's context taps, and writing trained params back
as checkpoints the loaders read (HF names and layouts). It exists for the demo model and its drafter
(`tools/demo/make_demo.py`), which give drafting real acceptance to measure; it is not a training framework
(reference path only, whole sequences, no sharding).

The drafter is trained as DFlash drafters are: for an anchor position a of a sequence, its block [token a, MASK x
(B - 1)] at positions a.. attends to the target's taps of positions 0..a-1 (the anchor's own taps are not in the
context, as at inference) and row j predicts token a + j. Sequences are the target's own greedy continuations,
so what the drafter learns is what verification accepts.

Letters: s sequences, t tokens, a anchors a sequence, b block rows, h hidden."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from qwen_jax import model as M
from qwen_jax.config import LAYER_GDN, DFlashConfig, ModelConfig, TextConfig
from qwen_jax.model import dflash as D
from qwen_jax.model.ops import Backend, Fused

PAGE = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _pages(t: int) -> int:
    return -(-t // PAGE)


def _fresh(cfg: TextConfig, tokens: jax.Array, capacity: int, dtype) -> tuple[M.ModelState, M.PrefillBatch]:
    """Pools for S sequences of up to `capacity` rows (slot 0 and page 0 left unused, as the engine leaves them, so
    sequence i has slot i + 1) and the prompt batch of tokens [S, T] from position 0."""
    s, t = tokens.shape
    n = _pages(capacity)
    state = M.init_state(cfg, num_slots=s + 1, num_pages=s * n + 1, page_size=PAGE, dtype=dtype)
    table = 1 + jnp.arange(s * n, dtype=jnp.int32).reshape(s, n)
    batch = M.make_prefill_batch(tokens, jnp.zeros(s, jnp.int32), jnp.full(s, t, jnp.int32),
                                 jnp.arange(1, s + 1, dtype=jnp.int32), table)
    return state, batch


def prefill_all(params, cfg: ModelConfig, tokens: jax.Array, *, taps: tuple[int, ...] = (),
                backend: Backend | None = None, dtype=jnp.float32):
    """tokens [S, T] from position 0 -> (logits [S, T, V] fp32, taps [S, T, len(taps), H] or None), computed in
    dtype on a fresh state."""
    backend = Backend() if backend is None else backend
    state, batch = _fresh(cfg.text, tokens, tokens.shape[1], dtype)
    logits, _, tapped = M.prefill(params, state, batch, cfg, backend, all_logits=True, taps=taps)
    return logits, tapped


def lm_loss(params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross entropy of tokens [S, T] (every row but the last predicts the next)."""
    logits, _ = prefill_all(params, cfg, tokens)
    lp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1))


def generate_greedy(params, cfg: ModelConfig, prompts: jax.Array, n: int, *, backend: Backend | None = None,
                    dtype=jnp.float32) -> jax.Array:
    """prompts [S, P] -> [S, P + n]: each prompt and its n greedy tokens, by the model's prompt pass and serial
    decode step (what the engine runs, on one fixed batch), computed in dtype."""
    backend = Backend() if backend is None else backend
    s, p = prompts.shape
    state, batch = _fresh(cfg.text, prompts, p + n, dtype)
    logits, state, _ = M.prefill(params, state, batch, cfg, backend)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def one(carry, i):
        state, tok = carry
        window = M.make_window(tok[:, None], jnp.full((s, 1), -1, jnp.int32), jnp.full(s, p, jnp.int32) + i,
                               batch.slot, batch.page_table)
        logits, state = M.step(params, state, window, cfg, backend)
        nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return (state, nxt), tok

    _, out = jax.lax.scan(one, (state, first), jnp.arange(n, dtype=jnp.int32))
    return jnp.concatenate([prompts.astype(jnp.int32), out.T], axis=1)


def drafter_features(params, cfg: ModelConfig, dcfg: DFlashConfig, tokens: jax.Array) -> jax.Array:
    """The drafter's context features of tokens [S, T]: the target's taps after dcfg.target_layer_ids, concatenated
    in layer order -> [S, T, n * H]."""
    _, tapped = prefill_all(params, cfg, tokens, taps=dcfg.target_layer_ids)
    s, t = tokens.shape
    return tapped.reshape(s, t, -1)


def block_weights(dcfg: DFlashConfig, decay: float | None) -> jax.Array:
    """[B - 1] loss weights of the draft rows: exp(-(j - 1) / decay) for row j (the first draft counts most: a
    later one is only accepted after it), or all ones without a decay."""
    j = jnp.arange(dcfg.block_size - 1, dtype=jnp.float32)
    return jnp.ones_like(j) if decay is None else jnp.exp(-j / decay)


def _anchor_blocks(dparams, target_params, dcfg: DFlashConfig, features: jax.Array, tokens: jax.Array,
                   anchors: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The drafts' logits of the blocks at anchors [S, A] (block (s, a) sees the context rows of positions < a)
    -> (logits [S*A, B - 1, V] fp32, the tokens they should propose [S*A, B - 1])."""
    backend = Backend()
    s, t = tokens.shape
    b = dcfg.block_size
    ctx_k, ctx_v = D.context_kv(dparams, dcfg, features, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t)),
                                backend)
    seq = jnp.repeat(jnp.arange(s), anchors.shape[1])
    anchor = anchors.reshape(-1)
    positions = anchor[:, None] + jnp.arange(b, dtype=jnp.int32)[None, :]
    block = D.block_tokens(tokens[seq, anchor], dcfg)
    ctx_valid = jnp.arange(t, dtype=jnp.int32)[None, :] < anchor[:, None]
    hidden = D.run_block(dparams, target_params, dcfg, block, positions, jnp.ones(block.shape, bool),
                         ctx_k[:, seq], ctx_v[:, seq], ctx_valid, features.dtype, backend)
    return D.logits_of(target_params, dcfg, hidden[:, 1:], backend), tokens[seq[:, None], positions[:, 1:]]


def drafter_loss(dparams, target_params, dcfg: DFlashConfig, features: jax.Array, tokens: jax.Array,
                 anchors: jax.Array, *, decay: float | None = None) -> jax.Array:
    """Weighted mean cross entropy of the drafts: features [S, T, n*H] (`drafter_features`) of tokens [S, T];
    anchors [S, A] positions, each in 1..T - B. Block (s, a) sees the context rows of positions < a."""
    logits, labels = _anchor_blocks(dparams, target_params, dcfg, features, tokens, anchors)
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1)[..., 0]
    w = block_weights(dcfg, decay)
    return jnp.sum(ce * w) / (ce.shape[0] * jnp.sum(w))


def teacher_forced_acceptance(dparams, target_params, dcfg: DFlashConfig, features: jax.Array, tokens: jax.Array,
                              anchors: jax.Array) -> float:
    """Mean leading greedy drafts equal to the tokens, over the blocks at anchors: what a window accepts where the
    drafter sees the exact context (as after every verified window) and tokens are the target's greedy text."""
    logits, labels = _anchor_blocks(dparams, target_params, dcfg, features, tokens, anchors)
    right = jnp.argmax(logits, axis=-1) == labels
    return float(jnp.mean(jnp.sum(jnp.cumprod(right, axis=1), axis=1)))


def adamw(loss: Callable, params, batches, *, steps: int, lr: float, warmup: int = 50, weight_decay: float = 0.01,
          log: Callable[[int, float], None] | None = None, log_every: int = 50):
    """Minimise loss(params, *batch) over `steps` batch tuples from the iterator `batches` with AdamW (linear warm-up,
    cosine decay to a tenth, gradients clipped to norm 1) -> the params. Norm weights and other vectors are not
    decayed."""
    import optax
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr / 10)
    mask = jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=weight_decay, mask=mask))
    state = opt.init(params)

    @jax.jit
    def update(params, state, *batch):
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    for i in range(steps):
        params, state, value = update(params, state, *next(batches))
        if log is not None and (i % log_every == 0 or i == steps - 1):
            log(i, float(value))
    return params


# --- writing params back as checkpoints ---------------------------------------------------------------------------

def _dense(w) -> np.ndarray:
    if isinstance(w, Fused):
        w = w.weight
    if not isinstance(w, jax.Array | np.ndarray):
        raise ValueError(f"only dense weights can be written, got {type(w).__name__}")
    return np.asarray(w, np.float32)


def _split(w: Fused, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    if not isinstance(w, Fused) or len(w.sizes) != len(names):
        raise ValueError(f"expected a fused weight of {len(names)} parts ({', '.join(names)})")
    cuts = np.cumsum(w.sizes)[:-1]
    return {f"{n}.weight": part for n, part in zip(names, np.split(_dense(w), cuts, axis=0))}


def _vec(v, *, zero_centred: bool = False) -> np.ndarray:
    """A norm weight as HF stores it: zero-centred ones hold w, applied as 1 + w (the loader added the 1)."""
    a = np.asarray(v, np.float32)
    return a - np.float32(1.0) if zero_centred else a


def model_tensors(params, cfg: ModelConfig, *, prefix: str = "model.language_model.") -> dict[str, np.ndarray]:
    """A dense text model's params (`load_checkpoint`'s tree) -> HF-named fp32 tensors: the text model of a
    Qwen3_5ForConditionalGeneration by default (the layout mlx-lm converts), "model." for a Qwen3_5ForCausalLM."""
    t = cfg.text
    out = {f"{prefix}embed_tokens.weight": _dense(params["embed"]),
           f"{prefix}norm.weight": _vec(params["norm"], zero_centred=True)}
    if params["lm_head"] is not None:
        out["lm_head.weight"] = _dense(params["lm_head"])
    for i, (kind, layer) in enumerate(zip(t.layer_types, params["layers"])):
        p = f"{prefix}layers.{i}"
        out[f"{p}.input_layernorm.weight"] = _vec(layer["input_norm"], zero_centred=True)
        out[f"{p}.post_attention_layernorm.weight"] = _vec(layer["post_norm"], zero_centred=True)
        out.update(_split(layer["mlp"]["gate_up"], (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")))
        out[f"{p}.mlp.down_proj.weight"] = _dense(layer["mlp"]["down"])
        if kind == LAYER_GDN:
            g, la = layer["gdn"], f"{p}.linear_attn"
            out.update(_split(g["in_proj"], tuple(f"{la}.in_proj_{n}" for n in ("qkv", "z", "b", "a"))))
            out[f"{la}.out_proj.weight"] = _dense(g["out"])
            out[f"{la}.conv1d.weight"] = np.asarray(g["conv"], np.float32)[:, None, :]
            out[f"{la}.dt_bias"] = _vec(g["dt_bias"])
            out[f"{la}.A_log"] = _vec(g["A_log"])
            out[f"{la}.norm.weight"] = _vec(g["norm"])
        else:
            a, sa = layer["attn"], f"{p}.self_attn"
            out.update(_split(a["qkv"], tuple(f"{sa}.{n}_proj" for n in ("q", "k", "v"))))
            out[f"{sa}.o_proj.weight"] = _dense(a["o"])
            out[f"{sa}.q_norm.weight"] = _vec(a["q_norm"], zero_centred=True)
            out[f"{sa}.k_norm.weight"] = _vec(a["k_norm"], zero_centred=True)
    return out


def drafter_tensors(params, cfg: DFlashConfig) -> dict[str, np.ndarray]:
    """A dense drafter's params (`load_dflash`'s tree) -> the DFlashDraftModel's tensors, fp32."""
    out = {"fc.weight": _dense(params["fc"]), "hidden_norm.weight": _vec(params["hidden_norm"]),
           "norm.weight": _vec(params["norm"])}
    for i, layer in enumerate(params["layers"]):
        p, a = f"layers.{i}", layer["attn"]
        out[f"{p}.input_layernorm.weight"] = _vec(layer["input_norm"])
        out[f"{p}.post_attention_layernorm.weight"] = _vec(layer["post_norm"])
        out.update(_split(layer["mlp"]["gate_up"], (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")))
        out[f"{p}.mlp.down_proj.weight"] = _dense(layer["mlp"]["down"])
        out[f"{p}.self_attn.q_proj.weight"] = _dense(a["q"])
        out.update(_split(a["kv"], (f"{p}.self_attn.k_proj", f"{p}.self_attn.v_proj")))
        out[f"{p}.self_attn.o_proj.weight"] = _dense(a["o"])
        out[f"{p}.self_attn.q_norm.weight"] = _vec(a["q_norm"])
        out[f"{p}.self_attn.k_norm.weight"] = _vec(a["k_norm"])
    return out


def write_checkpoint(out_dir: str | Path, tensors: dict[str, np.ndarray], config: dict[str, Any], *,
                     dtype: str = "bfloat16", extra_files: dict[str, Any] | None = None,
                     copy_from: str | Path | None = None) -> Path:
    """Write tensors (cast to dtype) as model.safetensors with config.json ("dtype" set), JSON files from
    extra_files (name -> object), and the tokenizer files found in copy_from."""
    from safetensors.numpy import save_file
    import ml_dtypes
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    save_file({k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in sorted(tensors.items())},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    files = {"config.json": {**config, "dtype": dtype}, **(extra_files or {})}
    for name, obj in files.items():
        (out / name).write_text(json.dumps(obj, indent=2) + "\n")
    if copy_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(copy_from) / name).exists():
                shutil.copyfile(Path(copy_from) / name, out / name)
    return out

