"""Requests in, engine calls, responses out: the chat template and tokenizer, sampling defaults, the context
check, submission, and turning `TokenEvent`s into OpenAI bodies or SSE chunks. No HTTP here (app.py) and no arrays
(the engine).

Cancellation: every path that stops listening before the engine finished (client gone, stream cancelled,
exception) runs `_Run.close`, which calls `handle.cancel()`; the engine then stops the request at its next round or,
if it is still queued, never starts it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

import numpy as np

from qwen_jax.engine.api import (ContextLengthExceeded, EngineOverloaded, GenerationRequest, PromptMedia,
                                 SamplingOptions, TokenEvent, TokenLogprob)
from qwen_jax.sampling import RequestPenalties, choice_seed, derive_seed
from server import protocol as P
from server.errors import APIError, bad_request, error_body
from server.images import ImageLimits, message_images
from server.metrics import ServerMetrics
from server.parsers import (THINK_END, THINK_START, TOOL_END, TOOL_START, ForcedCalls, ForcedReplyParser,
                            ParsedReply, ReplyDelta, ReplyParser, parse_forced, parse_reply, prompt_opens_think,
                            resolve_reasoning_parser)

# How long a client told "overloaded" should wait; one decode round is milliseconds, admission frees as soon as
# any request finishes, so a short retry is right.
RETRY_AFTER_SECONDS = 1
# Compiled grammars kept, response_format's and forced tool calls' (a schema's masks are cached with its grammar,
# so repeats are cheap).
GRAMMARS_KEPT = 16


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling values for fields a request leaves out. Without a generation_config.json: OpenAI's defaults
    (temperature 1, no top-p/top-k/min-p cut, no repetition penalty)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0


def load_generation_defaults(model_dir: str | Path | None) -> GenerationDefaults:
    """The checkpoint's recommended sampling (what vLLM applies by default). `do_sample: false` means greedy."""
    if model_dir is None:
        return GenerationDefaults()
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return GenerationDefaults()
    try:
        gen = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None
    base = GenerationDefaults()

    def pick(key, kind, fallback):
        v = gen.get(key)
        return kind(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else fallback

    temperature = pick("temperature", float, base.temperature)
    if gen.get("do_sample") is False:
        temperature = 0.0
    repetition = pick("repetition_penalty", float, base.repetition_penalty)
    try:
        RequestPenalties(repetition=repetition)  # the engine's own check of the value
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return GenerationDefaults(temperature=temperature, top_p=pick("top_p", float, base.top_p),
                              top_k=max(pick("top_k", int, base.top_k), 0), min_p=pick("min_p", float, base.min_p),
                              repetition_penalty=repetition)


# apply_chat_template's own parameters; chat_template_kwargs may only add template variables, not override these.
_TEMPLATE_PARAMS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) \
    - {"self", "kwargs"}


def _template_clash(kwargs: dict[str, Any]) -> list[str]:
    """The keys of chat template variables that are apply_chat_template's own parameters (not allowed)."""
    return sorted(k for k in kwargs if k in _TEMPLATE_PARAMS)


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """Server-wide chat template variables: a JSON object whose keys are not apply_chat_template's own parameters.
    ValueError naming `--default-chat-template-kwargs` otherwise."""
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"--default-chat-template-kwargs must be a JSON object, got {kwargs!r}")
    clash = _template_clash(kwargs)
    if clash:
        raise ValueError(f"--default-chat-template-kwargs: {', '.join(clash)} cannot be set this way "
                         "(apply_chat_template's own parameters)")
    return dict(kwargs)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_payloads(chunks: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The decoded payloads of an SSE stream of ours (`_sse` pieces), [DONE] left out: what the routes that rewrite
    the chat stream in another API's events read."""
    async for raw in chunks:
        data = raw[len("data: "):].strip() if raw.startswith("data: ") else ""
        if data and data != "[DONE]":
            yield json.loads(data)


class _Run:
    """One submitted request's bookkeeping: latency metrics as events arrive, and a close that runs exactly once
    (finish reason counted, handle cancelled if the engine had not finished it)."""

    def __init__(self, handle, metrics: ServerMetrics):
        self.handle = handle
        self.metrics = metrics
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.token_ids: list[int] = []  # the reply's ids so far (stop ids included), for return_token_ids
        self.stop_reason: str | int | None = None  # the engine's (TokenEvent.stop_reason)
        self._last_token_at: float | None = None
        self._closed = False

    async def events(self) -> AsyncIterator[TokenEvent]:
        async for ev in self.handle:
            if ev.token_ids:
                self.token_ids += ev.token_ids
                now = time.monotonic()
                if self._last_token_at is not None:
                    gap = (now - self._last_token_at) / len(ev.token_ids)
                    for _ in ev.token_ids:
                        self.metrics.itl.observe(gap)
                self._last_token_at = now
            if ev.finish_reason is not None:
                self.finish_reason = ev.finish_reason
                self.error = ev.error
                self.stop_reason = ev.stop_reason
            yield ev
            if ev.finish_reason is not None:
                return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.finish_reason is None:
            self.handle.cancel()
            self.finish_reason = "cancelled"
        self.metrics.finished(self.finish_reason)
        h = self.handle
        if h.first_token_time is not None and h.arrival_time is not None:
            self.metrics.ttft.observe(h.first_token_time - h.arrival_time)
        if self.finish_reason in ("stop", "length") and h.finish_time is not None:
            self.metrics.e2e.observe(h.finish_time - h.arrival_time)


def _usage(runs: list[_Run], n: int | None = None) -> dict:
    """A reply's usage over its choices, each n consecutive runs one prompt's (default: all of them): each prompt
    once, the completions summed, and the prompt tokens that every choice of a prompt took from the prompt cache."""
    n = n or len(runs)
    groups = [runs[i:i + n] for i in range(0, len(runs), n)]
    p = sum(g[0].handle.prompt_tokens for g in groups)
    c = sum(r.handle.completion_tokens for r in runs)
    cached = sum(min(r.handle.cached_tokens for r in g) for g in groups)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _close_all(runs: list[_Run]) -> Callable[[], None]:
    def close() -> None:
        for r in runs:
            r.close()
    return close


async def _merged(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The chunks of several choices' streams as they come, each stream's in its own order (when several are ready
    at once, the lower choice first)."""
    if len(streams) == 1:
        async for piece in streams[0]:
            yield piece
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                i = pending.pop(task)
                try:
                    piece = task.result()
                except StopAsyncIteration:
                    continue
                yield piece
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in streams:
            await it.aclose()


@dataclass(frozen=True)
class ReplyMode:
    """How a chat reply's text is parsed (server/parsers.py): the think block split off (--reasoning-parser),
    whether the prompt left one open, and tool calls parsed out of the content (a request with tools, whose schemas
    type XML calls' arguments) or, when tool_choice forces calls, read from the content's JSON document."""
    reasoning: bool = False
    in_think: bool = False
    tools: bool = False
    tool_schemas: tuple[dict[str, Any], ...] = ()
    forced: ForcedCalls | None = None

    @property
    def parses(self) -> bool:
        return self.reasoning or self.tools or self.forced is not None

    def whole(self, text: str) -> ParsedReply:
        if self.forced is not None:
            return parse_forced(text, self.forced, reasoning=self.reasoning, in_think=self.in_think)
        return parse_reply(text, reasoning=self.reasoning, in_think=self.in_think, tools=self.tools,
                           tool_schemas=self.tool_schemas)

    def stream(self) -> ReplyParser | ForcedReplyParser:
        if self.forced is not None:
            return ForcedReplyParser(self.forced, reasoning=self.reasoning, in_think=self.in_think)
        return ReplyParser(reasoning=self.reasoning, in_think=self.in_think, tools=self.tools,
                           tool_schemas=self.tool_schemas)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _finish_reason(reason: str | None, calls: bool) -> str | None:
    """A reply that made calls and stopped by itself ends in "tool_calls" (OpenAI's); one cut by the budget stays
    "length", so the client knows a call may be missing."""
    return "tool_calls" if calls and reason == "stop" else reason


@dataclass(frozen=True)
class EventStream:
    """A streamed reply: SSE strings, and `close` for the HTTP layer to call however the response ended (also
    when the client left before the first chunk was pulled, where the generator's own finally never runs)."""
    chunks: AsyncIterator[str]
    close: Callable[[], None]


class ClientDisconnected(Exception):
    """The client went away before a non-streamed reply was ready; nothing is sent."""


class Serving:
    """reasoning_parser: "none" (the default here, so chat content is the reply's text as generated), "qwen3", or
    "auto" (qwen3 when the chat template writes think blocks; `python -m server`'s default)."""

    def __init__(self, engine, *, served_model_name: str, model_root: str, defaults: GenerationDefaults,
                 default_max_tokens: int | None = None, image_limits: ImageLimits = ImageLimits(),
                 reasoning_parser: str = "none", default_template_kwargs: dict[str, Any] | None = None):
        self.engine = engine
        # Template variables every chat request gets unless it sets them itself (`--default-chat-template-kwargs`).
        self.default_template_kwargs = check_template_kwargs(default_template_kwargs or {})
        self.tokenizer = engine.tokenizer
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        self.reasoning_parser = resolve_reasoning_parser(reasoning_parser, template)
        # The parsers read tags out of the text. Qwen's tokenizers keep them as ordinary added tokens, but where a
        # tokenizer marks one special, skipping special tokens would erase it: those replies keep them (as vLLM's
        # hermes parser does).
        special = set(getattr(self.tokenizer, "all_special_tokens", ()) or ())
        self._tags_special = bool(special & {THINK_START, THINK_END, TOOL_START, TOOL_END})
        self.model_name = served_model_name
        self.model_root = model_root
        self.defaults = defaults
        self.default_max_tokens = default_max_tokens
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size = int(engine.model_config.text.vocab_size)
        self.created = int(time.time())
        self.metrics = ServerMetrics(served_model_name, engine.stats)
        # Templating and tokenizing a long prompt takes milliseconds to seconds: off the event loop so streams
        # keep flowing, on one thread because a HF tokenizer is not safe to call from two threads at once.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        # Images: decoded, resized and run through the vision tower off the event loop, a few at once.
        self.image_limits = image_limits
        self._image_threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="images")
        # Grammars: a pattern's or grammar's automata can take a second or two to build; on a thread of their own,
        # so that tokenizing other requests does not wait behind them.
        self._grammar_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammars")
        self._token_texts: dict[int, str] = {}  # logprob token strings, bounded by the vocabulary
        self._grammars: collections.OrderedDict[str, Any] = collections.OrderedDict()  # by their schema's text

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        self._image_threads.shutdown(wait=False, cancel_futures=True)
        self._grammar_thread.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------------ small routes

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def models(self) -> P.ModelList:
        return P.ModelList(data=[P.ModelCard(id=self.model_name, created=self.created, root=self.model_root,
                                             max_model_len=self.max_model_len)])

    def health(self) -> dict[str, Any]:
        s = self.engine.stats()
        return {"status": "ok", "model": self.model_name, "max_model_len": self.max_model_len,
                "running": s.running, "waiting": s.waiting, "free_pages": s.free_pages, "total_pages": s.total_pages,
                "free_slots": s.free_slots, "total_slots": s.total_slots,
                "prompt_cache_entries": s.prompt_cache_entries}

    def reset_prompt_cache(self) -> dict[str, Any]:
        return {"cleared": self.engine.clear_prompt_cache()}

    async def tokenize(self, req: P.TokenizeCompletionRequest | P.TokenizeChatRequest) -> P.TokenizeResponse:
        self.check_model(req.model)
        if isinstance(req, P.TokenizeChatRequest):
            first = _first_image(req.messages)
            if first is not None:
                raise bad_request(f"{first}: /tokenize does not take images", param=first)
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids, _ = await self._chat_prompt(req.messages, req.chat_template_kwargs, req.add_generation_prompt,
                                             req.add_special_tokens, tools)
        else:
            tok = self._need_tokenizer("prompt")
            ids = await self._off_loop(lambda: tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return P.TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, req: P.DetokenizeRequest) -> P.DetokenizeResponse:
        self.check_model(req.model)
        tok = self._need_tokenizer("tokens")
        self._check_ids(req.tokens, "tokens")
        try:
            text = await self._off_loop(lambda: tok.decode(req.tokens))
        except (ValueError, TypeError, OverflowError) as e:
            raise bad_request(f"tokens: cannot decode ({e})", param="tokens") from None
        return P.DetokenizeResponse(prompt=text)

    # ------------------------------------------------------------------------------------------- generation

    async def chat(self, req: P.ChatCompletionRequest, wait_disconnect: Callable[[], Awaitable[None]]):
        """-> ChatCompletionResponse, or an EventStream when req.stream."""
        self.check_model(req.model)
        if req.forces_calls:
            grammar, grammar_param = await self._calls_grammar(req), "tool_choice"
            forced = ForcedCalls(req.forced_function, tuple(t.function.name for t in req.tools))
        else:
            grammar = await self._grammar(req)
            grammar_param = "response_format" if req.structured_outputs is None else req.structured_param
            forced = None
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.parse_tools else None
        ids, prompt_text = await self._chat_prompt(req.messages, req.chat_template_kwargs, req.add_generation_prompt,
                                                   False, tools)
        in_think = prompt_opens_think(prompt_text)
        mode = ReplyMode(reasoning=self.reasoning_parser == "qwen3", in_think=in_think,
                         tools=req.parse_tools and forced is None, tool_schemas=tuple(tools or ()), forced=forced)
        media = None
        if _first_image(req.messages) is not None:
            ids, media = await self._image_prompt(req.messages, ids)
        grammar_after = self._think_end_id(grammar_param) if grammar is not None and in_think else None
        thinking = None
        if req.thinking_budget is not None and in_think:
            thinking = (req.thinking_budget, self._think_end_id("thinking_budget"))
        runs, rid = self._submit(req, [ids], req.output_limit, "messages", req.logprobs_count, "chatcmpl", media,
                                 skip_special_tokens=not (mode.parses and self._tags_special), grammar=grammar,
                                 grammar_after=grammar_after, thinking=thinking)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._chat_stream(runs, rid, include_usage, mode, ids if req.return_token_ids else None)
        replies = await self._until_disconnect(self._collect_all(runs), wait_disconnect)
        choices = []
        for i, (run, (text, logprobs)) in enumerate(zip(runs, replies)):
            self._raise_if_failed(run)
            content = None if logprobs is None else P.ChatLogprobs(content=[self._chat_logprob(lp) for lp in logprobs])
            reply = mode.whole(text)
            calls = [P.ToolCallOut(id=_call_id(), function=P.FunctionCall(name=c.name, arguments=c.arguments))
                     for c in reply.tool_calls]
            message = P.AssistantMessage(content=reply.content, reasoning_content=reply.reasoning,
                                         reasoning=reply.reasoning, tool_calls=calls or None)
            choices.append(P.ChatChoice(index=i, message=message, logprobs=content,
                                        finish_reason=_finish_reason(run.finish_reason, bool(calls)),
                                        stop_reason=run.stop_reason,
                                        token_ids=list(run.token_ids) if req.return_token_ids else None))
        return P.ChatCompletionResponse(id=rid, created=int(time.time()), model=self.model_name, choices=choices,
                                        usage=P.Usage(**_usage(runs)),
                                        prompt_token_ids=list(ids) if req.return_token_ids else None)

    async def completion(self, req: P.CompletionRequest, wait_disconnect: Callable[[], Awaitable[None]]):
        """-> CompletionResponse, or an EventStream when req.stream."""
        self.check_model(req.model)
        grammar = await self._grammar(req)
        prompts = []
        for prompt in req.prompt:
            if isinstance(prompt, str):
                tok = self._need_tokenizer("prompt")
                ids = await self._off_loop(
                    lambda text=prompt: tok(text, add_special_tokens=req.add_special_tokens)["input_ids"])
                if not ids:
                    raise bad_request("prompt: the prompt is empty", param="prompt")
            else:
                ids = prompt
                self._check_ids(ids, "prompt")
            prompts.append(ids)
        runs, rid = self._submit(req, prompts, req.max_tokens, "prompt", req.logprobs, "cmpl", grammar=grammar)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._completion_stream(runs, rid, include_usage, req.n,
                                           prompts if req.return_token_ids else None)
        replies = await self._until_disconnect(self._collect_all(runs), wait_disconnect)
        choices = []
        for i, (run, (text, logprobs)) in enumerate(zip(runs, replies)):
            self._raise_if_failed(run)
            lp = None if logprobs is None else self._completion_logprobs(logprobs)[0]
            ids = {"prompt_token_ids": list(prompts[i // req.n]), "token_ids": list(run.token_ids)} \
                if req.return_token_ids else {}
            choices.append(P.CompletionChoice(index=i, text=text, finish_reason=run.finish_reason, logprobs=lp,
                                              stop_reason=run.stop_reason, **ids))
        return P.CompletionResponse(id=rid, created=int(time.time()), model=self.model_name, choices=choices,
                                    usage=P.Usage(**_usage(runs, req.n)))

    # ------------------------------------------------------------------------------------------ prompt side

    def _need_tokenizer(self, param: str):
        if self.tokenizer is None:
            raise bad_request(f"{param}: this server has no tokenizer (synthetic weights); send token ids to "
                              f"/v1/completions", param=param)
        return self.tokenizer

    def _check_ids(self, ids: list[int], param: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise bad_request(f"{param}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                              param=param)

    async def _off_loop(self, fn, pool: ThreadPoolExecutor | None = None):
        return await asyncio.get_running_loop().run_in_executor(pool or self._tokenizer_thread, fn)

    async def _chat_prompt(self, messages: list[P.ChatMessage], kwargs: dict[str, Any] | None,
                           add_generation_prompt: bool, add_special_tokens: bool,
                           tools: list[dict[str, Any]] | None = None) -> tuple[list[int], str]:
        """-> the prompt's ids and its text (where the reply starts: inside a think block or not)."""
        tok = self._need_tokenizer("messages")
        kwargs = {**self.default_template_kwargs, **(kwargs or {})}
        clash = _template_clash(kwargs)
        if clash:
            raise bad_request(f"chat_template_kwargs: {', '.join(clash)} cannot be set here",
                              param="chat_template_kwargs")
        conversation = [_template_message(m) for m in messages]

        def render() -> tuple[list[int], str]:
            text = tok.apply_chat_template(conversation, tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
            return tok(text, add_special_tokens=add_special_tokens)["input_ids"], text

        try:
            ids, text = await self._off_loop(render)
        except Exception as e:  # noqa: BLE001 - jinja's raise_exception, TypeErrors from odd kwargs: all the client's
            raise bad_request(f"messages: the chat template refused these messages ({type(e).__name__}: {e})",
                              param="messages") from None
        if not ids:
            raise bad_request("messages: the chat template produced an empty prompt", param="messages")
        return ids, text

    async def _image_prompt(self, messages: list[P.ChatMessage], ids: list[int]) -> tuple[list[int], PromptMedia]:
        """A chat prompt with images: each image decoded (server/images.py), resized and cut into patches, its one
        `<|image_pad|>` from the chat template repeated to its row count, its rows from the vision tower, and the
        prompt's M-RoPE positions. -> (the prompt's ids, its media for the engine)."""
        from qwen_jax.vision import (expand_image_pads, image_token_rows, mrope_positions, num_image_tokens,
                                     preprocess_image)
        vision = getattr(self.engine, "vision", None)
        if vision is None:
            first = _first_image(messages)
            raise bad_request(f"{first}: this model takes no images (its checkpoint has no vision tower, or the "
                              "server runs with --no-vision)", param=first)
        conversation = [_template_message(m) for m in messages]
        merge = vision.cfg.spatial_merge_size
        cfg = self.engine.model_config
        loop = asyncio.get_running_loop()

        def prepare():
            images = message_images(conversation, self.image_limits)
            return [preprocess_image(im.pixels, vision.processor) for im in images]

        processed = await loop.run_in_executor(self._image_threads, prepare)
        grids = [p.grid_thw for p in processed]
        try:
            ids = expand_image_pads(ids, [num_image_tokens(g, merge) for g in grids], cfg.image_token_id)
        except ValueError as e:
            raise bad_request(f"messages: {e} (the chat template places one per image part)",
                              param="messages") from None
        self._output_budget(len(ids), None, "messages")  # too long with its images: 400 before the tower runs
        try:
            rows = await loop.run_in_executor(self._image_threads, lambda: self.engine.encode_images(processed))
        except ValueError as e:
            raise bad_request(f"messages: {e}", param="messages") from None
        rope, _ = mrope_positions(ids, grids, image_token_id=cfg.image_token_id, merge_size=merge)
        return ids, PromptMedia(image_token_rows(ids, cfg.image_token_id), np.concatenate(rows), rope)

    def _submit(self, req: P.ChatCompletionRequest | P.CompletionRequest, batch: list[list[int]],
                max_tokens: int | None, prompt_param: str, logprobs: int | None, id_prefix: str,
                media: PromptMedia | None = None, *, skip_special_tokens: bool = True,
                grammar=None, grammar_after: int | None = None,
                thinking: tuple[int, int] | None = None) -> tuple[list[_Run], str]:
        """batch: the prompts' ids (chat: one; completions: a batch) -> one run a choice (req.n a prompt, prompt i's
        choice j at i * n + j; all queued or none), and the reply's id. grammar: what the replies follow
        (`_grammar`, `_calls_grammar`); grammar_after: the token after which it starts (`</think>`'s when the prompt
        leaves a think block open), None: from the first. thinking: (the thinking budget, the think block's end id)."""
        budgets = [self._output_budget(len(p), max_tokens, prompt_param) for p in batch]
        if req.n * len(batch) > self.engine.max_queued:
            what = f"{req.n} choices" if len(batch) == 1 else f"{len(batch)} prompts x {req.n} choices"
            raise bad_request(f"n: {what} wait in the queue together; this server queues at most "
                              f"{self.engine.max_queued} requests (--max-queued)", param="n")
        d = self.defaults
        top_k = req.top_k if req.top_k is not None else d.top_k
        sampling = SamplingOptions(
            temperature=req.temperature if req.temperature is not None else d.temperature,
            top_p=req.top_p if req.top_p is not None else d.top_p,
            top_k=max(top_k, 0),
            min_p=req.min_p if req.min_p is not None else d.min_p,
            seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logit_bias=req.bias_pairs,
            repetition_penalty=d.repetition_penalty if req.repetition_penalty is None else req.repetition_penalty)
        rid = f"{id_prefix}-{uuid.uuid4().hex}"
        total = req.n * len(batch)
        gens = [GenerationRequest(prompt_ids=tuple(p), max_tokens=budget, sampling=choice, stop=req.stop,
                                  stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                                  min_tokens=req.min_tokens, logprobs=logprobs, draft=req.draft,
                                  request_id=rid if total == 1 else f"{rid}-{k * req.n + i}",
                                  media=media, skip_special_tokens=skip_special_tokens, grammar=grammar,
                                  grammar_after=grammar_after, thinking_budget=thinking and thinking[0],
                                  think_end=thinking and thinking[1])
                for k, (p, budget) in enumerate(zip(batch, budgets))
                for i, choice in enumerate(self._choices(sampling, p, req.n))]
        try:
            handles = self.engine.submit_all(gens)
        except EngineOverloaded as e:
            self.metrics.rejected("queue_full")
            raise APIError(503, f"The server is overloaded (request queue full): {e}. Retry shortly.",
                           type="server_error", code="overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except ContextLengthExceeded as e:
            raise bad_request(str(e), param=prompt_param, code="context_length_exceeded") from None
        except ValueError as e:
            raise bad_request(str(e), param=_engine_param(str(e), prompt_param)) from None
        return [_Run(h, self.metrics) for h in handles], rid

    async def _grammar(self, req: P.ChatCompletionRequest | P.CompletionRequest):
        """A request's response_format or structured_outputs compiled (`_compiled`), or None for free text.
        json_object: any JSON object; json_schema without a schema: any JSON value; choice: one of the strings;
        regex: a whole match; grammar: a text of its root rule. A schema the compiler cannot enforce is a 400 naming
        the keyword; a pattern or grammar outside the supported syntax, one naming what and where."""
        so = req.structured_outputs
        if so is not None:
            param = req.structured_param
            try:
                if so.choice is not None:
                    return await self._compiled(None, param, choice=so.choice)
                if so.regex is not None:
                    return await self._compiled(None, param, regex=so.regex)
                if so.grammar is not None:
                    return await self._compiled(None, param, ebnf=so.grammar)
                return await self._compiled(so.json_, param)
            except ValueError as e:
                raise bad_request(f"{param}: {e}", param=param) from None
        fmt = req.response_format
        if fmt is None or fmt.type == "text":
            return None
        schema = None if fmt.type == "json_object" else fmt.json_schema.schema_ or {}
        try:
            return await self._compiled(schema, "response_format")
        except ValueError as e:
            raise bad_request(f"response_format.json_schema.schema: {e}", param="response_format") from None

    async def _calls_grammar(self, req: P.ChatCompletionRequest):
        """The grammar of the calls tool_choice forces (`_compiled`). A named function: its parameters' schema (the
        reply is its arguments). "required": an array of at least one call (at most one with parallel_tool_calls
        false), each `{"name": NAME, "parameters": ...}` of one of the tools (`calls_schema`). A parameters schema
        the compiler cannot enforce is a 400 naming the tool and the keyword."""
        parameters = [_parameters(t) for t in req.tools]
        if req.forced_function is not None:
            k = next(i for i, t in enumerate(req.tools) if t.function.name == req.forced_function)
            try:
                return await self._compiled(parameters[k], "tool_choice")
            except ValueError as e:
                raise bad_request(f"tools[{k}].function.parameters: {e}", param="tools") from None
        schema = calls_schema([t.function.name for t in req.tools], parameters,
                              one_call=req.parallel_tool_calls is False)
        try:
            return await self._compiled(schema, "tool_choice")
        except ValueError as e:
            from qwen_jax import structured
            for k, tool_parameters in enumerate(parameters):  # which tool: its schema alone names the place in it
                try:
                    structured.compile_json_schema(tool_parameters)
                except ValueError as alone:
                    raise bad_request(f"tools[{k}].function.parameters: {alone}", param="tools") from None
            raise bad_request(f"tools: {e}", param="tools") from None

    async def _compiled(self, schema: dict[str, Any] | bool | None, param: str, choice: list[str] | None = None,
                        regex: str | None = None, ebnf: str | None = None):
        """A JSON schema compiled (`qwen_jax.structured.compile_json_schema`; None: any JSON object), the last
        GRAMMARS_KEPT kept by the schema's text; the compiler's ValueError passes through. The first one also builds
        the engine's token texts (`Engine.token_bytes`), off the event loop. param: the request field that asked
        for it (the 400 when there is no tokenizer). choice: instead of a schema, the strings one of which the reply
        is (`structured.compile_choice`). regex: instead of a schema, a pattern the whole reply matches
        (`structured.compile_regex`). ebnf: a GBNF grammar's text (`structured.compile_grammar`). Compiling runs
        off the event loop, on the grammar thread (a pattern's automaton can take a second or two)."""
        from qwen_jax import structured
        self._need_tokenizer(param)
        await self._off_loop(self.engine.token_bytes)
        # property order matters (the reply keeps it); a choice's key never parses as a schema's text
        key = ("choice " + json.dumps(choice) if choice is not None else "regex " + json.dumps(regex)
               if regex is not None else "grammar " + json.dumps(ebnf) if ebnf is not None else json.dumps(schema))
        grammar = self._grammars.get(key)
        if grammar is None:
            if choice is not None:
                grammar = structured.compile_choice(choice)
            elif regex is not None:
                grammar = await self._off_loop(lambda: structured.compile_regex(regex), self._grammar_thread)
            elif ebnf is not None:
                grammar = await self._off_loop(lambda: structured.compile_grammar(ebnf), self._grammar_thread)
            else:
                grammar = await self._off_loop(lambda: structured.compile_json_schema(schema), self._grammar_thread)
            self._grammars[key] = grammar
            while len(self._grammars) > GRAMMARS_KEPT:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(key)
        return grammar

    @property
    def think_end(self) -> int | None:
        """The `</think>` token's id, or None where the tokenizer (or a model without one) has no such token."""
        if self.tokenizer is None:
            return None
        ids = self.tokenizer.convert_tokens_to_ids([THINK_END])
        return None if not ids or ids[0] is None or ids[0] == self.tokenizer.unk_token_id else int(ids[0])

    def _think_end_id(self, param: str) -> int:
        """The `</think>` token's id, where a reply that starts inside a think block leaves it (and a grammar that
        `param` asked for starts)."""
        end = self.think_end
        if end is None:
            raise bad_request(f"{param}: the prompt opens a think block and this tokenizer has no {THINK_END} token "
                              f"to start the constrained reply after; turn thinking off "
                              f"(chat_template_kwargs.enable_thinking: false)", param=param)
        return end

    def _choices(self, sampling: SamplingOptions, ids: list[int], n: int) -> list[SamplingOptions]:
        """Each choice's sampling: the request's, with choice i's seed drawn from the request's (or, without one,
        from the seed the engine derives from the prompt) by `sampling.choice_seed`. Choice 0 is the reply to the
        same request with n=1."""
        if n == 1:
            return [sampling]
        base = sampling.seed if sampling.seed is not None else derive_seed(ids, self.engine.seed_salt)
        return [sampling] + [dataclasses.replace(sampling, seed=choice_seed(base, i)) for i in range(1, n)]

    def _output_budget(self, n_prompt: int, requested: int | None, param: str) -> int:
        limit = self.max_model_len
        where = "messages" if param == "messages" else "prompt"
        if requested is None:
            room = limit - n_prompt
            if room < 1:
                raise bad_request(f"This model's maximum context length is {limit} tokens. However, your {where} "
                                  f"resulted in {n_prompt} tokens. Please reduce the length of the {where}.",
                                  param=param, code="context_length_exceeded")
            return min(room, self.default_max_tokens) if self.default_max_tokens else room
        if n_prompt + requested > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{n_prompt + requested} tokens ({n_prompt} in the {where}, {requested} in the "
                              f"completion). Please reduce the length of the {where} or completion.",
                              param=param, code="context_length_exceeded")
        return requested

    # ------------------------------------------------------------------------------------------ output side

    async def _collect(self, run: _Run) -> tuple[str, list[TokenLogprob] | None]:
        parts: list[str] = []
        logprobs: list[TokenLogprob] | None = None
        try:
            async for ev in run.events():
                parts.append(ev.text)
                if ev.logprobs is not None:
                    logprobs = (logprobs or []) + list(ev.logprobs)
        finally:
            run.close()
        return "".join(parts), logprobs

    async def _collect_all(self, runs: list[_Run]) -> list[tuple[str, list[TokenLogprob] | None]]:
        try:
            return await asyncio.gather(*(self._collect(r) for r in runs))
        finally:
            for r in runs:
                r.close()

    async def _until_disconnect(self, work: Awaitable, wait_disconnect: Callable[[], Awaitable[None]]):
        """Await `work` unless the client disconnects first; then cancel it (its finally cancels the request)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(wait_disconnect())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            raise ClientDisconnected()
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                # Let the cancellation reach _collect's finally before returning to the route.
                await asyncio.gather(task, return_exceptions=True)

    @staticmethod
    def _raise_if_failed(run: _Run) -> None:
        if run.finish_reason == "error":
            raise APIError(500, f"Generation failed: {run.error or 'unknown engine error'}", type="server_error",
                           code="generation_failed")
        if run.finish_reason == "cancelled":
            raise APIError(503, "The request was cancelled by the server (shutting down?).", type="server_error",
                           code="cancelled", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    def _chat_stream(self, runs: list[_Run], rid: str, include_usage: bool, mode: ReplyMode,
                     prompt_ids: list[int] | None = None) -> EventStream:
        """prompt_ids: given with return_token_ids, sent on each choice's first chunk; each chunk then carries the
        token ids decided since the one before."""
        created = int(time.time())
        usage_none = {"usage": None} if include_usage else {}
        with_ids = prompt_ids is not None

        def frame(choices: list[dict[str, Any]], **extra) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                         "choices": choices, **extra})

        def chunk(i: int, delta: dict[str, Any], finish_reason: str | None = None, logprobs=None,
                  token_ids: list[int] | None = None) -> str:
            body = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            if finish_reason is not None and runs[i].stop_reason is not None:
                body["stop_reason"] = runs[i].stop_reason
            if with_ids:
                body["token_ids"] = token_ids or []
            return frame([body], **usage_none)

        async def choice(i: int, run: _Run):
            yield (chunk(i, {"role": "assistant", "content": ""}) if not with_ids else
                   frame([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None, "token_ids": []}], prompt_token_ids=list(prompt_ids),
                         **usage_none))
            parser = mode.stream() if mode.parses else None
            calls = 0

            def delta_body(delta: ReplyDelta) -> dict[str, Any]:
                nonlocal calls
                body: dict[str, Any] = {}
                if delta.reasoning:
                    body["reasoning_content"] = body["reasoning"] = delta.reasoning
                if delta.content:
                    body["content"] = delta.content
                if delta.tool_calls:
                    body["tool_calls"] = [{"index": calls + k, "id": _call_id(), "type": "function",
                                           "function": {"name": c.name, "arguments": c.arguments}}
                                          for k, c in enumerate(delta.tool_calls)]
                    calls += len(delta.tool_calls)
                return body

            async for ev in run.events():
                if parser is None:
                    delta = ReplyDelta(content=ev.text)
                else:
                    # One chunk per engine event (its logprobs with it), holding what may be part of a tag.
                    delta = parser.feed(ev.text) if ev.text else ReplyDelta()
                    if ev.finish_reason is not None:
                        delta += parser.finish()
                body = delta_body(delta)
                if ev.finish_reason in ("error", "cancelled"):
                    if body:
                        yield chunk(i, body)
                    return
                reason = _finish_reason(_client_reason(ev.finish_reason), calls > 0)
                lp = None if ev.logprobs is None else {
                    "content": [self._chat_logprob(x).model_dump() for x in ev.logprobs]}
                ids = list(ev.token_ids)
                if mode.forced is not None and "tool_calls" in body and reason is not None:
                    # The forced calls, which only the reply's end settles, in their own chunk; then the finish.
                    yield chunk(i, body, None, lp, ids)
                    body, lp, ids = {}, None, []
                if body or lp is not None or reason is not None or (with_ids and ids):
                    yield chunk(i, body, reason, lp, ids)

        usage = (lambda: frame([], usage=_usage(runs))) if include_usage else None
        return EventStream(self._stream(runs, [choice(i, r) for i, r in enumerate(runs)], usage), _close_all(runs))

    def _completion_stream(self, runs: list[_Run], rid: str, include_usage: bool, n: int = 1,
                           prompts: list[list[int]] | None = None) -> EventStream:
        """prompts: given with return_token_ids: each choice's first chunk carries its prompt's ids, and every chunk
        the token ids decided since the one before."""
        created = int(time.time())
        usage_none = {"usage": None} if include_usage else {}
        sent_prompt = set()

        def frame(choices: list[dict[str, Any]], **extra) -> str:
            return _sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                         "choices": choices, **extra})

        def chunk(i: int, text: str, finish_reason: str | None = None, logprobs=None,
                  token_ids: tuple[int, ...] = ()) -> str:
            body = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            if finish_reason is not None and runs[i].stop_reason is not None:
                body["stop_reason"] = runs[i].stop_reason
            if prompts is not None:
                if i not in sent_prompt:
                    sent_prompt.add(i)
                    body["prompt_token_ids"] = list(prompts[i // n])
                body["token_ids"] = list(token_ids)
            return frame([body], **usage_none)

        async def choice(i: int, run: _Run):
            offset = 0
            async for ev in run.events():
                reason = _client_reason(ev.finish_reason)
                if ev.finish_reason in ("error", "cancelled"):
                    if ev.text:
                        yield chunk(i, ev.text)
                    return
                lp = None
                if ev.logprobs is not None:
                    lp, offset = self._completion_logprobs(list(ev.logprobs), offset)
                    lp = lp.model_dump()
                if ev.token_ids or ev.text or reason is not None:
                    yield chunk(i, ev.text, reason, lp, ev.token_ids)

        usage = (lambda: frame([], usage=_usage(runs, n))) if include_usage else None
        return EventStream(self._stream(runs, [choice(i, r) for i, r in enumerate(runs)], usage), _close_all(runs))

    async def _stream(self, runs: list[_Run], choices: list[AsyncIterator[str]],
                      usage: Callable[[], str] | None) -> AsyncIterator[str]:
        """The SSE framing common to both routes: the choices' chunks as they come, the usage chunk when asked for
        and every choice finished, an error event if generation failed after the 200 went out, then [DONE]. A
        cancelled stream (client gone) ends here without writing more."""
        try:
            async for piece in _merged(choices):
                yield piece
            failed = next((r for r in runs if r.finish_reason == "error"), None)
            if failed is not None:
                yield _sse(error_body(f"Generation failed: {failed.error or 'unknown engine error'}",
                                      type="server_error", code="generation_failed"))
            elif any(r.finish_reason == "cancelled" for r in runs):
                yield _sse(error_body("The request was cancelled by the server (shutting down?).",
                                      type="server_error", code="cancelled"))
            elif usage is not None:
                yield usage()
        except Exception as e:  # noqa: BLE001 - the status line is gone; the error must travel as an event
            yield _sse(error_body(f"Generation failed: {type(e).__name__}: {e}", type="server_error",
                                  code="generation_failed"))
        finally:
            for r in runs:
                r.close()
        yield SSE_DONE

    # ---------------------------------------------------------------------------------------------- logprobs

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = f"<{token_id}>" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._token_texts[token_id] = text
        return text

    def _chat_logprob(self, lp: TokenLogprob) -> P.ChatTokenLogprob:
        text = self._token_text(lp.token_id)
        return P.ChatTokenLogprob(
            token=text, logprob=lp.logprob, bytes=list(text.encode()),
            top_logprobs=[P.TopLogprob(token=(t := self._token_text(i)), logprob=v, bytes=list(t.encode()))
                          for i, v in lp.top])

    def _completion_logprobs(self, lps: list[TokenLogprob], start: int = 0) -> tuple[P.CompletionLogprobs, int]:
        """-> the logprobs block and the text offset after its last token (streams continue from there)."""
        tokens, offsets, pos = [], [], start
        for lp in lps:
            text = self._token_text(lp.token_id)
            tokens.append(text)
            offsets.append(pos)
            pos += len(text)
        return P.CompletionLogprobs(tokens=tokens, token_logprobs=[lp.logprob for lp in lps],
                                    top_logprobs=[{self._token_text(i): v for i, v in lp.top} for lp in lps],
                                    text_offset=offsets), pos


# The engine names the GenerationRequest field first in its ValueErrors ("stop: ...", "top_k must be ...").
_ENGINE_FIELDS = {"prompt_ids": None, "max_tokens": "max_tokens", "stop": "stop", "stop_token_ids": "stop_token_ids",
                  "logprobs": "logprobs", "seed": "seed", "temperature": "temperature", "top_k": "top_k",
                  "top_p": "top_p", "min_p": "min_p", "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
                  "logit_bias": "logit_bias", "grammar": "response_format", "min_tokens": "min_tokens"}


def _engine_param(message: str, prompt_param: str) -> str | None:
    head = message.split(maxsplit=1)[0].rstrip(":") if message else ""
    if head not in _ENGINE_FIELDS:
        return None
    return _ENGINE_FIELDS[head] or prompt_param


def _client_reason(reason: str | None) -> str | None:
    return reason if reason in ("stop", "length") else None


def _first_image(messages: list[P.ChatMessage]) -> str | None:
    """The param of the first image_url part (`messages[i].content[j]`), or None."""
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.get("type") == "image_url":
                    return f"messages[{i}].content[{j}]"
    return None


def _template_message(m: P.ChatMessage) -> dict[str, Any]:
    msg = m.model_dump(exclude_none=True)
    # Qwen templates know system/user/assistant/tool; OpenAI's newer "developer" role is the system prompt.
    if msg["role"] == "developer":
        msg["role"] = "system"
    if "reasoning" in msg:
        msg.setdefault("reasoning_content", msg.pop("reasoning"))
    return msg


def _parameters(tool: P.ToolDefinition) -> dict[str, Any]:
    """A tool's parameters schema; absent, any JSON object (OpenAI's: a function without parameters)."""
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object"}


def calls_schema(names: list[str], parameters: list[dict[str, Any]], *, one_call: bool = False) -> dict[str, Any]:
    """The schema of the reply under tool_choice "required": an array of calls (at least one; at most one with
    one_call), each an object `{"name": NAME, "parameters": ...}` of one of the tools (names[k] with
    parameters[k]). Each tool's schema moves to `#/items/anyOf/k/properties/parameters`, its local $refs with it
    (`_moved`)."""
    calls = [{"type": "object",
              "properties": {"name": {"const": name},
                             "parameters": _moved(schema, f"#/items/anyOf/{k}/properties/parameters")},
              "required": ["name", "parameters"], "additionalProperties": False}
             for k, (name, schema) in enumerate(zip(names, parameters))]
    return {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({"maxItems": 1} if one_call else {})}


# The keywords whose values are schemas: maps of them, lists of them, or one (items and additionalProperties).
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions"})
_SCHEMA_HOLDERS = frozenset({"items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf"})


def _moved(schema: Any, place: str) -> Any:
    """A JSON schema as it reads at `place` (a JSON pointer, "#/...") inside a larger one: its local $refs ("#",
    "#/...") prefixed with `place`, so each still names the same part of it. Only schema positions are walked;
    enum, const and annotations are values, left as they are. Anything else (a remote $ref, a malformed keyword) is
    kept for the compiler to refuse."""
    if isinstance(schema, list):
        return [_moved(sub, place) for sub in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = place + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _moved(sub, place) for name, sub in value.items()}
        elif key in _SCHEMA_HOLDERS:
            out[key] = _moved(value, place)
        else:
            out[key] = value
    return out
