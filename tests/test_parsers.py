"""server/parsers.py without a model: reasoning and tool calls out of whole replies, and the streamed parser fed the
same replies cut every way (one cut anywhere, two cuts anywhere, every character apart, random pieces), whose joined
deltas must equal the whole-text result."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from server.parsers import (ParsedReply, ReplyParser, ToolCall, parse_reply, parse_tool_call, prompt_opens_think,
                            resolve_reasoning_parser)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
WEATHER = ToolCall("get_weather", '{"city": "Paris", "unit": "c"}')
CALL2 = '<tool_call>\n{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>'
NOW = ToolCall("now", '{"tz": "UTC"}')

# (reply text, in_think, reasoning on, tools on) -> ParsedReply
CASES = [
    # Thinking on: the prompt opened the block; the reply closes it.
    ("\nLet me think.\n</think>\n\nBlue.", True, True, False, ParsedReply("Let me think.", "Blue.")),
    ("<think>\nA\n\nB\n</think>\n\nC\n", True, True, False, ParsedReply("A\n\nB", "C\n")),
    # Cut off before the end of the block: all reasoning.
    ("\nstill thinking </thi", True, True, False, ParsedReply("still thinking </thi", None)),
    ("\n\n", True, True, False, ParsedReply(None, None)),
    ("", True, True, False, ParsedReply(None, None)),
    ("</think>\n\nJust this.", True, True, False, ParsedReply(None, "Just this.")),
    # Thinking off (or a template without think): content, unless the reply opens a block at its start.
    ("Blue, green </think> red", False, True, False, ParsedReply(None, "Blue, green </think> red")),
    ("Say <think> twice.", False, True, False, ParsedReply(None, "Say <think> twice.")),
    ("  <think>\nhm\n</think>\n\nok", False, True, False, ParsedReply("hm", "ok")),
    ("<think>\nnever closed", False, True, False, ParsedReply("never closed", None)),
    ("<thin", False, True, False, ParsedReply(None, "<thin")),
    ("\n <thinker", False, True, False, ParsedReply(None, "\n <thinker")),
    # Reasoning parser off: the text as it is.
    ("\nA</think>\n\nB", True, False, False, ParsedReply(None, "\nA</think>\n\nB")),
    ("", False, False, False, ParsedReply(None, "")),
    # Tool calls in the content.
    ("\nI need the weather.\n</think>\n\n" + CALL, True, True, True,
     ParsedReply("I need the weather.", None, (WEATHER,))),
    ("Checking.\n" + CALL + "\n" + CALL2 + "\n", False, True, True, ParsedReply(None, "Checking.", (WEATHER, NOW))),
    (CALL + "\nand then " + CALL2 + " done", False, False, True, ParsedReply(None, "and then  done", (WEATHER, NOW))),
    # Tags inside the reasoning are not calls.
    ("\nmaybe " + CALL + "\n</think>\n\nNo call.", True, True, True, ParsedReply("maybe " + CALL, "No call.")),
    # A block that is not a call stays in the content; so does one never closed.
    ("<tool_call>\n{not json}\n</tool_call>", False, True, True,
     ParsedReply(None, "<tool_call>\n{not json}\n</tool_call>")),
    ("x " + CALL[:-3], False, True, True, ParsedReply(None, "x " + CALL[:-3])),
    ("<tool_call><tool_call>" + CALL[11:] + "\n" + CALL2, False, True, True,
     ParsedReply(None, "<tool_call><tool_call>" + CALL[11:], (NOW,))),
    ("text <tool_", False, True, True, ParsedReply(None, "text <tool_")),
    ("  \n ", False, True, True, ParsedReply(None, None)),
    ('<tool_call>{"name": "f"}</tool_call>', False, True, True, ParsedReply(None, None, (ToolCall("f", "{}"),))),
]


def streamed(pieces: list[str], *, reasoning: bool, in_think: bool, tools: bool) -> ParsedReply:
    parser = ReplyParser(reasoning=reasoning, in_think=in_think, tools=tools)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    thought = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    calls = tuple(c for d in deltas for c in d.tool_calls)
    if not (reasoning or tools):
        return ParsedReply(None, content)
    return ParsedReply(thought or None, content or None, calls)


def cuts(text: str, rng: random.Random):
    """The ways of cutting `text` this test tries: whole, every one cut, every two cuts (short texts; else a
    sample), every character apart, and random pieces."""
    n = len(text)
    yield [text]
    for i in range(n + 1):
        yield [text[:i], text[i:]]
    pairs = list(itertools.combinations(range(1, n), 2))
    if len(pairs) > 2000:
        pairs = rng.sample(pairs, 2000)
    for i, j in pairs:
        yield [text[:i], text[i:j], text[j:]]
    yield list(text)
    for _ in range(50):
        points = sorted(rng.sample(range(n + 1), min(n + 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0] + points, points + [n])]


@pytest.mark.parametrize("text,in_think,reasoning,tools,want", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_whole_and_every_cut(text, in_think, reasoning, tools, want):
    assert parse_reply(text, reasoning=reasoning, in_think=in_think, tools=tools) == want
    rng = random.Random(len(text))
    for pieces in cuts(text, rng):
        assert streamed(pieces, reasoning=reasoning, in_think=in_think, tools=tools) == want, pieces


def test_random_replies_stream_as_whole():
    """Random strings over an alphabet of tag fragments, newlines and call bodies: any cut gives the whole result."""
    atoms = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<", "</", "<t", "think>", "tool_call>", "\n",
             "\n\n", " ", "a", "bc", '{"name": "f", "arguments": {"x": 1}}', "{bad", '"}', "<|im_start|>"]
    rng = random.Random(0)
    for trial in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 14)))
        for in_think, reasoning, tools in itertools.product((False, True), repeat=3):
            want = parse_reply(text, reasoning=reasoning, in_think=in_think, tools=tools)
            for _ in range(6):
                points = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
                pieces = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
                got = streamed(pieces, reasoning=reasoning, in_think=in_think, tools=tools)
                assert got == want, (text, pieces, in_think, reasoning, tools)


def test_stream_sends_reasoning_then_content_then_the_call_whole():
    """The shape of a stream, not only its sum: reasoning as it comes (a trailing newline held, the boundary tag
    split across pieces found), then content until a call opens, then the call as one delta when it closes."""
    p = ReplyParser(reasoning=True, in_think=True, tools=True)
    assert p.feed("\nThe user").reasoning == "The user"
    assert p.feed(" wants\n").reasoning == " wants"
    d = p.feed("\n</thi")
    assert not d
    d = p.feed("nk>\n\nLet me check.")
    assert (d.reasoning, d.content) == ("", "Let me check.")
    assert not p.feed("\n<tool_call>\n{\"name\": \"get_weather\", ")
    d = p.feed('"arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>')
    assert d.tool_calls == (WEATHER,) and d.content == ""
    assert not p.finish()


def test_tool_call_bodies():
    assert parse_tool_call('{"name": "f", "arguments": {"a": [1, "é"]}}') == ToolCall("f", '{"a": [1, "é"]}')
    assert parse_tool_call('  {"name": "f", "arguments": "{\\"a\\": 1}"}\n') == ToolCall("f", '{"a": 1}')
    for bad in ('{"name": "f", "arguments": [1]}', '{"name": "", "arguments": {}}', '{"arguments": {}}',
                '["f"]', '{"name": "f", "arguments": "not json"}', '{"name": "f", "arguments": {"x": NaN}}',
                '{"name": 3}', ""):
        assert parse_tool_call(bad) is None, bad
    json.loads(parse_tool_call('{"name": "f", "arguments": {"q": "\\"quoted\\""}}').arguments)


def test_prompt_opens_think():
    turn = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_opens_think(turn + "<think>\n")
    assert not prompt_opens_think(turn + "<think>\n\n</think>\n\n")
    assert not prompt_opens_think(turn)
    # An earlier turn's open tag (a user quoting one) is not the reply's.
    assert not prompt_opens_think("<|im_start|>user\nwhat is <think><|im_end|>\n<|im_start|>assistant\n")
    assert prompt_opens_think("plain text prompt <think>")


def test_resolve_reasoning_parser():
    assert resolve_reasoning_parser("auto", "...{{- '<think>\\n' }}...") == "qwen3"
    assert resolve_reasoning_parser("auto", "{{ messages }}") == "none"
    assert resolve_reasoning_parser("auto", None) == "none"
    assert resolve_reasoning_parser("auto", {"default": "x", "tool_use": "<think>"}) == "qwen3"
    assert resolve_reasoning_parser("none", "<think>") == "none"
    with pytest.raises(ValueError, match="deepseek"):
        resolve_reasoning_parser("deepseek", None)
