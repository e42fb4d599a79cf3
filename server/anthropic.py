"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), served by the chat route.

A Messages request is rewritten as a chat completions request (`to_chat`): the system prompt as a system message,
text and image blocks as content parts, `tool_use` blocks as an assistant turn's tool calls, `tool_result` blocks
as tool messages, tools as functions (`input_schema` the parameters), `tool_choice` auto / any / tool / none as
"auto" / "required" / a named function / "none", `thinking` enabled / disabled as the chat template's
`enable_thinking`, `stop_sequences` as stop strings. So everything the chat route does holds here too: sampling,
drafting, the prompt cache, forced tool calls by grammar, images. The reply is rewritten back
(`from_chat`, `MessagesStream`): reasoning (with `--reasoning-parser qwen3`) as a thinking block, the text as a text
block, each tool call as a tool_use block; finish reasons as stop reasons (stop: end_turn, or stop_sequence with
the string that matched; length: max_tokens; tool calls: tool_use). `cache_control` marks are accepted and
ignored (the prompt cache is automatic), as are `metadata` and `service_tier`. `thinking.budget_tokens` is the
chat route's `thinking_budget`: a think block still open after that many tokens is closed there. Errors keep their
HTTP status and take Anthropic's body, {"type": "error", "error": {"type": ..., "message": ...}}.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Field

from server import protocol as P
from server.errors import APIError, bad_request
from server.serving import sse_payloads

# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


def error_body(e: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


class Message(P._Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Tool(P._Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: Any = None


class MessagesRequest(P._Strict):
    model: str | None = None
    max_tokens: P.MaxTokens
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: P.Temperature | None = None
    top_p: P.TopP | None = None
    top_k: Annotated[int, Field(ge=0, le=P.INT32_MAX)] | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class CountTokensRequest(P._Strict):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def _text_of(blocks: str | list[dict[str, Any]], where: str) -> str:
    """The text of a string or of text blocks (system prompts, tool results)."""
    if isinstance(blocks, str):
        return blocks
    out = []
    for j, b in enumerate(blocks):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad_request(f"{where}[{j}]: only text blocks are supported here, got {b.get('type')!r}",
                              param=f"{where}[{j}]")
        out.append(b["text"])
    return "\n".join(out)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source") or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise bad_request(f"{where}: an image's source must be base64 data or a url", param=where)
    return {"type": "image_url", "image_url": {"url": url}}


def _messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        if m.role == "assistant":
            text, reasoning, calls = [], [], []
            for j, b in enumerate(m.content):
                kind = b.get("type")
                if kind == "text":
                    text.append(b.get("text", ""))
                elif kind == "thinking":
                    reasoning.append(b.get("thinking", ""))
                elif kind == "tool_use":
                    calls.append({"id": b.get("id"), "type": "function", "function": {
                        "name": b.get("name"), "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
                elif kind != "redacted_thinking":
                    raise bad_request(f"{where}[{j}]: {kind!r} blocks are not supported in assistant turns",
                                      param=f"{where}[{j}]")
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        parts: list[dict[str, Any]] = []
        for j, b in enumerate(m.content):
            kind = b.get("type")
            if kind == "tool_result":  # a tool message of its own, in order
                content = b.get("content", "")
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _text_of(content if content is not None else "", f"{where}[{j}].content")})
            elif kind == "text":
                parts.append({"type": "text", "text": b.get("text", "")})
            elif kind == "image":
                parts.append(_image_part(b, f"{where}[{j}]"))
            else:
                raise bad_request(f"{where}[{j}]: {kind!r} blocks are not supported by this server (text, image, "
                                  "tool_result and, in assistant turns, tool_use and thinking are)",
                                  param=f"{where}[{j}]")
        if parts:
            out.append({"role": "user", "content": parts})
    return out


def _tools(req: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        kind = choice.get("type")
        if kind == "tool":
            body["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "any", "none"):
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise bad_request(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice")
        if choice.get("disable_parallel_tool_use"):
            body["parallel_tool_calls"] = False
    thinking = req.thinking
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in ("enabled", "disabled"):
            raise bad_request(f"thinking.type must be enabled or disabled, got {kind!r}", param="thinking")
        body["chat_template_kwargs"] = {"enable_thinking": kind == "enabled"}
        if kind == "enabled" and thinking.get("budget_tokens") is not None:
            body["thinking_budget"] = thinking["budget_tokens"]
    return body


def to_chat(req: MessagesRequest) -> P.ChatCompletionRequest:
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req), "max_tokens": req.max_tokens,
                            "stream": req.stream, **_tools(req)}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.stream:  # the prompt's length for message_start, the reply's for message_delta
        body["stream_options"] = {"include_usage": True}
        body["return_token_ids"] = True
    return P.ChatCompletionRequest.model_validate(body)


def tokenize_request(req: CountTokensRequest) -> P.TokenizeChatRequest:
    body = {"model": req.model, "messages": _messages(req), **_tools(req)}
    for name in ("tool_choice", "parallel_tool_calls", "thinking_budget"):
        body.pop(name, None)
    return P.TokenizeChatRequest.model_validate(body)


def _stop_reason(finish: str | None, stop: str | int | None) -> tuple[str | None, str | None]:
    """(Anthropic's stop_reason, stop_sequence) from the chat route's finish_reason and vLLM's stop_reason."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return ("end_turn", None) if finish == "stop" else (None, None)


def _usage(prompt: int, completion: int, cached: int) -> dict[str, int]:
    return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        args = json.loads(arguments) if arguments else {}
    except ValueError:
        args = {"arguments": arguments}  # not JSON (a free-text call the parser still took): kept as a string
    return {"type": "tool_use", "id": call_id, "name": name, "input": args}


def from_chat(r: P.ChatCompletionResponse) -> dict[str, Any]:
    c = r.choices[0]
    m = c.message
    content: list[dict[str, Any]] = []
    if m.reasoning_content:
        content.append({"type": "thinking", "thinking": m.reasoning_content, "signature": ""})
    if m.content:
        content.append({"type": "text", "text": m.content})
    for call in m.tool_calls or ():
        content.append(_tool_use(call.id, call.function.name, call.function.arguments))
    reason, sequence = _stop_reason(c.finish_reason, c.stop_reason)
    cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
    return {"id": _message_id(), "type": "message", "role": "assistant", "model": r.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": _usage(r.usage.prompt_tokens, r.usage.completion_tokens, cached)}


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


class MessagesStream:
    """The chat route's stream (one choice, with usage and token ids) rewritten as Anthropic's events:
    message_start, then per block content_block_start / _delta / _stop (thinking, text, tool_use), message_delta
    with the stop reason and usage, message_stop; a failure after the start as an error event."""

    def __init__(self, chunks: AsyncIterator[str], model: str):
        self.chunks, self.model = chunks, model
        self.block: str | None = None  # the open block's kind
        self.index = -1

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.block = kind
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[str]:
        if self.block is None:
            return []
        self.block = None
        return [_event("content_block_stop", {"index": self.index})]

    def _delta(self, kind: str, block: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        out = self._open(kind, block) if self.block != kind else []
        return out + [_event("content_block_delta", {"index": self.index, "delta": delta})]

    async def events(self) -> AsyncIterator[str]:
        reason = sequence = None
        started = False
        async for chunk in sse_payloads(self.chunks):
            if "error" in chunk:
                for piece in self._close():
                    yield piece
                yield _event("error", {"error": {"type": "api_error", "message": chunk["error"]["message"]}})
                return
            if not started:
                started = True
                yield _event("message_start", {"message": {
                    "id": _message_id(), "type": "message", "role": "assistant", "model": self.model, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": _usage(len(chunk.get("prompt_token_ids") or ()), 0, 0)}})
                yield _event("ping", {})
            if chunk.get("usage") and not chunk.get("choices"):
                u = chunk["usage"]
                cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for piece in self._close():
                    yield piece
                yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                               "usage": _usage(u["prompt_tokens"], u["completion_tokens"], cached)})
                yield _event("message_stop", {})
                return
            for choice in chunk.get("choices", ()):
                delta = choice.get("delta") or {}
                pieces: list[str] = []
                if delta.get("reasoning_content"):
                    pieces += self._delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                          {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
                if delta.get("content"):
                    pieces += self._delta("text", {"type": "text", "text": ""},
                                          {"type": "text_delta", "text": delta["content"]})
                for call in delta.get("tool_calls") or ():
                    f = call["function"]
                    block = _tool_use(call["id"], f["name"], "")
                    pieces += self._open("tool_use", block)
                    pieces.append(_event("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": f["arguments"]}}))
                    pieces += self._close()
                if choice.get("finish_reason") is not None:
                    reason, sequence = _stop_reason(choice["finish_reason"], choice.get("stop_reason"))
                for piece in pieces:
                    yield piece
