"""A chat reply's text split into reasoning, content and tool calls, as Qwen's chat template writes them; pure text,
no tokenizer, no HTTP.

Reasoning (`--reasoning-parser qwen3`): the think block is `<think>\\n...\\n</think>\\n\\n` before the answer. Qwen3.5's
generation prompt opens it (`<think>\\n` when thinking, a closed empty block `<think>\\n\\n</think>\\n\\n` when
`enable_thinking` is false), so the reply usually starts inside it and only writes its end. A template whose prompt
does not open one leaves the model free to start its reply with `<think>`. So: the reply is reasoning up to
`</think>` if the prompt left a think block open or the reply opens one at its start; otherwise all of it is content.
A reply cut off (length) before `</think>` is all reasoning. The newlines the template puts around the reasoning and
before the answer are not part of either, as the template strips them when it renders the turn back.

Tool calls: each call is a `<tool_call>` ... `</tool_call>` block in the content, and its body decides its form:
- JSON (Qwen3's Hermes-style form, what the tiny checkpoint's template asks for): `{"name": ..., "arguments": {...}}`.
- XML (Qwen3.5's form, vLLM's and SGLang's `qwen3_coder`): `<function=NAME>`, then per argument
  `<parameter=KEY>\\nVALUE\\n</parameter>`, then `</function>`, whitespace between elements. The name and each key
  are the text up to `>` (not empty, no whitespace or `<`: a `>` left out would otherwise swallow the next line). A
  value is the text up to the first `</parameter>` that is followed, after whitespace, by the next `<parameter=` or by
  `</function>` (so code holding `</parameter>` still parses), less one leading and one trailing newline. Values
  are text; the request's tool schema (tools[i].function.parameters.properties[KEY], its `type` a name, a list, or
  the types of its `anyOf`/`oneOf` branches as pydantic writes Optional) converts them: `integer`/`number` to a
  JSON number (JSON's grammar after stripping whitespace, finite; `03106` stays text), `boolean` to true/false
  (any case), `object`/`array` to that kind of JSON value; `null` (exactly) is null for any typed parameter unless
  the type is only `string`; whatever does not convert, an unknown key or function, and a type we do not know stay
  the text. Unlike vLLM: no Python-literal fallback (`ast.literal_eval` gives tuples and sets, not JSON), no
  repair of a missing `</parameter>` or `</function>`, a bare `<function=` outside a `<tool_call>` block is text,
  and a block with two `<function=` elements is not a call (Qwen's template writes one call a block).
A block whose body is neither form, with an empty name, or with elements not closed stays in the content, as vLLM's
hermes parser leaves it; so does a block the reply never closes. The content left around the calls is stripped.
NaN, Infinity and numbers too large for a double are refused: clients parse the arguments with strict JSON parsers.

Calls and reasoning: a call block inside a think block that the reply closes is reasoning, not a call (a model
drafting a call while thinking has not made it; parsing drafts gives phantom duplicate calls). But Qwen3.5 at times
writes its call without closing the think block first (vLLM #35687 made `<tool_call>` an implicit `</think>` for
this; lost calls were vLLM #39056's complaint). So with tools parsed, a think block that has no `</think>` ends at
its first block that is a call: the text before it is the reasoning, the rest is content. A reply cut off mid-thought
just after a complete call (length) hence makes that call; its finish_reason stays "length".

Forced calls (tool_choice "required" or a named function; `ForcedCalls`): no `<tool_call>` blocks. The content after
the think block is one JSON document that a grammar enforced while sampling (the arguments of the named function,
or an array of `{"name", "parameters"}` items), so it is read as JSON, not searched for tags. A reply that is not a
whole document (cut by max_tokens or a stop string) makes no call and keeps its text as content.

Both come in two forms that must agree: `parse_reply` over a whole reply (non-streamed responses) and `ReplyParser`
fed the reply's pieces as the engine decides them (streams). A tag may arrive cut across pieces, so the stream holds
back any suffix that could still become one, and holds each call block until it closes (content or reasoning, the
call goes out whole). A call block inside a think block is held, with all the reasoning after it, until `</think>`
(then it was reasoning) or the reply's end (then it was the call). The joined deltas equal `parse_reply` for every
way of cutting the text (tests/test_parsers.py checks every cut).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
# Where the current turn starts in a ChatML prompt: the think block that matters is the one after it.
TURN_START = "<|im_start|>"

REASONING_PARSERS = ("none", "qwen3")


def resolve_reasoning_parser(choice: str, chat_template: str | dict | None) -> str:
    """`auto` is `qwen3` for a chat template that writes think blocks (every Qwen3/3.5 template) and `none` for one
    that does not, where a `<think>` in a reply is the model's text to keep."""
    if choice == "auto":
        templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
        return "qwen3" if any(THINK_START in t for t in templates) else "none"
    if choice not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {choice!r}; expected auto, {', '.join(REASONING_PARSERS)}")
    return choice


def prompt_opens_think(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a think block open, i.e. the reply starts inside it: the current turn's
    last `<think>` has no `</think>` after it (thinking on; `enable_thinking: false` renders a closed block)."""
    turn = prompt_text.rsplit(TURN_START, 1)[-1]
    return turn.rfind(THINK_START) > turn.rfind(THINK_END)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


@dataclasses.dataclass(frozen=True)
class ParsedReply:
    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclasses.dataclass(frozen=True)
class ReplyDelta:
    """What one piece of a streamed reply added: each field the text to append to it (empty: nothing new)."""
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __add__(self, later: ReplyDelta) -> ReplyDelta:
        return ReplyDelta(self.reasoning + later.reasoning, self.content + later.content,
                          self.tool_calls + later.tool_calls)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a double")
    return value


def _loads(text: str) -> Any:
    """Strict JSON: what `json.dumps` gives back is JSON again (no NaN, no Infinity, no 1e999 turned infinite)."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)


def _parse_json_call(body: str) -> ToolCall | None:
    try:
        call = _loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def _parameters_of(function: str, tools: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The JSON schemas of a function's parameters by name (its tool's `parameters.properties`; the first tool of
    that name), empty for a function the request did not give."""
    for tool in tools:
        spec = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(spec, Mapping) and spec.get("name") == function:
            parameters = spec.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
            return properties if isinstance(properties, Mapping) else {}
    return {}


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema names, in order: its `type` (a name or a list) and those of its
    `anyOf`/`oneOf` branches, one level (pydantic writes Optional[int] as anyOf integer, null)."""
    if not isinstance(schema, Mapping):
        return []
    branches = [schema] + [b for key in ("anyOf", "oneOf") if isinstance(schema.get(key), list)
                           for b in schema[key] if isinstance(b, Mapping)]
    types: list[str] = []
    for branch in branches:
        kind = branch.get("type")
        if isinstance(kind, str):
            types.append(kind)
        elif isinstance(kind, list):
            types += [t for t in kind if isinstance(t, str)]
    return types


_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_JSON_KINDS = {"object": dict, "array": list}
_NOT_CONVERTED = object()


def _as_type(value: str, kind: str) -> Any:
    """`value` (stripped) as a JSON value of `kind`, or _NOT_CONVERTED."""
    if kind == "boolean":
        return value.lower() == "true" if value.lower() in ("true", "false") else _NOT_CONVERTED
    if kind in ("integer", "number"):
        if not _JSON_NUMBER.fullmatch(value):
            return _NOT_CONVERTED
        want: type | tuple[type, ...] = (int, float)
    elif kind in _JSON_KINDS:
        want = _JSON_KINDS[kind]
    else:
        return _NOT_CONVERTED
    try:
        parsed = _loads(value)  # ValueError too for an integer past Python's 4300-digit limit
    except ValueError:
        return _NOT_CONVERTED
    return parsed if isinstance(parsed, want) else _NOT_CONVERTED


def convert_parameter(text: str, schema: Any) -> Any:
    """An XML call's parameter value (text) as the JSON value its schema asks for; the text when it names no type
    we convert to or the text does not convert."""
    types = _schema_types(schema)
    value = text.strip()
    if value == "null" and types and types != ["string"]:
        return None
    if "string" in types:
        return text
    for kind in types:
        converted = _as_type(value, kind)
        if converted is not _NOT_CONVERTED:
            return converted
    return text


FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"


def _tag_name(text: str, pos: int) -> tuple[str, int] | None:
    """The NAME of a `<function=NAME>` or `<parameter=NAME>` whose NAME starts at pos, and the index after its `>`."""
    close = text.find(">", pos)
    name = text[pos:close] if close >= 0 else ""
    if not name or "<" in name or any(c.isspace() for c in name):
        return None
    return name, close + 1


def _skip_space(text: str, pos: int, stop: int) -> int:
    while pos < stop and text[pos].isspace():
        pos += 1
    return pos


def _parameter_end(text: str, start: int, stop: int) -> int:
    """Where a value that starts at `start` ends: its first `</parameter>` followed, after whitespace, by the next
    `<parameter=` or by the function's end at `stop`; -1 for none."""
    pos = start
    while (end := text.find(PARAMETER_END, pos, stop)) >= 0:
        after = _skip_space(text, end + len(PARAMETER_END), stop)
        if after == stop or text.startswith(PARAMETER_START, after):
            return end
        pos = end + 1
    return -1


def _parse_xml_call(body: str, tools: Sequence[Mapping[str, Any]]) -> ToolCall | None:
    text = body.strip()
    if not (text.startswith(FUNCTION_START) and text.endswith(FUNCTION_END)):
        return None
    stop = len(text) - len(FUNCTION_END)
    tag = _tag_name(text, len(FUNCTION_START))
    if tag is None or tag[1] > stop:
        return None
    name, pos = tag
    schemas = _parameters_of(name, tools)
    arguments: dict[str, Any] = {}
    while (pos := _skip_space(text, pos, stop)) < stop:
        tag = _tag_name(text, pos + len(PARAMETER_START)) if text.startswith(PARAMETER_START, pos) else None
        if tag is None or tag[1] > stop:
            return None
        key, start = tag
        end = _parameter_end(text, start, stop)
        if end < 0:
            return None
        value = text[start:end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = convert_parameter(value, schemas.get(key))
        pos = end + len(PARAMETER_END)
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def parse_tool_call(body: str, tools: Sequence[Mapping[str, Any]] = ()) -> ToolCall | None:
    """A block's body -> its call, or None when it is not one (the block then stays in the content). A body that
    starts with `<function=` is an XML call, whose values `tools` (the request's, as OpenAI sends them) type; any
    other is a JSON call, whose `arguments` may be an object or an object's JSON text (some fine-tunes write the
    latter) and, left out, mean the function takes none."""
    if body.lstrip().startswith(FUNCTION_START):
        return _parse_xml_call(body, tools)
    return _parse_json_call(body)


_TOOL_BLOCK = re.compile(re.escape(TOOL_START) + "(.*?)" + re.escape(TOOL_END), re.DOTALL)


def split_reasoning(text: str, in_think: bool,
                    is_call: Callable[[str], bool] | None = None) -> tuple[str, str]:
    """-> (reasoning, content) of a whole reply; in_think: the prompt left a think block open; is_call (tools
    parsed): whether a block's body is a call, the first of which ends a think block that has no `</think>`."""
    opened = in_think
    head = text.lstrip()
    if head.startswith(THINK_START):
        text, opened = head[len(THINK_START):], True
    if not opened:
        return "", text
    reasoning, closed, content = text.partition(THINK_END)
    if closed:
        return reasoning.strip("\n"), content.lstrip("\n")
    if is_call is not None:
        for block in _TOOL_BLOCK.finditer(reasoning):
            if is_call(block.group(1)):
                return reasoning[:block.start()].strip("\n"), reasoning[block.start():]
    return reasoning.strip("\n"), ""


def split_tool_calls(content: str, tools: Sequence[Mapping[str, Any]] = ()) -> tuple[str, tuple[ToolCall, ...]]:
    """-> (the content without its well-formed call blocks, stripped; the calls in order)."""
    kept, calls, pos = [], [], 0
    for block in _TOOL_BLOCK.finditer(content):
        call = parse_tool_call(block.group(1), tools)
        if call is None:
            continue
        kept.append(content[pos:block.start()])
        calls.append(call)
        pos = block.end()
    kept.append(content[pos:])
    return "".join(kept).strip(), tuple(calls)


def parse_reply(text: str, *, reasoning: bool, in_think: bool, tools: bool,
                tool_schemas: Sequence[Mapping[str, Any]] = ()) -> ParsedReply:
    """A whole reply. reasoning: split the think block (qwen3); in_think: the prompt left one open; tools: parse
    tool-call blocks out of the content; tool_schemas: the request's tools (OpenAI's form), which type XML calls'
    arguments. With either parser on, an empty field is None."""
    is_call = (lambda body: parse_tool_call(body, tool_schemas) is not None) if tools else None
    thought, content = split_reasoning(text, in_think, is_call) if reasoning else ("", text)
    calls: tuple[ToolCall, ...] = ()
    if tools:
        content, calls = split_tool_calls(content, tool_schemas)
    if not (reasoning or tools):
        return ParsedReply(None, content)
    return ParsedReply(thought or None, content or None, calls)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (what may still become the tag)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _Trim:
    """Streams text with `chars` stripped from both ends of the whole: a leading run is dropped, a trailing run is
    held until more text follows it (then sent) or the end comes (then dropped)."""

    def __init__(self, chars: str | None):
        self.chars = chars
        self._started = False
        self._held = ""

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip(self.chars)
            if not text:
                return ""
            self._started = True
        text = self._held + text
        body = text.rstrip(self.chars)
        self._held = text[len(body):]
        return body


class _ToolStream:
    """Content in, (content out, calls) out: text streams until a `<tool_call>` opens; the block is held until its
    `</tool_call>` and leaves as one call (or, not a call, as content)."""

    def __init__(self, tool_schemas: Sequence[Mapping[str, Any]]):
        self._tool_schemas = tool_schemas
        self._buf = ""
        self._in_call = False
        self._trim = _Trim(None)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        out, calls = [], []
        while True:
            if self._in_call:
                end = self._buf.find(TOOL_END)
                if end < 0:
                    break
                body, self._buf = self._buf[:end], self._buf[end + len(TOOL_END):]
                self._in_call = False
                call = parse_tool_call(body, self._tool_schemas)
                if call is None:
                    out.append(TOOL_START + body + TOOL_END)
                else:
                    calls.append(call)
            else:
                start = self._buf.find(TOOL_START)
                if start < 0:
                    keep = _partial_tag(self._buf, TOOL_START)
                    out.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                out.append(self._buf[:start])
                self._buf = self._buf[start + len(TOOL_START):]
                self._in_call = True
        return self._trim.feed("".join(out)), calls

    def finish(self) -> str:
        rest = (TOOL_START if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        return self._trim.feed(rest)


class ReplyParser:
    """One streamed reply (one choice): `feed` each piece of text as it comes, `finish` once at the end; each
    returns the delta to send. Same arguments and, joined, the same result as `parse_reply`."""

    def __init__(self, *, reasoning: bool, in_think: bool, tools: bool,
                 tool_schemas: Sequence[Mapping[str, Any]] = ()):
        self._tool_schemas = tool_schemas
        self.tools = _ToolStream(tool_schemas) if tools else None
        # Phases: "start" (a reply-opened think block is still possible), "think", "content".
        self._phase = "start" if reasoning else "content"
        self._opened = in_think
        self._buf = ""
        # In the think phase with tools, what _buf starts with and holds: None (reasoning text), "block" (a
        # `<tool_call>` not yet closed), "call" (a block that is a call, and all after it: it ends the think block
        # unless a `</think>` follows).
        self._held: str | None = None
        self._thought = _Trim("\n")
        self._after_think = False  # the newlines between `</think>` and the answer are dropped

    def feed(self, text: str) -> ReplyDelta:
        thought, content = self._split(text)
        return self._delta(thought, content)

    def finish(self) -> ReplyDelta:
        if self._phase == "start":
            thought, content = (self._buf, "") if self._opened else ("", self._buf)
        elif self._phase == "think":
            # Never closed: reasoning, unless a call ended it (then the call and all after it are content).
            thought, content = ("", self._buf) if self._held == "call" else (self._buf, "")
        else:
            thought, content = "", ""
        self._buf, self._held = "", None
        delta = self._delta(self._thought.feed(thought) if thought else "", content)
        if self.tools is None:
            return delta
        return delta + ReplyDelta(content=self.tools.finish())

    def _split(self, text: str) -> tuple[str, str]:
        self._buf += text
        thought = ""
        if self._phase == "start":
            head = self._buf.lstrip()
            if head.startswith(THINK_START):
                self._buf, self._opened = head[len(THINK_START):], True
            elif THINK_START.startswith(head):
                return "", ""  # blank so far, or a `<think>` still arriving
            self._phase = "think" if self._opened else "content"
        if self._phase == "think":
            thought, closed = self._think()
            thought = self._thought.feed(thought)
            if not closed:
                return thought, ""
            self._phase, self._after_think = "content", True
        content, self._buf = self._buf, ""
        if self._after_think:
            content = content.lstrip("\n")
            self._after_think = not content
        return thought, content

    def _think(self) -> tuple[str, bool]:
        """-> the reasoning _buf settles, and whether `</think>` closed the block (_buf then holds what follows)."""
        out = []
        while True:
            think_end = self._buf.find(THINK_END)
            if self._held == "block":
                block_end = self._buf.find(TOOL_END)
                if block_end >= 0 and (think_end < 0 or block_end < think_end):
                    body = self._buf[len(TOOL_START):block_end]
                    if parse_tool_call(body, self._tool_schemas) is not None:
                        self._held = "call"
                    else:
                        out.append(self._buf[:block_end + len(TOOL_END)])
                        self._buf, self._held = self._buf[block_end + len(TOOL_END):], None
                    continue
            elif self._held is None:
                block = self._buf.find(TOOL_START) if self.tools is not None else -1
                if block >= 0 and (think_end < 0 or block < think_end):
                    out.append(self._buf[:block])
                    self._buf, self._held = self._buf[block:], "block"
                    continue
                if think_end < 0:
                    keep = max(_partial_tag(self._buf, THINK_END),
                               _partial_tag(self._buf, TOOL_START) if self.tools is not None else 0)
                    out.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
            if think_end < 0:
                return "".join(out), False
            out.append(self._buf[:think_end])
            self._buf, self._held = self._buf[think_end + len(THINK_END):], None
            return "".join(out), True

    def _delta(self, thought: str, content: str) -> ReplyDelta:
        calls: list[ToolCall] = []
        if self.tools is not None and content:
            content, calls = self.tools.feed(content)
        return ReplyDelta(thought, content, tuple(calls))


@dataclasses.dataclass(frozen=True)
class ForcedCalls:
    """tool_choice forcing calls: the reply's content (after the think block, when the prompt opens one) is one JSON
    document, which a grammar enforced while it was sampled. function: the function tool_choice names (the document
    is its arguments), or None for "required" (the document is an array of `{"name": ..., "parameters": ...}`, one
    item a call, each name one of `names`)."""
    function: str | None
    names: tuple[str, ...] = ()

    def calls(self, document: str) -> tuple[ToolCall, ...] | None:
        """The calls a document makes (a named function's arguments as generated; an array item's parameters
        re-encoded), or None when the text is not a whole document of that shape: a reply cut by max_tokens or by
        a stop string."""
        try:
            value = _loads(document)
        except ValueError:
            return None
        if self.function is not None:
            return (ToolCall(self.function, document),)
        if not isinstance(value, list) or not value:
            return None
        calls = []
        for item in value:
            if not isinstance(item, dict) or item.get("name") not in self.names or "parameters" not in item:
                return None
            calls.append(ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
        return tuple(calls)


class ForcedReplyParser:
    """A reply under forced calls, fed in pieces like `ReplyParser` (`parse_forced` feeds it whole). The think block
    the prompt opens streams as now: reasoning with the reasoning parser on; with it off, content up to and with
    its `</think>` (where the document starts). The document is held, and at the end leaves as its calls, or as
    content when it is not whole."""

    def __init__(self, forced: ForcedCalls, *, reasoning: bool, in_think: bool):
        self.forced = forced
        self._reasoning = ReplyParser(reasoning=True, in_think=in_think, tools=False) if reasoning else None
        self._raw_think = in_think and not reasoning  # content until `</think>`, then the document
        self._buf = ""  # with _raw_think: what may be the start of `</think>`
        self._document = ""

    def feed(self, text: str) -> ReplyDelta:
        if self._reasoning is not None:
            delta = self._reasoning.feed(text)
            self._document += delta.content
            return ReplyDelta(reasoning=delta.reasoning)
        if not self._raw_think:
            self._document += text
            return ReplyDelta()
        self._buf += text
        end = self._buf.find(THINK_END)
        if end >= 0:
            head, self._document = self._buf[:end + len(THINK_END)], self._buf[end + len(THINK_END):]
            self._buf, self._raw_think = "", False
            return ReplyDelta(content=head)
        keep = _partial_tag(self._buf, THINK_END)
        head, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return ReplyDelta(content=head)

    def finish(self) -> ReplyDelta:
        delta = ReplyDelta(content=self._buf)  # a think block never closed: all of it was content
        self._buf = ""
        if self._reasoning is not None:
            rest = self._reasoning.finish()
            self._document += rest.content
            delta = ReplyDelta(reasoning=rest.reasoning)
        document, self._document = self._document, ""
        calls = self.forced.calls(document) if document else None
        return delta + (ReplyDelta(content=document) if calls is None else ReplyDelta(tool_calls=calls))


def parse_forced(text: str, forced: ForcedCalls, *, reasoning: bool, in_think: bool) -> ParsedReply:
    """A whole reply under forced calls (`ForcedReplyParser`'s deltas joined); an empty field is None."""
    parser = ForcedReplyParser(forced, reasoning=reasoning, in_think=in_think)
    delta = parser.feed(text) + parser.finish()
    return ParsedReply(delta.reasoning or None, delta.content or None, delta.tool_calls)
