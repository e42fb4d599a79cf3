"""Regular expressions compiled to deterministic automata over UTF-8 bytes, for structured outputs: vLLM's
`structured_outputs.regex` (the whole reply matches) and JSON Schema's `pattern` and `format` on strings (the
string's value matches; `json_string` reads it through JSON's escapes).

The syntax is the common core of ECMA-262 (which JSON Schema names) and Python's `re`:
- literals, `.` (any character but \\n, \\r, U+2028 and U+2029), classes `[...]` and `[^...]` with ranges and
  escapes, groups `(...)`, `(?:...)`, `(?<name>...)`, `(?P<name>...)`, alternation `|`, quantifiers `*`, `+`,
  `?`, `{n}`, `{n,}`, `{n,m}` (a lazy `?` after one is accepted: the language is the same);
- escapes \\d \\D \\w \\W \\s \\S (ASCII digits and word characters; ECMA's whitespace), \\t \\n \\r \\f \\v \\0,
  \\xHH, \\uHHHH, \\u{H...}, \\A and \\Z / \\z (as ^ and $), and any punctuation escaped for itself;
- `^` and `$` (and \\A, \\Z) assert the start and end of the whole text.
Anything else (lookaround, backreferences, \\b, \\p{...}, inline flags, possessive quantifiers) is a ValueError
that says what and where.

`compile_regex` matches the whole text (vLLM's `regex`: the whole reply); with search=True the pattern may match
anywhere in it, as JSON Schema reads `pattern` (a value matches "[0-9]" when it holds a digit: anchor a pattern,
"^...$", to constrain the whole value). Anchors assert the text's start and end in both readings.

Compiling: the pattern's parse tree becomes an NFA whose edges are byte ranges (each character class split into
the UTF-8 sequences of its code points: only well-formed UTF-8, no surrogates), then a DFA by subset
construction, with its dead states removed (every state can still reach the end) and its states merged where they
behave alike. Sizes are bounded: MAX_NFA_STATES and MAX_DFA_STATES, a ValueError past them.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

MAX_NFA_STATES = 100_000
MAX_DFA_STATES = 8_192
MAX_REPEAT = 1_000  # the largest count a {n,m} may give

DEAD = -1  # a table entry: the byte is refused
CLOSE = -2  # a table entry of a JSON string's automaton: the closing quote, the value complete

_TOP = 0x10FFFF
_ANY = ((0, _TOP),)
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
_NEWLINES = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
_CHAR_ESCAPES = {"t": 0x09, "n": 0x0A, "r": 0x0D, "f": 0x0C, "v": 0x0B}


# ---- character sets: sorted, disjoint, non-adjacent (lo, hi) code point ranges ---------------------------------

def _norm(ranges) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _negate(ranges) -> tuple[tuple[int, int], ...]:
    out, at = [], 0
    for lo, hi in _norm(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= _TOP:
        out.append((at, _TOP))
    return tuple(out)


_DOT = _negate(_NEWLINES)


def _encode(cp: int) -> bytes:
    return chr(cp).encode("utf-8", "surrogatepass")


def utf8_sequences(lo: int, hi: int) -> list[tuple[tuple[int, int], ...]]:
    """The code points lo..hi (surrogates left out) as UTF-8: a list of byte-range sequences, each the product of
    its ranges, together exactly the encodings of those code points."""
    out, todo = [], [(lo, hi)]
    while todo:
        x, y = todo.pop()
        if x > y:
            continue
        if x <= 0xDFFF and y >= 0xD800:  # no surrogates
            todo += [(x, min(y, 0xD7FF)), (max(x, 0xE000), y)]
            continue
        split = next((b for b in (0x7F, 0x7FF, 0xFFFF) if x <= b < y), None)
        if split is not None:  # one encoded length at a time
            todo += [(x, split), (split + 1, y)]
            continue
        if y <= 0x7F:
            out.append(((x, y),))
            continue
        for i in range(1, len(_encode(x))):
            m = (1 << (6 * i)) - 1  # the low bits the last i bytes carry
            if x & ~m != y & ~m:
                if x & m:
                    todo += [(x, x | m), ((x | m) + 1, y)]
                    break
                if y & m != m:
                    todo += [(x, (y & ~m) - 1), (y & ~m, y)]
                    break
        else:  # aligned: each byte position ranges independently
            out.append(tuple(zip(_encode(x), _encode(y))))
    return out


# ---- parsing -------------------------------------------------------------------------------------------------------
# Parse tree: ("set", ranges), ("cat", items), ("alt", items), ("rep", item, min, max or None), ("bol",), ("eol",)

class _Parser:
    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def fail(self, what: str, at: int | None = None):
        raise ValueError(f"{what} at position {self.i if at is None else at} of the pattern")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        if self.i >= len(self.p):
            self.fail("the pattern ends too early")
        c = self.p[self.i]
        self.i += 1
        return c

    def parse(self):
        tree = self.alternation()
        if self.i < len(self.p):
            self.fail("unbalanced ')'")
        return tree

    def alternation(self):
        items = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            items.append(self.sequence())
        return items[0] if len(items) == 1 else ("alt", tuple(items))

    def sequence(self):
        items = []
        while self.peek() is not None and self.peek() not in "|)":
            items.append(self.quantified())
        return items[0] if len(items) == 1 else ("cat", tuple(items))

    def counts(self) -> tuple[int, int | None] | None:
        """A {n}, {n,} or {n,m} at the cursor (consumed), else None (a literal '{')."""
        end = self.p.find("}", self.i)
        body = self.p[self.i + 1:end] if end > 0 else ""
        lo, comma, hi = body.partition(",")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        lo_n, hi_n = int(lo), (int(hi) if hi else None) if comma else int(lo)
        if hi_n is not None and hi_n < lo_n:
            self.fail(f"the quantifier {{{body}}} has its bounds out of order")
        if max(lo_n, hi_n or 0) > MAX_REPEAT:
            self.fail(f"the quantifier {{{body}}} counts past {MAX_REPEAT}")
        self.i = end + 1
        return lo_n, hi_n

    def quantifier(self) -> tuple[int, int | None] | None:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if c == "{":
            return self.counts()
        return None

    def quantified(self):
        at = self.i
        atom = self.atom()
        bounds = self.quantifier()
        if bounds is None:
            return atom
        if atom[0] in ("bol", "eol"):
            self.fail("an anchor cannot be repeated", at)
        if self.peek() == "?":  # lazy: the same language
            self.i += 1
        elif self.peek() == "+":
            self.fail("possessive quantifiers are not supported")
        if self.peek() is not None and self.peek() in "*+?" or (self.peek() == "{" and self._is_counts()):
            self.fail("a quantifier follows a quantifier")
        return ("rep", atom, *bounds)

    def _is_counts(self) -> bool:
        at = self.i
        got = self.counts()
        self.i = at
        return got is not None

    def atom(self):
        at = self.i
        c = self.take()
        if c == "(":
            if self.p.startswith("?", self.i):
                if self.p.startswith("?:", self.i):
                    self.i += 2
                elif self.p.startswith("?<", self.i) and not self.p.startswith(("?<=", "?<!"), self.i) \
                        or self.p.startswith("?P<", self.i):
                    end = self.p.find(">", self.i)
                    if end < 0:
                        self.fail("a group name is not closed")
                    self.i = end + 1
                elif self.p.startswith(("?=", "?!", "?<=", "?<!"), self.i):
                    self.fail("lookaround is not supported", at)
                else:
                    self.fail("inline flags and extensions '(?...)' are not supported", at)
            tree = self.alternation()
            if self.peek() != ")":
                self.fail("a group is not closed", at)
            self.i += 1
            return tree
        if c == "[":
            return ("set", self.char_class(at))
        if c == ".":
            return ("set", _DOT)
        if c == "^":
            return ("bol",)
        if c == "$":
            return ("eol",)
        if c == "\\":
            return self.escape(in_class=False)
        if c in "*+?":
            self.fail("nothing to repeat", at)
        if c == "{":
            self.i = at
            if self._is_counts():
                self.fail("nothing to repeat", at)
            self.i = at + 1
        return ("set", ((ord(c), ord(c)),))

    def hex_digits(self, n: int) -> int:
        digits = self.p[self.i:self.i + n]
        if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
            self.fail(f"an escape needs {n} hex digits")
        self.i += n
        return int(digits, 16)

    def escape(self, in_class: bool):
        """After a backslash: ("set", ranges), or ("bol",) / ("eol",) outside a class."""
        at = self.i - 1
        c = self.take()
        classes = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
        if c.lower() in classes:
            ranges = classes[c.lower()]
            return ("set", _negate(ranges) if c.isupper() else ranges)
        if c in _CHAR_ESCAPES:
            return ("set", ((_CHAR_ESCAPES[c],) * 2,))
        if c == "0" and not (self.peek() or "").isdigit():
            return ("set", ((0, 0),))
        if c == "x":
            cp = self.hex_digits(2)
        elif c == "u":
            if self.peek() == "{":
                end = self.p.find("}", self.i)
                body = self.p[self.i + 1:end] if end > 0 else ""
                if not body or len(body) > 6 or any(d not in "0123456789abcdefABCDEF" for d in body) \
                        or int(body, 16) > _TOP:
                    self.fail("\\u{...} needs 1 to 6 hex digits of a code point")
                self.i = end + 1
                cp = int(body, 16)
            else:
                cp = self.hex_digits(4)
        elif c == "b" and in_class:
            cp = 0x08
        elif c in "AZz" and not in_class:
            return ("bol",) if c == "A" else ("eol",)
        elif c in "bB":
            self.fail("word boundaries (\\b, \\B) are not supported", at)
        elif c.isdigit() or c == "k":
            self.fail("backreferences are not supported", at)
        elif c in "pP":
            self.fail("Unicode property escapes (\\p, \\P) are not supported", at)
        elif c.isalnum() or c == "_":
            self.fail(f"the escape \\{c} is not supported", at)
        else:
            cp = ord(c)
        return ("set", ((cp, cp),))

    def char_class(self, at: int) -> tuple[tuple[int, int], ...]:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.peek() is None:
                self.fail("a character class is not closed", at)
            if self.peek() == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_atom()
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.class_atom()
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1]:
                    self.fail("a class range needs a single character at each end")
                if hi[0][0] < lo[0][0]:
                    self.fail("a class range is out of order")
                ranges.append((lo[0][0], hi[0][0]))
            else:
                ranges.extend(lo)
        ranges = _norm(ranges)
        return _negate(ranges) if negate else ranges

    def class_atom(self) -> tuple[tuple[int, int], ...]:
        c = self.take()
        if c == "\\":
            return self.escape(in_class=True)[1]
        if c == "[" and self.peek() == ":":
            self.fail("POSIX classes [:name:] are not supported")
        return ((ord(c), ord(c)),)


# ---- automata ------------------------------------------------------------------------------------------------------

class _Nfa:
    """States with epsilon edges, start-of-text and end-of-text assertion edges, byte-range edges, and (for a
    grammar's rules, `qwen_jax.ebnf`) edges that call another rule by name."""

    def __init__(self):
        self.eps: list[list[int]] = []
        self.bol: list[list[int]] = []
        self.eol: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []
        self.calls: list[list[tuple[str, int]]] = []

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise ValueError(f"the pattern is too large (more than {MAX_NFA_STATES} automaton states)")
        for table in (self.eps, self.bol, self.eol, self.edges, self.calls):
            table.append([])
        return len(self.eps) - 1

    def build(self, tree, start: int) -> int:
        """Adds the tree's states after `start`; returns its end state."""
        kind = tree[0]
        if kind == "set":
            end = self.state()
            for seq in (s for lo, hi in tree[1] for s in utf8_sequences(lo, hi)):
                at = start
                for k, (lo, hi) in enumerate(seq):
                    nxt = end if k == len(seq) - 1 else self.state()
                    self.edges[at].append((lo, hi, nxt))
                    at = nxt
            return end
        if kind == "cat":
            for item in tree[1]:
                start = self.build(item, start)
            return start
        if kind == "alt":
            end = self.state()
            for item in tree[1]:
                branch = self.state()
                self.eps[start].append(branch)
                self.eps[self.build(item, branch)].append(end)
            return end
        if kind == "call":
            end = self.state()
            self.calls[start].append((tree[1], end))
            return end
        if kind in ("bol", "eol"):
            end = self.state()
            (self.bol if kind == "bol" else self.eol)[start].append(end)
            return end
        _, item, lo, hi = tree
        for _ in range(lo):
            start = self.build(item, start)
        if hi is None:
            loop = self.state()
            self.eps[start].append(loop)
            self.eps[self.build(item, loop)].append(loop)
            return loop
        end = self.state()
        for _ in range(hi - lo):
            self.eps[start].append(end)
            start = self.build(item, start)
        self.eps[start].append(end)
        return end

    def closure(self, states, *, bol: bool, eol: bool) -> frozenset:
        seen, todo = set(states), list(states)
        while todo:
            s = todo.pop()
            nxt = self.eps[s] + (self.bol[s] if bol else []) + (self.eol[s] if eol else [])
            for t in nxt:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)


@dataclasses.dataclass(frozen=True, eq=False)
class ByteAutomaton:
    """A DFA over bytes: `table[state, byte]` the next state, DEAD, or (a JSON string's) CLOSE; `accept[state]` the
    text may end there; `start` the state before the first byte. Every state it can reach can still reach an end
    (an accepting state or a CLOSE). A JSON string's automaton also has `starts[state, byte]`: the byte begins a
    character of the value (a raw character's first byte, or an escape's backslash), for counting its length."""
    table: np.ndarray  # int32 [states, 256]
    accept: np.ndarray  # bool [states]
    start: int
    description: str = ""
    starts: np.ndarray | None = None  # bool [states, 256]

    @property
    def empty(self) -> bool:
        """Whether it accepts nothing (then start is DEAD)."""
        return self.start < 0

    def run(self, data: bytes, state: int | None = None) -> int:
        """The state after `data` from `state` (the start by default); DEAD or CLOSE where it stops."""
        state = self.start if state is None else state
        for b in data:
            if state < 0:
                return state
            state = int(self.table[state, b])
        return state

    def matches(self, data: bytes) -> bool:
        state = self.run(data)
        return state >= 0 and bool(self.accept[state])


def _determinize(nfa: _Nfa, start: int, final: int, what: str) -> ByteAutomaton:
    """Subset construction, then dead states pruned and equivalent ones merged."""
    table, accept, _ = subsets(nfa, start, final, what)
    return finish(table, accept, 0, what)


class _Numbering:
    """Numbers for keys in the order they are first seen (`keys`), at most MAX_DFA_STATES of them."""

    def __init__(self, what: str):
        self.what, self.index, self.keys = what, {}, []

    def __call__(self, key) -> int:
        got = self.index.get(key)
        if got is None:
            if len(self.keys) >= MAX_DFA_STATES:
                raise ValueError(f"{self.what} is too large (more than {MAX_DFA_STATES} automaton states)")
            got = self.index[key] = len(self.keys)
            self.keys.append(key)
        return got


def live_states(n: int, edges: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """bool [n]: the states from which some path of `edges` ([E, 2] source, target pairs) reaches one that `ends`."""
    back: list[list[int]] = [[] for _ in range(n)]
    for s, t in np.unique(edges, axis=0).tolist() if len(edges) else ():
        back[t].append(s)
    live = ends.copy()
    todo = list(np.flatnonzero(live))
    while todo:
        t = todo.pop()
        for s in back[t]:
            if not live[s]:
                live[s] = True
                todo.append(s)
    return live


def subsets(nfa: _Nfa, start: int, final: int, what: str) -> tuple[np.ndarray, np.ndarray, list[dict[str, int]]]:
    """Subset construction: (table [states, 256], accept [states], per state its rule calls {name: next state});
    state 0 is the start. The start state alone may pass start-of-text edges; end-of-text edges count only for
    acceptance."""
    numbers = _Numbering(what)
    # the start's set is numbered apart: a later set equal to it may not pass ^ again
    keys = numbers.keys
    keys.append(nfa.closure([start], bol=True, eol=False))
    rows: list[np.ndarray] = []
    accept: list[bool] = []
    calls: list[dict[str, int]] = []

    def intern(targets: frozenset) -> int:
        return numbers(nfa.closure(targets, bol=False, eol=False))

    k = 0
    while k < len(keys):
        states = keys[k]
        accept.append(final in nfa.closure(states, bol=k == 0, eol=True))
        row = np.full(256, DEAD, np.int32)
        edges = [e for s in states for e in nfa.edges[s]]
        cuts = sorted({lo for lo, _, _ in edges} | {hi + 1 for _, hi, _ in edges})
        by_set: dict[frozenset, int] = {}
        for a, b in zip(cuts, cuts[1:]):  # byte ranges [a, b) that every edge covers whole or not at all
            ts = frozenset(t for lo, hi, t in edges if lo <= a and b - 1 <= hi)
            if not ts:
                continue
            got = by_set.get(ts)
            if got is None:
                by_set[ts] = got = intern(ts)
            row[a:b] = got
        rows.append(row)
        called: dict[str, set] = {}
        for s in states:
            for name, t in nfa.calls[s]:
                called.setdefault(name, set()).add(t)
        calls.append({name: intern(frozenset(ts)) for name, ts in sorted(called.items())})
        k += 1
    return np.stack(rows), np.array(accept), calls


def finish(table: np.ndarray, accept: np.ndarray, start: int, what: str,
           starts: np.ndarray | None = None) -> ByteAutomaton:
    """The automaton with its dead states removed (those that reach neither an accepting state nor a CLOSE: their
    entries become DEAD) and states that behave alike merged (Moore's partition refinement; with `starts`, only
    states that also count characters alike)."""
    n = table.shape[0]
    sources = np.repeat(np.arange(n), 256)
    targets = table.reshape(-1)
    real = targets >= 0
    live = live_states(n, np.stack([sources[real], targets[real]], axis=1), accept | (table == CLOSE).any(axis=1))
    if not live[start]:
        return ByteAutomaton(np.full((0, 256), DEAD, np.int32), np.zeros(0, bool), DEAD, what,
                             None if starts is None else np.zeros((0, 256), bool))
    table = np.where((table >= 0) & ~live[np.maximum(table, 0)], DEAD, table)
    # keep the states reachable from start
    keep = np.zeros(n, bool)
    keep[start] = True
    todo = [start]
    while todo:
        row = table[todo.pop()]
        for t in set(row[row >= 0].tolist()):
            if not keep[t]:
                keep[t] = True
                todo.append(t)
    old = np.flatnonzero(keep)
    renumber = np.full(n, DEAD, np.int32)
    renumber[old] = np.arange(len(old))
    table = np.where(table[old] >= 0, renumber[np.maximum(table[old], 0)], table[old]).astype(np.int32)
    accept, start = accept[old], int(renumber[start])
    if starts is not None:
        starts = starts[old] & (table >= 0)
    # merge equivalent states, over the byte classes (bytes whose columns are equal behave alike everywhere)
    both = table if starts is None else np.concatenate([table, starts.astype(np.int32)], axis=0)
    _, columns = np.unique(both.T, axis=0, return_index=True)
    columns = np.sort(columns)
    compact = table[:, columns]
    flags = None if starts is None else starts[:, columns].astype(np.int64)
    cls = accept.astype(np.int64)
    count = len(np.unique(cls))
    while True:
        mapped = np.where(compact >= 0, cls[np.maximum(compact, 0)], compact)
        sig = np.concatenate([cls[:, None], mapped] + ([] if flags is None else [flags]), axis=1)
        _, cls = np.unique(sig, axis=0, return_inverse=True)
        cls = cls.reshape(-1)
        if cls.max() + 1 == count:
            break
        count = int(cls.max()) + 1
    reps = np.zeros(count, np.int64)
    reps[cls] = np.arange(len(cls))
    merged = table[reps]
    merged = np.where(merged >= 0, cls[np.maximum(merged, 0)], merged).astype(np.int32)
    return ByteAutomaton(merged, accept[reps].astype(bool), int(cls[start]), what,
                         None if starts is None else starts[reps])


def _from_tree(tree, what: str) -> ByteAutomaton:
    nfa = _Nfa()
    start = nfa.state()
    final = nfa.build(tree, start)
    return _determinize(nfa, start, final, what)


def compile_regex(pattern: str, what: str = "the pattern", *, search: bool = False) -> ByteAutomaton:
    """The texts (UTF-8) that `pattern` matches whole, or with search=True anywhere in them. ValueError for syntax
    outside the supported set (see the module's docstring) or a pattern too large; an automaton that accepts
    nothing has `empty` set."""
    if not isinstance(pattern, str):
        raise ValueError(f"{what} must be a string, not {type(pattern).__name__}")
    try:
        tree = _Parser(pattern).parse()
    except ValueError as e:
        raise ValueError(f"{what} {pattern!r}: {e}") from None
    if search:
        tree = ("cat", (("rep", ("set", _ANY), 0, None), tree, ("rep", ("set", _ANY), 0, None)))
    return _from_tree(tree, what)


def intersect(a: ByteAutomaton, b: ByteAutomaton) -> ByteAutomaton:
    """The texts both accept (a product of two text automata, without CLOSE entries)."""
    what = f"{a.description} with {b.description}"
    if a.empty or b.empty:
        return finish(np.full((1, 256), DEAD, np.int32), np.zeros(1, bool), 0, what)
    numbers = _Numbering(what)
    numbers((a.start, b.start))
    order = numbers.keys
    rows = []
    k = 0
    while k < len(order):
        x, y = order[k]
        ta, tb = a.table[x], b.table[y]
        row = np.full(256, DEAD, np.int32)
        for byte in np.flatnonzero((ta >= 0) & (tb >= 0)).tolist():
            row[byte] = numbers((int(ta[byte]), int(tb[byte])))
        rows.append(row)
        k += 1
    accept = np.array([bool(a.accept[x] and b.accept[y]) for x, y in order])
    return finish(np.stack(rows), accept, 0, what)


# A JSON string's content states, per state q of the value's automaton: between characters (raw bytes go to q),
# after a backslash, and inside \u00XX (only control characters are written as \u escapes: every other character
# is written as itself, so no string is lost and the automaton stays small).
_BETWEEN, _ESC, _U, _U0, _U00, _U000, _U001 = range(7)
_SHORT = {ord('"'): 0x22, ord("\\"): 0x5C, ord("/"): 0x2F, ord("b"): 0x08, ord("f"): 0x0C, ord("n"): 0x0A,
          ord("r"): 0x0D, ord("t"): 0x09}
_HEX = {ord(c): int(c, 16) for c in "0123456789abcdefABCDEF"}


def json_string(value: ByteAutomaton) -> ByteAutomaton:
    """The bytes between a JSON string's quotes whose value `value` accepts, the closing quote a CLOSE entry: raw
    characters (no control bytes, no '"' or '\\\\' unescaped), the short escapes, and \\u00XX for U+0000..U+001F.
    States 7q + sub-state; accept is all False (a string ends only at its quote); `starts` marks the bytes that
    begin a character."""
    if value.empty:
        return value
    n = value.table.shape[0]
    vt = value.table
    table = np.full((7 * n, 256), DEAD, np.int32)

    def to(q):  # next-state ids for the between sub-state of value states q (array), DEAD kept
        return np.where(q >= 0, 7 * q + _BETWEEN, DEAD)

    base = np.arange(n) * 7
    between = base + _BETWEEN
    raw = np.arange(0x20, 0x100)
    raw = raw[(raw != 0x22) & (raw != 0x5C)]
    table[between[:, None], raw[None, :]] = to(vt[:, raw])
    table[between, 0x22] = np.where(value.accept, CLOSE, DEAD)
    table[between, 0x5C] = base + _ESC
    for byte, decoded in _SHORT.items():
        table[base + _ESC, byte] = to(vt[:, decoded])
    table[base + _ESC, ord("u")] = base + _U
    starts = np.zeros((7 * n, 256), bool)
    starts[between[:, None], raw[None, :]] = (raw < 0x80) | (raw >= 0xC0)
    starts[between, 0x5C] = True
    table[base + _U, ord("0")] = base + _U0
    table[base + _U0, ord("0")] = base + _U00
    table[base + _U00, ord("0")] = base + _U000
    table[base + _U00, ord("1")] = base + _U001
    for byte, digit in _HEX.items():
        table[base + _U000, byte] = to(vt[:, digit])
        table[base + _U001, byte] = to(vt[:, 0x10 + digit])
    return finish(table, np.zeros(7 * n, bool), 7 * value.start + _BETWEEN, value.description, starts)


# ---- JSON Schema formats -----------------------------------------------------------------------------------------
# Each is a subset of the format's strings (never a string outside it), kept small: upper-case T and Z, fractions
# of at most 9 digits, no leap seconds, IPv6 without an embedded IPv4 tail, hostnames of at most four labels.
_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)"
        r"|02-(?:0[1-9]|1\d|2[0-8]))")
_LEAP = r"(?:\d\d(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)-02-29"
_DATE = rf"(?:\d{{4}}-{_DAY}|{_LEAP})"
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,9})?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
_H16 = "[0-9a-fA-F]{1,4}"
_IPV6 = "|".join([rf"(?:{_H16}:){{7}}{_H16}", rf"(?:{_H16}:){{1,7}}:", rf"(?:{_H16}:){{1,6}}:{_H16}"]
                 + [rf"(?:{_H16}:){{1,{6 - k}}}(?::{_H16}){{1,{k + 1}}}" for k in range(1, 6)]
                 + [rf":(?:(?::{_H16}){{1,7}}|:)"])
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_N = r"\d{1,9}"
_HMS = rf"T(?:{_N}H(?:{_N}M)?(?:{_N}S)?|{_N}M(?:{_N}S)?|{_N}S)"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "duration": rf"P(?:{_N}W|(?:{_N}Y(?:{_N}M)?(?:{_N}D)?|{_N}M(?:{_N}D)?|{_N}D)(?:{_HMS})?|{_HMS})",
    "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": r"(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
    "ipv6": _IPV6,
    "hostname": rf"{_LABEL}(?:\.{_LABEL}){{0,3}}",
    "email": rf"[A-Za-z0-9_%+-]{{1,32}}(?:\.[A-Za-z0-9_%+-]{{1,32}}){{0,2}}@{_LABEL}(?:\.{_LABEL}){{1,3}}",
}


@functools.lru_cache(maxsize=None)
def format_automaton(name: str) -> ByteAutomaton:
    """FORMATS[name] compiled (once a process: the automata are shared, never changed)."""
    return compile_regex(FORMATS[name], f"'format' {name!r}")
