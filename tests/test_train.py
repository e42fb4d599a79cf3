"""qwen_jax.train on the tiny captures (CPU, float32): params written back as checkpoints load as the same params;
greedy generation with the model's own step is the engine's reply; the drafter's block loss is the cross entropy
of the cacheless drafter (`dflash.forward`) at each anchor; a few AdamW steps lower both losses."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax import train as T
from qwen_jax.checkpoint import load_checkpoint, load_dflash
from qwen_jax.engine.api import GenerationRequest
from qwen_jax.engine.engine import Engine
from qwen_jax.model import dflash as D
from qwen_jax.model.ops import Backend
from tests.conftest import CAPTURES


def _same_params(a, b) -> bool:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.mark.parametrize("name,prefix", [("tiny", "model.language_model."), ("tiny-text-tied", "model.")])
def test_written_model_loads_as_the_same_params(tmp_path, name, prefix):
    import json
    ck = load_checkpoint(CAPTURES / name, dtype=jnp.float32, progress=False)
    raw = json.loads((CAPTURES / name / "config.json").read_text())
    raw.pop("vision_config", None)
    out = T.write_checkpoint(tmp_path / name, T.model_tensors(ck.params, ck.config, prefix=prefix), raw,
                             dtype="float32", copy_from=CAPTURES / name)
    again = load_checkpoint(out, dtype=jnp.float32, progress=False)
    assert _same_params(ck.params, again.params)
    assert (out / "tokenizer.json").exists()


def test_written_drafter_loads_as_the_same_params(tmp_path):
    import json
    target = load_checkpoint(CAPTURES / "tiny", dtype=jnp.float32, progress=False)
    dr = load_dflash(CAPTURES / "tiny-dflash", target=target.config.text, dtype=jnp.float32)
    raw = json.loads((CAPTURES / "tiny-dflash" / "config.json").read_text())
    out = T.write_checkpoint(tmp_path / "d", T.drafter_tensors(dr.params, dr.config), raw, dtype="float32")
    assert _same_params(dr.params, load_dflash(out, target=target.config.text, dtype=jnp.float32).params)


def test_packed_weights_are_refused():
    ck = load_checkpoint(CAPTURES / "tiny-mlx-4bit", dtype=jnp.float32, progress=False)
    with pytest.raises(ValueError, match="only dense weights"):
        T.model_tensors(ck.params, ck.config)


@pytest.fixture(scope="module")
def tiny():
    return load_checkpoint(CAPTURES / "tiny", dtype=jnp.float32, progress=False)


def test_greedy_generation_is_the_engines_reply(tiny):
    rng = np.random.default_rng(3)
    prompts = rng.integers(0, 490, size=(2, 20)).astype(np.int32)
    got = np.asarray(jax.jit(lambda p, x: T.generate_greedy(p, tiny.config, x, 12))(tiny.params,
                                                                                     jnp.asarray(prompts)))
    assert got.shape == (2, 32) and (got[:, :20] == prompts).all()
    e = Engine(tiny.params, tiny.config, None, dtype="float32", max_model_len=128, parallel=2, backend=Backend(),
               progress=False, max_logprobs=0)
    with e:
        want = [e.submit(GenerationRequest(tuple(int(t) for t in p), 12, ignore_eos=True)).result(300).token_ids
                for p in prompts]
    assert [tuple(int(t) for t in row[20:]) for row in got] == [tuple(w) for w in want]


@pytest.fixture(scope="module")
def drafter(tiny):
    return load_dflash(CAPTURES / "tiny-dflash", target=tiny.config.text, dtype=jnp.float32)


def test_drafter_loss_is_the_cacheless_drafters_cross_entropy(tiny, drafter):
    cfg, b = drafter.config, drafter.config.block_size
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, 490, size=(2, 24)).astype(np.int32))
    feats = T.drafter_features(tiny.params, tiny.config, cfg, tokens)
    assert feats.shape == (2, 24, cfg.num_taps * cfg.hidden_size)
    anchors = np.array([[3, 11], [1, 20]], np.int32)
    got = T.drafter_loss(drafter.params, tiny.params, cfg, feats, tokens, jnp.asarray(anchors), decay=2.0)
    w = np.exp(-np.arange(b - 1) / 2.0)
    ce = []
    for s, a in itertools.product(range(2), range(2)):
        anchor = int(anchors[s, a])
        h = D.forward(drafter.params, tiny.params, cfg, feats[s:s + 1, :anchor],
                      D.block_tokens(tokens[s:s + 1, anchor], cfg), Backend())
        lp = jax.nn.log_softmax(D.logits_of(tiny.params, cfg, h[:, 1:], Backend()))[0]
        labels = np.asarray(tokens[s, anchor + 1:anchor + b])
        ce.append(-np.asarray(lp)[np.arange(b - 1), labels])
    want = float(np.sum(np.stack(ce) * w) / (4 * w.sum()))
    assert abs(float(got) - want) <= 1e-5 * abs(want)


def test_a_few_steps_lower_both_losses(tiny, drafter):
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, 490, size=(2, 64)).astype(np.int32))
    lm = lambda p, x: T.lm_loss(p, tiny.config, x)  # noqa: E731
    before = float(lm(tiny.params, tokens))
    params = T.adamw(lm, tiny.params, itertools.repeat((tokens,)), steps=6, lr=3e-3, warmup=1)
    assert float(lm(params, tokens)) < before - 0.1

    feats = T.drafter_features(tiny.params, tiny.config, drafter.config, tokens)
    anchors = jnp.asarray(rng.integers(1, 60, size=(2, 4)).astype(np.int32))
    dl = lambda p, f, x, a: T.drafter_loss(p, tiny.params, drafter.config, f, x, a)  # noqa: E731
    before = float(dl(drafter.params, feats, tokens, anchors))
    dparams = T.adamw(dl, drafter.params, itertools.repeat((feats, tokens, anchors)), steps=6, lr=3e-3, warmup=1)
    assert float(dl(dparams, feats, tokens, anchors)) < before - 0.1
