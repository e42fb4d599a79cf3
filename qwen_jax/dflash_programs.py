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

Drafts are the drafter's argmax (dflash's greedy proposal; exact-match verification makes any proposal lossless),
or, with `Drafter.tree_rows`, a tree (`propose_tree`): the drafter scores each block position apart from the
others, so the likeliest continuations are the prefixes with the highest sums of per-position log-probabilities,
and the tree is the best of them found best first. A window of r rows takes the tree's first r - 1 nodes, itself a
tree (a node is found after its parent). Its rows are verified as serial steps too (`programs.chain_window`'s
tree), so a tree changes how many tokens a window yields, never which.

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

# A tree window's rows (the gdn window kernels take up to 16 rows a stream).
TREE_ROWS_MAX = 16
FROM_DRAFT = -2  # a window token that says: this slot's draft for this row (row r reads draft r - 1)
# Positions of context a slot's draft cache keeps by default (the newest): the context the z-lab drafters were
# trained with (model_spec C.1).
DRAFT_WINDOW = 4096


@dataclasses.dataclass
class Drafter:
    """A loaded drafter: params (qwen_jax.checkpoint.load_dflash), its config, and the draft cache's window (rows
    of context a slot keeps: the newest `window` positions). tree_rows: 0 for chains of the argmax; else windows
    verify trees of up to that many rows (the pending token and tree_rows - 1 drafts), each node with up to
    tree_branch children."""
    params: dict
    cfg: DFlashConfig
    window: int = 4096
    tree_rows: int = 0
    tree_branch: int = 2

    def __post_init__(self):
        if self.tree_rows and not 2 <= self.tree_rows <= TREE_ROWS_MAX:
            raise ValueError(f"tree_rows: a tree window of 2 to {TREE_ROWS_MAX} rows, got {self.tree_rows}")
        if self.tree_rows and not 1 <= self.tree_branch <= 8:
            raise ValueError(f"tree_branch (--draft-tree): 1 to 8 children a node, got {self.tree_branch}")

    @property
    def nodes(self) -> int:
        """Drafts a slot keeps: a block's proposals, or a tree's nodes."""
        return self.tree_rows - 1 if self.tree_rows else self.cfg.block_size - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
    """The drafter's device state: the context K/V of each slot's committed rows, each slot's next drafts
    [slots, n] int32 (`Drafter.nodes`), and the window row each draft hangs off [slots, n] (draft i is row i + 1; a
    chain's draft i hangs off row i)."""
    cache: dflash.DraftCache
    drafts: jax.Array
    parents: jax.Array


def init_draft_state(d: Drafter, num_slots: int, dtype) -> DraftState:
    cache = dflash.init_cache(d.cfg, num_slots=num_slots, window=d.window, dtype=dtype)
    chain = jnp.broadcast_to(jnp.arange(d.nodes, dtype=jnp.int32), (num_slots, d.nodes))
    return DraftState(cache, jnp.zeros((num_slots, d.nodes), jnp.int32), chain)


def propose(logits: jax.Array, slot: jax.Array, anchor_position: jax.Array) -> jax.Array:
    """The drafter's logits [S, B - 1, V] for the positions after anchor_position [S] of each stream's slot [S] ->
    drafts [S, B - 1] int32 (argmax; tests swap in oracles that read the slot and position)."""
    del slot, anchor_position
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def propose_tree(logits: jax.Array, slot: jax.Array, anchor_position: jax.Array, nodes: int, branch: int
                 ) -> tuple[jax.Array, jax.Array]:
    """The drafter's logits [S, B - 1, V] for the positions after anchor_position [S] of each stream's slot [S]
    -> (tokens [S, nodes], parents [S, nodes]) (tests swap in oracles that read the slot and position): the tree of
    the `nodes` likeliest continuations under the drafter's per-position distributions, a continuation's score the
    sum of its tokens' log-probabilities, each node taking its position's `branch` likeliest tokens at most. Found
    best first: a frontier holds, for every node found, its likeliest child not yet taken and the sibling after it;
    each step takes the frontier's best (ties: the earliest entry). Node i is window row i + 1 and hangs off row
    parents[i] (0: the pending token); a node is found after its parent, so any first k nodes form a tree. Past a
    frontier that runs dry (branch 1: a chain of B - 1), padding rows: token 0, hanging off the root's parent."""
    del slot, anchor_position
    s, depth_max = logits.shape[:2]
    k = min(branch, logits.shape[-1])
    top_lp, top_tok = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)  # [S, D, k]
    width = nodes + 1
    neg = jnp.float32(-jnp.inf)
    idx = jnp.arange(s)
    # frontier entries: score, parent's score, parent row, depth (0-based block position), rank among its siblings
    score = jnp.full((s, width), neg).at[:, 0].set(top_lp[:, 0, 0])
    base = jnp.zeros((s, width), jnp.float32)
    par = jnp.zeros((s, width), jnp.int32)
    dep = jnp.zeros((s, width), jnp.int32)
    rank = jnp.zeros((s, width), jnp.int32)
    tokens, parents = [], []
    for n in range(nodes):
        j = jnp.argmax(score, axis=1)
        pick = lambda a: a[idx, j]  # noqa: E731
        sc, bs, pr, dp, rk = pick(score), pick(base), pick(par), pick(dep), pick(rank)
        tokens.append(jnp.where(sc > neg, top_tok[idx, dp, jnp.minimum(rk, k - 1)], 0))
        parents.append(jnp.where(sc > neg, pr, -1))
        # the taken entry becomes its next sibling; the node's likeliest child goes into a fresh entry
        nxt = rk + 1
        sib = jnp.where(nxt < k, bs + top_lp[idx, dp, jnp.minimum(nxt, k - 1)], neg)
        score, rank = score.at[idx, j].set(sib), rank.at[idx, j].set(nxt)
        child = jnp.where(dp + 1 < depth_max, sc + top_lp[idx, jnp.minimum(dp + 1, depth_max - 1), 0], neg)
        score = score.at[:, n + 1].set(child)
        base, par = base.at[:, n + 1].set(sc), par.at[:, n + 1].set(n + 1)
        dep, rank = dep.at[:, n + 1].set(dp + 1), rank.at[:, n + 1].set(0)
    return jnp.stack(tokens, axis=1).astype(jnp.int32), jnp.stack(parents, axis=1).astype(jnp.int32)


def _draft_next(params, dparams, d: Drafter, backend: M.Backend, dstate: DraftState, slot, cache_len,
                taps, n_new, anchor) -> DraftState:
    """Append each stream's first n_new rows of taps [S, T, n, H] (positions cache_len..) to its slot's draft cache,
    then draft the block after them from `anchor` [S]: its argmax, or its tree (`Drafter.tree_rows`)."""
    s, t = taps.shape[:2]
    dcfg = d.cfg
    b = dcfg.block_size
    batch = dflash.DraftBatch(slot, cache_len, taps.reshape(s, t, -1), n_new, dflash.block_tokens(anchor, dcfg),
                              jnp.full((s,), b, jnp.int32))
    with jax.named_scope("dflash"):
        logits, cache = dflash.draft(dparams, params, dcfg, dstate.cache, batch, backend)
    if not d.tree_rows:
        return DraftState(cache, dstate.drafts.at[slot].set(propose(logits, slot, cache_len + n_new)),
                          dstate.parents)
    tokens, parents = propose_tree(logits, slot, cache_len + n_new, d.nodes, d.tree_branch)
    return DraftState(cache, dstate.drafts.at[slot].set(tokens), dstate.parents.at[slot].set(parents))


def prompt_program(cfg: ModelConfig, d: Drafter, backend: M.Backend, packing: P.Packing,
                   top_n: int) -> Callable:
    """(params, dparams, state, dstate, batch [S x T], sample params [S], media, embed rows, penalties [S], history)
    -> (state, dstate, tokens [S], logprobs or None): `programs.prompt_program`, the chunk's taps appended to the
    draft cache and a block drafted from each lane's sample (empty lanes: slot 0, nothing appended)."""
    lanes_fn = P.prompt_lanes(packing)

    def program(params, dparams, state, dstate, batch, sp, media, embed_rows, pen, hist):
        with jax.named_scope("prompt"):
            logits, state, taps = lanes_fn(params, state, batch, cfg, backend, taps=d.cfg.target_layer_ids,
                                           embeds=P.media_embeds(media, embed_rows))
        tokens, lp = P.sample_rows(logits, sp, top_n, penalties=P.prompt_penalties(pen, hist, batch.slot))
        dstate = _draft_next(params, dparams, d, backend, dstate, batch.slot, batch.start, taps, batch.lengths,
                             tokens)
        return state, dstate, tokens, lp

    return program


def window_program(cfg: ModelConfig, d: Drafter, backend: M.Backend, top_n: int,
                   scratch_pages: int = 0) -> Callable:
    """(params, dparams, state, dstate, last, lens, history, window [S x R] of chains, sample params [S*R], penalties
    [S*R], grammar masks [S*R, W]) -> (state, dstate, last, lens, history, tokens [S, R], logprobs or None, accepted
    rows [S]):
    `programs.draft_program` with window tokens of
    `FROM_DRAFT` read from the slot's drafts (R <= the drafts kept + 1), then the accepted rows' taps appended to the
    draft cache and the next block drafted from the newest sample.

    With trees (`Drafter.tree_rows`), a stream whose row 1 is `FROM_DRAFT` verifies its slot's tree instead of the
    host's chain: the drafts hang off the rows `DraftState.parents` says, rows past the tree's first R - 1 nodes and
    the rows of other streams keep the host's parents. The tree reads its ancestors through the pool's scratch pages
    from `scratch_pages` on (`Layout.tree_pages`: two a row), and the tokens handed back are the accepted path's
    first (`programs.chain_window`)."""

    def program(params, dparams, state, dstate, last, lens, hist, window, sp, pen, mask):
        s, r = window.tokens.shape
        drafted = dstate.drafts[window.slot][:, jnp.maximum(jnp.arange(r) - 1, 0)]
        from_draft = window.tokens == FROM_DRAFT
        window = dataclasses.replace(window, tokens=jnp.where(from_draft, drafted, window.tokens))
        tree = None
        if d.tree_rows:
            hung = dstate.parents[window.slot][:, jnp.maximum(jnp.arange(r) - 1, 0)]
            parents = jnp.where(from_draft, hung, window.parents)
            scratch = (scratch_pages + jnp.arange(s * r * 2, dtype=jnp.int32)).reshape(s, r, 2)
            tree = (parents, scratch)
        w = P.chain_window(params, state, last, lens, window, sp, cfg, backend, top_n, taps=d.cfg.target_layer_ids,
                           tree=tree, hist=hist, pen=pen, mask=mask)
        dstate = _draft_next(params, dparams, d, backend, dstate, window.slot, w.cache_len, w.taps, w.took,
                             w.newest)
        return w.state, dstate, w.last, w.lens, w.hist, w.tokens, w.logprobs, w.took, w.ranks

    return program


def slot_copy_program() -> Callable:
    """(state, dstate, src, dst) -> (state, dstate): `programs.slot_copy_program` and slot src's draft cache rows,
    drafts and their parents copied to slot dst (the prompt cache keeps and restores them with the GDN states)."""
    base = P.slot_copy_program()

    def program(state, dstate, src, dst):
        cache = dstate.cache
        cache = dflash.DraftCache(cache.k.at[:, dst].set(cache.k[:, src]), cache.v.at[:, dst].set(cache.v[:, src]))
        return base(state, src, dst), DraftState(cache, dstate.drafts.at[dst].set(dstate.drafts[src]),
                                                 dstate.parents.at[dst].set(dstate.parents[src]))

    return program
