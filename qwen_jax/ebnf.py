"""Context-free grammars in GBNF (the EBNF dialect of llama.cpp and vLLM's `structured_outputs.grammar`), compiled
to one byte automaton a rule whose edges also call other rules, for `qwen_jax.structured`.

Syntax: rules `name ::= body` (a name: letters, digits, '-' and '_'; a rule runs until the next `name ::=`), the
start rule `root`; in a body: sequences, alternation `|`, grouping `( )`, the repeats `*`, `+`, `?`, `{m}`, `{m,}`,
`{m,n}`, string literals in double (or single) quotes with the escapes \\n \\r \\t \\\\ \\" \\' \\xHH \\uHHHH
\\UHHHHHHHH, character classes `[...]` (ranges, `^` to negate, the same escapes, \\] and \\-), `.` for any
character, rule names, and `#` comments to the end of a line. Literals and classes are UTF-8 text.

How it compiles: a rule's body becomes an NFA (`qwen_jax.regex._Nfa`) over bytes and calls, then a DFA by subset
construction (a call is one more letter). A rule that can match the empty text is never called as such: a call to
it is an epsilon edge beside a call to its non-empty form (the same automaton, its start state copied as one that
does not accept), so a call always reads at least a byte and a parser never loops without reading. Rules that can
produce no text are dropped (a ValueError if root is one); left recursion (a rule that can call itself before
reading a byte) is a ValueError naming the rules, as are undefined names and sizes past `regex`'s limits.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qwen_jax import regex as _regex

MAX_RULES = 1000

# JSON as a GBNF grammar (an object at the top; whitespace after each value): an example of the syntax, and what
# the tests and tools/bench_structured.py read through rules to compare with the JSON Schema path.
JSON_GRAMMAR = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9]{1,3})? ws
ws ::= | " " | "\n" [ \t]{0,20}
"""


@dataclasses.dataclass(frozen=True, eq=False)
class Rule:
    """A rule's automaton: `table[state, byte]` (DEAD refused), `accept[state]` (the rule may end there),
    `calls[state]`: (the called rule's index, the state after it) pairs. State 0 is the start."""
    name: str
    table: np.ndarray
    accept: np.ndarray
    calls: tuple[tuple[tuple[int, int], ...], ...]


_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "\\": 0x5C, '"': 0x22, "'": 0x27, "[": 0x5B, "]": 0x5D, "-": 0x2D,
            "/": 0x2F, "0": 0x00, "f": 0x0C, "v": 0x0B, "b": 0x08, "^": 0x5E, ".": 0x2E}
_NAME = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


class _Parser:
    def __init__(self, text: str):
        self.s, self.i = text, 0

    def fail(self, what: str, at: int | None = None):
        at = self.i if at is None else at
        line = self.s.count("\n", 0, at) + 1
        col = at - (self.s.rfind("\n", 0, at) + 1) + 1
        raise ValueError(f"{what} at line {line}, column {col} of the grammar")

    def space(self) -> None:
        while self.i < len(self.s):
            c = self.s[self.i]
            if c == "#":
                end = self.s.find("\n", self.i)
                self.i = len(self.s) if end < 0 else end + 1
            elif c.isspace():
                self.i += 1
            else:
                return

    def name(self) -> str:
        start = self.i
        while self.i < len(self.s) and self.s[self.i] in _NAME:
            self.i += 1
        return self.s[start:self.i]

    def rule_starts(self) -> bool:
        """Whether `name ::=` comes next (the cursor stays)."""
        at = self.i
        name = self.name()
        self.space()
        found = bool(name) and self.s.startswith("::=", self.i)
        self.i = at
        return found

    def parse(self) -> dict[str, tuple]:
        rules: dict[str, tuple] = {}
        self.space()
        while self.i < len(self.s):
            at = self.i
            name = self.name()
            if not name:
                self.fail(f"expected a rule name, found {self.s[self.i]!r}")
            self.space()
            if not self.s.startswith("::=", self.i):
                self.fail(f"expected '::=' after the rule name {name!r}")
            self.i += 3
            if name in rules:
                self.fail(f"the rule {name!r} is defined twice", at)
            rules[name] = self.alternation()
            if len(rules) > MAX_RULES:
                self.fail(f"more than {MAX_RULES} rules")
        return rules

    def alternation(self):
        items = [self.sequence()]
        while self.i < len(self.s) and self.s[self.i] == "|":
            self.i += 1
            items.append(self.sequence())
        return items[0] if len(items) == 1 else ("alt", tuple(items))

    def sequence(self):
        items = []
        while True:
            self.space()
            if self.i >= len(self.s) or self.s[self.i] in "|)" or self.rule_starts():
                break
            items.append(self.repeated())
        return items[0] if len(items) == 1 else ("cat", tuple(items))

    def repeated(self):
        atom = self.atom()
        while self.i < len(self.s):
            c = self.s[self.i]
            if c in "*+?":
                self.i += 1
                atom = ("rep", atom, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[c])
            elif c == "{":
                at = self.i
                end = self.s.find("}", self.i)
                body = self.s[self.i + 1:end].replace(" ", "") if end > 0 else ""
                lo, comma, hi = body.partition(",")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    self.fail("a repeat {m}, {m,} or {m,n} is malformed", at)
                lo_n, hi_n = int(lo), ((int(hi) if hi else None) if comma else int(lo))
                if hi_n is not None and hi_n < lo_n:
                    self.fail("a repeat's bounds are out of order", at)
                if max(lo_n, hi_n or 0) > _regex.MAX_REPEAT:
                    self.fail(f"a repeat counts past {_regex.MAX_REPEAT}", at)
                self.i = end + 1
                atom = ("rep", atom, lo_n, hi_n)
            else:
                break
        return atom

    def atom(self):
        at = self.i
        c = self.s[self.i]
        if c == "(":
            self.i += 1
            tree = self.alternation()
            self.space()
            if self.i >= len(self.s) or self.s[self.i] != ")":
                self.fail("a group is not closed", at)
            self.i += 1
            return tree
        if c in "\"'":
            self.i += 1
            chars = []
            while True:
                if self.i >= len(self.s):
                    self.fail("a string is not closed", at)
                if self.s[self.i] == c:
                    self.i += 1
                    break
                chars.append(self.char())
            return ("cat", tuple(("set", ((cp, cp),)) for cp in chars))
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            self.i += 1
            return ("set", ((0, 0x10FFFF),))
        if c in _NAME:
            return ("call", self.name())
        self.fail(f"unexpected {c!r}")

    def char(self) -> int:
        c = self.s[self.i]
        self.i += 1
        if c != "\\":
            return ord(c)
        if self.i >= len(self.s):
            self.fail("an escape is cut off")
        e = self.s[self.i]
        self.i += 1
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width:
            digits = self.s[self.i:self.i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits) \
                    or int(digits, 16) > 0x10FFFF:
                self.fail(f"\\{e} needs {width} hex digits of a code point")
            self.i += width
            return int(digits, 16)
        if e not in _ESCAPES:
            self.fail(f"the escape \\{e} is not supported")
        return _ESCAPES[e]

    def char_class(self) -> tuple[tuple[int, int], ...]:
        at = self.i
        self.i += 1
        negate = self.i < len(self.s) and self.s[self.i] == "^"
        if negate:
            self.i += 1
        ranges = []
        while True:
            if self.i >= len(self.s):
                self.fail("a character class is not closed", at)
            if self.s[self.i] == "]":
                self.i += 1
                break
            lo = self.char()
            if self.s.startswith("-", self.i) and self.i + 1 < len(self.s) and self.s[self.i + 1] != "]":
                self.i += 1
                hi = self.char()
                if hi < lo:
                    self.fail("a class range is out of order")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        ranges = _regex._norm(ranges)
        return _regex._negate(ranges) if negate else ranges


def _names(tree, out: set) -> set:
    if tree[0] == "call":
        out.add(tree[1])
    elif tree[0] in ("cat", "alt"):
        for item in tree[1]:
            _names(item, out)
    elif tree[0] == "rep":
        _names(tree[1], out)
    return out


def _fixpoint(rules: dict[str, tuple], leaf) -> dict[str, bool]:
    """A property of rules from their trees, least fixpoint: leaf(tree) for sets; cat needs all, alt any; a repeat
    of at least one needs its item, of none is `leaf(None)`."""
    known = {name: False for name in rules}

    def of(tree) -> bool:
        kind = tree[0]
        if kind == "set":
            return leaf(tree)
        if kind == "call":
            return known[tree[1]]
        if kind == "cat":
            return all(of(item) for item in tree[1])
        if kind == "alt":
            return any(of(item) for item in tree[1])
        return of(tree[1]) if tree[2] > 0 else leaf(None)

    changed = True
    while changed:
        changed = False
        for name, tree in rules.items():
            if not known[name] and of(tree):
                known[name] = changed = True
    return known


def _rewrite(tree, productive: dict[str, bool], nullable: dict[str, bool]):
    """Calls to rules that produce nothing become empty sets; calls to nullable rules become (skip | non-empty)."""
    kind = tree[0]
    if kind == "call":
        name = tree[1]
        if not productive[name]:
            return ("set", ())
        if nullable[name]:
            return ("rep", ("call", name + "+"), 0, 1)
        return tree
    if kind in ("cat", "alt"):
        return (kind, tuple(_rewrite(item, productive, nullable) for item in tree[1]))
    if kind == "rep":
        return ("rep", _rewrite(tree[1], productive, nullable), tree[2], tree[3])
    return tree


def _automaton(tree, what: str) -> tuple[np.ndarray, np.ndarray, list[dict[str, int]]]:
    nfa = _regex._Nfa()
    start = nfa.state()
    final = nfa.build(tree, start)
    return _regex.subsets(nfa, start, final, what)


def compile_ebnf(text: str, root: str = "root") -> tuple[list[Rule], int]:
    """The grammar's rules as automata (those reachable from `root`), and root's index. ValueError for syntax
    outside the supported set, an undefined rule, left recursion, a root that produces nothing, or sizes past the
    limits."""
    if not isinstance(text, str):
        raise ValueError(f"the grammar must be a string, not {type(text).__name__}")
    trees = _Parser(text).parse()
    if root not in trees:
        raise ValueError(f"the grammar has no {root!r} rule")
    for name, tree in trees.items():
        for called in sorted(_names(tree, set())):
            if called not in trees:
                raise ValueError(f"the rule {name!r} calls {called!r}, which is not defined")
    productive = _fixpoint(trees, lambda t: t is None or bool(t[1]))
    if not productive[root]:
        raise ValueError(f"the rule {root!r} produces no text (every way through it needs a rule that has none)")
    nullable = _fixpoint(trees, lambda t: t is None)
    # root's automaton and those of the non-empty forms ("name+") its calls reach
    built: dict[str, tuple] = {}
    todo = [root]
    while todo:
        key = todo.pop()
        if key in built:
            continue
        base = key[:-1] if key.endswith("+") else key
        table, accept, calls = _automaton(_rewrite(trees[base], productive, nullable), f"the rule {base!r}")
        if key.endswith("+"):  # the non-empty form: a start that does not accept
            table = np.concatenate([table[:1], table])
            table = np.where(table >= 0, table + 1, table).astype(np.int32)
            accept = np.concatenate([[False], accept])
            calls = [{n: s + 1 for n, s in c.items()} for c in [calls[0]] + calls]
        built[key] = (table, accept, calls)
        todo.extend(n for c in calls for n in c if n not in built)
    alive = _prune(built)
    if root not in alive:
        raise ValueError(f"the rule {root!r} produces no text")
    order = [root] + sorted(k for k in alive if k != root)
    index = {key: k for k, key in enumerate(order)}
    rules = [Rule(key, alive[key][0], built[key][1],
                  tuple(tuple((index[n], s) for n, s in sorted(c.items())) for c in alive[key][1]))
             for key in order]
    _check_left_recursion(rules)
    return rules, 0


def _prune(built: dict[str, tuple]) -> dict[str, tuple]:
    """Each rule's edges into states that cannot reach an accepting one removed, by bytes and by calls to rules
    that can produce text (a rule whose start is dead is dropped with the calls to it, until nothing changes):
    {rule: (table, calls)} for the rules left."""
    alive = set(built)
    while True:
        out = {}
        for key in alive:
            table, accept, calls = built[key]
            calls = [{n: t for n, t in c.items() if n in alive} for c in calls]
            edges = [(s, t) for s in range(len(accept))
                     for t in set(table[s][table[s] >= 0].tolist()) | set(calls[s].values())]
            live = _regex.live_states(len(accept), np.array(edges, np.int64).reshape(-1, 2), accept)
            if live[0]:
                table = np.where((table >= 0) & ~live[np.maximum(table, 0)], _regex.DEAD, table).astype(np.int32)
                out[key] = (table, [{name: t for name, t in c.items() if live[t]} for c in calls])
        if set(out) == alive:
            return out
        alive = set(out)


def _check_left_recursion(rules: list[Rule]) -> None:
    """A rule that calls, at its start, a rule that calls ... itself at its start, would be entered forever before
    a byte is read: a ValueError naming the cycle."""
    first = [sorted({r for r, _ in rule.calls[0]}) for rule in rules]
    state = [0] * len(rules)  # 0 unseen, 1 on the path, 2 done

    def visit(k: int, path: list[int]) -> None:
        state[k] = 1
        for r in first[k]:
            if state[r] == 1:
                cycle = path[path.index(r):] + [r]
                names = " -> ".join(rules[i].name.removesuffix("+") for i in cycle)
                raise ValueError(f"left recursion: {names} (a rule calls itself before reading anything)")
            if state[r] == 0:
                visit(r, path + [r])
        state[k] = 2

    for k in range(len(rules)):
        if state[k] == 0:
            visit(k, [k])
