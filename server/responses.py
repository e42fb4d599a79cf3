"""OpenAI's Responses API (`POST /v1/responses`), served by the chat route.

A Responses request is rewritten as a chat completions request (`to_chat`): `instructions` as a system message,
`input` (a string, or items) as the conversation: messages (roles user / system / developer / assistant, parts
input_text / output_text / input_image), `function_call` items as an assistant turn's tool calls and
`function_call_output` items as tool messages, `reasoning` items as the next assistant turn's reasoning; function
tools as chat tools, `tool_choice` and `parallel_tool_calls` as they are, `text.format` (json_schema, json_object)
as response_format, `reasoning.effort` "none" as thinking off (any other effort: on), `max_output_tokens` as
max_tokens. So everything the chat route does holds here: sampling, drafting, the prompt cache, tool calls forced
by grammar, structured outputs, images. The reply is rewritten back (`from_chat`, `ResponsesStream`): reasoning
(with `--reasoning-parser qwen3`) as a reasoning item, the text as a message item, each tool call as a
function_call item; a reply cut by max_output_tokens is "incomplete".
Responses are stored (`store`, true unless the request says false) in memory, the last `--responses-store N` of
them (`ResponseStore`): `GET /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`, `DELETE
/v1/responses/{id}`, and `previous_response_id`, which answers the stored conversation (that response's history,
its input and its output items) followed by the new input, as if the whole of it had been sent as `input` (the
earlier instructions are not carried over, as in OpenAI's API). `background` responses return at once, queued,
and run on the server (`GET` shows their status and then their output; `POST /v1/responses/{id}/cancel` stops one,
its request cancelled in the engine); a failure leaves status "failed" with the error.
Streams are the API's typed events (response.created ... response.completed), each with its sequence_number.
`top_logprobs` (or `include` naming the text's logprobs) asks the chat route for logprobs, returned on the message's
text part.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import Field

from server import protocol as P
from server.errors import APIError, bad_request
from server.serving import sse_payloads


class ResponsesRequest(P._Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: P.MaxTokens | None = None
    temperature: P.Temperature | None = None
    top_p: P.TopP | None = None
    top_k: Annotated[int, Field(ge=0, le=P.INT32_MAX)] | None = None  # (vLLM's extra sampling fields)
    seed: Annotated[int, Field(ge=-P.INT32_MAX - 1, le=P.INT32_MAX)] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=P.MAX_TOP_LOGPROBS)] | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


# `include` asking for the message's logprobs (as top_logprobs does): each reply token's logprob and its top ones,
# the reasoning's tokens too, on the message's output_text part (streamed on its deltas).
LOGPROBS = "message.output_text.logprobs"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _text_parts(content: str | list[dict[str, Any]], where: str, *, images: bool) -> str | list[dict[str, Any]]:
    """A message's content as the chat route takes it: a string, or text (and, where allowed, image) parts."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and images and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        else:
            what = "text or image" if images else "text"
            raise bad_request(f"{where}[{j}]: only {what} parts are supported here, got {kind!r} (input_image takes "
                              "an image_url: a data: URL or an http(s) one)", param=f"{where}[{j}]")
    return parts


def _joined(parts: str | list[dict[str, Any]]) -> str:
    return parts if isinstance(parts, str) else "".join(p["text"] for p in parts)


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (a string: one user message)."""
    return [{"role": "user", "content": req.input}] if isinstance(req.input, str) else list(req.input)


def _messages(instructions: str | None, items: list[dict[str, Any]], first: int = 0) -> list[dict[str, Any]]:
    """The chat messages of `items` (a stored history, then the request's input, which starts at `first`: errors
    name input[i - first])."""
    out: list[dict[str, Any]] = []
    if instructions is not None:
        out.append({"role": "system", "content": instructions})
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn they precede

    def assistant() -> dict[str, Any]:
        """The assistant turn function calls join: the last message where it is an assistant's, else a new one."""
        if out and out[-1]["role"] == "assistant" and not reasoning:
            return out[-1]
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        out.append(msg)
        return msg

    for i, item in enumerate(items):
        where = f"input[{i - first}]" if i >= first else f"previous_response_id (its item {i})"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                                  param=f"{where}.role")
            content = item.get("content")
            if not isinstance(content, (str, list)):
                raise bad_request(f"{where}.content must be a string or a list of parts", param=f"{where}.content")
            if role == "assistant":
                assistant()["content"] += _joined(_text_parts(content, f"{where}.content", images=False))
            else:
                out.append({"role": "system" if role == "developer" else role,
                            "content": _text_parts(content, f"{where}.content", images=role == "user")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad_request(f"{where}: a function_call item needs call_id, name and arguments (strings)",
                                  param=where)
            msg = assistant()
            msg.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise bad_request(f"{where}: a function_call_output item needs call_id and output", param=where)
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _joined(_text_parts(output, f"{where}.output", images=False))})
        elif kind == "reasoning":
            texts = [c.get("text", "") for c in item.get("content") or () if isinstance(c, dict)]
            texts = texts or [s.get("text", "") for s in item.get("summary") or () if isinstance(s, dict)]
            reasoning.append("".join(texts))
        else:
            raise bad_request(f"{where}: {kind!r} items are not supported by this server (message, function_call, "
                              "function_call_output and reasoning are; earlier turns come with previous_response_id)",
                              param=where)
    if not any(m["role"] != "system" for m in out):
        raise bad_request("input holds no message to answer", param="input")
    return out


def _tools(req: ResponsesRequest) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise bad_request(f"tools[{i}]: only function tools are supported (type \"function\" with a name), "
                                  f"got {t.get('type')!r}", param=f"tools[{i}]")
            fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            tools.append({"type": "function", "function": fn})
        body["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request('tool_choice must be "auto", "none", "required" or {"type": "function", "name": NAME}',
                              param="tool_choice")
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        body["tool_choice"] = choice
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    return body


def _format(req: ResponsesRequest) -> dict[str, Any] | None:
    """text.format as the chat route's response_format (None: free text)."""
    fmt = (req.text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}",
                      param="text.format")


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]] | None = None) -> P.ChatCompletionRequest:
    """The chat request answering `req`, after the conversation `history` (a stored response's items, for
    previous_response_id)."""
    history = history or []
    messages = _messages(req.instructions, history + input_items(req), first=len(history))
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                            "return_token_ids": True, **_tools(req)}
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    fmt = _format(req)
    if fmt is not None:
        body["response_format"] = fmt
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        if effort not in ("none", "minimal", "low", "medium", "high"):
            raise bad_request(f"reasoning.effort must be none, minimal, low, medium or high, got {effort!r}",
                              param="reasoning.effort")
        body["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
    if req.top_logprobs is not None or LOGPROBS in (req.include or ()):
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    return P.ChatCompletionRequest.model_validate(body)


def _base(req: ResponsesRequest, model: str, stored: bool) -> dict[str, Any]:
    """A new response object: the fields that echo the request."""
    rid, created = _new_id("resp"), int(time.time())
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": "in_progress",
            "background": bool(req.background), "error": None, "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {}, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None}, "store": stored,
            "temperature": req.temperature, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": req.top_p,
            "truncation": "disabled", "user": req.user, "usage": None}


def _usage(prompt: int, completion: int, cached: int, reasoning: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": prompt + completion}


def _reasoning_tokens(ids, think_end: int | None, reasoned: bool) -> int:
    """The reply's tokens up to and including the think block's end (`</think>`), where the reply had reasoning."""
    if not reasoned or not ids:
        return 0
    ids = list(ids)
    return ids.index(think_end) + 1 if think_end in ids else len(ids)


def _reasoning_item(iid: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": iid, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(iid: str, text: str | None, status: str) -> dict[str, Any]:
    return {"type": "message", "id": iid, "status": status, "role": "assistant",
            "content": [] if text is None else [_text_part(text)]}


def _call_item(iid: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": iid, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _finish(obj: dict[str, Any], finish: str | None) -> dict[str, Any]:
    cut = finish == "length"
    obj["status"] = "incomplete" if cut else "completed"
    obj["incomplete_details"] = {"reason": "max_output_tokens"} if cut else None
    return obj


def queued(req: ResponsesRequest, model: str) -> dict[str, Any]:
    """A background response as its request returns it: stored, queued, no output yet."""
    return {**_base(req, model, True), "status": "queued"}


def from_chat(req: ResponsesRequest, r: P.ChatCompletionResponse, think_end: int | None,
              stored: bool = False, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response answering req from the chat route's reply r; base: the response object to fill (a background
    response's, keeping its id and creation time), else a new one."""
    c = r.choices[0]
    m = c.message
    output: list[dict[str, Any]] = []
    if m.reasoning_content:
        output.append(_reasoning_item(_new_id("rs"), m.reasoning_content))
    status = "incomplete" if c.finish_reason == "length" else "completed"
    if m.content or not m.tool_calls:
        output.append(_message_item(_new_id("msg"), m.content or "", status))
        if c.logprobs is not None:
            output[-1]["content"][0]["logprobs"] = [t.model_dump() for t in c.logprobs.content]
    for call in m.tool_calls or ():
        output.append(_call_item(_new_id("fc"), call.id, call.function.name, call.function.arguments))
    cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
    obj = dict(base) if base is not None else _base(req, r.model, stored)
    obj["output"] = output
    obj["usage"] = _usage(r.usage.prompt_tokens, r.usage.completion_tokens, cached,
                          _reasoning_tokens(c.token_ids, think_end, bool(m.reasoning_content)))
    return _finish(obj, c.finish_reason)


class ResponsesStream:
    """The chat route's stream (one choice, with usage and token ids) rewritten as the Responses API's events:
    response.created and .in_progress; per output item output_item.added, its deltas (reasoning_text,
    output_text with its content part, function_call_arguments) and .done events, output_item.done; then
    response.completed (or response.incomplete) with the whole response, which goes to `keep` (to store it); a
    failure as an error event."""

    def __init__(self, chunks: AsyncIterator[str], req: ResponsesRequest, model: str, think_end: int | None,
                 stored: bool = False, keep: Callable[[dict[str, Any]], None] | None = None):
        self.chunks, self.req, self.think_end, self.keep = chunks, req, think_end, keep
        self.response = _base(req, model, stored)
        self.seq = 0
        self.item: dict[str, Any] | None = None  # the open item (its text gathered in place)
        self.ids: list[int] = []
        self.logprobs: list[dict[str, Any]] = []  # tokens' logprobs not yet on a text delta

    def _event(self, kind: str, payload: dict[str, Any]) -> str:
        body = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": len(self.response["output"]) - 1}

    def _open(self, item: dict[str, Any]) -> list[str]:
        out = self._close()
        self.response["output"].append(item)
        self.item = item
        added = {**item, "status": "in_progress"}
        if item["type"] == "function_call":  # its arguments follow as a delta
            added["arguments"] = ""
        out.append(self._event("response.output_item.added", {"output_index": len(self.response["output"]) - 1,
                                                               "item": added}))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", {**self._where(), "content_index": 0,
                                                                    "part": _text_part("")}))
        return out

    def _close(self, status: str = "completed") -> list[str]:
        item, out = self.item, []
        if item is None:
            return out
        where = self._where()
        if item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", {**where, "content_index": 0,
                                                                     "text": item["content"][0]["text"]}))
        elif item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] += self.logprobs  # (tokens after the last text: a stop id's)
            self.logprobs = []
            out.append(self._event("response.output_text.done", {**where, "content_index": 0, "text": part["text"],
                                                                  "logprobs": part["logprobs"]}))
            out.append(self._event("response.content_part.done", {**where, "content_index": 0, "part": part}))
            item["status"] = status
        else:
            out.append(self._event("response.function_call_arguments.done", {**where, "name": item["name"],
                                                                             "arguments": item["arguments"]}))
        self.item = None
        return out + [self._event("response.output_item.done", {"output_index": where["output_index"],
                                                                 "item": item})]

    def _text(self, kind: str, text: str) -> list[str]:
        out = []
        if self.item is None or self.item["type"] != kind:
            out = self._open(_reasoning_item(_new_id("rs"), "") if kind == "reasoning"
                             else _message_item(_new_id("msg"), "", "in_progress"))
        part = self.item["content"][0]
        part["text"] += text
        if kind == "reasoning":
            return out + [self._event("response.reasoning_text.delta", {**self._where(), "content_index": 0,
                                                                         "delta": text})]
        logprobs, self.logprobs = self.logprobs, []
        part["logprobs"] += logprobs
        return out + [self._event("response.output_text.delta", {**self._where(), "content_index": 0, "delta": text,
                                                                  "logprobs": logprobs})]

    async def events(self) -> AsyncIterator[str]:
        finish = None
        yield self._event("response.created", {"response": dict(self.response)})
        yield self._event("response.in_progress", {"response": dict(self.response)})
        async for chunk in sse_payloads(self.chunks):
            if "error" in chunk:
                for piece in self._close("incomplete"):
                    yield piece
                err = chunk["error"]
                yield self._event("error", {"code": err.get("code"), "message": err["message"],
                                            "param": err.get("param")})
                return
            if chunk.get("usage") and not chunk.get("choices"):
                u = chunk["usage"]
                cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for piece in self._close("incomplete" if finish == "length" else "completed"):
                    yield piece
                reasoned = any(item["type"] == "reasoning" for item in self.response["output"])
                if not self.response["output"]:  # an empty reply: an empty message, as the whole reply gives
                    self.response["output"].append(_message_item(_new_id("msg"), "", "completed"))
                self.response["usage"] = _usage(u["prompt_tokens"], u["completion_tokens"], cached,
                                                _reasoning_tokens(self.ids, self.think_end, reasoned))
                _finish(self.response, finish)
                kind = "response.incomplete" if finish == "length" else "response.completed"
                if self.keep is not None:
                    self.keep(self.response)
                yield self._event(kind, {"response": self.response})
                return
            for choice in chunk.get("choices", ()):
                self.ids += choice.get("token_ids") or ()
                self.logprobs += (choice.get("logprobs") or {}).get("content") or ()
                delta = choice.get("delta") or {}
                pieces: list[str] = []
                if delta.get("reasoning_content"):
                    pieces += self._text("reasoning", delta["reasoning_content"])
                if delta.get("content"):
                    pieces += self._text("message", delta["content"])
                for call in delta.get("tool_calls") or ():
                    f = call["function"]
                    pieces += self._open(_call_item(_new_id("fc"), call["id"], f["name"], f["arguments"]))
                    pieces.append(self._event("response.function_call_arguments.delta",
                                              {**self._where(), "delta": f["arguments"]}))
                if choice.get("finish_reason") is not None:
                    finish = choice["finish_reason"]
                for piece in pieces:
                    yield piece


# How many responses the server keeps by default (`--responses-store`). Each holds its whole conversation (earlier
# turns shared with the response it continues, not copied), images included as sent.
DEFAULT_STORE = 256

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as the input_items listing shows it: typed, a string content as one text part."""
    out = {"type": item.get("type", "message"), **item}
    if out["type"] == "message" and isinstance(out.get("content"), str):
        kind = "output_text" if out.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": kind, "text": out["content"]}]
    return out


@dataclasses.dataclass
class Stored:
    response: dict[str, Any]  # the response object as it was returned (a background one: as it stands now)
    inputs: list[dict[str, Any]]  # the request's input items, each with an id
    history: list[dict[str, Any]]  # the conversation before the response's output: earlier turns, then inputs
    cancel: asyncio.Event | None = None  # a background response's, set to stop its work

    @property
    def running(self) -> bool:
        return self.response["status"] in ("queued", "in_progress")


class ResponseStore:
    """The last `capacity` stored responses, in memory (a restart forgets them); past that the oldest goes (a
    background one still running is cancelled as it goes). A response keeps its conversation with it, so
    previous_response_id reads a chain back whole even after responses earlier in it were deleted or dropped.
    Used from the event loop only (no locking)."""

    def __init__(self, capacity: int = DEFAULT_STORE):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"--responses-store must be an integer >= 0, got {capacity!r}")
        self.capacity = capacity
        self._kept: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def stores(self, req: ResponsesRequest) -> bool:
        """Whether req's response is kept; raises the 400s of a background request that cannot be."""
        if req.background:
            if req.store is False or not self.capacity:
                raise bad_request("background responses are stored (their result is read back with GET); this "
                                  "request has store false" if req.store is False else
                                  "background responses need the response store (--responses-store 0 here)",
                                  param="background")
            if req.stream:
                raise bad_request("background responses are not streamed here: send stream false and read the "
                                  "result with GET /v1/responses/{id}", param="stream")
        return self.capacity > 0 and req.store is not False

    def history(self, req: ResponsesRequest) -> list[dict[str, Any]] | None:
        """The conversation previous_response_id continues: its history and its output items (None without one)."""
        rid = req.previous_response_id
        if rid is None:
            return None
        if not self.capacity:
            raise bad_request("previous_response_id: this server stores no responses (--responses-store 0); send "
                              "the whole conversation in input", param="previous_response_id")
        prev = self._kept.get(rid)
        if prev is None:
            raise bad_request(f"Previous response with id {rid!r} not found: never stored (store false), deleted, "
                              f"or dropped (this server keeps the last {self.capacity})",
                              param="previous_response_id", code="previous_response_not_found")
        if prev.response["status"] not in ("completed", "incomplete"):
            raise bad_request(f"previous_response_id: response {rid!r} is {prev.response['status']}; only a "
                              "completed or incomplete response can be continued", param="previous_response_id")
        return prev.history + prev.response["output"]

    def keep(self, req: ResponsesRequest, history: list[dict[str, Any]] | None, response: dict[str, Any], *,
             cancel: asyncio.Event | None = None) -> None:
        inputs = [item if "id" in item else {"id": _new_id(_ID_PREFIX.get(item.get("type", "message"), "item")),
                                             **item} for item in input_items(req)]
        self._kept[response["id"]] = Stored(response, inputs, (history or []) + inputs, cancel)
        while len(self._kept) > self.capacity:
            _, old = self._kept.popitem(last=False)
            self._stop(old)

    def finish(self, rid: str, response: dict[str, Any]) -> None:
        """A background response's final object (completed, incomplete, failed); nothing if it was cancelled,
        deleted or dropped meanwhile."""
        stored = self._kept.get(rid)
        if stored is not None and stored.running:
            stored.response = response

    def get(self, rid: str) -> Stored:
        stored = self._kept.get(rid)
        if stored is None:
            raise APIError(404, f"No response found with id {rid!r}", param="response_id", code="not_found")
        return stored

    @staticmethod
    def _stop(stored: Stored) -> None:
        if stored.cancel is not None and stored.running:
            stored.cancel.set()
            stored.response = {**stored.response, "status": "cancelled"}

    def cancel(self, rid: str) -> dict[str, Any]:
        """Stop a background response (its request is cancelled in the engine); one already finished is returned
        as it is."""
        stored = self.get(rid)
        if stored.cancel is None:
            raise bad_request(f"response {rid!r} was not created with background true; only background responses "
                              "can be cancelled", param="response_id")
        self._stop(stored)
        return stored.response

    def delete(self, rid: str) -> dict[str, Any]:
        self._stop(self.get(rid))
        del self._kept[rid]
        return {"id": rid, "object": "response", "deleted": True}

    def input_items(self, rid: str, limit: str | None = None, order: str | None = None,
                    after: str | None = None) -> dict[str, Any]:
        """A page of a response's input items (OpenAI's list: newest first unless order=asc, 20 unless limit
        says 1-100, starting after the item `after`)."""
        items = [_listed(item) for item in self.get(rid).inputs]
        try:
            n = 20 if limit is None else int(limit)
        except ValueError:
            n = 0
        if not 1 <= n <= 100:
            raise bad_request(f"limit must be an integer from 1 to 100, got {limit!r}", param="limit")
        if order not in (None, "asc", "desc"):
            raise bad_request(f"order must be asc or desc, got {order!r}", param="order")
        if order != "asc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad_request(f"after: response {rid!r} has no input item {after!r}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:n]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > n}
