"""qwen_jax.ebnf and structured.compile_grammar: random replies of GBNF grammars checked by independent
recognizers (Python's json, a recursive-descent reader, `re`), masks against byte-by-byte stepping on the hand-built
and the tiny tokenizer's vocabularies, nullable rules and recursion, and the errors."""

import json
import re

import numpy as np
import pytest

from qwen_jax.ebnf import JSON_GRAMMAR, compile_ebnf
from qwen_jax.structured import Matcher, compile_grammar
from tests.test_structured import (BYTE_ID, HAND, STOP, VOCAB, assert_masks_match_feeding, letters_vocab,
                                   timed_steps, walk)

ARITH = r"""
root ::= expr
expr ::= term (space? [-+] space? term)*
term ::= factor (space? [*/] space? factor)*
factor ::= number | "(" space? expr space? ")" | "-" factor
number ::= [0-9]{1,4}
space ::= " "
"""
# nullable rules called where they may be empty, repeats of nullable groups, a nullable root
LISTS = r"""
root ::= (item sep?)*
item ::= word | "<" root ">"
word ::= [a-z]* "!"?
sep ::= "," | ";" " "?
"""
CHOICES = """root ::= "yes" | "no" | "yes, " reason
reason ::= 'because ' [a-z ]{1,10} '.'
"""


def arith_ok(text: str) -> bool:
    """A recursive-descent reader of ARITH's language (no automata)."""
    pos = 0

    def peek():
        return text[pos] if pos < len(text) else ""

    def take(c):
        nonlocal pos
        if peek() == c:
            pos += 1
            return True
        return False

    def number():
        nonlocal pos
        start = pos
        while peek().isdigit() and pos - start < 4:
            pos += 1
        return pos > start and not peek().isdigit()

    def factor():
        if take("("):
            take(" ")
            if not expr():
                return False
            take(" ")
            return take(")")
        if take("-"):
            return factor()
        return number()

    def chain(item, ops):
        nonlocal pos
        if not item():
            return False
        while True:
            save = pos
            take(" ")
            if peek() and peek() in ops:
                pos += 1
                take(" ")
                if not item():
                    return False
            else:
                pos = save
                return True

    def term():
        return chain(factor, "*/")

    def expr():
        return chain(term, "-+")

    return expr() and pos == len(text)


def lists_ok(text: str) -> bool:
    """LISTS' language by repeated reduction of innermost <...> groups to a word."""
    flat = re.compile(r"(?:(?:[a-z]*!?)(?:,|; ?)?)*")
    while True:
        inner = re.search(r"<([^<>]*)>", text)
        if not inner:
            return flat.fullmatch(text) is not None
        if not flat.fullmatch(inner.group(1)):
            return False
        text = text[:inner.start()] + "x" + text[inner.end():]


GRAMMARS = {"json": (JSON_GRAMMAR, lambda t: isinstance(json.loads(t), dict)), "arith": (ARITH, arith_ok),
            "lists": (LISTS, lists_ok),
            "choices": (CHOICES, lambda t: re.fullmatch(r"yes|no|yes, because [a-z ]{1,10}\.", t) is not None)}


@pytest.fixture(scope="module")
def tiny_tokens():
    from qwen_jax.checkpoint import load_tokenizer
    from qwen_jax.structured import TokenBytes
    return TokenBytes.from_tokenizer(load_tokenizer("captures/tiny"), 512)


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_random_replies_are_in_the_language(name, tiny_tokens):
    text, ok = GRAMMARS[name]
    grammar = compile_grammar(text)
    rng = np.random.default_rng(11)
    done = 0
    for tokens, stops in ((HAND, [STOP]), (tiny_tokens, [493])):
        for _ in range(20):
            reply, ended, _ = walk(grammar, tokens, stops, rng, steps=150)
            if ended:
                assert ok(reply.decode()), reply
                done += 1
    assert done >= 15, done


@pytest.mark.parametrize("name,small", [(name, None) for name in GRAMMARS]
                         + [("json", 0), ("arith", 0), ("choices", 0)])
def test_allowed_matches_stepping_byte_by_byte(name, small, tiny_tokens, monkeypatch):
    """At states along random walks a token is allowed exactly when feeding it (the rules' own steps, not the
    masks' table reads) is accepted; small=0: every trie node read by the rules' tables, none stepped."""
    if small is not None:
        from qwen_jax import structured
        monkeypatch.setattr(structured, "SMALL_NODE", small)
    grammar = compile_grammar(GRAMMARS[name][0])
    rng = np.random.default_rng(12)
    checked = 0
    for tokens, stops in ((HAND, [STOP]), (tiny_tokens, [493])):
        for _ in range(2):
            _, _, states = walk(grammar, tokens, stops, rng, steps=40)
            for m in states[::max(1, len(states) // 5)]:
                assert_masks_match_feeding(m, tokens, stops)
                checked += 1
    assert checked >= 8


def feed(m: Matcher, text: bytes) -> None:
    for b in text:
        m.advance(BYTE_ID[b])


def test_nullable_rules_recursion_and_ends():
    m = Matcher(compile_grammar(LISTS), HAND, [STOP])
    assert m.complete  # a nullable root: the empty reply is whole
    feed(m, b"ab!,<c; <>>")
    assert m.complete and not m.terminated
    assert not m.allowed()[BYTE_ID[ord(">")]]  # nothing open to close
    m = Matcher(compile_grammar(LISTS), HAND, [STOP])
    feed(m, b"<<a")
    assert not m.complete and m.allowed()[BYTE_ID[ord(">")]] and not m.allowed()[STOP]
    m = Matcher(compile_grammar(CHOICES), HAND, [STOP])
    feed(m, b"yes")
    assert m.complete and not m.terminated and m.allowed()[BYTE_ID[ord(",")]]
    feed(m, b", because ab.")
    assert m.terminated and np.flatnonzero(m.allowed()).tolist() == [STOP]
    # an empty-only rule called twice, and a rule that produces nothing beside one that does
    assert Matcher(compile_grammar('root ::= e e "x"\ne ::= ""'), HAND, [STOP]).allowed()[BYTE_ID[ord("x")]]
    m = Matcher(compile_grammar('root ::= "a" | dead\ndead ::= "b" dead'), HAND, [STOP])
    assert np.flatnonzero(m.allowed()).tolist() == [VOCAB.index(b"a")]


def test_a_large_vocabulary_in_a_grammar_string():
    """JSON's string content through GBNF rules over 60K tokens: the rule's table reads them all at once."""
    vocab, tokens, byte_id = letters_vocab(5)
    allowed, per_step = timed_steps(Matcher(compile_grammar(JSON_GRAMMAR), tokens, [256]), byte_id, b'{"a": "', 5)
    assert allowed[vocab.index(b'",')] and allowed[vocab.index(b'"}')] and allowed[vocab.index(b"\\n")]
    assert not allowed[vocab.index(b"\n")] and not allowed[vocab.index(b'"},')]
    assert allowed.sum() > 0.99 * (tokens.is_text.sum() - 256)
    assert per_step < 0.1, per_step


@pytest.mark.parametrize("text,message", [
    ("root ::= root \"a\" | \"b\"", "left recursion: root -> root"),
    ("root ::= a\na ::= b\nb ::= a \"x\" | \"y\"", "left recursion: a -> b -> a"),
    ('root ::= n a "x"\na ::= n root | "y"\nn ::= "z"?', "left recursion"),
    ("root ::= x", "calls 'x', which is not defined"),
    ("start ::= \"a\"", "no 'root' rule"),
    ("root ::= [a", "class is not closed at line 1, column 10"),
    ("root ::= \"a", "string is not closed"),
    ("root ::= (\"a\"", "group is not closed"),
    ("root ::= \"a\"\nroot ::= \"b\"", "defined twice"),
    ("root ::= b\nb ::= b \"x\" | \"y\"", "left recursion: b -> b"),
    ("root ::= b\nb ::= \"x\" b", "produces no text"),
    ("root ::= \"a\"{3,1}", "out of order"),
    ("root ::= \"\\q\"", "escape \\q"),
    ("root = \"a\"", "expected '::='"),
    ("root ::= \"a\" @", "unexpected '@'"),
])
def test_errors_say_what_and_where(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compile_grammar(text)


def test_rules_are_small_automata():
    rules, root = compile_ebnf(ARITH)
    assert rules[root].name == "root" and all(r.table.shape[0] <= 12 for r in rules)
    assert {r.name for r in rules} == {"root", "expr", "term", "factor", "number", "space"}


def test_readings_are_kept_for_the_vocabulary_not_for_a_walks_rests(monkeypatch):
    """What a rule's or an automaton's state reads of a trie node is kept per grammar and vocabulary; the small
    tries of a walk's rests share node names (lo, depth) with the vocabulary's and must not take its readings."""
    from qwen_jax import structured
    monkeypatch.setattr(structured, "SMALL_NODE", 0)  # read the small trie by the tables too
    vocab, tokens, byte_id = letters_vocab(7)
    small = structured._SortedTrie([(b"ab", 0), (b"b", 1), (b'x"', 2)])
    for grammar, prefix in ((compile_grammar('root ::= "<" [a-z]* ">"'), b"<"),
                            (structured.compile_regex(r"<[a-z]*>"), b"<")):
        m = Matcher(grammar, tokens, [256])
        for b in prefix:
            m.advance(byte_id[b])
        stack = next(iter(m._state))
        cache = grammar._cache_for(tokens)
        big = np.zeros(len(tokens._trie.keys) + 1, bool)
        structured._walk(tokens._trie, [stack], big, cache)  # keeps the reading of (0, N, 0)
        assert big.sum() > 1000
        got = np.zeros(len(small.keys), bool)
        structured._walk(small, [stack], got, cache)  # the rest trie's node (0, 3, 0): its own reading
        fresh = np.zeros(len(small.keys), bool)
        structured._walk(small, [stack], fresh, structured._LRU(1 << 20, 0, 1 << 20))
        assert got.tolist() == fresh.tolist() == [True, True, False]
