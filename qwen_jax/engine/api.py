"""The engine's public surface: what the server (and the offline CLI) hand in and get back.

A request goes in as a `GenerationRequest` of token ids; `Engine.submit` returns a `RequestHandle` at once (or
raises: `EngineOverloaded` when the bounded queue is full, `ContextLengthExceeded` when the prompt can never fit,
`ValueError` for bad parameters). The handle yields `TokenEvent`s as tokens are decided (async iteration for the
server, `events()` for synchronous callers) and ends with an event carrying `finish_reason`. `cancel()` stops the
request at the next round (a queued request never starts) and frees its state.
"""

from __future__ import annotations

import dataclasses

import numpy as np


class EngineOverloaded(RuntimeError):
    """The wait queue is full; retry later (HTTP 503 with Retry-After)."""


class ContextLengthExceeded(ValueError):
    """The prompt (plus at least one new token) can never fit the context this engine serves."""


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None  # None: derived from the prompt (qwen_jax.sampling.derive_seed), so replies reproduce
    # Penalties on tokens already in the context (qwen_jax.sampling.Penalties); drafted windows count each row's path.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits first


@dataclasses.dataclass(frozen=True, eq=False)
class PromptMedia:
    """Prompt rows whose embeddings are given instead of their tokens' (an image's rows: the vision tower's output in
    place of the image pad tokens'), and the prompt's M-RoPE positions. The reply's positions continue from the
    largest prompt position + 1 (`rope_delta`)."""
    rows: np.ndarray  # [n] int: prompt rows, strictly ascending
    embeds: np.ndarray  # [n, hidden] float: their embeddings (cast to the compute dtype)
    rope_positions: np.ndarray  # [3, T] int: (t, h, w) position of every prompt row, T = len(prompt_ids)

    @property
    def rope_delta(self) -> int:
        """Where the reply's positions stand against its cache positions: max + 1 - T."""
        return int(np.max(self.rope_positions)) + 1 - self.rope_positions.shape[1]


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingOptions = SamplingOptions()
    stop: tuple[str, ...] = ()  # stop strings, matched on the detokenized text; the match is not returned
    stop_token_ids: tuple[int, ...] = ()  # extra stop ids besides the checkpoint's EOS ids
    ignore_eos: bool = False
    # The reply's first min_tokens tokens are never a stop id (they get -inf before the draw) and stop strings are
    # looked for only in the text after them (vLLM's min_tokens). At most max_tokens.
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; n >= 0: the chosen token's logprob plus the top n
    draft: bool = True  # False: serial decoding (the reference the drafted path must equal)
    request_id: str = ""
    skip_special_tokens: bool = True  # text leaves out the tokenizer's special tokens (token_ids keep them)
    media: PromptMedia | None = None  # image rows (embeddings given) and M-RoPE positions; None: text only
    # Structured outputs: the reply's text follows this grammar (a qwen_jax.structured.Grammar; the sampler never
    # draws a token outside it, and the reply ends where the grammar's document ends). Such a request's calls are
    # not pipelined (each step's mask needs the tokens before it on the host); it drafts as others do (chains: a
    # window's rows masked along its drafts), but for tree windows, where it decodes serially.
    grammar: object | None = None
    # The grammar starts after this token id is generated (the end of a think block); None: from the first token.
    grammar_after: int | None = None
    # A thinking budget: the prompt leaves a think block open and `think_end` is the token that closes it; if the
    # reply has not produced think_end among its first thinking_budget tokens, its next token is think_end (-inf
    # at every other id before that draw). None: no budget. While its think block is open such a stream decodes
    # serially (no drafts), and the call that may force the token waits for the tokens before it on the host.
    thinking_budget: int | None = None
    think_end: int | None = None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]  # tokens decided since the previous event
    text: str  # text newly safe to show (a possible stop-string prefix is held back until resolved)
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error" on the last event
    error: str | None = None
    # with finish_reason "stop": the stop string that matched, or the stop id from stop_token_ids (None: EOS or the
    # grammar's end), as vLLM's stop_reason
    stop_reason: str | int | None = None


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Counters for /metrics, /health and the leak tests (pools return to baseline after finish/cancel/error)."""
    running: int
    waiting: int
    free_pages: int
    total_pages: int
    free_slots: int
    total_slots: int
    prompt_tokens_total: int
    generation_tokens_total: int
    draft_proposed_total: int = 0
    draft_accepted_total: int = 0
    draft_windows_total: int = 0  # drafted windows landed, one a stream (each gives its accepted drafts + 1 tokens)
    prompt_cache_entries: int = 0  # kept prompt states (each holds a kept GDN slot and shares KV pages)
    prompt_cache_hits_total: int = 0  # requests resumed from a kept prompt state
    prompt_cache_hit_tokens_total: int = 0  # prompt tokens those requests did not run
    prompt_cache_queried_tokens_total: int = 0  # prompt tokens of every request started with the cache on


# The Engine class (qwen_jax/engine/engine.py) implements this contract:
#   Engine.from_checkpoint(model_dir, *, dtype="bfloat16", kv_cache="bf16", max_model_len=4096, parallel=16,
#                          max_queued=64, backend=None, progress=True) -> Engine
#     also: compile_cache (persistent compilation cache dir, default $QWEN_JAX_CACHE_DIR or ~/.cache/qwen_jax/jax;
#     None = off), max_logprobs=20 (the most top logprobs a request may ask; 0 = logprobs refused), and the
#     Engine(...) keywords (num_pages, buckets, max_prefill_chunk, prefill_step, seed_salt, fixed_shapes).
#   engine.tokenizer, engine.model_config (qwen_jax.config.ModelConfig), engine.model_name, engine.max_model_len
#   engine.start()      compile every program bucket (progress bar), start the scheduler thread
#   engine.shutdown()   queued and running requests end with finish_reason "error"
#   engine.submit(GenerationRequest) -> RequestHandle   (raises EngineOverloaded / ContextLengthExceeded / ValueError)
#   engine.validate(GenerationRequest)                  the same checks as submit, without queueing
#   engine.stats() -> EngineStats
# RequestHandle: request_id, prompt_tokens, completion_tokens, cancel(), `async for ev in handle`, handle.events()
#   (blocking iterator), handle.result() (the whole reply as a Completion), and monotonic timestamps
#   arrival_time / first_token_time / finish_time for metrics.
# Events: one per decided token (token_ids holds that token, stop ids included; text leaves stop ids and stop
#   strings out); the last event carries finish_reason. "stop"/"length" arrive on the event of the token that
#   ended the reply; "cancelled" and "error" on an extra event with empty token_ids.
