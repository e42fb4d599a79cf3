"""DFlash block drafts in the engine's programs (model_spec Part C; the drafter is qwen_jax.model.dflash).

With a drafter, two of `qwen_jax.programs`' programs take its params and its state too, and the drafts never
leave the device:
  prompt  the prompt chunk as before, with the target's taps (its residual stream after the drafter's
          `target_layer_ids`) of every chunk row appended to the slot's draft cache; then a draft call from the
          lane's sampled token: the slot's next block of drafts (kept when the chunk ends the prompt; a later
          chunk's replaces it otherwise).
  draft   the chain window of `programs.draft_program`, whose rows may read the slot's drafts (`FROM_DRAFT`: row
          r takes draft r - 1); after acceptance and commit, the accepted rows' taps go into the draft cache and
          a draft call from the newest sample proposes the next block.
So a stream's windows can be enqueued back to back: each reads its first token, its length and its drafts where
the previous window left them. The drafts only decide how many tokens a window yields: every row is the serial
step at its position, sampled with the keyed rule and accepted only when it equals its predecessor's sample
(drafted ≡ serial whatever the drafter proposes).

Drafts are the drafter's argmax (dflash's greedy proposal; exact-match verification makes any proposal lossless).

Rows a stream commits through the decode program (its last token, or rounds where too many streams draft for a
window call to pay: `programs.Buckets.chain_cap`) are not fed to the drafter: its context has a gap there until the
draft cache's window has moved past it, and its drafts after such a round are stale. Both cost acceptance, never
exactness.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from qwen_jax import model as M
from qwen_jax import programs as P
from qwen_jax.config import DFlashConfig, ModelConfig
from qwen_jax.model import dflash

FROM_DRAFT = -2  # a window token that says: this slot's draft for this row (row r reads draft r - 1)
# Positions of context a slot's draft cache keeps by default (the newest): the context the z-lab drafters were
# trained with (model_spec C.1).
DRAFT_WINDOW = 4096


@dataclasses.dataclass
class Drafter:
    """A loaded drafter: params (qwen_jax.checkpoint.load_dflash), its config, and the draft cache's window (rows
    of context a slot keeps: the newest `window` positions)."""
    params: dict
    cfg: DFlashConfig
    window: int = 4096


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
    """The drafter's device state: the context K/V of each slot's committed rows, and each slot's next drafts
    [slots, B - 1] int32."""
    cache: dflash.DraftCache
    drafts: jax.Array


def init_draft_state(d: Drafter, num_slots: int, dtype) -> DraftState:
    cache = dflash.init_cache(d.cfg, num_slots=num_slots, window=d.window, dtype=dtype)
    return DraftState(cache, jnp.zeros((num_slots, d.cfg.block_size - 1), jnp.int32))


def propose(logits: jax.Array, slot: jax.Array, anchor_position: jax.Array) -> jax.Array:
    """The drafter's logits [S, B - 1, V] for the positions after anchor_position [S] of each stream's slot [S] ->
    drafts [S, B - 1] int32 (argmax; tests swap in oracles that read the slot and position)."""
    del slot, anchor_position
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _draft_next(params, dparams, dcfg: DFlashConfig, backend: M.Backend, dstate: DraftState, slot, cache_len,
                taps, n_new, anchor) -> DraftState:
    """Append each stream's first n_new rows of taps [S, T, n, H] (positions cache_len..) to its slot's draft cache,
    then draft the block after them from `anchor` [S]."""
    s, t = taps.shape[:2]
    b = dcfg.block_size
    batch = dflash.DraftBatch(slot, cache_len, taps.reshape(s, t, -1), n_new, dflash.block_tokens(anchor, dcfg),
                              jnp.full((s,), b, jnp.int32))
    with jax.named_scope("dflash"):
        logits, cache = dflash.draft(dparams, params, dcfg, dstate.cache, batch, backend)
    return DraftState(cache, dstate.drafts.at[slot].set(propose(logits, slot, cache_len + n_new)))


def prompt_program(cfg: ModelConfig, dcfg: DFlashConfig, backend: M.Backend, packing: P.Packing,
                   top_n: int) -> Callable:
    """(params, dparams, state, dstate, batch [S x T], sample params [S], media, embed rows) -> (state, dstate,
    tokens [S], logprobs or None): `programs.prompt_program`, the chunk's taps appended to the draft cache and a
    block drafted from each lane's sample (empty lanes: slot 0, nothing appended)."""
    lanes_fn = P.prompt_lanes(packing)

    def program(params, dparams, state, dstate, batch, sp, media, embed_rows):
        with jax.named_scope("prompt"):
            logits, state, taps = lanes_fn(params, state, batch, cfg, backend, taps=dcfg.target_layer_ids,
                                           embeds=P.media_embeds(media, embed_rows))
        tokens, lp = P.sample_rows(logits, sp, top_n)
        dstate = _draft_next(params, dparams, dcfg, backend, dstate, batch.slot, batch.start, taps, batch.lengths,
                             tokens)
        return state, dstate, tokens, lp

    return program


def window_program(cfg: ModelConfig, dcfg: DFlashConfig, backend: M.Backend, top_n: int) -> Callable:
    """(params, dparams, state, dstate, last, lens, window [S x R] of chains, sample params [S*R]) -> (state, dstate,
    last, lens, tokens [S, R], logprobs or None, accepted rows [S]): `programs.draft_program` with window tokens of
    `FROM_DRAFT` read from the slot's drafts (R <= the block size), then the accepted rows' taps appended to the
    draft cache and the next block drafted from the newest sample."""

    def program(params, dparams, state, dstate, last, lens, window, sp):
        r = window.tokens.shape[1]
        drafted = dstate.drafts[window.slot][:, jnp.maximum(jnp.arange(r) - 1, 0)]
        window = dataclasses.replace(window, tokens=jnp.where(window.tokens == FROM_DRAFT, drafted, window.tokens))
        w = P.chain_window(params, state, last, lens, window, sp, cfg, backend, top_n, taps=dcfg.target_layer_ids)
        dstate = _draft_next(params, dparams, dcfg, backend, dstate, window.slot, w.cache_len, w.taps, w.took,
                             w.newest)
        return w.state, dstate, w.last, w.lens, w.tokens, w.logprobs, w.took

    return program


def slot_copy_program() -> Callable:
    """(state, dstate, src, dst) -> (state, dstate): `programs.slot_copy_program` and slot src's draft cache rows
    and drafts copied to slot dst (the prompt cache keeps and restores them with the GDN states)."""
    base = P.slot_copy_program()

    def program(state, dstate, src, dst):
        cache = dstate.cache
        cache = dflash.DraftCache(cache.k.at[:, dst].set(cache.k[:, src]), cache.v.at[:, dst].set(cache.v[:, src]))
        return base(state, src, dst), DraftState(cache, dstate.drafts.at[dst].set(dstate.drafts[src]))

    return program
