"""Times qwen_jax.structured on a synthetic byte-level vocabulary of 150K tokens (host CPU only).

The vocabulary is deterministic: every single byte, made-up words (bare, with a leading space, capitalized),
JSON punctuation runs (`":`, `"},`, `\\n  `), whitespace runs, digit strings, CJK characters whole and in pieces,
words glued to quotes and commas, escapes, code-ish symbol runs. For each schema it prints:
- cold: the first allowed() of each kind of parser state (its top frame and phase) in a fresh grammar, whose
  cache is empty (the vocabulary's one-time index is built before, and timed on its own line); first, json_object
  at fixed places (PROBES: mid-character, escapes, numbers, ...), the first masks this vocabulary ever computes;
- steady: ms per step (allowed() + advance()) over replies of up to 200 tokens, picking random allowed tokens
  (half the time among those holding a quote, comma, colon, opening bracket or digit, so that structure grows
  rather than strings, and mostly not those holding a closing bracket, so that replies run long): the first
  replies of a fresh grammar (until --tokens steps), then later replies of the same grammar (its masks cached),
  median and p99.

    python tools/bench_structured.py [--replies 5] [--tokens 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qwen_jax.ebnf import JSON_GRAMMAR  # noqa: E402
from qwen_jax.structured import (Matcher, TokenBytes, compile_grammar, compile_json_schema,  # noqa: E402
                                 compile_regex)

VOCAB_SIZE = 150_000
STOP = 150_001  # one of the special (None) ids past the text tokens

ORDER = {
    "$defs": {
        "Address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "maxLength": 10},
            "country": {"enum": ["US", "DE", "FR", "JP", "CN"]}},
            "required": ["street", "city", "country"]},
        "Item": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
            "required": ["sku", "qty", "price"]},
    },
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 64},
            "email": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
            "address": {"$ref": "#/$defs/Address"}},
            "required": ["name", "address"]},
        "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1},
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
        "express": {"type": "boolean"},
    },
    "required": ["id", "customer", "items", "status", "express"],
}
TREE = {
    "$defs": {"node": {"type": "object", "properties": {
        "label": {"type": "string", "maxLength": 32},
        "weight": {"type": "number"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["label", "children"]}},
    "$ref": "#/$defs/node",
}
PROBES = [b"{", b'{"', b'{"a"', b'{"a":', b'{"a": "x', b'{"a": "\xe4', b'{"a": "\xe4\xb8', b'{"a": "\\',
          b'{"a": "\\u0', b'{"a": 1', b'{"a": 1.', b'{"a": 1e', b'{"a": t', b'{"a": [', b'{"a": [1,',
          b'{"a": 1,', b'{"a": {}', b'{"a": 1,\n  "b": "x", "c": [null, "y"]']
CONTACT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+( [A-Z][a-z]+)*$", "maxLength": 40},
        "email": {"type": "string", "format": "email"},
        "id": {"type": "string", "format": "uuid"},
        "seen": {"type": "string", "format": "date-time"},
        "ip": {"anyOf": [{"type": "string", "format": "ipv4"}, {"type": "string", "format": "ipv6"}]},
        "code": {"type": "string", "pattern": "[0-9]{3}"},
    },
    "required": ["name", "email", "id", "seen", "ip", "code"],
}
# name -> a JSON schema (dict or None), or ("regex", pattern), or ("grammar", GBNF text)
SCHEMAS = {"json_object": None, "order (pydantic-like)": ORDER, "tree ($ref recursion)": TREE,
           "contact (patterns, formats)": CONTACT,
           "regex reply": ("regex", r"(Yes|No|Maybe)(, because [a-z ,]{1,60}\.)? Confidence: [0-9]{1,2}%"),
           "JSON as a GBNF grammar": ("grammar", JSON_GRAMMAR)}


def synthetic_vocab(size: int = VOCAB_SIZE, seed: int = 0) -> list[bytes | None]:
    """`size` distinct text tokens, then 16 special (None) ids."""
    rng = np.random.default_rng(seed)
    tokens: dict[bytes, None] = {}

    def add(t: bytes) -> None:
        if t and len(tokens) < size:
            tokens.setdefault(t, None)

    for b in range(256):
        add(bytes([b]))
    punct = [b"{", b"}", b"[", b"]", b'"', b":", b",", b" ", b"\n"]
    for a in punct:
        for b in punct:
            add(a + b)
            for c in punct:
                add(a + b + c)
    for n in range(1, 65):
        add(b" " * n)
    for n in range(33):
        add(b"\n" + b" " * n)
        add(b",\n" + b" " * n)
        add(b"\n" + b"\t" * min(n, 8))
    for n in range(1000):
        add(str(n).encode())
    for e in (b"\\n", b"\\t", b'\\"', b"\\\\", b"\\/", b"\\u00", b"\\u", b"\\r\\n", b'\\""', b"\\n\\n"):
        add(e)
    cjk = [chr(c).encode() for c in range(0x4E00, 0x4E00 + 12000)]
    for c in cjk[:8000]:
        add(c)
        add(c[:2])
        add(c[2:])
    for k in range(0, 8000, 2):
        add(cjk[k] + cjk[k + 1])
    for c in "éèüößçñøåæœ—–…€£¥©®°±µ¶·½":
        add(c.encode())
        add((" " + c).encode())
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "th",
              "ch", "sh", "pr", "tr", "gr", "cl", "bl", "str"]
    nuclei = ["a", "e", "i", "o", "u", "ea", "ou", "ai", "io", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "ll", "ss", "rt", "tion", "ing", "ed"]
    symbols = list(b"()=;<>+-*/&|!?#%@$^~'`_.")
    while len(tokens) < size:
        word = "".join(onsets[rng.integers(len(onsets))] + nuclei[rng.integers(len(nuclei))] +
                       codas[rng.integers(len(codas))] for _ in range(rng.integers(1, 4)))
        r = rng.random()
        w = word.encode()
        if r < 0.35:
            add(b" " + w)
        elif r < 0.6:
            add(w)
        elif r < 0.7:
            add(b" " + w.capitalize())
        elif r < 0.75:
            add(w.capitalize())
        elif r < 0.8:
            add(b'"' + w)
        elif r < 0.84:
            add(w + [b'"', b'",', b'":', b'"}', b'"]', b'")'][rng.integers(6)])
        elif r < 0.87:
            add(b'"' + w + b'":')
        elif r < 0.9:
            add(w + b"\n")
        elif r < 0.95:
            add(bytes(rng.choice(symbols, size=rng.integers(1, 4))))
        else:
            add(w[: rng.integers(1, len(w) + 1)])
    return list(tokens) + [None] * 16


def state_kind(m: Matcher) -> str:
    """A label of the parser state: the top frame's node type (and phase for containers), for the cold table."""
    names = []
    for stack in m._state:
        if stack is None:
            names.append("done")
            continue
        frame = stack[0]
        kind = type(frame[0]).__name__.lstrip("_")
        if kind in ("Object", "Array"):
            kind += ":" + ("open", "key_done", "colon", "value_done", "comma")[frame[1]]
        elif kind == "String":
            kind += ":plain" if frame[1] == 0 else ":inside a character or escape"
            kind += " (limited)" if frame[0].max_len is not None else ""
        names.append(kind)
    return " | ".join(sorted(set(names)))


def reply(grammar, tokens: TokenBytes, growers: np.ndarray, closers: np.ndarray, rng, max_tokens: int,
          cold: dict | None):
    """One random reply; returns the per-step times (allowed + advance, seconds)."""
    m = Matcher(grammar, tokens, [STOP])
    times = []
    for _ in range(max_tokens):
        start = time.perf_counter()
        allowed = m.allowed()
        took_mask = time.perf_counter() - start
        if cold is not None:
            cold.setdefault(state_kind(m), took_mask)
        if m.terminated:
            break
        pool = allowed & tokens.is_text
        if rng.random() < 0.5 and (pool & growers).any():
            pool = pool & growers
        if rng.random() < 0.85 and (pool & ~closers).any():
            pool = pool & ~closers
        token = int(rng.choice(np.flatnonzero(pool)))
        start = time.perf_counter()
        m.advance(token)
        times.append(took_mask + time.perf_counter() - start)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replies", type=int, default=5, help="replies per schema after the first")
    ap.add_argument("--tokens", type=int, default=200, help="tokens per reply at most")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    vocab = synthetic_vocab()
    start = time.perf_counter()
    tokens = TokenBytes(vocab)
    print(f"vocabulary: {tokens.is_text.sum()} text tokens + {tokens.vocab_size - tokens.is_text.sum()} special; "
          f"TokenBytes index (once per vocabulary): {1e3 * (time.perf_counter() - start):.0f} ms")
    growers = np.array([t is not None and any(c in t for c in b'"{[,:0123456789') for t in vocab])
    closers = np.array([t is not None and any(c in t for c in b"}]") for t in vocab])
    grammar = compile_json_schema(None)
    print("\n## json_object, fixed places, cold (ms)")
    for text in PROBES:
        m = Matcher(grammar, tokens, [STOP])
        for byte in text:
            m.advance(byte)  # ids 0..255 are the single bytes
        start = time.perf_counter()
        allowed = m.allowed()
        took = time.perf_counter() - start
        print(f"{text.decode('utf-8', 'backslashreplace')!r:58s} {1e3 * took:8.2f}  ({allowed.sum()} allowed)")
    rng = np.random.default_rng(args.seed)
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        if isinstance(schema, tuple):
            grammar = (compile_regex if schema[0] == "regex" else compile_grammar)(schema[1])
        else:
            grammar = compile_json_schema(schema)
        print(f"\n## {name}: compile {1e3 * (time.perf_counter() - start):.1f} ms")
        cold: dict[str, float] = {}
        first: list[float] = []
        while len(first) < args.tokens:
            first += reply(grammar, tokens, growers, closers, rng, args.tokens - len(first), cold)
        later = []
        for _ in range(args.replies):
            later += reply(grammar, tokens, growers, closers, rng, args.tokens, None)
        print(f"{'cold state (first allowed())':58s} {'ms':>8s}")
        for kind, took in sorted(cold.items(), key=lambda kv: -kv[1]):
            print(f"{kind:58s} {1e3 * took:8.2f}")
        for label, times in (("first replies, cold cache", first), (f"{args.replies} later replies", later)):
            ms = 1e3 * np.array(times)
            print(f"steady, {label}: {len(ms)} steps, median {np.median(ms):.3f} ms, "
                  f"p99 {np.percentile(ms, 99):.3f} ms, max {ms.max():.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
