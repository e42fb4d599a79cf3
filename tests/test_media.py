"""Prompts with given embeddings (`GenerationRequest.media`: an image's rows, the vision tower's output in place of
the pad tokens' embeddings, and M-RoPE positions) on captures/tiny (reference path, CPU, float32).

The engine's reply equals the model's own: the whole prompt through `model.prefill` with the embeddings and
positions, then greedy steps at the positions after the largest prompt position. It does not depend on the prompt's
chunking (an image cut between two chunks), nor on what runs beside it (text requests and another image request
in the same calls). The media pool's rows are given back once the prompt has run, and on cancel."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax import model as M
from qwen_jax import programs as P
from qwen_jax.checkpoint import load_checkpoint, load_tokenizer
from qwen_jax.engine.api import GenerationRequest, PromptMedia, SamplingOptions
from qwen_jax.engine.engine import Engine
from qwen_jax.model import Backend
from tests.conftest import CAPTURES
from tests.test_engine import _baseline

TIMEOUT = 300
PAD, START, END = 498, 496, 497  # the tiny tokenizer's <|image_pad|>, <|vision_start|>, <|vision_end|>


@pytest.fixture(scope="module")
def ck():
    return load_checkpoint(CAPTURES / "tiny", dtype=jnp.float32, progress=False)


def _engine(ck, **kw):
    buckets = P.Buckets(prompt_rows=(64, 128), prompt_lanes=(2,), decode_streams=(4,), logprobs=1)
    args = dict(dtype="float32", max_model_len=256, parallel=4, max_queued=8, backend=Backend(), buckets=buckets,
                prefill_step=64, progress=False, media_rows=30, max_logprobs=1)
    args.update(kw)
    e = Engine(ck.params, ck.config, load_tokenizer(CAPTURES / "tiny"), **args)
    e.start()
    return e


@pytest.fixture(scope="module")
def engine(ck):
    """One engine for the module (its programs compiled once): a media pool of 30 rows, room for the two images
    that run together below (20 + 9 rows) and for one of two 25-row images at a time."""
    e = _engine(ck)
    yield e
    e.shutdown()


def _image_prompt(rng, before: int, grid: tuple[int, int], after: int, hidden: int) -> GenerationRequest:
    """Text, then an image of a merged grid (h, w) as pad rows between vision start/end, then text; M-RoPE positions
    as qwen3_5 lays them out (model_spec A.8): the image's rows at (p, p + row, p + col), then p += max(h, w)."""
    h, w = grid
    ids = [int(t) for t in rng.integers(0, 490, size=before)] + [START] + [PAD] * (h * w) + [END]
    ids += [int(t) for t in rng.integers(0, 490, size=after)]
    rope, p = [], 0
    for i, t in enumerate(ids):
        if t == PAD and ids[i - 1] == START:
            for r in range(h):
                for c in range(w):
                    rope.append((p, p + r, p + c))
            p += max(h, w)
        elif t != PAD:
            rope.append((p, p, p))
            p += 1
    rows = np.flatnonzero(np.asarray(ids) == PAD)
    embeds = rng.normal(0, 1, (len(rows), hidden)).astype(np.float32)
    media = PromptMedia(rows, embeds, np.asarray(rope, np.int64).T)
    return GenerationRequest(tuple(ids), max_tokens=10, ignore_eos=True, media=media)


def _direct(ck, req: GenerationRequest) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from the model's functions: the prompt in one chunk, then one-row windows +
    commit."""
    cfg, t = ck.config, len(req.prompt_ids)
    state = M.init_state(cfg.text, num_slots=2, num_pages=5, page_size=64, dtype=jnp.float32)
    table = np.arange(1, 5, dtype=np.int32)[None]
    tokens = np.zeros((1, 256), np.int32)
    tokens[0, :t] = req.prompt_ids
    batch = M.make_prefill_batch(tokens, [0], [t], [1], table)
    rope = np.zeros((3, 1, 256), np.int32)
    rope[:, 0, :t] = req.media.rope_positions
    batch = dataclasses.replace(batch, rope_positions=jnp.asarray(rope))
    mask = np.zeros((1, 256), bool)
    mask[0, req.media.rows] = True
    rows = np.zeros((1, 256, cfg.text.hidden_size), np.float32)
    rows[0, req.media.rows] = req.media.embeds
    logits, state, _ = M.prefill(ck.params, state, batch, cfg, Backend(), embeds=(jnp.asarray(mask),
                                                                                   jnp.asarray(rows)))
    out = [int(np.argmax(logits[0]))]
    lps = [float(jax.nn.log_softmax(logits[0])[out[-1]])]
    delta = req.media.rope_delta
    for k in range(req.max_tokens - 1):
        window = M.make_window([[out[-1]]], [[-1]], [t + k], [1], table)
        window = dataclasses.replace(window, rope_positions=window.rope_positions + delta)
        logits, kept, _ = M.verify(ck.params, state, window, cfg, Backend())
        state = M.commit(state, kept, window, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), cfg,
                         Backend())
        out.append(int(np.argmax(logits[0, 0])))
        lps.append(float(jax.nn.log_softmax(logits[0, 0])[out[-1]]))
    return out, lps


def _media_free(e: Engine) -> bool:
    return e._media.free == e._media.total


def test_image_rows_reply_as_the_model_does(ck, engine):
    rng = np.random.default_rng(4)
    h = ck.config.text.hidden_size
    req = _image_prompt(rng, 50, (4, 5), 30, h)  # the image spans the 64-row chunk boundary
    assert req.media.rope_delta < 0
    want, want_lp = _direct(ck, req)
    e = engine
    got = e.submit(dataclasses.replace(req, logprobs=0)).result(TIMEOUT)
    assert list(got.token_ids) == want
    # Other programs, so float32 noise apart (the engine's decode call runs 4 streams); a reply at the wrong
    # M-RoPE positions (the decode rows without the delta) is 0.15 away.
    np.testing.assert_allclose([lp.logprob for lp in got.logprobs], want_lp, atol=2e-5, rtol=0)
    # the embeddings and positions are used: the same ids as text give another reply
    text = e.submit(dataclasses.replace(req, media=None)).result(TIMEOUT)
    assert list(text.token_ids) != want
    # beside text requests and another image request, in the same prompt and decode calls
    other = _image_prompt(rng, 10, (3, 3), 5, h)
    texts = [GenerationRequest(tuple(int(t) for t in rng.integers(0, 490, size=n)), max_tokens=8,
                               sampling=SamplingOptions(temperature=0.8, seed=n), ignore_eos=True)
             for n in (70, 20)]
    alone = [e.submit(r).result(TIMEOUT) for r in [other] + texts]
    handles = [e.submit(r) for r in [req, texts[0], other, texts[1]]]
    together = [h.result(TIMEOUT) for h in handles]
    assert [r.token_ids for r in together] == [got.token_ids, alone[1].token_ids, alone[0].token_ids,
                                               alone[2].token_ids]
    _baseline(e)
    assert _media_free(e)


def test_media_rows_wait_free_and_refusals(ck, engine):
    rng = np.random.default_rng(8)
    h = ck.config.text.hidden_size
    e = engine
    big = [_image_prompt(rng, 5, (5, 5), 5, h) for _ in range(2)]  # 25 rows each: one at a time
    handles = [e.submit(r) for r in big]
    assert all(x.result(TIMEOUT).finish_reason == "length" for x in handles)
    assert _media_free(e)
    h0 = e.submit(dataclasses.replace(big[0], max_tokens=200))
    next(iter(h0.events()))
    h0.cancel()
    assert h0.result(TIMEOUT).finish_reason == "cancelled"
    _baseline(e)
    assert _media_free(e)
    m = big[0].media
    bad = [(PromptMedia(m.rows[::-1], m.embeds, m.rope_positions), "strictly ascending"),
           (PromptMedia(m.rows, m.embeds[:, :5], m.rope_positions), "media.embeds"),
           (PromptMedia(m.rows, m.embeds * np.nan, m.rope_positions), "media.embeds"),
           (PromptMedia(m.rows, m.embeds, m.rope_positions[:2]), "media.rope_positions"),
           (PromptMedia(np.arange(31), np.zeros((31, h)), m.rope_positions), "holds 30")]
    for media, match in bad:
        with pytest.raises(ValueError, match=match):
            e.submit(dataclasses.replace(big[0], media=media))
    plain = Engine(ck.params, ck.config, None, dtype="float32", max_model_len=128, parallel=2, backend=Backend(),
                   progress=False)
    with pytest.raises(ValueError, match="media_rows=0"):
        plain.validate(big[0])
