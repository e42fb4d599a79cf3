"""One running request on the scheduler's side: where its prompt and cache stand, and what each decided token
does to its reply (stop ids, stop strings, max tokens, context end)."""

from __future__ import annotations

import collections
import enum

import numpy as np

from qwen_jax import sampling
from qwen_jax.engine.api import GenerationRequest, TokenEvent, TokenLogprob
from qwen_jax.engine.drafts import CopyIndex
from qwen_jax.engine.handle import RequestHandle
from qwen_jax.engine.policy import Acceptance
from qwen_jax.engine.text import Detokenizer, StopStrings


class Phase(enum.Enum):
    PROMPT = "prompt"  # prompt chunks still to run
    DECODE = "decode"  # one pending token (sampled, not yet in the cache) per round


class Stream:
    def __init__(self, handle: RequestHandle, *, slot: int, pages: list[int], pages_per_stream: int,
                 sampling_rule: sampling.RequestSampling, stop_ids: frozenset[int], max_model_len: int, tokenizer,
                 copy_drafts: bool = False, block_drafts: bool = False, resumed: int = 0,
                 media_rows: list[int] = (), penalties: sampling.RequestPenalties | None = None,
                 matcher=None, grammar_after: int | None = None):
        req: GenerationRequest = handle.request
        self.handle = handle
        self.request = req
        self.prompt = np.asarray(req.prompt_ids, np.int32)
        self.slot = slot
        self.pages = pages
        self.page_table = np.zeros(pages_per_stream, np.int32)
        self.page_table[:len(pages)] = pages
        self.sampling = sampling_rule
        self.penalties = penalties  # None when all are neutral
        self.stop_ids = stop_ids
        self.max_model_len = max_model_len
        self.phase = Phase.PROMPT
        self.prefilled = resumed  # prompt rows in the cache (a resumed prompt starts with a kept prefix's)
        self.keep_at: list[int] = []  # prompt lengths whose states the prompt cache keeps (ascending)
        self.cache_len = 0  # positions in the cache (prompt + committed reply tokens)
        self.next_input: int | None = None  # the next decode call's input when the host has it (after a prompt)
        self.sampled = 0  # tokens sampled so far, including decode calls still in flight
        self.finishing = False  # max_tokens or the context end comes with its last sampled token: no more calls
        self.inflight = 0  # decode calls or draft windows dispatched and not yet fetched
        self.drafting = False  # in draft windows (its calls in flight, if any, are windows)
        # per draft window in flight: what it yields if every draft stands and its last sample is the copy's next
        # token, and whether that guess still stands (False once an earlier window went another way)
        self.windows: collections.deque[tuple[list[int], bool]] = collections.deque()
        # Structured outputs: the grammar's matcher (qwen_jax.structured.Matcher; None: free text), on from the
        # first token or once `grammar_after` is generated. Such a stream's calls are not pipelined (each needs its
        # tokens so far on the host); its windows mask each row along the drafts (`Engine._row_masks`).
        self.matcher = matcher
        self.grammar_after = grammar_after
        self.grammar_on = matcher is not None and grammar_after is None
        # A thinking budget (`GenerationRequest.thinking_budget`): whether the think block is still open as far as
        # the host knows (its tokens landed), and whether the bias row on the device forces its end now.
        self.think_open = req.thinking_budget is not None
        self.think_forced = False
        self.base_bias: np.ndarray | None = None  # its logit bias as a [V] row (set by the engine with a matcher)
        # prompt + decided tokens, indexed for copy drafts (None: this stream decodes serially)
        self.copies = CopyIndex(req.prompt_ids) if copy_drafts and req.draft else None
        # drafts from the engine's DFlash drafter, on the device (qwen_jax.dflash_programs)
        self.block_drafts = block_drafts and req.draft
        self.acceptance = Acceptance()  # what its windows kept, for the rows of the next (engine.policy)
        self.generated: list[int] = []
        self.detok = Detokenizer(tokenizer, skip_special_tokens=req.skip_special_tokens) if tokenizer else None
        self.stops = StopStrings(req.stop)
        # Images: the media pool rows holding its image rows' embeddings (given back once the prompt has run), each
        # prompt row's pool row (-1: its token's embedding), its M-RoPE positions, and how far the reply's M-RoPE
        # positions run from its cache positions
        self.media_rows = list(media_rows)
        self.embed_rows: np.ndarray | None = None
        self.rope: np.ndarray | None = None
        self.rope_delta = 0
        if req.media is not None:
            self.embed_rows = np.full(len(self.prompt), -1, np.int32)
            self.embed_rows[np.asarray(req.media.rows)] = self.media_rows
            self.rope = np.asarray(req.media.rope_positions, np.int32)
            self.rope_delta = req.media.rope_delta

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def next_chunk(self, cap: int) -> tuple[int, int]:
        """(start, length) of the next prompt chunk of at most `cap` rows (cap a multiple of the grid, so every
        chunk but the last ends on the grid and the next one starts on it), ending at the next keep point."""
        end = min(self.prompt_len, self.prefilled + cap, *self.keep_at[:1])
        return self.prefilled, end - self.prefilled

    def media_chunk(self, start: int, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The embed rows and M-RoPE positions of prompt rows start..start+n (None, None for text)."""
        if self.embed_rows is None:
            return None, None
        return self.embed_rows[start:start + n], self.rope[:, start:start + n]

    def assumed(self) -> list[int]:
        """The tokens the draft windows in flight are guessed to yield, in order."""
        return [t for yielded, _ in self.windows for t in yielded]

    def think_due(self) -> bool:
        """Whether the next token sampled is the one a thinking budget forces, should the think block still be
        open (the tokens before it landed: `think_open`)."""
        return self.think_open and self.sampled == self.request.thinking_budget

    def budget(self) -> int:
        """Tokens this stream may still sample (max_tokens and the context end)."""
        return min(self.request.max_tokens - self.sampled, self.max_model_len - self.prompt_len - self.sampled)

    def token_event(self, token: int, logprob: TokenLogprob | None) -> TokenEvent:
        """Record a decided token and return its event (finish_reason set when this token ends the reply)."""
        self.generated.append(token)
        if token == self.request.think_end:
            self.think_open = False
        if self.copies is not None:
            self.copies.append(token)
        if self.matcher is not None and token not in self.stop_ids:
            if self.grammar_on:
                self.matcher.advance(token)  # a token the mask forbade: ValueError, the stream fails
            elif token == self.grammar_after:
                self.grammar_on = True
        finish = reason = None
        if token in self.stop_ids:
            finish = "stop"  # the stop token's own text is not part of the reply; what was held back is
            reason = token if token in self.request.stop_token_ids else None
            text = self._flush()
        else:
            text = self.detok.add(token) if self.detok is not None else ""
            hit = False
            if len(self.generated) > self.request.min_tokens:  # stop strings in the text after min_tokens only
                text, hit = self.stops.feed(text)
            if hit:
                finish, reason = "stop", self.stops.matched  # the match and anything after it are dropped
            elif self.grammar_on and self.matcher.terminated:
                finish = "stop"  # the grammar's document is whole and nothing may follow it
                text += self._flush()
            elif (len(self.generated) >= self.request.max_tokens
                  or self.prompt_len + len(self.generated) >= self.max_model_len):
                finish = "length"
                text += self._flush()
        lps = (logprob,) if logprob is not None else None
        return TokenEvent((token,), text, lps, finish, stop_reason=reason)

    def _flush(self) -> str:
        if self.detok is None:
            return ""
        text, hit = self.stops.feed(self.detok.flush())
        return text if hit else text + self.stops.flush()
