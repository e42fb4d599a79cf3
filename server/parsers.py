"""A chat reply's text split into reasoning, content and tool calls, as Qwen's chat template writes them; pure text,
no tokenizer, no HTTP.

Reasoning (`--reasoning-parser qwen3`): the think block is `<think>\\n...\\n</think>\\n\\n` before the answer. Qwen3.5's
generation prompt opens it (`<think>\\n` when thinking, a closed empty block `<think>\\n\\n</think>\\n\\n` when
`enable_thinking` is false), so the reply usually starts inside it and only writes its end. A template whose prompt
does not open one leaves the model free to start its reply with `<think>`. So: the reply is reasoning up to
`</think>` if the prompt left a think block open or the reply opens one at its start; otherwise all of it is content.
A reply cut off (length) before `</think>` is all reasoning. The newlines the template puts around the reasoning and
before the answer are not part of either, as the template strips them when it renders the turn back.

Tool calls (Qwen's Hermes-style JSON, what the template's tool prompt asks for): each call is a block
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` in the content (never in the reasoning: a model that
drafts a call while thinking has not made it). A block whose body is not such JSON stays in the content, as vLLM's
hermes parser leaves it; so does a block the reply never closes. The content left around the calls is stripped.

Both come in two forms that must agree: `parse_reply` over a whole reply (non-streamed responses) and `ReplyParser`
fed the reply's pieces as the engine decides them (streams). A tag may arrive cut across pieces, so the stream holds
back any suffix that could still become one; the joined deltas equal `parse_reply` for every way of cutting the text
(tests/test_parsers.py checks every cut).
"""

from __future__ import annotations

import dataclasses
import json
import re

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


def parse_tool_call(body: str) -> ToolCall | None:
    """A block's body -> its call, or None when it is not one (the block then stays in the content). `arguments`
    may be an object or an object's JSON text (some fine-tunes write the latter); left out, the function takes none.
    NaN and Infinity are refused: clients parse the arguments with strict JSON parsers."""
    try:
        call = json.loads(body, parse_constant=_reject_constant)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, parse_constant=_reject_constant)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


_TOOL_BLOCK = re.compile(re.escape(TOOL_START) + "(.*?)" + re.escape(TOOL_END), re.DOTALL)


def split_reasoning(text: str, in_think: bool) -> tuple[str, str]:
    """-> (reasoning, content) of a whole reply; in_think: the prompt left a think block open."""
    opened = in_think
    head = text.lstrip()
    if head.startswith(THINK_START):
        text, opened = head[len(THINK_START):], True
    if not opened:
        return "", text
    reasoning, closed, content = text.partition(THINK_END)
    return reasoning.strip("\n"), content.lstrip("\n") if closed else ""


def split_tool_calls(content: str) -> tuple[str, tuple[ToolCall, ...]]:
    """-> (the content without its well-formed call blocks, stripped; the calls in order)."""
    kept, calls, pos = [], [], 0
    for block in _TOOL_BLOCK.finditer(content):
        call = parse_tool_call(block.group(1))
        if call is None:
            continue
        kept.append(content[pos:block.start()])
        calls.append(call)
        pos = block.end()
    kept.append(content[pos:])
    return "".join(kept).strip(), tuple(calls)


def parse_reply(text: str, *, reasoning: bool, in_think: bool, tools: bool) -> ParsedReply:
    """A whole reply. reasoning: split the think block (qwen3); in_think: the prompt left one open; tools: parse
    tool-call blocks out of the content. With either parser on, an empty field is None."""
    thought, content = split_reasoning(text, in_think) if reasoning else ("", text)
    calls: tuple[ToolCall, ...] = ()
    if tools:
        content, calls = split_tool_calls(content)
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

    def __init__(self):
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
                call = parse_tool_call(body)
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

    def __init__(self, *, reasoning: bool, in_think: bool, tools: bool):
        self.tools = _ToolStream() if tools else None
        # Phases: "start" (a reply-opened think block is still possible), "think", "content".
        self._phase = "start" if reasoning else "content"
        self._opened = in_think
        self._buf = ""
        self._thought = _Trim("\n")
        self._after_think = False  # the newlines between `</think>` and the answer are dropped

    def feed(self, text: str) -> ReplyDelta:
        thought, content = self._split(text)
        return self._delta(thought, content)

    def finish(self) -> ReplyDelta:
        if self._phase == "start":
            thought, content = (self._buf, "") if self._opened else ("", self._buf)
        elif self._phase == "think":
            thought, content = self._buf, ""
        else:
            thought, content = "", ""
        self._buf = ""
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
            end = self._buf.find(THINK_END)
            if end < 0:
                keep = _partial_tag(self._buf, THINK_END)
                thought, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return self._thought.feed(thought), ""
            thought, self._buf = self._buf[:end], self._buf[end + len(THINK_END):]
            self._phase, self._after_think = "content", True
            thought = self._thought.feed(thought)
        content, self._buf = self._buf, ""
        if self._after_think:
            content = content.lstrip("\n")
            self._after_think = not content
        return thought, content

    def _delta(self, thought: str, content: str) -> ReplyDelta:
        calls: list[ToolCall] = []
        if self.tools is not None and content:
            content, calls = self.tools.feed(content)
        return ReplyDelta(thought, content, tuple(calls))
