"""JSON Schema's numeric bounds (`minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`) as byte automata
over a number's JSON text (`bounded_number`), for structured outputs.

The numbers written are a subset of JSON's, chosen so that every value in the bounds has exactly one spelling
family and a reply can never be stuck: no exponent, no "-0" (a zero is written unsigned), at most `max_bytes`
bytes; "integer" allows no fraction. Within that subset a text is accepted exactly when its value lies in the
bounds, compared as exact decimals (a bound is read as the shortest decimal that round-trips its float, which is
what a schema's text says).

The construction: each bound is one regular expression over the number's text, built digit by digit from the
bound's decimal digits (an integer part longer or equal and larger; equal and a fraction larger, compared with the
shorter one padded with zeros), with the sign handled by comparing magnitudes; the bounds, the subset's own syntax
and the length limit are compiled with `qwen_jax.regex` and intersected.
"""

from __future__ import annotations

import math
from decimal import Decimal

from qwen_jax import regex as _regex

_KEYS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")


def _any_digits(n: int) -> str:
    return "" if n == 0 else f"[0-9]{{{n}}}"


def _digit_range(lo: int, hi: int) -> str | None:
    if lo > hi:
        return None
    return str(lo) if lo == hi else f"[{lo}-{hi}]"


def _alt(*parts: str | None) -> str | None:
    """Any of the parts (None: nothing matches)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _cat(*parts: str | None) -> str | None:
    return None if any(p is None for p in parts) else "".join(parts)


def _int_above(i: str) -> str | None:
    """Integer texts (no leading zeros) of a value above the integer i."""
    n = len(i)
    alts = [f"[1-9][0-9]{{{n},}}"]
    for k in range(n):
        d = _digit_range(int(i[k]) + 1, 9)
        if d is not None:
            alts.append(i[:k] + d + _any_digits(n - k - 1))
    return _alt(*alts)


def _int_below(i: str) -> str | None:
    """Integer texts (no leading zeros) of a value below the integer i."""
    n = len(i)
    alts = []
    if n > 1:
        alts += ["0", "[1-9]" + ("" if n == 2 else f"[0-9]{{0,{n - 2}}}")]
    for k in range(n):
        d = _digit_range(1 if k == 0 and n > 1 else 0, int(i[k]) - 1)
        if d is not None:
            alts.append(i[:k] + d + _any_digits(n - k - 1))
    return _alt(*alts)


# Fraction digits d (at least one) against a bound's fraction s (non-empty, no trailing zeros), as 0.d against 0.s.

def _frac_ge(s: str) -> str:
    rest = "[0-9]*" if len(s) == 1 else _frac_ge(s[1:])
    return _alt(_cat(_digit_range(int(s[0]) + 1, 9), "[0-9]*"), s[0] + rest)


def _frac_gt(s: str) -> str:
    rest = "[0-9]*[1-9][0-9]*" if len(s) == 1 else _frac_gt(s[1:])
    return _alt(_cat(_digit_range(int(s[0]) + 1, 9), "[0-9]*"), s[0] + rest)


def _frac_le(s: str) -> str:
    rest = "0*" if len(s) == 1 else f"(?:{_frac_le(s[1:])})?"
    return _alt(_cat(_digit_range(0, int(s[0]) - 1), "[0-9]*"), s[0] + rest)


def _frac_lt(s: str) -> str | None:
    rest = None if len(s) == 1 else f"(?:{_frac_lt(s[1:])})?"
    return _alt(_cat(_digit_range(0, int(s[0]) - 1), "[0-9]*"), _cat(s[0], rest))


class _Texts:
    """The regular expressions of unsigned and signed numbers against a bound (integer: no fraction)."""

    def __init__(self, integer: bool, max_bytes: int):
        self.integer, self.max_bytes = integer, max_bytes
        self.fraction = "" if integer else r"(?:\.[0-9]+)?"
        self.unsigned = "(?:0|[1-9][0-9]*)" + self.fraction
        self.positive = "[1-9][0-9]*" if integer else r"(?:[1-9][0-9]*(?:\.[0-9]+)?|0\.[0-9]*[1-9][0-9]*)"

    def magnitude(self, op: str, d: Decimal) -> str | None:
        """Unsigned texts whose value v has `v op d` (op: ge, gt, le, lt; d >= 0)."""
        if d >= Decimal(10) ** self.max_bytes:  # longer than any text: every text is below it
            return None if op in ("ge", "gt") else self.unsigned
        i, _, f = f"{d:f}".partition(".")
        f = f.rstrip("0")
        if len(f) > self.max_bytes:
            # No text has that many fraction digits: v >= d and v > d mean v > d cut there, v <= d and v < d
            # mean v <= d cut there.
            op = "gt" if op in ("ge", "gt") else "le"
            f = f[:self.max_bytes].rstrip("0")
        i = i.lstrip("0") or "0"
        if not f:
            frac = {"ge": self.fraction, "le": self.fraction and r"(?:\.0+)?",
                    "gt": None if self.integer else r"\.[0-9]*[1-9][0-9]*", "lt": None}[op]
        else:
            frac = {"ge": r"\." + _frac_ge(f), "gt": r"\." + _frac_gt(f), "le": rf"(?:\.{_frac_le(f)})?",
                    "lt": rf"(?:\.{_frac_lt(f)})?"}[op]
        whole = _int_above(i) if op in ("ge", "gt") else _int_below(i)
        return _alt(_cat(whole, self.fraction), _cat(i, frac))

    def signed(self, op: str, c: Decimal) -> str | None:
        """Texts whose value x has `x op c` (a "-0" may be among them; `syntax` leaves it out)."""
        if op in ("ge", "gt"):
            if c >= 0:
                return self.magnitude(op, c)
            return _alt(self.unsigned, _cat("-", self.magnitude("le" if op == "ge" else "lt", -c)))
        if c > 0 or (c == 0 and op == "le"):
            return _alt(self.magnitude(op, c), "-" + self.unsigned)
        return _cat("-", self.magnitude("ge" if op == "le" else "gt", -c))

    def syntax(self) -> str:
        return f"(?:{self.unsigned}|-{self.positive})"


def _bound(schema: dict, key: str, pointer: str) -> Decimal | None:
    value = schema.get(key)
    if value is None or isinstance(value, bool):
        return None
    if not isinstance(value, int | float) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{key!r} must be a number, not {value!r} (at {pointer})")
    return Decimal(value) if isinstance(value, int) else Decimal(repr(value))


def bounds(schema: dict, pointer: str) -> tuple | None:
    """((lower, strict) or None, (upper, strict) or None) from a schema's numeric bounds, None when it has none.
    `exclusiveMinimum` / `exclusiveMaximum` are numbers (JSON Schema 6 on) or, beside `minimum` / `maximum`, true
    or false (draft 4); with both kinds the tighter bound holds."""
    if not any(k in schema for k in _KEYS):
        return None
    sides = []
    for plain, strict in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        lower = plain == "minimum"
        flag = schema.get(strict)
        if isinstance(flag, bool) and plain not in schema:
            raise ValueError(f"{strict!r} true or false needs {plain!r} beside it (at {pointer})")
        found = []
        if (b := _bound(schema, plain, pointer)) is not None:
            found.append((b, flag is True))
        elif plain in schema:
            raise ValueError(f"{plain!r} must be a number, not {schema[plain]!r} (at {pointer})")
        if (b := _bound(schema, strict, pointer)) is not None:
            found.append((b, True))
        # the tighter: the larger lower bound (strict first when equal), the smaller upper one
        key = (lambda s: (s[0], s[1])) if lower else (lambda s: (-s[0], s[1]))
        sides.append(max(found, key=key) if found else None)
    return tuple(sides)


def bounded_number(integer: bool, lower: tuple | None, upper: tuple | None,
                   max_bytes: int) -> _regex.ByteAutomaton | None:
    """The texts of numbers (integers: no fraction) whose value is within `lower` and `upper` ((bound, strict) or
    None), of at most max_bytes bytes, without exponents or "-0"; None when there is no such text."""
    texts = _Texts(integer, max_bytes)
    parts = [texts.syntax(), f"[-.0-9]{{1,{max_bytes}}}"]
    for side, ops in ((lower, ("ge", "gt")), (upper, ("le", "lt"))):
        if side is None:
            continue
        c, strict = side
        op = ops[strict]
        if integer:  # an integer bound: ceil/floor, strictness folded in
            c, op = _integral(c, op)
        pattern = texts.signed(op, c)
        if pattern is None:
            return None
        parts.append(pattern)
    auto = None
    for pattern in parts:
        a = _regex.compile_regex(pattern, "the bounds")
        auto = a if auto is None else _regex.intersect(auto, a)
    return None if auto.empty else auto


def _integral(c: Decimal, op: str) -> tuple[Decimal, str]:
    """An integer bound and ge/le equivalent, for integers, to `x op c`."""
    floor, ceil = math.floor(c), math.ceil(c)
    return {"ge": (Decimal(ceil), "ge"), "gt": (Decimal(floor + 1), "ge"),
            "le": (Decimal(floor), "le"), "lt": (Decimal(ceil - 1), "le")}[op]
