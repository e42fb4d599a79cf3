"""server/parsers.py without a model: reasoning and tool calls (JSON and XML forms) out of whole replies, and the
streamed parser fed the same replies cut every way (one cut anywhere, two cuts anywhere, every character apart, random
pieces), whose joined deltas must equal the whole-text result."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from server.parsers import (ParsedReply, ReplyParser, ToolCall, convert_parameter, parse_reply, parse_tool_call,
                            prompt_opens_think, resolve_reasoning_parser)

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


def streamed(pieces: list[str], *, reasoning: bool, in_think: bool, tools: bool, tool_schemas=()) -> ParsedReply:
    parser = ReplyParser(reasoning=reasoning, in_think=in_think, tools=tools, tool_schemas=tool_schemas)
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


# ------------------------------------------------------------------------------- Qwen3.5's XML call form
SCHEMAS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "filters": {"type": "object"}, "limit": {"type": ["integer", "null"]}}}}},
]
XCALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
         "</parameter>\n</function>\n</tool_call>")
XWEATHER = ToolCall("get_weather", '{"city": "Paris", "days": 3}')
XCALL2 = ("<tool_call>\n<function=search>\n<parameter=query>\nline one\n\nline </parameter> two\n</parameter>\n"
          '<parameter=filters>\n{"lang": "fr"}\n</parameter>\n<parameter=limit>\nnull\n</parameter>\n</function>\n'
          "</tool_call>")
XSEARCH = ToolCall("search",
                   '{"query": "line one\\n\\nline </parameter> two", "filters": {"lang": "fr"}, "limit": null}')

# (reply text, in_think, reasoning on) -> ParsedReply; tools on, with SCHEMAS.
XML_CASES = [
    # Thinking on, the answer a call: the form the real checkpoints write.
    ("\nThe user wants the weather.\n</think>\n\n" + XCALL, True, True,
     ParsedReply("The user wants the weather.", None, (XWEATHER,))),
    ("Sure.\n\n" + XCALL + "\n" + XCALL2, False, True, ParsedReply(None, "Sure.", (XWEATHER, XSEARCH))),
    # JSON and XML blocks mixed in one reply, in order.
    (CALL + "\n" + XCALL + "\nthen\n" + CALL2 + XCALL2, False, False,
     ParsedReply(None, "then", (WEATHER, XWEATHER, NOW, XSEARCH))),
    # A call without parameters; the whitespace between elements is free.
    ("<tool_call><function=now></function></tool_call>", False, True,
     ParsedReply(None, None, (ToolCall("now", "{}"),))),
    ("<tool_call>  <function=get_weather>\t<parameter=days>7</parameter>  </function> </tool_call>", False, False,
     ParsedReply(None, None, (ToolCall("get_weather", '{"days": 7}'),))),
    # A call in a think block that the reply closes is reasoning.
    ("\nmaybe " + XCALL + "\n</think>\n\nNo call.", True, True, ParsedReply("maybe " + XCALL, "No call.")),
    ("\ndraft " + XCALL + "\n</think>\n\n" + XCALL2, True, True, ParsedReply("draft " + XCALL, None, (XSEARCH,))),
    # ... but one in a think block never closed ends it (Qwen3.5 skipping `</think>`): the call and what follows are
    # content.
    ("\nI will look it up.\n\n" + XCALL + "\n", True, True, ParsedReply("I will look it up.", None, (XWEATHER,))),
    ("<think>\nhm\n" + XCALL + "\n" + CALL + "\nbye", False, True, ParsedReply("hm", "bye", (XWEATHER, WEATHER))),
    ("\nhm " + CALL, True, True, ParsedReply("hm ", None, (WEATHER,))),
    # ... its first block that is a call: blocks that are not stay reasoning; an unclosed one is reasoning.
    ("\nuse <tool_call> tags </tool_call> like\n" + XCALL, True, True,
     ParsedReply("use <tool_call> tags </tool_call> like", None, (XWEATHER,))),
    ("\nuse <tool_call> tags " + XCALL[11:], True, True, ParsedReply("use <tool_call> tags " + XCALL[11:], None)),
    ("\nuse <tool_call>\n<function=get_weather>\n</think>\n\nok", True, True,
     ParsedReply("use <tool_call>\n<function=get_weather>", "ok")),
    ("\nthinking " + XCALL[:-5], True, True, ParsedReply("thinking " + XCALL[:-5], None)),
    ('\nx <tool_call>{"name": "f", "arguments": {"t": "</think>"}}</tool_call> y', True, True,
     ParsedReply('x <tool_call>{"name": "f", "arguments": {"t": "', '"}}</tool_call> y')),
    # Malformed blocks stay in the content: empty name, elements not closed, a `>` left out, junk between elements,
    # two functions in one block, a parameter outside the function.
    ("<tool_call>\n<function=>\n</function>\n</tool_call>", False, False,
     ParsedReply(None, "<tool_call>\n<function=>\n</function>\n</tool_call>")),
    (XCALL.replace("</parameter>\n</function>", "</function>"), False, False,
     ParsedReply(None, XCALL.replace("</parameter>\n</function>", "</function>"))),
    (XCALL.replace("</function>\n", ""), False, False, ParsedReply(None, XCALL.replace("</function>\n", ""))),
    (XCALL.replace("<parameter=city>", "<parameter=city"), False, False,
     ParsedReply(None, XCALL.replace("<parameter=city>", "<parameter=city"))),
    (XCALL.replace("<function=get_weather>", "<function=get weather>"), False, False,
     ParsedReply(None, XCALL.replace("<function=get_weather>", "<function=get weather>"))),
    (XCALL.replace("</parameter>\n<parameter=days>", "</parameter>\nand\n<parameter=days>").replace(
        "3\n</parameter>", "3\n</parameter>\nfin"), False, False,
     ParsedReply(None, XCALL.replace("</parameter>\n<parameter=days>", "</parameter>\nand\n<parameter=days>").replace(
         "3\n</parameter>", "3\n</parameter>\nfin"))),
    (XCALL.replace("</function>\n</tool_call>", "</function>\n<function=now>\n</function>\n</tool_call>") + XCALL,
     False, False, ParsedReply(None, XCALL.replace("</function>\n</tool_call>",
                                                   "</function>\n<function=now>\n</function>\n</tool_call>"),
                               (XWEATHER,))),
    ("<tool_call>\n<parameter=a>\n1\n</parameter>\n<function=f>\n</function>\n</tool_call>", False, False,
     ParsedReply(None, "<tool_call>\n<parameter=a>\n1\n</parameter>\n<function=f>\n</function>\n</tool_call>")),
    ("x <function=get_weather>\n</function>", False, False, ParsedReply(None, "x <function=get_weather>\n</function>")),
    ("x " + XCALL[:-4], False, True, ParsedReply(None, "x " + XCALL[:-4])),
]


@pytest.mark.parametrize("text,in_think,reasoning,want", XML_CASES, ids=[f"xml{i}" for i in range(len(XML_CASES))])
def test_xml_whole_and_every_cut(text, in_think, reasoning, want):
    assert parse_reply(text, reasoning=reasoning, in_think=in_think, tools=True, tool_schemas=SCHEMAS) == want
    rng = random.Random(len(text))
    for pieces in cuts(text, rng):
        got = streamed(pieces, reasoning=reasoning, in_think=in_think, tools=True, tool_schemas=SCHEMAS)
        assert got == want, pieces


def test_xml_calls_without_tools_parsed_are_text():
    """Reasoning on, tools off: an XML call (in or after the think block) is text, whatever is unclosed."""
    for text, in_think in (("\nhm\n" + XCALL, True), ("\nhm\n</think>\n\n" + XCALL, True), (XCALL, False)):
        want = parse_reply(text, reasoning=True, in_think=in_think, tools=False)
        assert not want.tool_calls and XCALL in (want.reasoning or "") + (want.content or "")
        for pieces in cuts(text, random.Random(0)):
            assert streamed(pieces, reasoning=True, in_think=in_think, tools=False) == want


def test_stream_holds_a_call_inside_think_until_it_is_settled():
    """The shape of a stream where the call comes inside the think block: reasoning flows up to `<tool_call>`; the
    block, and the reasoning after it, wait for `</think>` (reasoning after all) or the end (the call)."""
    p = ReplyParser(reasoning=True, in_think=True, tools=True, tool_schemas=SCHEMAS)
    assert p.feed("\nLet me check.\n<tool_").reasoning == "Let me check."
    assert not p.feed("call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n")
    assert not p.feed("</function>\n</tool_call>\n")
    d = p.finish()
    assert (d.reasoning, d.content, d.tool_calls) == ("", "", (ToolCall("get_weather", '{"city": "Paris"}'),))

    p = ReplyParser(reasoning=True, in_think=True, tools=True, tool_schemas=SCHEMAS)
    assert p.feed("\nmaybe " + XCALL).reasoning == "maybe "
    assert not p.feed(" or not")
    d = p.feed("</think>\n\nNo.")
    assert (d.reasoning, d.content, d.tool_calls) == (XCALL + " or not", "No.", ())
    # A block that is not a call leaves as reasoning as soon as it closes.
    p = ReplyParser(reasoning=True, in_think=True, tools=True, tool_schemas=SCHEMAS)
    assert p.feed("\nsay <tool_call> and ").reasoning == "say "
    assert p.feed("</tool_call> twice").reasoning == "<tool_call> and </tool_call> twice"


def test_xml_stream_sends_content_then_the_call_whole():
    p = ReplyParser(reasoning=False, in_think=False, tools=True, tool_schemas=SCHEMAS)
    assert p.feed("Checking.\n<tool_call>\n<func").content == "Checking."
    for piece in ("tion=get_weather>\n<parameter=city>\n", "Paris\n</param", "eter>\n<parameter=days>\n3\n",
                  "</parameter>\n</function>\n</tool_"):
        assert not p.feed(piece)
    assert p.feed("call>").tool_calls == (XWEATHER,)
    assert not p.finish()


def test_random_xml_replies_stream_as_whole():
    """Random strings over XML fragments, tags, whitespace and values, with the schemas: any cut gives the whole."""
    atoms = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=search>",
             "<function=>", "</function>", "<parameter=days>", "<parameter=city>", "<parameter=filters>",
             "</parameter>", "<parameter=", ">", "\n", " ", "3", "Paris", '{"a": [1]}', "null", "true", "<", "</",
             '{"name": "f", "arguments": {"x": 1}}']
    rng = random.Random(1)
    for trial in range(400):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 18)))
        for in_think, reasoning in itertools.product((False, True), repeat=2):
            want = parse_reply(text, reasoning=reasoning, in_think=in_think, tools=True, tool_schemas=SCHEMAS)
            for _ in range(6):
                points = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
                pieces = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
                got = streamed(pieces, reasoning=reasoning, in_think=in_think, tools=True, tool_schemas=SCHEMAS)
                assert got == want, (text, pieces, in_think, reasoning)
    # Well-formed random calls: every one parses, its values as the schema types them.
    for trial in range(200):
        city, days = rng.choice(["Paris", "São Paulo", "a\nb", " x ", "</parameter>"]), rng.randint(-5, 10 ** 12)
        order = [("city", city), ("days", str(days))]
        rng.shuffle(order)
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in order)
        call = parse_tool_call(f"\n<function=get_weather>\n{params}</function>\n", SCHEMAS)
        assert json.loads(call.arguments) == {"city": city, "days": days}


CONVERSIONS = [
    # (schema, text, value)
    ({"type": "string"}, " 3 ", " 3 "),
    ({"type": "string"}, "null", "null"),
    (None, "3", "3"),
    ({}, "true", "true"),
    ({"type": "integer"}, "42", 42),
    ({"type": "integer"}, " -7 ", -7),
    ({"type": "integer"}, "03106", "03106"),  # a zip code's leading zero is kept: not JSON's number grammar
    ({"type": "integer"}, "4.5", 4.5),
    ({"type": "integer"}, "+4", "+4"),
    ({"type": "integer"}, "1_000", "1_000"),
    ({"type": "integer"}, "2026-01-15", "2026-01-15"),
    ({"type": "integer"}, "null", None),
    ({"type": "integer"}, "9" * 5000, "9" * 5000),  # past Python's int digit limit: kept, not a crash
    ({"type": "number"}, "2.5e3", 2500.0),
    ({"type": "number"}, "1e999", "1e999"),
    ({"type": "number"}, "NaN", "NaN"),
    ({"type": "number"}, "Infinity", "Infinity"),
    ({"type": "boolean"}, "True", True),
    ({"type": "boolean"}, "false", False),
    ({"type": "boolean"}, "yes", "yes"),
    ({"type": "boolean"}, "1", "1"),
    ({"type": "object"}, '{"a": [1, "é"]}', {"a": [1, "é"]}),
    ({"type": "object"}, "[1]", "[1]"),
    ({"type": "object"}, "{'a': 1}", "{'a': 1}"),
    ({"type": "object"}, '{"a": NaN}', '{"a": NaN}'),
    ({"type": "array"}, " [1, 2]\n", [1, 2]),
    ({"type": "array"}, '{"a": 1}', '{"a": 1}'),
    ({"type": "array"}, "[1e999]", "[1e999]"),
    ({"type": "null"}, "null", None),
    ({"type": "null"}, "None", "None"),
    ({"type": "date"}, "2026-01-15", "2026-01-15"),
    ({"type": "date"}, "null", None),
    ({"type": ["integer", "null"]}, "5", 5),
    ({"type": ["integer", "null"]}, "null", None),
    ({"type": ["string", "integer"]}, "5", "5"),
    ({"type": ["string", "null"]}, "null", None),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "12", 12),
    ({"anyOf": [{"type": "boolean"}, {"type": "array"}]}, "[true]", [True]),
    ({"oneOf": [{"type": "object"}, {"type": "string"}]}, '{"a": 1}', '{"a": 1}'),
    ({"type": 3}, "3", "3"),
    ("integer", "3", "3"),
]


@pytest.mark.parametrize("schema,text,value", CONVERSIONS, ids=[f"conv{i}" for i in range(len(CONVERSIONS))])
def test_parameter_conversion(schema, text, value):
    got = convert_parameter(text, schema)
    assert got == value and type(got) is type(value)


def test_xml_call_bodies():
    """Values lose one newline each side, no more; keys come back in the model's order; a repeated key keeps its last
    value; a function the request did not give takes its values as text; the arguments are strict JSON."""
    body = "<function=get_weather>\n<parameter=city>\n\n Paris \n\n</parameter><parameter=days>2</parameter>"
    assert parse_tool_call(body + "</function>", SCHEMAS) == \
        ToolCall("get_weather", '{"city": "\\n Paris \\n", "days": 2}')
    assert parse_tool_call(body + "<parameter=days>\n4\n</parameter></function>", SCHEMAS).arguments == \
        '{"city": "\\n Paris \\n", "days": 4}'
    assert parse_tool_call("<function=other>\n<parameter=days>\n2\n</parameter>\n</function>", SCHEMAS) == \
        ToolCall("other", '{"days": "2"}')
    assert parse_tool_call("<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>") == \
        ToolCall("get_weather", '{"days": "2"}')
    assert parse_tool_call('<function=f.g-1:x>\n<parameter=q>\n"é" \\ \n</parameter>\n</function>') == \
        ToolCall("f.g-1:x", '{"q": "\\"é\\" \\\\ "}')
    for bad in ("<function=f>", "<function=f></function> x", "x <function=f></function>", "<function=f</function>",
                "<function=></function>", "<function=f>\n<parameter=>\n1\n</parameter>\n</function>",
                "<function=f>\n<parameter=a b>\n1\n</parameter>\n</function>",
                "<function=f>\n<parameter=a>\n1\n</function>", "<function=f>\n<parameter=a>\n1\n</parameter>",
                "<function=f>\n</parameter>\n</function>"):
        assert parse_tool_call(bad, SCHEMAS) is None, bad
    # A value may hold `</parameter>` itself where the next element does not follow it.
    assert parse_tool_call("<function=f>\n<parameter=a>1</parameter>\n</parameter></function>") == \
        ToolCall("f", '{"a": "1</parameter>"}')
    # A JSON call's numbers too large for a double are refused, as NaN is.
    assert parse_tool_call('{"name": "f", "arguments": {"x": 1e999}}') is None
