"""qwen_jax.regex: UTF-8 range splitting against Python's encoder, compiled patterns against Python's `re` on random
texts, no dead ends along random walks, the JSON string layer, intersections and length limits, the formats against
Python's own parsers, and the errors."""

import datetime
import ipaddress
import itertools
import re
import uuid

import numpy as np
import pytest

from qwen_jax.regex import (CLOSE, DEAD, FORMATS, MAX_DFA_STATES, compile_regex, intersect, json_string,
                            utf8_sequences)


@pytest.mark.parametrize("lo,hi", [(0, 0x7F), (0x41, 0x5A), (0x50, 0x900), (0x7F0, 0x10400), (0xD000, 0xE100),
                                   (0xFFF0, 0x10010), (0x10FF00, 0x10FFFF), (0x3A9, 0x3A9)])
def test_utf8_sequences_are_exactly_the_encodings(lo, hi):
    got = set()
    for seq in utf8_sequences(lo, hi):
        for bs in itertools.product(*[range(a, b + 1) for a, b in seq]):
            assert bytes(bs) not in got  # the sequences do not overlap
            got.add(bytes(bs))
    assert got == {chr(c).encode() for c in range(lo, hi + 1) if not 0xD800 <= c <= 0xDFFF}


# (pattern, alphabet of the random texts): Python's re with re.ASCII reads these as ECMA-262 does
PATTERNS = [
    (r"abc", "abcx"),
    (r"a|b|ab", "abc"),
    (r"(ab|a)*b?", "ab"),
    (r"a{2,3}b{0,2}c{2}", "abc"),
    (r"x{3,}y?", "xy"),
    (r"[a-c]+[^a-c]?", "abcdé中"),
    (r"[\d.]+e[+-]?\d{1,2}", "0123.e+-x"),
    (r"\w+@\w+\.(com|org)", "ab_1@.comorg"),
    (r"\s*\S+\s*", " \t\nab"),
    (r".{2,4}", "a\né中😀"),
    (r"^(?:yes|no)$|^maybe$", "yesnomaybe"),
    (r"(?P<word>[A-Z][a-z]*)( (?<more>[a-z]+))*", "Ab c"),
    (r"[\u00e0-\u00ff]+\x41?", "àéÿA b"),
    (r"[-a]*[a-]", "a-b"),
    (r"\.\*\+\?\(\)\[\]\{\}\|\\\^\$/", r".*+?()[]{}|\^$/"),
    (r"[^\]]x*", "]xa"),
    (r"\x20\u{1F600}\0?", " 😀\x00"),
    (r"", "ab"),
    (r"a*?b+?", "ab"),
    (r"[😀-😂]{1,2}|é", "😀😁😂😃é"),
]


@pytest.mark.parametrize("pattern,alphabet", PATTERNS)
def test_compiled_patterns_match_as_python_does(pattern, alphabet):
    auto = compile_regex(pattern)
    py = re.compile(pattern.replace(r"\u{1F600}", "\U0001F600").replace("(?<more>", "(?P<more>"), re.ASCII)
    rng = np.random.default_rng(len(pattern))
    for n in range(400):
        text = "".join(rng.choice(list(alphabet), size=int(rng.integers(0, 9))))
        want = py.fullmatch(text) is not None
        assert auto.matches(text.encode()) == want, text
        # a live state exactly where the text is a prefix of some match: checked one way along accepted texts
        if want:
            data = text.encode()
            for k in range(len(data) + 1):
                assert auto.run(data[:k]) >= 0
    # the matches the walks below find are matches for Python too (beyond ASCII, ECMA's \\s is not Python's)
    for _ in range(100):
        data = _random_member(auto, rng)
        if data.isascii() or "\\s" not in pattern.lower():
            assert py.fullmatch(data.decode()) is not None, data


def _distances(auto) -> np.ndarray:
    """Bytes from each state to the nearest accepting one."""
    dist = np.where(auto.accept, 0, 10**9)
    while True:
        nxt = np.where(auto.table >= 0, dist[np.maximum(auto.table, 0)] + 1, 10**9).min(axis=1)
        new = np.minimum(dist, nxt)
        if (new == dist).all():
            return dist
        dist = new


def _random_member(auto, rng, stop: float = 0.3) -> bytes:
    """A random text the automaton accepts: random live bytes (half the time one that brings an end nearer),
    stopping at accepting states now and then."""
    dist = _distances(auto)
    state, out = auto.start, bytearray()
    for _ in range(400):
        if auto.accept[state] and (rng.random() < stop or not (auto.table[state] >= 0).any()):
            return bytes(out)
        row = auto.table[state]
        choices = np.flatnonzero(row >= 0)
        assert choices.size, f"dead end after {bytes(out)!r}"
        nearer = choices[dist[row[choices]] < dist[state]]
        b = int(rng.choice(nearer if nearer.size and rng.random() < 0.5 else choices))
        out.append(b)
        state = int(row[b])
    raise AssertionError("no end in 400 bytes")


@pytest.mark.parametrize("pattern", [p for p, _ in PATTERNS] + list(FORMATS.values()))
def test_every_state_can_still_end(pattern):
    auto = compile_regex(pattern)
    live = (auto.table >= 0).any(axis=1) | auto.accept
    assert live.all()
    # and every entry leads to a state that is live
    assert ((auto.table == DEAD) | (auto.table >= 0)).all()


def test_anchors_and_empty_languages():
    assert compile_regex(r"a^b").empty
    assert compile_regex(r"a$b").empty
    assert compile_regex(r"[^\x00-\u{10FFFF}]").empty
    assert compile_regex(r"^$").matches(b"") and not compile_regex(r"^$").matches(b"a")
    assert compile_regex(r"\Aab\Z").matches(b"ab")
    auto = compile_regex(r"(^a|b)+")
    assert auto.matches(b"abb") and not auto.matches(b"ba") and not auto.matches(b"aa")


def test_only_well_formed_utf8():
    auto = compile_regex(r".*")
    for bad in (b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xe4\xb8"):
        assert not auto.matches(bad)
    assert auto.run(b"\xc0") == DEAD and auto.run(b"\xed\xa0") == DEAD and auto.run(b"\xe4\xb8") >= 0
    assert auto.matches("中文😀é".encode())
    assert not auto.matches(b"a\nb") and not auto.matches("a\u2028".encode())


def _content(text: str) -> bytes:
    """A JSON string's inside as json.dumps writes it (non-ASCII raw)."""
    import json
    return json.dumps(text, ensure_ascii=False)[1:-1].encode()


def test_json_string_reads_values_through_escapes():
    value = compile_regex(r'a"b\\c\nd/\x01é')
    auto = json_string(value)
    inside = _content('a"b\\c\nd/\x01é')
    assert inside == b'a\\"b\\\\c\\nd/\\u0001\xc3\xa9'
    state = auto.run(inside)
    assert state >= 0 and auto.table[state, ord('"')] == CLOSE
    assert auto.run(b'a"') == DEAD  # a raw quote closes the string only where the value is whole
    assert auto.run(b'a\\"b\\\\c\\u000ad\\/\\u0001\xc3\xa9') >= 0  # \u000a and \/ are other spellings
    assert auto.run(b"a\\u0022") == DEAD  # only control characters as \u escapes
    assert auto.run(b"a\\x") == DEAD and auto.run(b"a\x01") == DEAD  # no raw control bytes
    assert not auto.accept.any()
    free = json_string(compile_regex(r"[\s\S]*"))
    for text in ["", "plain", 'q"uo\\te', "\t\n\r\x00\x1f\x7f", "中😀"]:
        s = free.run(_content(text))
        assert s >= 0 and free.table[s, ord('"')] == CLOSE, text


def test_intersections_and_character_starts():
    both = intersect(compile_regex(r"[a-c]*"), compile_regex(r".{2,3}"))
    for n in range(6):
        assert both.matches(b"a" * n) == (2 <= n <= 3)
    assert not both.matches(b"ad")
    assert intersect(compile_regex(r"ab"), compile_regex(r"a.")).matches(b"ab")
    assert intersect(compile_regex(r"ab"), compile_regex(r"ac")).empty
    # a JSON string's automaton marks where each character of the value begins
    auto = json_string(compile_regex(r"[\s\S]*"))
    content = _content('aé\n中"😀\x01')
    state, begun = auto.start, 0
    for b in content:
        begun += bool(auto.starts[state, b])
        state = int(auto.table[state, b])
    assert begun == 7


def _duration_ok(s: str) -> bool:
    m = re.fullmatch(r"P(?:(\d+)Y)?(?:(\d+)M)?(?:(\d+)W)?(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?)?", s)
    if not m or s.endswith("T"):
        return False
    date, time = m.groups()[:4], m.groups()[4:]
    if not any(date) and not any(time):
        return False
    return not (date[2] and (any(date[:2]) or date[3] or any(time)))  # weeks stand alone


def _hostname_ok(s: str) -> bool:
    labels = s.split(".")
    return len(s) <= 255 and all(
        1 <= len(x) <= 63 and x[0] != "-" and x[-1] != "-" and re.fullmatch(r"[A-Za-z0-9-]+", x) for x in labels)


def _email_ok(s: str) -> bool:
    local, _, domain = s.partition("@")
    return (bool(re.fullmatch(r"[A-Za-z0-9_%+-]+(\.[A-Za-z0-9_%+-]+)*", local)) and "." in domain
            and _hostname_ok(domain))


CHECKS = {
    "date": datetime.date.fromisoformat,
    "time": datetime.time.fromisoformat,
    "date-time": datetime.datetime.fromisoformat,
    "uuid": uuid.UUID,
    "ipv4": ipaddress.IPv4Address,
    "ipv6": ipaddress.IPv6Address,
    "duration": _duration_ok,
    "hostname": _hostname_ok,
    "email": _email_ok,
}
KNOWN = {
    "date": (["2024-02-29", "2000-02-29", "1999-12-31", "2023-04-30"],
             ["2023-02-29", "1900-02-29", "2023-13-01", "2023-04-31", "2023-1-01"]),
    "time": (["23:59:59Z", "00:00:00.123+05:30", "12:30:00-08:00"], ["24:00:00Z", "12:60:00Z", "12:30:00"]),
    "date-time": (["2024-02-29T12:00:00Z", "1985-04-12T23:20:50.52+01:00"], ["2024-02-29 12:00:00Z"]),
    "uuid": (["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
    "ipv4": (["0.0.0.0", "255.255.255.255", "10.1.20.3"], ["256.1.1.1", "01.1.1.1", "1.1.1"]),
    "ipv6": (["::", "::1", "fe80::1", "2001:db8::8a2e:370:7334", "1:2:3:4:5:6:7:8", "1::", "1:2:3:4:5:6:7::"],
             ["1::2::3", ":::", "1:2:3:4:5:6:7:8:9", "12345::"]),
    "duration": (["P1Y2M3DT4H5M6S", "P3W", "PT0S", "P1D"], ["P", "PT", "P1W2D", "P1YT"]),
    "hostname": (["example.com", "a", "a-b.c0.d.e"], ["-a.com", "a..b", "a_b"]),
    "email": (["john.doe@example.com", "x+y@a.io"], ["@example.com", "a@b", "a..b@c.d"]),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_formats_against_python(name):
    auto = compile_regex(FORMATS[name])
    good, bad = KNOWN[name]
    for text in good:
        assert auto.matches(text.encode()), text
    for text in bad:
        assert not auto.matches(text.encode()), text
    rng = np.random.default_rng(7)
    for _ in range(200):
        text = _random_member(auto, rng, stop=0.5).decode()
        try:
            ok = CHECKS[name](text)
        except ValueError:
            ok = False
        assert ok is not False, text


@pytest.mark.parametrize("pattern,message", [
    ("(?=a)b", "lookaround"),
    ("(?<!a)b", "lookaround"),
    (r"(a)\1", "backreferences"),
    (r"\bword", "word boundaries"),
    (r"\p{L}", "Unicode property"),
    ("(?i)abc", "inline flags"),
    ("a++", "possessive"),
    ("a**", "quantifier follows a quantifier"),
    ("*a", "nothing to repeat"),
    ("{2}", "nothing to repeat"),
    ("(ab", "group is not closed"),
    ("ab)", "unbalanced"),
    ("[ab", "class is not closed"),
    ("[z-a]", "out of order"),
    ("a{3,2}", "out of order"),
    ("a{1001}", "counts past"),
    (r"\q", r"\q"),
    (r"\x4", "hex digits"),
    ("^*", "anchor cannot be repeated"),
    ("[[:alpha:]]", "POSIX"),
])
def test_unsupported_syntax_is_named(pattern, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compile_regex(pattern)


def test_size_limits():
    with pytest.raises(ValueError, match=f"more than {MAX_DFA_STATES}"):
        compile_regex(r"[ab]*a[ab]{13}")  # the classic: a DFA of 2^14 states
    assert compile_regex(r"[ab]*a[ab]{6}").table.shape[0] <= 2 ** 7 + 1
    # literal braces that are no quantifier
    assert compile_regex(r"a{b}").matches(b"a{b}") and compile_regex(r"x{,2}").matches(b"x{,2}")
