"""qwen_jax.structured: masks against byte-by-byte stepping, random walks checked by an independent validator, the
language's limits, schema errors, UTF-8 across tokens, and the shared mask cache."""

import datetime
import ipaddress
import json
import re
import time
import uuid
from decimal import Decimal

import numpy as np
import pytest

from qwen_jax.structured import (MAX_NUMBER_BYTES, MAX_WHITESPACE, Matcher, TokenBytes, compile_choice,
                                 compile_json_schema, compile_regex)

STOP = 3  # the hand-built vocabulary's stop token (a None entry)


def hand_vocab() -> list[bytes | None]:
    """Every single byte (so any text can be fed byte by byte), JSON punctuation runs, words, digits, whitespace
    runs, escapes, and UTF-8 characters whole and in pieces; a few None (special) entries among them."""
    words = [b"name", b"age", b"tags", b"kind", b"person", b"value", b"children", b"true", b"false", b"null",
             b"tru", b"nul", b"cat", b"car", b"type", b"lives", b"wheels", b"id", b"hello", b" world", b"a",
             b"b", b"c d", b"x", b"ab", b"le", b"ca"]
    punct = [b'{"', b'":', b'": ', b'","', b'", "', b'"}', b'"},', b'"]', b'["', b'[{', b'}]', b'},', b'}}',
             b'],', b', ', b',"', b'{}', b'[]', b'":"', b'":[', b'":{', b'":1', b'"a"', b'"b"', b'"c d"]',
             b'"person"', b'"cat"', b'"car"', b'"x"', b'" ', b'""', b'\\n', b'\\"', b'\\u00e9', b'\\ud83d',
             b'\\u12', b'\\', b'abc"', b'xy",', b'z"}', b'\n', b'\n  ', b'\n    ', b' ' * 8, b' ' * 20,
             b'\t\t', b'\r\n']
    numbers = [b"12", b"345", b"0.5", b"1e", b"e+", b"-1", b"99999999", b".0", b"E-", b"0", b"-0"]
    utf8 = ["é", "中", "文字", "😀", "ж"]
    pieces = [s.encode() for s in utf8]
    pieces += [p[:1] for p in pieces if len(p) > 1] + [p[1:] for p in pieces if len(p) > 1]
    pieces += [b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90", b'\xe4\xb8"', b'"\xe4', b"\x80\x80"]
    vocab: list[bytes | None] = [bytes([b]) for b in range(256)]
    vocab[STOP] = None  # the byte 0x03 cannot be written then: no JSON text needs it
    vocab += [None, None]
    seen = set(vocab)
    for t in words + punct + numbers + pieces:
        if t not in seen:
            seen.add(t)
            vocab.append(t)
    return vocab


VOCAB = hand_vocab()
HAND = TokenBytes(VOCAB)
BYTE_ID = {t[0]: i for i, t in enumerate(VOCAB) if t is not None and len(t) == 1}


@pytest.fixture(scope="module")
def tiny():
    from qwen_jax.checkpoint import load_tokenizer
    tok = load_tokenizer("captures/tiny")
    return tok, TokenBytes.from_tokenizer(tok, 512)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8, "description": "who"},
        "age": {"type": "integer"},
        "email": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c d"]}, "minItems": 1, "maxItems": 3},
        "kind": {"const": "person"},
    },
    "required": ["name", "age", "kind"],
}
TREE = {
    "$defs": {"node": {"type": "object",
                       "properties": {"value": {"type": "number"},
                                      "children": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                   "maxItems": 2}},
                       "required": ["value"]}},
    "$ref": "#/$defs/node",
}
UNION = {"anyOf": [
    {"type": "object", "properties": {"type": {"const": "cat"}, "lives": {"type": "integer"}},
     "required": ["type", "lives"]},
    {"type": "object", "properties": {"type": {"const": "car"}, "wheels": {"type": "integer"}},
     "required": ["type", "wheels"]},
]}
EXTRA = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
         "additionalProperties": {"type": "boolean"}}
TUPLE = {"type": "array", "prefixItems": [{"type": "string", "maxLength": 3}, {"type": "number"}],
         "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4}
LITERALS = {"enum": [1, 12, 1.5, -3, "x", None, True, [1, 2], {"a": 1}, "中"]}
SHORT = {"type": "string", "minLength": 2, "maxLength": 4}
PATTERNS = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{2,3}$"},
    "day": {"type": "string", "format": "date"},
    "ip": {"anyOf": [{"type": "string", "format": "ipv4"}, {"type": "string", "format": "ipv6"}]},
    "quote": {"type": "string", "pattern": "^(?:a|\"|\\\\|\\n|é|\\x01)+$", "maxLength": 3},
    "short": {"type": "string", "pattern": "[a-c]+", "minLength": 2, "maxLength": 3},
    "id": {"type": "string", "format": "uuid"},
    "size": {"type": "integer", "format": "int32"},
    "link": {"type": "string", "format": "uri", "maxLength": 4}},
    "required": ["code", "quote", "short"]}
BOUNDS = {"type": "object", "properties": {
    "age": {"type": "integer", "minimum": 18, "maximum": 120},
    "temp": {"type": "number", "exclusiveMinimum": -40.5, "maximum": 60},
    "share": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
    "n": {"type": "integer", "minimum": -3.5, "exclusiveMaximum": 3},
    "old": {"type": ["number", "null"], "minimum": 1, "exclusiveMinimum": True, "maximum": 9.99}},
    "required": ["age", "temp", "share"]}
SCHEMAS = {"json_object": None, "person": PERSON, "tree": TREE, "union": UNION, "extra": EXTRA, "tuple": TUPLE,
           "literals": LITERALS, "short": SHORT, "number": {"type": "number"}, "any": {}, "patterns": PATTERNS, "bounds": BOUNDS}


# ---- an independent validator of the documented language ---------------------------------------------------------

class Pairs(list):
    """A parsed object as its (key, value) pairs in written order."""


def parse(text: bytes):
    """The document, its objects as Pairs and its fractions as exact Decimals (for numeric bounds)."""
    return json.loads(text.decode("utf-8"), object_pairs_hook=Pairs, parse_float=Decimal)


def resolve(ref: str, root):
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        node = node[part]
    return node


def same_json(a, b) -> bool:
    def plain(v):
        if isinstance(v, Pairs):
            return {k: plain(x) for k, x in v}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return float(v) if isinstance(v, Decimal) else v
    return json.dumps(plain(a), sort_keys=True) == json.dumps(plain(b), sort_keys=True)


def kind_of(v) -> str:
    if isinstance(v, Pairs):
        return "object"
    if isinstance(v, list):
        return "array"
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, int):
        return "integer"
    return "number" if isinstance(v, float | Decimal) else "string"


def _parses(parse_text):
    def check(text: str) -> bool:
        try:
            parse_text(text)
            return True
        except ValueError:
            return False
    return check


FORMAT_CHECKS = {"date": _parses(datetime.date.fromisoformat), "uuid": _parses(uuid.UUID),
                 "ipv4": _parses(ipaddress.IPv4Address), "ipv6": _parses(ipaddress.IPv6Address)}


def within(x: Decimal, schema: dict) -> bool:
    """JSON Schema's numeric bounds (draft 4's boolean exclusives too), compared exactly."""
    def bound(key):
        b = schema.get(key)
        return None if b is None or isinstance(b, bool) else Decimal(repr(b)) if isinstance(b, float) else Decimal(b)

    checks = [(bound("minimum"), lambda b: x > b if schema.get("exclusiveMinimum") is True else x >= b),
              (bound("exclusiveMinimum"), lambda b: x > b),
              (bound("maximum"), lambda b: x < b if schema.get("exclusiveMaximum") is True else x <= b),
              (bound("exclusiveMaximum"), lambda b: x < b)]
    return all(b is None or ok(b) for b, ok in checks)


def conforms(v, schema, root) -> bool:
    """JSON Schema's meaning of the supported keywords, plus the module's promises: declared keys in order and
    no others unless additionalProperties says so, integers without fraction."""
    if schema is True or schema == {}:
        return True
    if "$ref" in schema:
        return conforms(v, resolve(schema["$ref"], root), root)
    for union in ("anyOf", "oneOf"):
        if union in schema:
            return any(conforms(v, s, root) for s in schema[union])
    if "allOf" in schema:
        return all(conforms(v, s, root) for s in schema["allOf"])
    if "const" in schema and not same_json(v, schema["const"]):
        return False
    if "enum" in schema and not any(same_json(v, e) for e in schema["enum"]):
        return False
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else list(types)
        if schema.get("nullable"):
            types.append("null")
        k = kind_of(v)
        if not (k in types or (k == "integer" and "number" in types)):
            return False
    k = kind_of(v)
    if k in ("integer", "number") and not within(Decimal(v), schema):
        return False
    if k == "string":
        if "pattern" in schema and not re.search(schema["pattern"], v):
            return False
        if not FORMAT_CHECKS.get(schema.get("format"), lambda s: True)(v):
            return False
        return schema.get("minLength", 0) <= len(v) <= schema.get("maxLength", 10**9)
    if k == "array":
        if not schema.get("minItems", 0) <= len(v) <= schema.get("maxItems", 10**9):
            return False
        prefix = schema.get("prefixItems", [])
        items = schema.get("items", True)
        return all(conforms(x, prefix[i] if i < len(prefix) else items, root) if
                   (i < len(prefix) or items is not False) else False for i, x in enumerate(v))
    if k == "object":
        keys = [key for key, _ in v]
        props = schema.get("properties")
        extra = schema.get("additionalProperties", False if props is not None else True)
        declared = list(props or {})
        if any(r not in keys for r in schema.get("required", [])):
            return False
        # extra keys follow the declared ones and are not checked against their names (documented), so a
        # name may repeat among them
        count = 0
        for key, x in v:
            if key in declared[count:]:
                count = declared.index(key) + 1
                if not conforms(x, props[key], root):
                    return False
            else:
                count = len(declared)
                if extra is False or not conforms(x, extra, root):
                    return False
        return True
    return True


# ---- helpers -------------------------------------------------------------------------------------------------------

def feed(m: Matcher, text: bytes) -> None:
    for b in text:
        m.advance(BYTE_ID[b])


def accepts(schema, text: bytes) -> bool:
    m = Matcher(compile_json_schema(schema), HAND, [STOP])
    try:
        feed(m, text)
    except ValueError:
        return False
    return m.complete


def finishes(m: Matcher, limit: int = 400) -> bool:
    """Whether a greedy byte-by-byte completion reaches a complete document (quotes and closers first, then
    short values)."""
    m = m.copy()
    order = [b'"', b"}", b"]", b"0", b"a", b"n", b":", b","]
    for _ in range(limit):
        if m.complete:
            return True
        allowed = m.allowed()
        ids = [BYTE_ID[c[0]] for c in order if allowed[BYTE_ID[c[0]]]]
        ids = ids or [i for b, i in sorted(BYTE_ID.items()) if allowed[i] and b not in b" \t\r\n"]
        ids = ids or [i for b, i in sorted(BYTE_ID.items()) if allowed[i]]
        if not ids:
            return False
        m.advance(ids[0])
    return False


def walk(schema_or_grammar, tokens: TokenBytes, stops, rng, steps: int = 300):
    """A random reply: uniform among allowed tokens, half the time among those holding a closer or a digit (so
    that walks end), stopping when terminated or (when complete) with a stop id a third of the time."""
    grammar = schema_or_grammar if not isinstance(schema_or_grammar, dict | type(None)) else (
        compile_json_schema(schema_or_grammar))
    m = Matcher(grammar, tokens, stops)
    text, states = b"", []
    closers = np.array([t is not None and any(c in t for c in b'"}],0123456789') for t in tokens.token_bytes])
    for _ in range(steps):
        allowed = m.allowed()
        states.append(m.copy())
        assert allowed.any(), f"dead end after {text!r}"
        if m.terminated:
            return text, True, states
        if m.complete and rng.random() < 1 / 3:
            return text, True, states
        pool = np.flatnonzero(allowed & tokens.is_text)
        if rng.random() < 0.5 and (allowed & closers).any():
            pool = np.flatnonzero(allowed & closers)
        t = int(rng.choice(pool))
        m.advance(t)
        text += tokens.token_bytes[t]
    return text, False, states


def letters_vocab(seed: int) -> tuple[list, TokenBytes, dict[int, int]]:
    """A 60K-token vocabulary of random lowercase words (and the single bytes, one special id 256, a few JSON
    pieces): (token bytes, TokenBytes, byte -> its single-byte id), for timing masks at scale."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", np.uint8)
    vocab = [bytes([b]) for b in range(256)] + [None]
    vocab += list({bytes(rng.choice(letters, size=rng.integers(2, 9))) for _ in range(60000)})
    vocab += [b'",', b'"}', b'"},', b'":', b'\\n', b'\n']
    return vocab, TokenBytes(vocab), {t[0]: i for i, t in enumerate(vocab) if t is not None and len(t) == 1}


def assert_masks_match_feeding(m: Matcher, tokens: TokenBytes, stops) -> None:
    """m.allowed() says of each token id what feeding it (the nodes' own byte steps, not the masks' reads) says;
    stop ids exactly when the text is complete."""
    allowed = m.allowed()
    for i, data in enumerate(tokens.token_bytes):
        if data is None:
            assert allowed[i] == (i in stops and m.complete)
            continue
        probe = m.copy()
        try:
            probe.advance(i)
            fits = True
        except ValueError:
            fits = False
        assert allowed[i] == fits, data


def timed_steps(m: Matcher, byte_id: dict[int, int], prefix: bytes, steps: int) -> tuple[np.ndarray, float]:
    """Feeds `prefix`, then `steps` times an "x" and its mask: (the last mask, seconds a step)."""
    for b in prefix:
        m.advance(byte_id[b])
    start = time.perf_counter()
    for _ in range(steps):
        m.advance(byte_id[ord("x")])
        allowed = m.allowed()
    return allowed, (time.perf_counter() - start) / steps


# ---- tests ---------------------------------------------------------------------------------------------------------

def test_token_bytes_from_the_tiny_tokenizer(tiny):
    tok, tb = tiny
    assert tb.vocab_size == 512
    assert all(tb.token_bytes[i] is None for i in range(500, 512))
    for i in tok.all_special_ids + list(tok.added_tokens_decoder):
        assert tb.token_bytes[i] is None
    singles = {t for t in tb.token_bytes if t is not None and len(t) == 1}
    assert len(singles) == 256
    checked = 0
    for i, t in enumerate(tb.token_bytes):
        if t is None:
            continue
        try:
            text = t.decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert tok.decode([i]) == text, (i, t)
        checked += 1
    assert checked > 300


@pytest.mark.parametrize("name", ["json_object", "person", "tree", "union", "extra", "tuple", "literals", "short",
                                  "patterns", "patterns, no stepping", "bounds"])
def test_allowed_matches_stepping_byte_by_byte(name, monkeypatch):
    """At states along random walks: a token is allowed exactly when its bytes, fed one by one, are accepted; and
    a sample of the allowed ones leave a state that still completes. ("no stepping": the patterns' automata read
    every trie node, however small.)"""
    if name.endswith(", no stepping"):
        from qwen_jax import structured
        monkeypatch.setattr(structured, "SMALL_NODE", 0)
        name = name.split(",")[0]
    rng = np.random.default_rng(1)
    grammar = compile_json_schema(SCHEMAS[name])
    texts = [t for t in HAND.token_bytes]
    checked = 0
    for _ in range(3):
        _, _, states = walk(grammar, HAND, [STOP], rng, steps=40)
        for m in states[:: max(1, len(states) // 6)]:
            allowed = m.allowed()
            for i, t in enumerate(texts):
                if t is None:
                    assert allowed[i] == (i == STOP and m.complete)
                    continue
                probe = m.copy()
                try:
                    feed(probe, t)
                    fits = True
                except ValueError:
                    fits = False
                assert allowed[i] == fits, (name, t)
            text_ids = np.flatnonzero(allowed & HAND.is_text)
            for i in rng.choice(text_ids, size=min(3, len(text_ids)), replace=False):
                probe = m.copy()
                probe.advance(int(i))
                assert finishes(probe), (name, texts[i])
            checked += 1
    assert checked >= 6


def test_allowed_matches_stepping_on_the_tiny_tokenizer(tiny):
    _, tb = tiny
    byte_id = {t[0]: i for i, t in enumerate(tb.token_bytes) if t is not None and len(t) == 1}
    rng = np.random.default_rng(2)
    for schema in (PERSON, None, EXTRA):
        _, _, states = walk(compile_json_schema(schema), tb, [493], rng, steps=60)
        for m in states[::5]:
            allowed = m.allowed()
            for i, t in enumerate(tb.token_bytes):
                if t is None:
                    assert allowed[i] == (i == 493 and m.complete)
                    continue
                probe = m.copy()
                try:
                    for b in t:
                        probe.advance(byte_id[b])
                    fits = True
                except ValueError:
                    fits = False
                assert allowed[i] == fits, t


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_random_walks_give_conforming_documents(name, tiny):
    schema = SCHEMAS[name]
    grammar = compile_json_schema(schema)
    rng = np.random.default_rng(3)
    done = 0
    for tokens, stops in ((HAND, [STOP]), (tiny[1], [491, 493])):
        for _ in range(25):
            text, ended, _ = walk(grammar, tokens, stops, rng)
            if not ended:
                continue
            value = parse(text)
            if schema is None:
                assert isinstance(value, Pairs)
            else:
                assert conforms(value, schema, schema), text
            if name == "person":
                assert {"name", "age", "kind"} <= {k for k, _ in value}
                assert dict(value)["kind"] == "person"
                assert 1 <= len(dict(value)["name"]) <= 8
                assert 1 <= len(dict(value).get("tags", ["a"])) <= 3
            if name == "literals":
                assert text in {b"1", b"12", b"1.5", b"-3", b'"x"', b"null", b"true", b"[1,2]", b'{"a":1}',
                                '"中"'.encode()}
            done += 1
    assert done >= 20, done


def test_documents_accepted_and_refused():
    assert accepts(PERSON, b'{"name": "Al", "age": 3, "kind": "person"}')
    assert accepts(PERSON, b'{\n  "name": "Al",\n  "age": -30,\n  "tags": ["a", "c d"],\n  "kind": "person"\n}')
    assert not accepts(PERSON, b'{"age": 3, "name": "Al", "kind": "person"}')  # declared order
    assert not accepts(PERSON, b'{"name": "Al", "kind": "person"}')  # required age
    assert not accepts(PERSON, b'{"name": "", "age": 3, "kind": "person"}')  # minLength
    assert not accepts(PERSON, b'{"name": "Al", "age": 3.5, "kind": "person"}')  # integer
    assert not accepts(PERSON, b'{"name": "Al", "age": 3, "kind": "persons"}')
    assert not accepts(PERSON, b'{"name": "Al", "age": 3, "kind": "person", "x": 1}')  # no extras
    assert not accepts(PERSON, b'{"name": "Al", "age": 3, "tags": [], "kind": "person"}')  # minItems
    assert not accepts(PERSON, b'{"name": "Al", "age": 3, "tags": ["a","a","a","a"], "kind": "person"}')
    assert accepts(EXTRA, b'{"id": 1, "more": true, "x\\"y": false}')
    assert not accepts(EXTRA, b'{"id": 1, "more": 1}')
    assert accepts(None, b'{"a": [1, {"b": null}, "c", -0.5e+3, true], "": {}}')
    assert not accepts(None, b'[1]')
    assert not accepts(None, b' {}')  # nothing before the document
    assert accepts(TUPLE, b'["abc", 1.5, true, false]')
    assert not accepts(TUPLE, b'["abcd", 1.5]')
    assert not accepts(TUPLE, b'["abc", 1.5, true, false, true]')
    assert accepts(UNION, b'{"type": "car", "wheels": 4}')
    assert not accepts(UNION, b'{"type": "car", "lives": 4}')
    assert accepts(TREE, b'{"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}, {"value": 4}]}')
    assert not accepts(TREE, b'{"value": 1, "children": [{"value": 2}, {"value": 3}, {"value": 4}]}')
    assert accepts({"type": "string"}, b'"\\u00e9\\n\\/\\"\\\\ \xe4\xb8\xad"')
    assert not accepts({"type": "string"}, b'"a\nb"')  # raw control byte
    assert not accepts({"type": "string"}, b'"\\x"')
    assert not accepts({"type": "string"}, b'"\\ud83d\\ude00"')  # surrogate escapes
    assert accepts({"properties": {"a/b": {"type": "null"}, 'q"': {}}, "required": ["a/b", 'q"']},
                   b'{"a/b": null, "q\\"": 0}')
    for bad_number in (b"01", b"1.", b"-", b"1e", b".5", b"+1", b"1.5.2"):
        assert not accepts({"type": "number"}, bad_number), bad_number
    for number in (b"0", b"-0", b"10", b"1.25", b"-1E+9", b"2e-3"):
        assert accepts({"type": "number"}, number), number


def test_numeric_bounds():
    """Bounds compared exactly on the number's text, strict or not, integers rounded inward; no exponent or "-0"
    where there are bounds (a number without them keeps JSON's whole syntax)."""
    age = {"type": "integer", "minimum": 17.5, "maximum": 120}
    for text, ok in ((b"18", True), (b"120", True), (b"17", False), (b"121", False), (b"18.0", False),
                     (b"1e2", False), (b"-18", False), (b"0120", False)):
        assert accepts(age, text) == ok, text
    share = {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
    for text, ok in ((b"0", False), (b"0.000", False), (b"0.0001", True), (b"1", True), (b"1.000", True),
                     (b"1.0001", False), (b"-0", False), (b"-0.5", False), (b"0.99999999999999999999", True)):
        assert accepts(share, text) == ok, text
    low = {"type": "number", "minimum": -2.5}
    for text, ok in ((b"-2.5", True), (b"-2.50", True), (b"-2.51", False), (b"-2.4999", True), (b"-0", False),
                     (b"0", True), (b"123456", True), (b"1e3", False)):
        assert accepts(low, text) == ok, text
    assert accepts({"type": "number", "maximum": 3, "exclusiveMaximum": True}, b"2.99")
    assert not accepts({"type": "number", "maximum": 3, "exclusiveMaximum": True}, b"3")
    tight = {"type": "integer", "minimum": 0, "exclusiveMinimum": 5, "maximum": 7, "exclusiveMaximum": 9}
    assert [n for n in range(-2, 12) if accepts(tight, str(n).encode())] == [6, 7]
    assert accepts({"minimum": 2}, b"2.5") and not accepts({"minimum": 2}, b'"x"')  # a number's keyword
    huge = {"type": "number", "maximum": 1e300}
    assert accepts(huge, b"9" * MAX_NUMBER_BYTES) and not accepts(huge, b"9" * (MAX_NUMBER_BYTES + 1))


def test_string_lengths_count_code_points():
    assert accepts(SHORT, '"中文字😀"'.encode())
    assert not accepts(SHORT, '"中文字😀a"'.encode())
    assert accepts(SHORT, b'"\\n\\u00e9"')
    assert not accepts(SHORT, b'"a"')
    assert not accepts(SHORT, b'"\\n\\u00e9ab\\t"')


def test_whitespace_and_number_limits():
    schema = {"type": "array", "items": {"type": "integer"}}
    assert accepts(schema, b"[" + b" " * MAX_WHITESPACE + b"1]")
    assert not accepts(schema, b"[" + b" " * (MAX_WHITESPACE + 1) + b"1]")
    assert accepts(schema, b"[1" + b"\n" * MAX_WHITESPACE + b"]")
    assert accepts(None, b'{"a"' + b"\t" * MAX_WHITESPACE + b":" + b" " * MAX_WHITESPACE + b"1}")
    assert not accepts(None, b'{"a"' + b"\t" * (MAX_WHITESPACE + 1) + b":1}")
    assert not accepts(None, b'{"a": 1' + b"\r\n" * MAX_WHITESPACE + b"}")
    assert accepts(None, b'{"a": 1,' + b"\r\n" * (MAX_WHITESPACE // 2) + b'"b": 2}')
    assert accepts({"type": "number"}, b"1" * MAX_NUMBER_BYTES)
    assert not accepts({"type": "number"}, b"1" * (MAX_NUMBER_BYTES + 1))
    # a number may not grow into a form it cannot finish within the limit: "...e+" needs one more digit
    assert not accepts({"type": "number"}, b"1" * (MAX_NUMBER_BYTES - 3) + b"e+")
    m = Matcher(compile_json_schema({"type": "number"}), HAND, [STOP])
    feed(m, b"1" * (MAX_NUMBER_BYTES - 2) + b"e")
    assert not m.allowed()[BYTE_ID[ord("+")]] and m.allowed()[BYTE_ID[ord("5")]]
    feed(m, b"5")
    assert m.terminated  # 32 bytes: nothing may follow


def test_advance_refuses_a_disallowed_token_and_keeps_the_state():
    m = Matcher(compile_json_schema(PERSON), HAND, [STOP])
    feed(m, b'{"na')
    before = m.allowed().copy()
    for bad in (BYTE_ID[ord("x")], STOP, 256, VOCAB.index(b'"}')):
        with pytest.raises(ValueError):
            m.advance(bad)
        assert np.array_equal(m.allowed(), before)
    with pytest.raises(ValueError):
        m.advance(HAND.vocab_size)
    feed(m, b'me"')
    assert m.allowed()[BYTE_ID[ord(":")]]


def test_stop_ids_exactly_when_complete_and_terminated_after_the_object():
    m = Matcher(compile_json_schema(None), HAND, [STOP])
    specials = [i for i, t in enumerate(VOCAB) if t is None]
    steps = [b"{", b'"a"', b":", b" ", b"1", b"2", b"}"]
    for piece in steps:
        allowed = m.allowed()
        assert not allowed[specials].any()
        assert not m.complete and not m.terminated
        m.advance(VOCAB.index(piece))
    assert m.complete and m.terminated
    allowed = m.allowed()
    assert allowed[STOP] and allowed.sum() == 1
    m.advance(STOP)
    assert m.terminated
    number = Matcher(compile_json_schema({"type": "integer"}), HAND, [STOP])
    feed(number, b"12")
    assert number.complete and not number.terminated  # more digits may come
    assert number.allowed()[STOP] and number.allowed()[BYTE_ID[ord("3")]]
    number.advance(STOP)
    assert not number.allowed()[BYTE_ID[ord("3")]]
    with pytest.raises(ValueError):
        Matcher(compile_json_schema(None), HAND, [BYTE_ID[ord("a")]])  # a text token as a stop id


def test_utf8_across_tokens():
    schema = {"type": "string"}
    grammar = compile_json_schema(schema)
    m = Matcher(grammar, HAND, [STOP])
    m.advance(BYTE_ID[ord('"')])
    m.advance(VOCAB.index("中".encode()[:1]))
    allowed = m.allowed()
    assert allowed[VOCAB.index("中".encode()[1:])]
    assert not allowed[BYTE_ID[ord("a")]] and not allowed[BYTE_ID[ord('"')]]
    assert not allowed[BYTE_ID[0xC0]]
    with pytest.raises(ValueError):
        m.advance(BYTE_ID[ord('"')])  # the character is unfinished
    m.advance(VOCAB.index("中".encode()[1:]))
    m.advance(VOCAB.index(b'"'))
    assert m.terminated
    for bad in (b'"\xc0\xaf"', b'"\xed\xa0\x80"', b'"\xf4\x90\x80\x80"', b'"\x80"', b'"\xe4\xb8"'):
        assert not accepts(schema, bad), bad
    assert accepts(schema, '"😀ж"'.encode())


def test_schema_errors_name_the_keyword_and_place():
    cases = [
        ({"type": "object", "properties": {"name": {"type": "string", "pattern": "(?=a)"}}}, "lookaround",
         "#/properties/name"),
        ({"type": "string", "pattern": "a+", "maxLength": 0}, "'pattern' and the length limits accepts no", "#"),
        ({"type": "string", "pattern": 3}, "'pattern' must be a string", "#"),
        ({"type": "string", "format": "date", "maxLength": 5000}, "above 4096", "#"),
        ({"type": "string", "format": "date", "minLength": 11}, "'format' 'date' and the length limits", "#"),
        ({"type": "integer", "multipleOf": 2}, "'multipleOf'", "at #)"),
        ({"type": "integer", "minimum": 0, "maximum": 0.5, "exclusiveMinimum": 0}, "no integer", "at #)"),
        ({"properties": {"x": {"type": "number", "maximum": "9"}}}, "'maximum' must be a number", "#/properties/x"),
        ({"type": "number", "exclusiveMaximum": False}, "'exclusiveMaximum' true or false needs 'maximum'", "#"),
        ({"type": "array", "items": {"uniqueItems": True}}, "'uniqueItems'", "#/items"),
        ({"$defs": {"a": {"not": {}}}, "$ref": "#/$defs/a"}, "'not'", "#/$defs/a"),
        ({"$ref": "#/$defs/missing"}, "does not resolve", "#"),
        ({"$ref": "http://example.com/s.json"}, "not supported", "#"),
        ({"type": "object", "properties": {"a": {"$ref": "#/definitions/b"}}}, "does not resolve",
         "#/properties/a"),
        ({"enum": []}, "'enum'", "#"),
        ({"type": "integer", "enum": ["a", 1.5]}, "'enum'", "#"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "'minLength'", "#"),
        ({"type": "object", "properties": {"x": {"enum": []}}, "required": ["x"]}, "'enum'", "#/properties/x"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "'minItems'", "#"),
        ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}, "'minItems'", "#"),
        ({"$defs": {"n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"]}},
          "$ref": "#/$defs/n"}, "recursion", "#/$defs/n"),
        ({"type": "object", "required": ["a"]}, "'a'", "#"),
        ({"allOf": [{}, {}]}, "'allOf'", "#"),
        ({"type": "strin"}, "'type'", "#"),
        ({"type": "string", "maxLength": -1}, "'maxLength'", "#"),
        ({"anyOf": [{}], "type": "string"}, "'anyOf'", "#"),
    ]
    for schema, keyword, where in cases:
        with pytest.raises(ValueError) as info:
            compile_json_schema(schema)
        assert keyword in str(info.value) and where in str(info.value), (schema, str(info.value))
    with pytest.raises(ValueError):
        compile_json_schema(False)
    # unsatisfiable parts that are optional are only left out
    grammar = compile_json_schema({"type": "object", "properties": {"x": {"enum": []}, "y": {"type": "null"}}})
    m = Matcher(grammar, HAND, [STOP])
    feed(m, b'{"')
    assert not m.allowed()[BYTE_ID[ord("x")]] and m.allowed()[BYTE_ID[ord("y")]]
    # annotations are ignored
    compile_json_schema({"title": "t", "description": "d", "default": 1, "examples": [1], "$comment": "c",
                         "$schema": "s", "deprecated": False, "readOnly": True, "type": "integer"})


def test_keyword_choices():
    assert accepts({"type": "object"}, b'{"any": [1, {"x": "y"}]}')
    assert accepts({"type": "object", "additionalProperties": {"type": "integer"}}, b'{"a": 1, "b": 2}')
    assert not accepts({"type": "object", "additionalProperties": {"type": "integer"}}, b'{"a": "1"}')
    assert accepts({"type": "object", "additionalProperties": False}, b"{}")
    assert not accepts({"type": "object", "additionalProperties": False}, b'{"a": 1}')
    assert accepts({"type": "string", "nullable": True}, b"null")
    assert accepts({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, b"false")
    assert accepts({"allOf": [{"type": "integer"}], "description": "n"}, b"7")
    assert not accepts({"properties": {}}, b"1")  # a kind's keywords without a type: that kind only
    assert accepts({"items": {"type": "null"}}, b"[null]")
    assert accepts({"const": {"a": [1, "é"]}}, '{"a":[1,"é"]}'.encode())
    assert not accepts({"const": {"a": [1, "é"]}}, '{"a": [1, "é"]}'.encode())  # written exactly
    assert accepts({"type": "array", "prefixItems": [{"type": "integer"}]}, b'[1, "any", {}]')
    assert accepts(True, b'"x"')


def test_matcher_copy_is_independent():
    m = Matcher(compile_json_schema(PERSON), HAND, [STOP])
    feed(m, b'{"name":')
    twin = m.copy()
    feed(twin, b'"Al"')
    assert m.allowed()[BYTE_ID[ord('"')]] and not m.allowed()[BYTE_ID[ord(",")]]
    assert twin.allowed()[BYTE_ID[ord(",")]]


def test_masks_are_read_only_and_shared_between_matchers():
    grammar = compile_json_schema(PERSON)
    first = Matcher(grammar, HAND, [STOP])
    feed(first, b'{"name": "A')
    mask = first.allowed()
    assert not mask.flags.writeable
    with pytest.raises(ValueError):
        mask[0] = True
    second = Matcher(grammar, HAND, [STOP])
    feed(second, b'{"name": "A')
    start = time.perf_counter()
    again = second.allowed()
    assert time.perf_counter() - start < 1e-3
    assert again is mask
    free = Matcher(compile_json_schema(None), HAND, [STOP])
    feed(free, b'{"a": "b')
    before = free.allowed()
    feed(free, b"c d\\u00e9")  # free string content: the state, and so the cached mask, stays the same
    assert free.allowed() is before
    other_vocab = TokenBytes(VOCAB)  # another vocabulary has its own cache
    third = Matcher(grammar, other_vocab, [STOP])
    feed_third = {t[0]: i for i, t in enumerate(VOCAB) if t is not None and len(t) == 1}
    for b in b'{"name": "A':
        third.advance(feed_third[b])
    assert third.allowed() is not mask and np.array_equal(third.allowed(), mask)


def test_a_large_vocabulary_in_a_string_is_fast():
    """Free string content with 60K tokens: the scan makes the mask a few numpy ops, not a walk."""
    vocab, tokens, byte_id = letters_vocab(5)
    m = Matcher(compile_json_schema({"type": "object", "properties": {"a": {"type": "string", "maxLength": 500},
                                                                      "b": {"type": "string"}}}), tokens, [256])
    allowed, per_step = timed_steps(m, byte_id, b'{"a": "', 20)
    assert allowed[vocab.index(b'",')] and not allowed[vocab.index(b'"},')] and not allowed[vocab.index(b"\n")]
    assert allowed.sum() > 0.99 * tokens.is_text.sum()
    assert per_step < 0.02, per_step


def test_choice_grammar(tiny):
    """compile_choice: on the tiny tokenizer every random walk spells one of the strings (multi-byte characters
    across tokens included); a string that starts another is complete but not terminated there, so the stop ids
    come up beside the longer string's next bytes; masks equal stepping byte by byte; bad lists are refused."""
    tok = tiny[1]
    choices = ["yes", "yes, gladly", "no", "ünïcode ✓"]
    g = compile_choice(choices)
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(40):
        text, done, states = walk(g, tok, [493], rng, steps=40)
        assert done and text.decode() in choices
        seen.add(text.decode())
    assert len(seen) >= 3
    m = Matcher(g, HAND, [STOP])
    feed(m, b"yes")
    allowed = m.allowed()
    assert m.complete and not m.terminated and allowed[STOP] and allowed[BYTE_ID[b","[0]]]
    rest = {t for t, data in enumerate(VOCAB) if data and b", gladly".startswith(data)}
    assert set(np.flatnonzero(allowed)) == rest | {STOP}  # the stop id, or the longer choice's next bytes
    feed(m, b", gladly")
    assert m.terminated and np.flatnonzero(m.allowed()).tolist() == [STOP]
    for state in (Matcher(g, HAND, [STOP]), m):
        want = np.zeros(HAND.vocab_size, bool)
        for t, data in enumerate(VOCAB):
            if data is None:
                continue
            c = state.copy()
            try:
                for b in data:
                    c.advance(BYTE_ID[b])
                want[t] = True
            except (ValueError, KeyError):
                pass
        want[STOP] = state.complete
        assert (state.allowed() == want).all()
    for bad in ([], "yes", ["a", ""], ["a", 3]):
        with pytest.raises(ValueError, match="choice"):
            compile_choice(bad)


def test_patterns_and_formats_in_strings():
    """A pattern is matched against the string's value (its JSON escapes read), the whole of it; formats are
    enforced on strings and annotations elsewhere; \\u escapes only for control characters."""
    quoted = {"type": "string", "pattern": '^a"b\\\\c\\n$'}
    assert accepts(quoted, b'"a\\"b\\\\c\\n"')
    assert accepts(quoted, b'"a\\"b\\\\c\\u000a"')
    assert not accepts(quoted, b'"a\\u0022b\\\\c\\n"')  # '"' is written \" (only controls as \u escapes)
    assert not accepts(quoted, b'"a\\"b\\\\c\\n!"')  # anchored: the whole value
    assert accepts({"type": "string", "pattern": "[0-9]"}, b'"ab1c"')  # unanchored: a search, as JSON Schema has it
    assert not accepts({"type": "string", "pattern": "[0-9]"}, b'"abc"')
    assert accepts({"type": "string", "format": "date"}, b'"2024-02-29"')
    assert not accepts({"type": "string", "format": "date"}, b'"2023-02-29"')
    assert accepts({"type": "integer", "format": "int64"}, b"7")  # an annotation on numbers
    assert accepts({"type": "string", "format": "uri"}, b'"anything at all"')  # not enforced: an annotation
    assert accepts({"pattern": "^x+$"}, b'"xx"') and not accepts({"pattern": "^x+$"}, b"1")  # pattern: strings
    both = {"type": "string", "format": "ipv4", "pattern": "^10\\."}
    assert accepts(both, b'"10.1.2.3"') and not accepts(both, b'"11.1.2.3"') and not accepts(both, b'"10.1"')
    assert accepts({"type": "string", "pattern": "é{2}", "maxLength": 2}, '"éé"'.encode())
    # the length limits look ahead: a state is allowed only where the pattern can still close within them
    m = Matcher(compile_json_schema({"type": "string", "pattern": "^(ab|abcdef)$", "minLength": 4}), HAND, [STOP])
    feed(m, b'"ab')
    assert not m.allowed()[BYTE_ID[ord('"')]] and m.allowed()[BYTE_ID[ord("c")]]
    m = Matcher(compile_json_schema({"type": "string", "pattern": "[a-c]", "maxLength": 3}), HAND, [STOP])
    feed(m, b'"xy')
    assert not m.allowed()[BYTE_ID[ord("x")]] and m.allowed()[BYTE_ID[ord("a")]]


def test_regex_grammar(tiny):
    """compile_regex: replies are whole matches; masks equal stepping byte by byte; the reply may stop where the
    text matches and ends where nothing may follow."""
    g = compile_regex(r"(yes|no)(, (because|since) [a-z ]{1,12}\.)?")
    rng = np.random.default_rng(4)
    py = re.compile(r"(yes|no)(, (because|since) [a-z ]{1,12}\.)?")
    for tokens, stops in ((HAND, [STOP]), (tiny[1], [493])):
        done = 0
        for _ in range(30):
            text, ended, states = walk(g, tokens, stops, rng, steps=60)
            if ended:
                assert py.fullmatch(text.decode()), text
                done += 1
            for m in states[::4]:
                assert_masks_match_feeding(m, tokens, stops)
        assert done >= 20
    m = Matcher(g, HAND, [STOP])
    feed(m, b"no")
    assert m.complete and not m.terminated
    feed(m, b", since ab.")
    assert m.terminated and np.flatnonzero(m.allowed()).tolist() == [STOP]
    assert Matcher(compile_regex("a*"), HAND, [STOP]).complete  # the empty reply matches
    with pytest.raises(ValueError, match="matches no text"):
        compile_regex("a^")
    with pytest.raises(ValueError, match="backreferences"):
        compile_regex(r"(a)\1")


def test_a_large_vocabulary_in_a_pattern_string_is_fast():
    """A pattern's string with 60K tokens: each step's mask (a new automaton state every step, as the length is
    counted) is read from the automaton's table over the whole vocabulary at once."""
    vocab, tokens, byte_id = letters_vocab(6)
    m = Matcher(compile_json_schema({"type": "object", "properties": {
        "a": {"type": "string", "pattern": "^[a-z ]+$", "maxLength": 200}}}), tokens, [256])
    allowed, per_step = timed_steps(m, byte_id, b'{"a": "', 20)
    assert allowed[vocab.index(b'"}')] and not allowed[vocab.index(b'",')] and not allowed[vocab.index(b"\\n")]
    assert allowed.sum() > 0.99 * (tokens.is_text.sum() - 256)
    assert per_step < 0.05, per_step


def test_masks_dropped_come_back_from_their_packed_copies(monkeypatch):
    """With room for two masks, a reply's masks are dropped as it goes; replayed, each comes back equal from its
    bit-packed copy, without a walk of the vocabulary."""
    from qwen_jax import structured
    monkeypatch.setattr(structured, "MASK_CACHE_BYTES", 2 * HAND.vocab_size)
    grammar = compile_json_schema(PERSON)
    text = b'{"name": "Al", "age": 7, "tags": ["a"], "kind": "person"}'
    first, masks = Matcher(grammar, HAND, [STOP]), []
    for b in text:
        masks.append(first.allowed().copy())
        first.advance(BYTE_ID[b])
    walks = []
    real = structured._walk
    monkeypatch.setattr(structured, "_walk", lambda *a, **k: walks.append(1) or real(*a, **k))
    again = Matcher(grammar, HAND, [STOP])
    for b, want in zip(text, masks):
        got = again.allowed()
        assert np.array_equal(got, want) and not got.flags.writeable
        again.advance(BYTE_ID[b])
    assert not walks
