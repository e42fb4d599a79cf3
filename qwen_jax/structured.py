"""Structured outputs: a JSON Schema compiled to a grammar over bytes, and per-request matchers that say which
token ids may come next (OpenAI's `response_format`: `json_object` and `json_schema`).

The language is JSON (RFC 8259) read byte by byte, with a few limits so that a model cannot loop forever and the
end of a document is plain to see:
- whitespace (space, \\n, \\t, \\r) where JSON allows it, at most `MAX_WHITESPACE` bytes in a row, and none before
  the document's first byte or after its last (a reply ends right after its top-level value closes);
- a number has at most `MAX_NUMBER_BYTES` bytes; "integer" allows no fraction or exponent; a number with bounds
  (minimum, maximum, exclusiveMinimum, exclusiveMaximum) has no exponent and no "-0" either (`qwen_jax.numrange`:
  its text is in the bounds exactly when its value is);
- strings: the escapes of RFC 8259, no raw control bytes, bytes >= 0x80 only as well-formed UTF-8 (Unicode's
  table: no overlong forms, surrogates or code points past U+10FFFF), and no \\uXXXX escape of a surrogate
  (D800-DFFF; the character itself is written instead), so a string's length in code points is known while it
  is written.

Schema keywords (`compile_json_schema`): type (a name or a list), enum, const, properties, required,
additionalProperties, items, prefixItems, minItems, maxItems, minLength, maxLength (code points), pattern (a
regular expression found in the value, as JSON Schema reads it: "^...$" for the whole value; `qwen_jax.regex`'s
syntax), format (on strings: date, time,
date-time, duration, uuid, ipv4, ipv6, hostname and email are enforced with `regex.FORMATS`; other formats, and
formats on other types, are annotations), minimum, maximum, exclusiveMinimum and exclusiveMaximum (numbers
or, draft 4, true/false beside minimum/maximum; on numbers and integers), anyOf, oneOf (read as anyOf), allOf with one subschema, $ref to a local
JSON pointer ("#", "#/$defs/NAME", "#/definitions/NAME", recursion allowed), $defs, definitions, nullable
(OpenAPI: adds "null"). Annotations are ignored (title, description, default, examples, $schema, $id, $comment,
deprecated, readOnly, writeOnly); any other keyword is a ValueError naming it and where it is (a JSON pointer).
Choices made where JSON Schema leaves room for a model:
- An object with "properties" writes its keys in the declared order, each at most once; a required one must come,
  an optional one may be left out. additionalProperties absent counts as false (as OpenAI's strict mode has it);
  with true or a schema, other keys may follow the declared ones (they are not checked against the declared
  names). An object without "properties" takes any keys (values: additionalProperties' schema, or any JSON).
  Keys are written as json.dumps writes them (non-ASCII characters raw).
- enum and const values are written exactly as json.dumps(value, ensure_ascii=False, separators=(",", ":"))
  writes them (no whitespace variants); beside them only type and nullable may stand (they filter the values).
- A schema without "type" takes only the kinds its keywords belong to (properties/required/additionalProperties:
  object; items/prefixItems/minItems/maxItems: array; minLength/maxLength: string; the numeric bounds: number);
  JSON Schema would let other
  kinds through, which no caller of a model means. No such keyword: any JSON value.
- $ref, anyOf, oneOf and allOf may stand only beside annotations and $defs (no intersection of schemas).
- A string with a pattern or an enforced format writes \\u escapes only for control characters (any other
  character is written as itself), so that its value is read as it is written.
Every state a matcher can reach can still be completed: parts of a schema that accept nothing (an empty enum,
minLength above maxLength, a required property no value fits, recursion that never ends) are left out where they
are optional and make compile_json_schema raise where they are not.

How masks are computed (`Matcher.allowed`). A parser state is a set of stacks (anyOf alternatives, or a declared
key and an extra key, are followed side by side); a stack is a linked list of immutable frames, so states hash,
compare and copy for free, and a token is allowed from a set exactly when it is allowed from one of its stacks.
Per stack, the vocabulary's bytes, sorted (`_SortedTrie`: a node is the range of tokens sharing a prefix), are
walked depth first with the stack, pruning at the first byte the grammar refuses. Inside a string, where almost
every token fits, the walk stops: each token's bytes past the node were read once as string content
(`_Scan`: still inside, closed, or invalid; the code points before the closing quote), so the string's length
limits are two numpy comparisons, and the bytes after a closing quote (`",`, `"}`, ...) are walked from the state
after the string, as a small trie of their own. A string with a pattern or format, and a `compile_regex` reply,
are read by a byte automaton (`qwen_jax.regex`): its table is applied to all of a node's tokens a byte position at
a time (numpy), and the bytes after a closing quote are walked as above. Masks are kept per state in an LRU shared
by every Matcher of the same (Grammar, TokenBytes) pair, and bit-packed in a second one, eight times as many.
"""

from __future__ import annotations

import bisect
import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from qwen_jax import ebnf as _ebnf
from qwen_jax import numrange as _numrange
from qwen_jax import regex as _regex

MAX_WHITESPACE = 16  # consecutive whitespace bytes between two tokens of JSON
MAX_NUMBER_BYTES = 32
MASK_CACHE_BYTES = 32 << 20  # per (Grammar, TokenBytes) pair: ~210 masks of a 150K vocabulary, ~135 of 248K
PACKED_MASK_BYTES = 32 << 20  # the same masks bit-packed, per pair: ~1080 of a 248K vocabulary
READINGS_BYTES = 32 << 20  # per pair: automata's and rules' readings of trie nodes (`_Reading`, `_RuleReading`)

_WHITESPACE = frozenset(b" \n\t\r")
_QUOTE, _BACKSLASH, _COMMA, _COLON = 0x22, 0x5C, 0x2C, 0x3A
_LBRACE, _RBRACE, _LBRACKET, _RBRACKET = 0x7B, 0x7D, 0x5B, 0x5D

# ---- byte tables -------------------------------------------------------------------------------------------------

_DEAD, _CLOSE = -1, -2


def _string_table() -> tuple[tuple[int, ...], ...]:
    """Next sub-state of string content per (sub-state, byte): _DEAD refused, _CLOSE the closing quote. Sub-states:
    0 between characters; 1-7 inside a UTF-8 character (they differ in the range of the next continuation byte:
    Unicode's well-formed sequences); 8 after a backslash; 9-13 inside \\uXXXX (10: after \\uD, where 8-F would
    make a surrogate). A character is counted where it starts (a byte read in sub-state 0)."""
    table = [[_DEAD] * 256 for _ in range(14)]
    between = table[0]
    for b in range(0x20, 0x80):
        between[b] = 0
    between[_QUOTE] = _CLOSE
    between[_BACKSLASH] = 8
    for lo, hi, sub in ((0xC2, 0xDF, 1), (0xE0, 0xE0, 4), (0xE1, 0xEC, 2), (0xED, 0xED, 5), (0xEE, 0xEF, 2),
                        (0xF0, 0xF0, 6), (0xF1, 0xF3, 3), (0xF4, 0xF4, 7)):
        for b in range(lo, hi + 1):
            between[b] = sub
    for sub, lo, hi, after in ((1, 0x80, 0xBF, 0), (2, 0x80, 0xBF, 1), (3, 0x80, 0xBF, 2), (4, 0xA0, 0xBF, 1),
                               (5, 0x80, 0x9F, 1), (6, 0x90, 0xBF, 2), (7, 0x80, 0x8F, 2)):
        for b in range(lo, hi + 1):
            table[sub][b] = after
    for b in b'"\\/bfnrt':
        table[8][b] = 0
    table[8][ord("u")] = 9
    for b in b"0123456789abcdefABCDEF":
        table[9][b], table[11][b], table[12][b], table[13][b] = 11, 12, 13, 0
    for b in b"dD":
        table[9][b] = 10
    for b in b"01234567":
        table[10][b] = 12
    return tuple(tuple(row) for row in table)


_STRING = _string_table()


def _number_table(integer: bool) -> tuple[tuple[int, ...], ...]:
    """Next sub-state of a number per (sub-state, byte). Sub-states: 0 nothing read, 1 after '-', 2 after a leading
    0, 3 in integer digits, 4 after '.', 5 in fraction digits, 6 after 'e', 7 after the exponent's sign, 8 in
    exponent digits."""
    table = [[_DEAD] * 256 for _ in range(9)]
    table[0][ord("-")] = 1
    for sub in (0, 1):
        table[sub][ord("0")] = 2
        for b in b"123456789":
            table[sub][b] = 3
    for b in b"0123456789":
        table[3][b] = 3
        if not integer:
            table[4][b] = table[5][b] = 5
            table[6][b] = table[7][b] = table[8][b] = 8
    if not integer:
        for sub in (2, 3):
            table[sub][ord(".")] = 4
        for sub in (2, 3, 5):
            table[sub][ord("e")] = table[sub][ord("E")] = 6
        table[6][ord("+")] = table[6][ord("-")] = 7
    return tuple(tuple(row) for row in table)


_NUMBER, _INTEGER = _number_table(False), _number_table(True)
_NUMBER_NEEDS = (1, 1, 0, 0, 1, 0, 1, 1, 0)  # bytes a number still needs, per sub-state, before it may end

# ---- grammar nodes -----------------------------------------------------------------------------------------------
# A frame is a tuple whose first item is the node that reads it: `frame[0].step(frame, below, byte, out)` appends
# to `out` every stack the byte leads to; `node.start(byte, below, out)` does the same for a value's first byte.
# A stack is (frame, below), `below` the rest of the stack or None; the stack None is a finished document.


class _Slot:
    """The schemas a value may match at one place of a schema. While compiling, `sources` are nodes and other slots
    (a $ref, an anyOf); afterwards `alts` are the concrete nodes that can produce a value there."""

    __slots__ = ("sources", "alts", "pointer", "reason")

    def __init__(self, sources: list, pointer: str, reason: str = ""):
        self.sources, self.alts, self.pointer, self.reason = sources, (), pointer, reason


def _feed(stack, byte: int, out: list) -> None:
    frame = stack[0]
    frame[0].step(frame, stack[1], byte, out)


class _Start:
    """The document's first byte: a value of the root slot, with nothing before it."""

    __slots__ = ("slot",)

    def __init__(self, slot: _Slot):
        self.slot = slot

    def step(self, frame, below, byte, out):
        for alt in self.slot.alts:
            alt.start(byte, below, out)

    def can_end(self, frame):
        return False


def _counted(count: int, min_len: int, max_len: int | None) -> int:
    """A string's count after one more character, -1 past max_len; without max_len it stops at min_len, so that a
    free string's state does not change as it grows."""
    if max_len is not None:
        return count + 1 if count < max_len else -1
    return count + 1 if count < min_len else count


class _String:
    """A string value (or an object key beyond the declared ones). Frame: (node, sub-state, code points so far);
    the count stops at min_len when there is no max_len, so a free string's state does not change as it grows."""

    __slots__ = ("min_len", "max_len", "pointer")

    def __init__(self, min_len: int, max_len: int | None, pointer: str):
        self.min_len, self.max_len, self.pointer = min_len, max_len, pointer

    def start(self, byte, below, out):
        if byte == _QUOTE:
            out.append(((self, 0, 0), below))

    def step(self, frame, below, byte, out):
        sub, count = frame[1], frame[2]
        after = _STRING[sub][byte]
        if after < 0:
            if after == _CLOSE and count >= self.min_len:
                out.append(below)
            return
        if sub == 0:
            count = _counted(count, self.min_len, self.max_len)
            if count < 0:
                return
        out.append(((self, after, count), below))

    def can_end(self, frame):
        return False


class _Number:
    """A number (integer: no fraction or exponent). Frame: (node, sub-state, bytes so far). A number has no closing
    byte: in a sub-state where it may end, a byte that does not continue it goes to the frame below."""

    __slots__ = ("table", "pointer")

    def __init__(self, integer: bool, pointer: str):
        self.table, self.pointer = (_INTEGER if integer else _NUMBER), pointer

    def start(self, byte, below, out):
        after = self.table[0][byte]
        if after >= 0:
            out.append(((self, after, 1), below))

    def step(self, frame, below, byte, out):
        sub, length = frame[1], frame[2]
        after = self.table[sub][byte]
        if after >= 0:
            if length + 1 + _NUMBER_NEEDS[after] <= MAX_NUMBER_BYTES:
                out.append(((self, after, length + 1), below))
        elif _NUMBER_NEEDS[sub] == 0 and below is not None:
            _feed(below, byte, out)

    def can_end(self, frame):
        return _NUMBER_NEEDS[frame[1]] == 0


class _Bounded:
    """A number held to numeric bounds, read by a byte automaton (`qwen_jax.numrange`). Frame: (node, state). As
    for _Number, there is no closing byte: where the automaton accepts, a byte that does not continue the number
    goes to the frame below."""

    __slots__ = ("rows", "accept", "first", "pointer")

    def __init__(self, auto: _regex.ByteAutomaton, pointer: str):
        self.rows, self.accept, self.first, self.pointer = auto.table.tolist(), auto.accept.tolist(), auto.start, pointer

    def start(self, byte, below, out):
        after = self.rows[self.first][byte]
        if after >= 0:
            out.append(((self, after), below))

    def step(self, frame, below, byte, out):
        after = self.rows[frame[1]][byte]
        if after >= 0:
            out.append(((self, after), below))
        elif self.accept[frame[1]] and below is not None:
            _feed(below, byte, out)

    def can_end(self, frame):
        return self.accept[frame[1]]


class _LitNode:
    """A node of a trie of byte strings: `children` by byte, `end` True where a string ends, `payload` what that
    string stands for (a declared key: the next property index and the value's slot)."""

    __slots__ = ("children", "end", "payload")

    def __init__(self):
        self.children: dict[int, _LitNode] = {}
        self.end, self.payload = False, None


def _lit_trie(items: Iterable[tuple[bytes, object]]) -> _LitNode:
    root = _LitNode()
    for data, payload in items:
        node = root
        for b in data:
            node = node.children.setdefault(b, _LitNode())
        node.end, node.payload = True, payload
    return root


class _Literals:
    """One of a fixed set of JSON texts (enum/const values, true/false/null). Frame: (node, trie node). A text that
    is a prefix of another (numbers: 1 and 12) ends where the next byte does not continue it."""

    __slots__ = ("values", "root", "pointer", "reason")

    def __init__(self, values: tuple[bytes, ...], pointer: str, reason: str = ""):
        self.values, self.pointer, self.reason = values, pointer, reason
        self.root = _lit_trie((v, None) for v in values)

    def _enter(self, node, byte, below, out) -> bool:
        child = node.children.get(byte)
        if child is None:
            return False
        out.append(((self, child), below) if child.children else below)
        return True

    def start(self, byte, below, out):
        self._enter(self.root, byte, below, out)

    def step(self, frame, below, byte, out):
        node = frame[1]
        if not self._enter(node, byte, below, out) and node.end and below is not None:
            _feed(below, byte, out)

    def can_end(self, frame):
        return frame[1].end


class _Automaton:
    """Text read by a byte automaton (`qwen_jax.regex`). Frame: (node, state, characters so far). Quoted: a JSON
    string whose value the automaton checks (`regex.json_string`'s table: the value starts at the opening quote and
    ends at the closing one, a CLOSE entry), its length in code points held to min_len..max_len (counted as
    _String counts); else raw text, a whole reply (vLLM's `regex`), which may end wherever the automaton
    accepts."""

    __slots__ = ("auto", "rows", "starts", "flat_table", "flat_starts", "quoted", "min_len", "max_len", "lengths",
                 "pointer", "reason")

    def __init__(self, auto: _regex.ByteAutomaton, quoted: bool, pointer: str, reason: str = "", min_len: int = 0,
                 max_len: int | None = None):
        self.auto, self.quoted, self.pointer, self.reason = auto, quoted, pointer, reason
        self.min_len, self.max_len = min_len, max_len
        self.rows = auto.table.tolist()  # Python ints: a step is two list lookups
        self.starts = None if auto.starts is None else auto.starts.tolist()
        # for masks (`_automaton_hits`): state * 256 + byte -> next state, and whether it begins a character
        self.flat_table = auto.table.reshape(-1).astype(np.int32)
        self.flat_starts = None if auto.starts is None else auto.starts.reshape(-1).astype(np.int32)
        limited = quoted and not auto.empty and (min_len or max_len is not None)
        self.lengths = _Lengths(auto, min_len, max_len) if limited else None

    def start(self, byte, below, out):
        if not self.quoted:
            self.step((self, self.auto.start, 0), below, byte, out)
        elif byte == _QUOTE and not self.auto.empty:
            out.append(((self, self.auto.start, 0), below))

    def step(self, frame, below, byte, out):
        _, state, count = frame
        nxt = self.rows[state][byte]
        if nxt >= 0:
            if self.starts is not None and self.starts[state][byte]:
                count = _counted(count, self.min_len, self.max_len)
                if count < 0:
                    return
            if self.lengths is None or self.lengths.fits(nxt, count):
                out.append(((self, nxt, count), below))
        elif nxt == _regex.CLOSE and count >= self.min_len:
            out.append(below)

    def can_end(self, frame):
        return not self.quoted and bool(self.auto.accept[frame[1]])


class _Rule:
    """A rule of a context-free grammar (`qwen_jax.ebnf`). Frame: (node, state). A byte goes on in the rule, into a
    rule called from this state (its frame pushed above one that resumes after the call), and, where the rule may
    end, to the frame below; every way is followed (a state is a set of stacks). Calls always read a byte (ebnf
    calls the non-empty form of a rule that may be empty), so a step never loops."""

    __slots__ = ("name", "rows", "calls", "accept", "nodes", "flat_table", "calling", "accepting")

    def __init__(self, rule: _ebnf.Rule):
        self.name, self.rows, self.calls = rule.name, rule.table.tolist(), rule.calls
        self.accept = rule.accept.tolist()
        self.nodes: list[_Rule] = []
        # for masks (`_rule_hits`): state * 256 + byte -> next state; states that call; states that may end
        self.flat_table = rule.table.reshape(-1).astype(np.int32)
        self.calling = np.array([bool(c) for c in rule.calls])
        self.accepting = rule.accept.astype(bool)

    def exits(self, state: int, below) -> list:
        """The stacks a byte read at `state` may go to other than this rule's own next state: into each rule
        called here, and (where the rule may end) the frame below."""
        out = []
        for callee, after in self.calls[state]:
            node = self.nodes[callee]
            out.append(((node, 0), ((self, after), below)))
        if self.accept[state] and below is not None:
            out.append(below)
        return out

    def step(self, frame, below, byte, out):
        state = frame[1]
        nxt = self.rows[state][byte]
        if nxt >= 0:
            out.append(((self, nxt), below))
        for callee, after in self.calls[state]:
            node = self.nodes[callee]
            node.step((node, 0), ((self, after), below), byte, out)
        if self.accept[state] and below is not None:
            _feed(below, byte, out)

    def can_end(self, frame):
        return self.accept[frame[1]]


MAX_PATTERN_LENGTH = 4096  # the largest minLength / maxLength beside a pattern or an enforced format


class _Lengths:
    """Which (state, characters so far) of a quoted automaton can still close within min_len..max_len characters:
    `levels[k, s]`, a string of exactly k more characters (k <= max_len) closes from state s, as prefix sums over k;
    without max_len, `levels[k, s]` is "at least k more"."""

    __slots__ = ("min_len", "max_len", "sums", "levels")

    def __init__(self, auto: _regex.ByteAutomaton, min_len: int, max_len: int | None):
        if max(min_len, max_len or 0) > MAX_PATTERN_LENGTH:
            raise ValueError(f"'minLength' / 'maxLength' above {MAX_PATTERN_LENGTH} beside 'pattern' or 'format' "
                             "is not supported")
        self.min_len, self.max_len = min_len, max_len
        both = np.concatenate([auto.table, auto.starts.astype(np.int32)], axis=0)
        _, cols = np.unique(both.T, axis=0, return_index=True)  # one byte of each class is enough here
        table, starts = auto.table[:, cols], auto.starts[:, cols]
        valid = table >= 0
        counted, kept = valid & starts, valid & ~starts
        target = np.maximum(table, 0)

        def level(x: np.ndarray) -> np.ndarray:  # states with a counted byte into x, closed under uncounted ones
            x = (counted & x[target]).any(axis=1)
            while True:
                y = x | (kept & x[target]).any(axis=1)
                if (y == x).all():
                    return x
                x = y

        closes = (auto.table == _regex.CLOSE).any(axis=1)
        first = closes
        while True:  # zero more characters: close after uncounted bytes only
            grown = first | (kept & first[target]).any(axis=1)
            if (grown == first).all():
                break
            first = grown
        levels = [first if max_len is not None else np.ones(len(closes), bool)]
        for _ in range(max_len if max_len is not None else min_len):
            levels.append(level(levels[-1]))
        levels = np.stack(levels)
        self.levels = levels
        self.sums = None
        if max_len is not None:
            self.sums = np.zeros((len(levels) + 1, len(closes)), np.int32)
            np.cumsum(levels, axis=0, out=self.sums[1:])

    def fits(self, state, count):
        """bool (or a bool array for arrays of states and counts): some closing string from `state`, `count`
        characters written, ends with min_len..max_len characters."""
        low = np.maximum(self.min_len - np.asarray(count), 0)
        if self.max_len is None:
            return self.levels[low, state]
        high = self.max_len - np.asarray(count)
        upper, lower = np.maximum(high, -1) + 1, np.clip(np.minimum(low, high + 1), 0, None)
        return (high >= low) & (self.sums[upper, state] - self.sums[lower, state] > 0)


# Phases of an object or array frame: after the opening bracket, after a key (before ':'), after ':', after a
# value, after ','. Each is a gap where whitespace may come.
_OPEN, _KEY_DONE, _COLON_DONE, _VALUE_DONE, _COMMA_DONE = range(5)


class _Object:
    """An object. `props`: (key as written with its quotes, value slot, required) in declared order; `extra`: the
    slot of other keys' values, None when there are none. Frame: (node, phase, next declared index, slot of the
    value whose key was read, whitespace run). Per next index i (finish() builds them): `keys[i]` the trie of keys
    that may come (declared ones from i up to and including the first required one), `can_close[i]` no required
    key left, `extra_ok[i]` an extra key may come, `can_continue[i]` some key may come after a comma."""

    __slots__ = ("props", "extra", "key_string", "pointer", "keys", "can_close", "extra_ok", "can_continue",
                 "key_reader")

    def __init__(self, props: list, extra: _Slot | None, key_string: _String, pointer: str):
        self.props, self.extra, self.key_string, self.pointer = props, extra, key_string, pointer
        self.key_reader = _KeyReader(self)

    def finish(self) -> None:
        self.props = [p for p in self.props if p[1].alts]
        if self.extra is not None and not self.extra.alts:
            self.extra = None
        n = len(self.props)
        self.keys, self.can_close, self.extra_ok, self.can_continue = [], [], [], []
        for i in range(n + 1):
            keys = []
            for j in range(i, n):
                keys.append((self.props[j][0], (j + 1, self.props[j][1])))
                if self.props[j][2]:
                    break
            closes = not any(required for _, _, required in self.props[i:])
            self.keys.append(_lit_trie(keys))
            self.can_close.append(closes)
            self.extra_ok.append(closes and self.extra is not None)
            self.can_continue.append(bool(keys) or self.extra_ok[i])

    def start(self, byte, below, out):
        if byte == _LBRACE:
            out.append(((self, _OPEN, 0, None, 0), below))

    def step(self, frame, below, byte, out):
        phase, i, slot, run = frame[1], frame[2], frame[3], frame[4]
        if byte in _WHITESPACE:
            if run < MAX_WHITESPACE:
                out.append(((self, phase, i, slot, run + 1), below))
        elif phase == _OPEN or phase == _COMMA_DONE:
            if byte == _QUOTE:
                child = self.keys[i].children.get(_QUOTE)
                if child is not None:
                    out.append(((self.key_reader, child), below))
                if self.extra_ok[i]:
                    after_key = ((self, _KEY_DONE, len(self.props), self.extra, 0), below)
                    out.append(((self.key_string, 0, 0), after_key))
            elif byte == _RBRACE and phase == _OPEN and self.can_close[i]:
                out.append(below)
        elif phase == _KEY_DONE:
            if byte == _COLON:
                out.append(((self, _COLON_DONE, i, slot, 0), below))
        elif phase == _COLON_DONE:
            after_value = ((self, _VALUE_DONE, i, None, 0), below)
            for alt in slot.alts:
                alt.start(byte, after_value, out)
        elif byte == _COMMA:
            if self.can_continue[i]:
                out.append(((self, _COMMA_DONE, i, None, 0), below))
        elif byte == _RBRACE and self.can_close[i]:
            out.append(below)

    def can_end(self, frame):
        return False


class _KeyReader:
    """A declared key being written, past its opening quote. Frame: (reader, trie node of the object's key trie)."""

    __slots__ = ("owner",)

    def __init__(self, owner: _Object):
        self.owner = owner

    def step(self, frame, below, byte, out):
        child = frame[1].children.get(byte)
        if child is None:
            return
        if child.end:  # keys end with their closing quote, so an ending node has no children
            next_index, slot = child.payload
            out.append(((self.owner, _KEY_DONE, next_index, slot, 0), below))
        else:
            out.append(((self, child), below))

    def can_end(self, frame):
        return False


class _Array:
    """An array: item k matches `prefix[k]`, later items `items` (None: no more items). Frame: (node, phase, items
    started, whitespace run); the count stops at `cap`, past which every count reads the same."""

    __slots__ = ("prefix", "items", "min_items", "max_items", "cap", "pointer")

    def __init__(self, prefix: list[_Slot], items: _Slot | None, min_items: int, max_items: int | None,
                 pointer: str):
        self.prefix, self.items, self.min_items, self.max_items, self.pointer = (
            prefix, items, min_items, max_items, pointer)
        self.cap = 0

    def slot_at(self, k: int) -> _Slot | None:
        return self.prefix[k] if k < len(self.prefix) else self.items

    def finish(self) -> None:
        """Narrows max_items to the items that can exist (an item whose schema accepts nothing ends the array)."""
        limit = next((k for k, s in enumerate(self.prefix) if not s.alts), None)
        if limit is None and (self.items is None or not self.items.alts):
            limit = len(self.prefix)
        if limit is not None:
            self.max_items = limit if self.max_items is None else min(self.max_items, limit)
        self.cap = self.max_items if self.max_items is not None else max(len(self.prefix), self.min_items)

    def start(self, byte, below, out):
        if byte == _LBRACKET:
            out.append(((self, _OPEN, 0, 0), below))

    def step(self, frame, below, byte, out):
        phase, count, run = frame[1], frame[2], frame[3]
        if byte in _WHITESPACE:
            if run < MAX_WHITESPACE:
                out.append(((self, phase, count, run + 1), below))
            return
        if phase == _VALUE_DONE:
            if byte == _COMMA:
                if self.max_items is None or count < self.max_items:
                    out.append(((self, _COMMA_DONE, count, 0), below))
            elif byte == _RBRACKET and count >= self.min_items:
                out.append(below)
            return
        if phase == _OPEN and byte == _RBRACKET:
            if self.min_items == 0:
                out.append(below)
            return
        if self.max_items is not None and count >= self.max_items:
            return
        after_item = ((self, _VALUE_DONE, min(count + 1, self.cap), 0), below)
        for alt in self.slot_at(count).alts:
            alt.start(byte, after_item, out)

    def can_end(self, frame):
        return False


def _can_end(stack) -> bool:
    """Whether the stack may stop here: every frame on it ends without another byte (a finished document, or a
    top-level number or literal that may end)."""
    while stack is not None:
        frame = stack[0]
        if not frame[0].can_end(frame):
            return False
        stack = stack[1]
    return True


# ---- compiling a schema ------------------------------------------------------------------------------------------

_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                          "deprecated", "readOnly", "writeOnly"})
_CONTAINERS = frozenset({"$defs", "definitions"})
_KEYWORDS = frozenset({"type", "enum", "const", "properties", "required", "additionalProperties", "items",
                       "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format",
                       "anyOf", "oneOf", "allOf", "$ref", "nullable", "minimum", "maximum", "exclusiveMinimum",
                       "exclusiveMaximum"})
_TYPE_NAMES = ("object", "array", "string", "number", "integer", "boolean", "null")
_KIND_KEYWORDS = {"object": ("properties", "required", "additionalProperties"),
                  "array": ("items", "prefixItems", "minItems", "maxItems"),
                  "string": ("minLength", "maxLength", "pattern"),
                  "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")}


def _pointer(base: str, *parts: object) -> str:
    return base + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _has_type(value, name: str) -> bool:
    if name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    kind = {"string": str, "boolean": bool, "object": dict, "array": list}.get(name)
    return value is None if kind is None else isinstance(value, kind)


class _Builder:
    """Turns a schema into slots and nodes (compile_json_schema's working state): $ref targets by pointer, and the
    scalar nodes shared by equal schemas so that equal alternatives collapse into one stack."""

    def __init__(self, root):
        self.root = root
        self.refs: dict[str, _Slot] = {}
        self.shared: dict[tuple, object] = {}
        self._any: _Slot | None = None

    def string(self, min_len: int, max_len: int | None, pointer: str) -> _String:
        return self.shared.setdefault(("string", min_len, max_len), _String(min_len, max_len, pointer))

    def text(self, pattern: str | None, fmt: str | None, min_len: int, max_len: int | None,
             pointer: str) -> _Automaton:
        """A string whose value `pattern` matches (a search, as JSON Schema has it) and that is of the `format`
        (regex.FORMATS, whole values), with the length limits."""
        key = ("text", pattern, fmt, min_len, max_len)
        node = self.shared.get(key)
        if node is None:
            try:
                parts = [] if pattern is None else [_regex.compile_regex(pattern, "'pattern'", search=True)]
                if fmt is not None:
                    parts.append(_regex.format_automaton(fmt))
                auto = parts[0]
                for other in parts[1:]:
                    auto = _regex.intersect(auto, other)
                what = " with ".join(p.description for p in parts)
                limits = " and the length limits" if min_len or max_len is not None else ""
                node = _Automaton(_regex.json_string(auto), True, pointer,
                                  f"{what}{limits} accepts no string (at {pointer})", min_len, max_len)
            except ValueError as e:
                raise ValueError(f"{e} (at {pointer})") from None
            self.shared[key] = node
        return node

    def number(self, integer: bool, pointer: str) -> _Number:
        return self.shared.setdefault(("number", integer), _Number(integer, pointer))

    def bounded(self, integer: bool, bounds: tuple, pointer: str) -> _Bounded | _Literals:
        """A number (integer: no fraction) within `bounds` (`numrange.bounds`); none (an empty _Literals saying
        why) when no number of at most MAX_NUMBER_BYTES bytes is."""
        key = ("bounded", integer, bounds)
        node = self.shared.get(key)
        if node is None:
            auto = _numrange.bounded_number(integer, *bounds, MAX_NUMBER_BYTES)
            if auto is None:
                kind = "integer" if integer else "number"
                return self.literals((), pointer, f"no {kind} of at most {MAX_NUMBER_BYTES} bytes is within the "
                                                  f"bounds (at {pointer})")
            self.shared[key] = node = _Bounded(auto, pointer)
        return node

    def literals(self, values: Iterable[bytes], pointer: str, reason: str = "") -> _Literals:
        values = tuple(sorted(set(values)))
        return self.shared.setdefault(("literals", values), _Literals(values, pointer, reason))

    def any_value(self) -> _Slot:
        """Any JSON value; objects take any keys."""
        if self._any is None:
            self._any = slot = _Slot([], "#")
            slot.sources = [self.string(0, None, "#"), self.number(False, "#"),
                            self.literals((b"true", b"false", b"null"), "#"),
                            _Object([], slot, self.string(0, None, "#"), "#"), _Array([], slot, 0, None, "#")]
        return self._any

    def any_object(self) -> _Slot:
        return _Slot([_Object([], self.any_value(), self.string(0, None, "#"), "#")], "#")

    def ref(self, ref, pointer: str) -> _Slot:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise ValueError(f"'$ref' {ref!r} is not supported (at {pointer}): only references inside the schema "
                             "('#', '#/$defs/NAME', '#/definitions/NAME')")
        slot = self.refs.get(ref)
        if slot is None:
            target = self.root
            for part in ref[2:].split("/") if ref != "#" else ():
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(target, dict) and part in target:
                    target = target[part]
                elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                    target = target[int(part)]
                else:
                    raise ValueError(f"'$ref' {ref!r} does not resolve (at {pointer})")
            self.refs[ref] = slot = _Slot([], ref)
            slot.sources = [self.schema(target, ref)]
        return slot

    def schema(self, schema, pointer: str) -> _Slot:
        if schema is True:
            return self.any_value()
        if schema is False:
            return _Slot([], pointer, f"the schema false accepts nothing (at {pointer})")
        if not isinstance(schema, dict):
            raise ValueError(f"a schema must be an object or a boolean, not {type(schema).__name__} (at {pointer})")
        used = set()
        for key in schema:
            if key in _KEYWORDS:
                used.add(key)
            elif key not in _ANNOTATIONS and key not in _CONTAINERS:
                raise ValueError(f"{key!r} is not supported (at {pointer})")
        for alone in ("$ref", "anyOf", "oneOf", "allOf"):
            if alone in used:
                beside = sorted(used - {alone})
                if beside:
                    raise ValueError(f"{alone!r} beside {beside[0]!r} is not supported (at {pointer})")
        if "$ref" in used:
            return self.ref(schema["$ref"], pointer)
        for union in ("anyOf", "oneOf", "allOf"):
            if union in used:
                subs = schema[union]
                if not isinstance(subs, list) or not subs:
                    raise ValueError(f"{union!r} must be a non-empty list of schemas (at {pointer})")
                if union == "allOf" and len(subs) != 1:
                    raise ValueError(f"'allOf' with {len(subs)} schemas is not supported, only one "
                                     f"(at {pointer})")
                return _Slot([self.schema(s, _pointer(pointer, union, k)) for k, s in enumerate(subs)], pointer)
        names = self.types(schema, used, pointer)
        if "enum" in used or "const" in used:
            beside = sorted(used - {"enum", "const", "type", "nullable"})
            if beside:
                raise ValueError(f"{beside[0]!r} beside 'enum' or 'const' is not supported (at {pointer})")
            return _Slot([self.enum(schema, names, pointer)], pointer)
        if names is None:
            return self.any_value()
        return _Slot([self.node(name, schema, pointer) for name in names], pointer)

    def types(self, schema: dict, used: set, pointer: str) -> list[str] | None:
        """The JSON types a schema allows, None for all of them."""
        if "type" in schema:
            names = schema["type"]
            names = [names] if isinstance(names, str) else names
            if not isinstance(names, list) or not names or any(n not in _TYPE_NAMES for n in names):
                raise ValueError(f"'type' must be one of {', '.join(_TYPE_NAMES)} or a list of them, not "
                                 f"{schema['type']!r} (at {pointer})")
            names = list(dict.fromkeys(names))
        else:
            names = [kind for kind, keys in _KIND_KEYWORDS.items() if used.intersection(keys)] or None
        nullable = schema.get("nullable", False)
        if not isinstance(nullable, bool):
            raise ValueError(f"'nullable' must be true or false (at {pointer})")
        if nullable and names is not None and "null" not in names:
            names.append("null")
        if names is not None and "number" in names and "integer" in names:
            names.remove("integer")
        return names

    def enum(self, schema: dict, names: list[str] | None, pointer: str) -> _Literals:
        if "enum" in schema:
            if not isinstance(schema["enum"], list):
                raise ValueError(f"'enum' must be a list (at {pointer})")
            values = list(schema["enum"])
        else:
            values = [schema["const"]]
        if "const" in schema and "enum" in schema:
            values = [v for v in values if v == schema["const"]]
        if names is not None:
            values = [v for v in values if any(_has_type(v, n) for n in names)]
        written = []
        for v in values:
            try:
                written.append(json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode())
            except (TypeError, ValueError) as e:
                raise ValueError(f"{v!r} is not a JSON value ({e}) (at {pointer})") from None
        keyword = "enum" if "enum" in schema else "const"
        return self.literals(written, pointer, f"{keyword!r} has no value the schema allows (at {pointer})")

    def node(self, name: str, schema: dict, pointer: str):
        if name == "string":
            min_len = self.count(schema, "minLength", pointer, 0)
            max_len = self.count(schema, "maxLength", pointer, None)
            pattern, fmt = schema.get("pattern"), schema.get("format")
            if pattern is not None and not isinstance(pattern, str):
                raise ValueError(f"'pattern' must be a string (at {pointer})")
            if fmt not in _regex.FORMATS:
                fmt = None  # an annotation, as JSON Schema reads formats it does not assert
            if pattern is None and fmt is None:
                return self.string(min_len, max_len, pointer)
            return self.text(pattern, fmt, min_len, max_len, pointer)
        if name in ("number", "integer"):
            bounds = _numrange.bounds(schema, pointer)
            if bounds is None:
                return self.number(name == "integer", pointer)
            return self.bounded(name == "integer", bounds, pointer)
        if name in ("boolean", "null"):
            return self.literals((b"true", b"false") if name == "boolean" else (b"null",), pointer)
        if name == "array":
            return self.array(schema, pointer)
        return self.object(schema, pointer)

    @staticmethod
    def count(schema: dict, key: str, pointer: str, default):
        value = schema.get(key, default)
        if value is not default and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{key!r} must be a non-negative integer, not {value!r} (at {pointer})")
        return value

    def array(self, schema: dict, pointer: str) -> _Array:
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise ValueError(f"'prefixItems' must be a list of schemas (at {pointer})")
        items = schema.get("items", True)
        if isinstance(items, list):
            raise ValueError(f"'items' as a list is not supported; use 'prefixItems' (at {pointer})")
        return _Array([self.schema(s, _pointer(pointer, "prefixItems", k)) for k, s in enumerate(prefix)],
                      None if items is False else self.schema(items, _pointer(pointer, "items")),
                      self.count(schema, "minItems", pointer, 0), self.count(schema, "maxItems", pointer, None),
                      pointer)

    def object(self, schema: dict, pointer: str) -> _Object:
        props = schema.get("properties")
        required = schema.get("required", [])
        extra = schema.get("additionalProperties", None if props is not None else True)
        if props is not None and not isinstance(props, dict):
            raise ValueError(f"'properties' must be an object (at {pointer})")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"'required' must be a list of names (at {pointer})")
        for name in required:
            if name not in (props or {}):
                raise ValueError(f"required property {name!r} is not declared in 'properties' (at {pointer})")
        if extra is None or extra is False:
            extra_slot = None
        else:
            extra_slot = self.schema(extra, _pointer(pointer, "additionalProperties"))
        declared = [(json.dumps(name, ensure_ascii=False).encode(),
                     self.schema(sub, _pointer(pointer, "properties", name)), name in required)
                    for name, sub in (props or {}).items()]
        return _Object(declared, extra_slot, self.string(0, None, pointer), pointer)


def _children(node) -> list[_Slot]:
    if isinstance(node, _Object):
        return [p[1] for p in node.props] + ([node.extra] if node.extra is not None else [])
    if isinstance(node, _Array):
        return node.prefix + ([node.items] if node.items is not None else [])
    return []


def _finish(root: _Slot) -> None:
    """Resolves every reachable slot to the concrete nodes that can produce a value (the least fixpoint of
    'productive': a node is when the values it must contain can be), drops the rest where they are optional, and
    raises where the root has none."""
    slots, nodes, todo = [], [], [root]
    seen_slots, seen_nodes = set(), set()
    while todo:
        slot = todo.pop()
        if id(slot) in seen_slots:
            continue
        seen_slots.add(id(slot))
        slots.append(slot)
        for source in slot.sources:
            if isinstance(source, _Slot):
                todo.append(source)
            elif id(source) not in seen_nodes:
                seen_nodes.add(id(source))
                nodes.append(source)
                todo.extend(_children(source))
    concrete = {}
    for slot in slots:  # the nodes a slot reaches through $refs and unions without reading a byte
        found, stack, visited = {}, [slot], set()
        while stack:
            s = stack.pop()
            if id(s) in visited:
                continue
            visited.add(id(s))
            for source in reversed(s.sources):
                if isinstance(source, _Slot):
                    stack.append(source)
                else:
                    found.setdefault(id(source), source)
        concrete[id(slot)] = list(found.values())
    productive: set[int] = set()

    def fills(slot: _Slot | None) -> bool:
        return slot is not None and any(id(n) in productive for n in concrete[id(slot)])

    def can_produce(node) -> bool:
        if isinstance(node, _String):
            return node.max_len is None or node.min_len <= node.max_len
        if isinstance(node, _Automaton):
            return not node.auto.empty and (node.lengths is None or node.lengths.fits(node.auto.start, 0))
        if isinstance(node, _Literals):
            return bool(node.values)
        if isinstance(node, _Object):
            return all(fills(slot) for _, slot, required in node.props if required)
        if isinstance(node, _Array):
            return (node.max_items is None or node.min_items <= node.max_items) and all(
                fills(node.slot_at(k)) for k in range(node.min_items))
        return True

    changed = True
    while changed:
        changed = False
        for node in nodes:
            if id(node) not in productive and can_produce(node):
                productive.add(id(node))
                changed = True
    for slot in slots:
        slot.alts = tuple(n for n in concrete[id(slot)] if id(n) in productive)
    for node in nodes:
        if id(node) in productive and isinstance(node, _Object | _Array):
            node.finish()
    if not root.alts:
        raise ValueError(f"the schema accepts no JSON document: {_why_empty(root, concrete, set())}")


def _why_empty(slot: _Slot, concrete: dict, seen: set) -> str:
    """A reason a slot has no value, following the first thing it needs that has none."""
    nodes = concrete[id(slot)]
    if not nodes:
        return slot.reason or f"nothing to match (at {slot.pointer})"
    node = nodes[0]
    if id(node) in seen:
        return f"'$ref' recursion that never ends (at {node.pointer})"
    seen.add(id(node))
    if isinstance(node, _String):
        return f"'minLength' {node.min_len} is above 'maxLength' {node.max_len} (at {node.pointer})"
    if isinstance(node, _Literals | _Automaton):
        return node.reason or f"no value (at {node.pointer})"
    if isinstance(node, _Object):
        for _, sub, required in node.props:
            if required and not sub.alts:
                return _why_empty(sub, concrete, seen)
    if isinstance(node, _Array):
        if node.max_items is not None and node.min_items > node.max_items:
            return f"'minItems' {node.min_items} is above 'maxItems' {node.max_items} (at {node.pointer})"
        for k in range(node.min_items):
            sub = node.slot_at(k)
            if sub is None:
                return f"'minItems' {node.min_items} needs more items than the schema allows (at {node.pointer})"
            if not sub.alts:
                return _why_empty(sub, concrete, seen)
    return f"no value (at {node.pointer})"


class Grammar:
    """A compiled schema (compile_json_schema): the start of every document it accepts. Immutable and shareable
    between requests and threads; it carries the mask caches of the vocabularies it was matched against (an LRU
    of MASK_CACHE_BYTES and a packed one of PACKED_MASK_BYTES each, dropped with the TokenBytes)."""

    def __init__(self, root: _Slot | None, description: str, initial=None):
        self._initial = frozenset({initial or ((_Start(root), 0), None)})
        self._description = description
        self._caches: weakref.WeakKeyDictionary[TokenBytes, _LRU] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Grammar({self._description})"

    def _cache_for(self, tokens: TokenBytes) -> _LRU:
        with self._lock:
            cache = self._caches.get(tokens)
            if cache is None:
                self._caches[tokens] = cache = _LRU(MASK_CACHE_BYTES, PACKED_MASK_BYTES, READINGS_BYTES)
            return cache


def compile_json_schema(schema) -> Grammar:
    """The grammar of the documents a JSON Schema (a dict, or True: any JSON value) accepts; None: any JSON object
    (`response_format` {"type": "json_object"}). Raises ValueError naming the offending keyword and its place (a
    JSON pointer) for what is not supported (see the module's docstring) or a schema that accepts nothing."""
    builder = _Builder(schema)
    if schema is None:
        root, description = builder.any_object(), "json_object"
    else:
        if not isinstance(schema, dict | bool):
            raise ValueError(f"a schema must be an object or a boolean, not {type(schema).__name__} (at #)")
        root, description = builder.ref("#", "#"), "json_schema"
    _finish(root)
    return Grammar(root, description)


def compile_choice(choices: Sequence[str]) -> Grammar:
    """The grammar whose documents are exactly one of `choices` (non-empty strings, written as they are, not as
    JSON: vLLM's structured_outputs `choice`). A choice that is the start of another is complete where it ends but
    not terminated (the longer one may follow)."""
    if isinstance(choices, str) or not isinstance(choices, Sequence) or not choices:
        raise ValueError("choice must be a non-empty list of strings")
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise ValueError(f"choice[{i}] must be a non-empty string, got {c!r}")
    root = _Slot([_Literals(tuple(sorted({c.encode() for c in choices})), "#")], "#")
    _finish(root)
    return Grammar(root, "choice")


def compile_regex(pattern: str) -> Grammar:
    """The grammar whose documents are the texts `pattern` matches whole (vLLM's structured_outputs `regex`; the
    syntax is `qwen_jax.regex`'s). A reply may stop wherever the text so far matches, and ends when nothing may
    follow. ValueError for syntax outside the supported set, a pattern too large, or one that matches nothing."""
    auto = _regex.compile_regex(pattern)
    if auto.empty:
        raise ValueError(f"the pattern {pattern!r} matches no text")
    node = _Automaton(auto, False, "#")
    return Grammar(None, "regex", initial=((node, auto.start, 0), None))


def compile_grammar(text: str) -> Grammar:
    """The grammar whose documents are the texts a GBNF grammar's `root` rule produces (vLLM's structured_outputs
    `grammar`; the syntax is `qwen_jax.ebnf`'s). A reply may stop wherever the text so far is whole, and ends when
    nothing may follow. ValueError for syntax outside the supported set, undefined rules, left recursion, or a
    root that produces nothing."""
    rules, root = _ebnf.compile_ebnf(text)
    nodes = [_Rule(rule) for rule in rules]
    for node in nodes:
        node.nodes = nodes
    return Grammar(None, "grammar", initial=((nodes[root], 0), None))


# ---- the vocabulary ----------------------------------------------------------------------------------------------

_STRUCTURAL = re.compile(rb'[\x00-\x1f"\\]')


def _read_string(data: bytes, start: int) -> tuple[int, int, int]:
    """data[start:] read as the inside of a JSON string from between two characters: (status, code points, rest),
    status 0 refused, 1 still inside at the end, 2 closed, with `rest` the index after the closing quote. The
    same reading as _String.step, over runs of plain text at C speed."""
    found = _STRUCTURAL.search(data, start)
    stop = found.start() if found else len(data)
    try:
        chars, pos = len(data[start:stop].decode()), stop
    except UnicodeDecodeError as e:
        chars, pos = len(data[start:start + e.start].decode()), start + e.start
    sub = 0
    for k in range(pos, len(data)):
        after = _STRING[sub][data[k]]
        if after < 0:
            return (2, chars, k + 1) if after == _CLOSE else (0, chars, 0)
        if sub == 0:
            chars += 1
        sub = after
    return 1, chars, 0


class _Scan:
    """The entries of a trie node, [lo, hi), read past the node's depth as string content (_read_string):
    `open_ok` still inside, `close_ok` closed, `chars` code points before the end or the closing quote, `rest` the
    bytes after the closing quote as a trie whose ids are positions in [lo, hi) (None when nothing closes)."""

    __slots__ = ("lo", "hi", "open_ok", "close_ok", "chars", "rest")

    def __init__(self, keys: list[bytes], lo: int, hi: int, depth: int):
        status = np.zeros(hi - lo, np.int8)
        self.chars = np.zeros(hi - lo, np.int32)
        rests = []
        for k in range(hi - lo):
            key = keys[lo + k]
            status[k], self.chars[k], after = _read_string(key, depth)
            if status[k] == 2:
                rests.append((key[after:], k))
        self.lo, self.hi = lo, hi
        self.open_ok, self.close_ok = status == 1, status == 2
        self.rest = _SortedTrie(rests) if rests else None


class _SortedTrie:
    """Byte strings sorted, read as a trie without building one: a node is (lo, hi, depth), the range of strings
    sharing their first `depth` bytes; its children are found by bisection on first visit and kept, as are the
    string scans of the nodes where a walk meets string content. `ids[k]` is what the k-th string stands for."""

    __slots__ = ("keys", "ids", "root_ends", "_children", "_scans", "_flat", "shared")

    def __init__(self, entries: list[tuple[bytes, int]]):
        entries = sorted(entries, key=lambda e: e[0])
        self.keys = [k for k, _ in entries]
        self.ids = np.fromiter((i for _, i in entries), np.int64, len(entries))
        self.root_ends = sum(1 for k in self.keys if not k)
        self._children: dict[tuple[int, int], tuple] = {}
        self._scans: dict[tuple[int, int], _Scan] = {}
        self._flat = None
        # True for a vocabulary's own trie (TokenBytes), whose nodes the caches may name by (lo, depth); never for
        # the small tries of a walk's rests
        self.shared = False

    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(every string's bytes end to end, each one's start there, each one's length), for reading all of a
        node's strings a byte position at a time."""
        if self._flat is None:
            lens = np.fromiter(map(len, self.keys), np.int64, len(self.keys))
            starts = np.zeros(len(lens), np.int64)
            np.cumsum(lens[:-1], out=starts[1:])
            self._flat = (np.frombuffer(b"".join(self.keys), np.uint8), starts, lens)
        return self._flat

    def children(self, lo: int, hi: int, depth: int) -> tuple[tuple[int, int, int, int], ...]:
        """(byte, lo, hi, how many strings end there) per child of the node."""
        got = self._children.get((lo, depth))
        if got is None:
            keys, found, k = self.keys, [], lo
            while k < hi and len(keys[k]) == depth:
                k += 1
            while k < hi:
                head = keys[k][:depth + 1]
                byte = head[depth]
                end = hi if byte == 255 else bisect.bisect_left(keys, head[:depth] + bytes((byte + 1,)), k, hi)
                ends = k
                while ends < end and len(keys[ends]) == depth + 1:
                    ends += 1
                found.append((byte, k, end, ends - k))
                k = end
            self._children[(lo, depth)] = got = tuple(found)
        return got

    def ends_at(self, lo: int, hi: int, depth: int) -> int:
        """How many of the node's strings end at it (they sort first)."""
        k = lo
        while k < hi and len(self.keys[k]) == depth:
            k += 1
        return k - lo

    def scan(self, lo: int, hi: int, depth: int) -> _Scan:
        got = self._scans.get((lo, depth))
        if got is None:
            self._scans[(lo, depth)] = got = _Scan(self.keys, lo, hi, depth)
        return got


class TokenBytes:
    """Each token id's text as bytes (None: a special/added token or an id past the tokenizer, never allowed by a
    grammar; an empty text is None too, as allowing it would let a reply grow without end). Builds the sorted
    vocabulary and its string scan once (a few hundred ms for 150K tokens), shared by every grammar."""

    def __init__(self, token_bytes: Sequence[bytes | None]):
        self.token_bytes: tuple[bytes | None, ...] = tuple(bytes(t) if t else None for t in token_bytes)
        self.vocab_size = len(self.token_bytes)
        if self.vocab_size == 0:
            raise ValueError("TokenBytes needs at least one token")
        self.is_text = np.array([t is not None for t in self.token_bytes])
        self._trie = _SortedTrie([(t, i) for i, t in enumerate(self.token_bytes) if t is not None])
        self._trie.shared = True
        # rank[i]: token i's place in the sorted vocabulary (past the end for the non-text ones), so that a mask
        # gathered from the walk's hits is one numpy op
        self._rank = np.full(self.vocab_size, len(self._trie.keys), np.int64)
        self._rank[self._trie.ids] = np.arange(len(self._trie.keys))
        self._trie.scan(0, len(self._trie.keys), 0)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int) -> TokenBytes:
        """From a transformers tokenizer of a byte-level BPE model (the GPT-2 byte alphabet in its vocabulary);
        added and special tokens are None, as are ids from the tokenizer's end up to vocab_size (the model's
        embedding may be larger)."""
        alphabet = _byte_level_alphabet()
        vocab = tokenizer.get_vocab()
        top = max(vocab.values()) + 1
        if vocab_size < top:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {top} ids")
        special = set(getattr(tokenizer, "added_tokens_decoder", {})) | set(tokenizer.all_special_ids)
        table: list[bytes | None] = [None] * vocab_size
        for text, i in vocab.items():
            if i in special:
                continue
            try:
                table[i] = bytes(alphabet[c] for c in text)
            except KeyError:
                raise ValueError(f"token {i} ({text!r}) is not written in the byte-level alphabet: structured "
                                 "outputs need a byte-level BPE tokenizer") from None
        return cls(table)


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet, character -> byte: printable Latin-1 bytes stand for themselves, the others
    (controls, space, 0x7F-0xA0, 0xAD) for the characters from U+0100 on, in byte order."""
    direct = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in direct}
    shifted = [b for b in range(256) if b not in table.values()]
    table.update({chr(0x100 + k): b for k, b in enumerate(shifted)})
    return table


# ---- masks -------------------------------------------------------------------------------------------------------


class _LRU:
    """Arrays by key, least recently used dropped past max_bytes; a lock around each access (one writer at a time,
    readers from any thread). Masks (`put_mask`) are also kept bit-packed in a second LRU of `packed_bytes`: one
    dropped from the first comes back from its packed copy (one unpack) rather than from a new walk."""

    def __init__(self, max_bytes: int, packed_bytes: int = 0, readings_bytes: int = 0):
        self._items: OrderedDict = OrderedDict()
        self._bytes, self._max = 0, max_bytes
        self._packed = _LRU(packed_bytes) if packed_bytes else None
        # what an automaton's or a rule's state reads of a trie node, whatever the stack below (`_Reading`,
        # `_RuleReading`): kept apart, so that these larger arrays do not push masks out
        self.readings = _LRU(readings_bytes) if readings_bytes else None
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            got = self._items.get(key)
            if got is not None:
                self._items.move_to_end(key)
                return got
        packed = self._packed.get(key) if self._packed is not None else None
        if packed is None:
            return None
        got = np.unpackbits(packed.bits, count=packed.size).view(bool)
        got.flags.writeable = False
        self.put(key, got)
        return got

    def put(self, key, value) -> None:
        """value: anything with `nbytes`."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._items[key] = value
            self._bytes += value.nbytes
            while self._bytes > self._max and len(self._items) > 1:
                self._bytes -= self._items.popitem(last=False)[1].nbytes

    def put_mask(self, key, mask: np.ndarray) -> None:
        """A read-only bool mask, kept as it is and bit-packed."""
        self.put(key, mask)
        if self._packed is not None:
            self._packed.put(key, _Packed(np.packbits(mask), mask.size))


class _Packed:
    """A bool mask's bits (np.packbits) and its length."""

    __slots__ = ("bits", "size", "nbytes")

    def __init__(self, bits: np.ndarray, size: int):
        self.bits, self.size, self.nbytes = bits, size, bits.nbytes


SMALL_NODE = 64  # an automaton's or rule's frame at a trie node of at most this many strings is stepped byte by byte


def _walk(trie: _SortedTrie, stacks: list, hits: np.ndarray, cache: _LRU, root=None) -> None:
    """Sets hits[k] for every trie string whose bytes, read from one of the stacks, leave a live state; depth first,
    a branch dropped at its first refused byte, string content handed to _string_hits, an automaton's frames to
    _automaton_hits and a rule's to _rule_hits (on nodes of more than SMALL_NODE strings). root: the trie node
    (lo, hi, depth) to start from, the whole trie by default."""
    todo = [(*(root or (0, len(trie.keys), 0)), stacks)]
    while todo:
        lo, hi, depth, stacks = todo.pop()
        stepping = []
        for stack in stacks:
            if stack is None:
                continue
            frame = stack[0]
            if type(frame[0]) is _String and frame[1] == 0:
                _string_hits(trie, lo, hi, depth, stack, hits, cache)
            elif type(frame[0]) is _Automaton and hi - lo > SMALL_NODE:
                _automaton_hits(trie, lo, hi, depth, stack, hits, cache)
            elif type(frame[0]) is _Rule and hi - lo > SMALL_NODE:
                _rule_hits(trie, lo, hi, depth, stack, hits, cache)
            else:
                stepping.append(stack)
        if not stepping:
            continue
        for byte, child_lo, child_hi, ends in trie.children(lo, hi, depth):
            out: list = []
            for stack in stepping:
                frame = stack[0]
                frame[0].step(frame, stack[1], byte, out)
            if out:
                if ends:
                    hits[child_lo:child_lo + ends] = True
                todo.append((child_lo, child_hi, depth + 1, out if len(out) == 1 else list(set(out))))


def _string_hits(trie: _SortedTrie, lo: int, hi: int, depth: int, stack, hits: np.ndarray, cache: _LRU) -> None:
    """hits for the node's strings read from a string frame between two characters: the node's _Scan, the length
    limits as comparisons, and the bytes after a closing quote walked from the frame below."""
    (node, _, count), below = stack
    scan = trie.scan(lo, hi, depth)
    ok_open, ok_close = scan.open_ok, scan.close_ok
    if node.max_len is not None:
        fits = scan.chars <= node.max_len - count
        ok_open, ok_close = ok_open & fits, ok_close & fits
    if count < node.min_len:
        ok_close = ok_close & (scan.chars >= node.min_len - count)
    window = hits[lo:hi]
    window |= ok_open
    if scan.rest is not None:
        window |= ok_close & _rest_ok(scan, below, cache)


class _Reading:
    """A trie node's strings read by an automaton from one state (`_read_all`), whatever the characters so far:
    `ends`, `states`, `gains`: the strings read to their end in a live state, that state, the characters they
    began; `closes`, `close_gains`: the strings whose closing quote came past their first byte, the characters
    before it, with the bytes after it as the trie `rests` (None when none has any); `quote`: the child node
    whose first byte is the closing quote, (lo, hi, depth, strings ending there), or None. `after_quote(below)`
    says which closing strings may go on from the stack below."""

    __slots__ = ("ends", "states", "gains", "closes", "close_gains", "bare", "rests", "quote", "_after", "nbytes")

    def __init__(self, ends, states, gains, closes, close_gains, after, keys, quote):
        self.ends, self.states, self.gains = ends, states, gains
        self.closes, self.close_gains, self.quote = closes, close_gains, quote
        self.bare = np.array([len(keys[k]) == a for k, a in zip(closes.tolist(), after.tolist())], bool)
        rests = [(keys[k][a:], n) for n, (k, a) in enumerate(zip(closes.tolist(), after.tolist())) if not self.bare[n]]
        self.rests = _SortedTrie(rests) if rests else None
        self._after: dict = {}
        self.nbytes = sum(a.nbytes for a in (ends, states, gains, closes, close_gains)) + 64 * len(rests)

    def after_quote(self, trie: _SortedTrie, below, cache: _LRU) -> tuple[np.ndarray, np.ndarray]:
        """(bool over `closes`: the string may end where it closes, its rest empty or walked from `below`; the
        strings under the quote node that may, as ids in the trie), per `below`."""
        got = self._after.get(below)
        if got is None:
            ok = self.bare.copy()
            if self.rests is not None and below is not None:
                ok[_rest_ids(self.rests, [below], cache)] = True
            quoted = np.zeros(0, np.int64)
            if self.quote is not None:
                lo, hi, depth, ends = self.quote
                hits = np.zeros(len(trie.keys) + 1, bool)
                hits[lo:lo + ends] = True
                if below is not None:
                    _walk(trie, [below], hits, cache, root=(lo, hi, depth))
                quoted = np.flatnonzero(hits)
            self._after[below] = got = (ok, quoted)
        return got


def _read_all(trie: _SortedTrie, lo: int, hi: int, depth: int, node: _Automaton, state: int) -> _Reading:
    """The node's strings from `depth` on, read by the automaton from `state`, the characters they begin counted
    from zero: the first byte by the node's children (a refused child is dropped whole, a closing quote is kept as
    a node), then all the live children's strings a byte position at a time (numpy)."""
    table, begins = node.flat_table, node.flat_starts
    flat, offsets, lens = trie.flat()
    ends = [np.arange(lo, lo + trie.ends_at(lo, hi, depth))]  # strings that end at the node
    states, gains = [np.full(len(ends[0]), state, np.int32)], [np.zeros(len(ends[0]), np.int32)]
    quote, spans, firsts, first_gains = None, [], [], []
    for byte, child_lo, child_hi, child_ends in trie.children(lo, hi, depth):
        code = state * 256 + byte
        nxt = int(table[code])
        if nxt == _regex.CLOSE:
            quote = (child_lo, child_hi, depth + 1, child_ends)
        elif nxt >= 0:
            spans.append(np.arange(child_lo, child_hi))
            firsts.append(np.full(child_hi - child_lo, nxt, np.int32))
            first_gains.append(np.full(child_hi - child_lo, 0 if begins is None else begins[code], np.int32))
    cat = np.concatenate
    ids = cat(spans) if spans else np.zeros(0, np.int64)
    cur = cat(firsts) if spans else np.zeros(0, np.int32)
    counts = cat(first_gains) if spans else np.zeros(0, np.int32)
    pos = offsets[ids] + depth + 1
    end = offsets[ids] + lens[ids]
    done = pos >= end
    ends.append(ids[done])
    states.append(cur[done])
    gains.append(counts[done])
    ids, pos, end, cur, counts = ids[~done], pos[~done], end[~done], cur[~done], counts[~done]
    closes, close_gains, afters = [], [], []
    while ids.size:
        code = cur * 256 + flat[pos]
        nxt = table[code]
        if begins is not None:
            counts = counts + begins[code]
        shut = nxt == _regex.CLOSE
        if shut.any():
            closes.append(ids[shut])
            close_gains.append(counts[shut])
            afters.append(pos[shut] + 1 - offsets[ids[shut]])
        alive = nxt >= 0
        pos = pos + 1
        done = alive & (pos >= end)
        ends.append(ids[done])
        states.append(nxt[done])
        gains.append(counts[done])
        alive &= ~done
        ids, pos, end, cur, counts = ids[alive], pos[alive], end[alive], nxt[alive], counts[alive]
    empty = np.zeros(0, np.int64)
    return _Reading(cat(ends), cat(states), cat(gains), cat(closes) if closes else empty,
                    cat(close_gains) if closes else empty.astype(np.int32), cat(afters) if closes else empty,
                    trie.keys, quote)


def _automaton_hits(trie: _SortedTrie, lo: int, hi: int, depth: int, stack, hits: np.ndarray, cache: _LRU) -> None:
    """hits for the node's strings read from an automaton's frame: the node's `_Reading` from the frame's state
    (kept while the frame's count changes, where there are length limits), held to the length limits from the
    frame's count, and the bytes after a closing quote walked from the frame below."""
    (node, state, count), below = stack
    lengths = node.lengths
    key = ("read", id(node), state, lo, depth)
    reading = cache.readings.get(key) if trie.shared else None
    if reading is None:
        reading = _read_all(trie, lo, hi, depth, node, state)
        if trie.shared:
            cache.readings.put(key, reading)
    ends = reading.ends
    if lengths is not None:
        ends = ends[lengths.fits(reading.states, count + reading.gains)]
    hits[ends] = True
    if reading.closes.size or reading.quote is not None:
        ok, quoted = reading.after_quote(trie, below, cache)
        if lengths is not None:
            total = count + reading.close_gains
            ok = ok & (total >= node.min_len) & (node.max_len is None or total <= node.max_len)
            if count < node.min_len:  # (the quote begins no character: the count is the string's)
                quoted = quoted[:0]
        hits[reading.closes[ok]] = True
        hits[quoted] = True


def _first_bytes(stacks: list) -> np.ndarray:
    """bool [256]: the bytes some of the stacks can read next."""
    got = np.zeros(256, bool)
    for byte in range(256):
        out: list = []
        for stack in stacks:
            _feed(stack, byte, out)
            if out:
                got[byte] = True
                break
    return got


class _RuleReading:
    """A trie node's strings read by a rule's own byte table from one state (`_read_rule`), whatever the stack
    below: `ends`, the strings read to their end inside the rule; `leaving`, per state with a way out of the rule,
    the strings (ids, and the position of their next byte in the trie's flat bytes) that reach it with bytes
    left."""

    __slots__ = ("ends", "leaving", "nbytes")

    def __init__(self, ends: np.ndarray, leaving: dict):
        self.ends, self.leaving = ends, leaving
        self.nbytes = ends.nbytes + sum(k.nbytes + q.nbytes for k, q in leaving.values())


def _read_rule(trie: _SortedTrie, lo: int, hi: int, depth: int, node: _Rule, state: int,
               leaves: np.ndarray) -> _RuleReading:
    """The node's strings from `depth` on through the rule's table from `state`: the first byte by the node's
    children, then all the live children's strings a byte position at a time (numpy)."""
    table = node.flat_table
    flat, offsets, lens = trie.flat()
    ends, spans, firsts = [], [], []
    for byte, child_lo, child_hi, child_ends in trie.children(lo, hi, depth):
        nxt = node.rows[state][byte]
        if nxt >= 0:
            ends.append(np.arange(child_lo, child_lo + child_ends))
            spans.append(np.arange(child_lo + child_ends, child_hi))
            firsts.append(np.full(child_hi - child_lo - child_ends, nxt, np.int32))
    ids = np.concatenate(spans) if spans else np.zeros(0, np.int64)
    cur = np.concatenate(firsts) if spans else np.zeros(0, np.int32)
    pos = offsets[ids] + depth + 1
    end = offsets[ids] + lens[ids]
    leaving: dict[int, list] = {}
    while ids.size:
        out = leaves[cur]
        if out.any():
            for s in np.unique(cur[out]).tolist():
                at = out & (cur == s)
                leaving.setdefault(s, []).append((ids[at], pos[at]))
        nxt = table[cur * 256 + flat[pos]]
        alive = nxt >= 0
        pos = pos + 1
        done = alive & (pos >= end)
        ends.append(ids[done])
        alive &= ~done
        ids, pos, end, cur = ids[alive], pos[alive], end[alive], nxt[alive]
    return _RuleReading(np.concatenate(ends) if ends else np.zeros(0, np.int64),
                        {s: (np.concatenate([k for k, _ in got]), np.concatenate([q for _, q in got]))
                         for s, got in leaving.items()})


def _rule_hits(trie: _SortedTrie, lo: int, hi: int, depth: int, stack, hits: np.ndarray, cache: _LRU) -> None:
    """hits for the node's strings read from a grammar rule's frame. Inside the rule: the node's `_RuleReading`
    from the frame's state (kept for every stack below). Its ways out (`_Rule.exits`: into a called rule, or back
    to the frame below): at the first byte, each of the node's children stepped through them and walked on; past
    it, for the strings that reach a state with a way out and whose next byte some way out can read, their rest
    walked from there."""
    (node, state), below = stack
    leaves = node.calling | (node.accepting if below is not None else False)
    key = ("rule", id(node), state, lo, depth, below is not None)
    reading = cache.readings.get(key) if trie.shared else None
    if reading is None:
        reading = _read_rule(trie, lo, hi, depth, node, state, leaves)
        if trie.shared:
            cache.readings.put(key, reading)
    hits[reading.ends] = True
    exits = node.exits(state, below)
    if exits:
        for byte, child_lo, child_hi, ends in trie.children(lo, hi, depth):
            out: list = []
            for exit_stack in exits:
                _feed(exit_stack, byte, out)
            if out:
                hits[child_lo:child_lo + ends] = True
                _walk(trie, list(set(out)), hits, cache, root=(child_lo, child_hi, depth + 1))
    flat, offsets, _ = trie.flat()
    for s, (ks, ps) in reading.leaving.items():
        exits = node.exits(s, below)
        keep = _first_bytes(exits)[flat[ps]]
        rests = [(trie.keys[k][p - offsets[k]:], k) for k, p in zip(ks[keep].tolist(), ps[keep].tolist())]
        if rests:
            hits[_rest_ids(_SortedTrie(rests), exits, cache)] = True


def _rest_ids(rest: _SortedTrie, stacks: list, cache: _LRU) -> np.ndarray:
    """The `ids` of a rest trie's strings that may follow from the stacks: the empty ones (their token ended where
    the rest began) and those a walk from the stacks allows."""
    hits = np.zeros(len(rest.keys), bool)
    hits[:rest.root_ends] = True
    _walk(rest, stacks, hits, cache)
    return rest.ids[hits]


def _rest_ok(scan: _Scan, below, cache: _LRU) -> np.ndarray:
    """Which of a scan's entries may follow their closing quote from the stack `below` (bool over [lo, hi))."""
    key = ("rest", id(scan), below)
    got = cache.get(key)
    if got is None:
        got = np.zeros(scan.hi - scan.lo, bool)
        got[_rest_ids(scan.rest, [below], cache)] = True
        cache.put(key, got)
    return got


def _stack_mask(stack, tokens: TokenBytes, cache: _LRU) -> np.ndarray:
    """The text tokens allowed from one stack (bool [vocab_size], read-only, cached)."""
    got = cache.get(stack)
    if got is None:
        trie = tokens._trie
        hits = np.zeros(len(trie.keys) + 1, bool)
        _walk(trie, [stack], hits, cache)
        got = hits[tokens._rank]
        got.flags.writeable = False
        cache.put_mask(stack, got)
    return got


class Matcher:
    """One reply's place in a grammar: which token ids may come next, fed the sampled ones. Stop ids are allowed
    exactly when the text so far is a complete document; after one, only stop ids are."""

    __slots__ = ("grammar", "tokens", "_stops", "_stop_ids", "_state", "_cache")

    def __init__(self, grammar: Grammar, tokens: TokenBytes, stop_ids: Iterable[int]):
        stops = sorted({int(s) for s in stop_ids})
        for s in stops:
            if not 0 <= s < tokens.vocab_size:
                raise ValueError(f"stop id {s} is outside the vocabulary (size {tokens.vocab_size})")
            if tokens.token_bytes[s] is not None:
                raise ValueError(f"stop id {s} is a text token ({tokens.token_bytes[s]!r}); stop ids must be "
                                 "special tokens")
        self.grammar, self.tokens = grammar, tokens
        self._stops = tuple(stops)
        self._stop_ids = np.array(stops, np.int64)
        self._state: frozenset = grammar._initial
        self._cache = grammar._cache_for(tokens)

    def copy(self) -> Matcher:
        """An independent matcher in the same state (the state is immutable, so this copies a few references)."""
        twin = object.__new__(Matcher)
        for name in Matcher.__slots__:
            setattr(twin, name, getattr(self, name))
        return twin

    @property
    def complete(self) -> bool:
        """The text so far is a whole document."""
        return any(_can_end(stack) for stack in self._state)

    @property
    def terminated(self) -> bool:
        """Complete, and no text token may follow (only stop ids): the reply ends here."""
        if not self.complete:
            return False
        return not any(_stack_mask(s, self.tokens, self._cache).any() for s in self._state if s is not None)

    def allowed(self) -> np.ndarray:
        """bool [vocab_size], read-only (a cached array): the text tokens whose bytes keep the text a prefix of a
        document the grammar accepts, and the stop ids when the text is complete."""
        state = self._state
        complete = self.complete
        if len(state) == 1 and not complete:
            return _stack_mask(next(iter(state)), self.tokens, self._cache)
        key = (state, self._stops) if complete else state
        got = self._cache.get(key)
        if got is None:
            got = np.zeros(self.tokens.vocab_size, bool)
            for stack in state:
                if stack is not None:
                    got |= _stack_mask(stack, self.tokens, self._cache)
            if complete:
                got[self._stop_ids] = True
            got.flags.writeable = False
            self._cache.put_mask(key, got)
        return got

    def advance(self, token_id: int) -> None:
        """Feeds a sampled token; ValueError (and no change) if it is not allowed now."""
        token_id = int(token_id)
        if not 0 <= token_id < self.tokens.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.tokens.vocab_size})")
        if token_id in self._stops:
            if not self.complete:
                raise ValueError(f"stop id {token_id} before the document is complete")
            self._state = frozenset({None})
            return
        data = self.tokens.token_bytes[token_id]
        if data is None:
            raise ValueError(f"token id {token_id} is a special token, never allowed in structured output")
        stacks = list(self._state)
        for byte in data:
            out: list = []
            for stack in stacks:
                if stack is not None:
                    frame = stack[0]
                    frame[0].step(frame, stack[1], byte, out)
            if not out:
                raise ValueError(f"token id {token_id} ({data!r}) is not allowed here")
            stacks = out if len(out) == 1 else list(set(out))
        self._state = frozenset(stacks)
