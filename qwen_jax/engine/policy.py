"""How many rows a drafting stream's next window gets (`DraftPolicy`), from what its windows have kept so far.

A window of r rows verifies the pending token and r - 1 drafts and yields the accepted drafts and one more token;
it costs `cost(r)` decode rounds (a serial round yields one token). If each draft stands with probability a, given
the ones before it stood, a window of r rows yields E(r) = 1 + a + ... + a^(r-1) tokens. The policy estimates a per
stream and picks the r (of the compiled row buckets, up to the round's cap) with the most tokens a round,
E(r) / cost(r); for copy drafts, none (a serial round) when no r beats a serial round, with a small window every
`probe` rounds so the estimate can recover. Block drafts always keep a window: a serial round's row never reaches
the drafter's context, and the drafts waiting on the device after it are for an older anchor, so a probe after
serial rounds would fail whatever the drafter could do.

Every choice is exact: a row's bits are the serial step's whatever the window's length (the chain windows' rule),
so the policy decides speed only, never a token.

The estimate: each landed window of n - 1 drafts that kept k of them adds k to the drafts that stood and, when k <
n - 1, one to those that did not (a draft after a rejected one is never seen). a = (stood + 1/2) / (stood + fell + 1),
both counts decayed by `decay` a window so the estimate follows the text: three windows that keep nothing take a
copy-drafting stream to serial rounds.

The default costs are the H100's at the 27B's shapes, one stream at 1K of context (BENCHMARKS.md, engine, session
40; the 2- and 8-row block windows interpolated); a small model's windows cost about one round, which
`DraftPolicy(copy_costs=..., block_costs=...)` can say."""

from __future__ import annotations

import dataclasses

# decode rounds a window of r rows costs (r: 2, 4, 8, 16)
COPY_COSTS = {2: 1.15, 4: 1.19, 8: 1.47, 16: 1.32}
BLOCK_COSTS = {2: 1.40, 4: 1.46, 8: 1.54, 16: 1.61}


@dataclasses.dataclass
class Acceptance:
    """A stream's drafts that stood and fell, decayed (see the module doc)."""
    stood: float = 0.0
    fell: float = 0.0
    serial_rounds: int = 0  # rounds decoded serially since its last window (copy drafts)

    def rate(self) -> float:
        return (self.stood + 0.5) / (self.stood + self.fell + 1.0)

    def landed(self, proposed: int, kept: int, decay: float) -> None:
        self.stood = self.stood * decay + kept
        self.fell = self.fell * decay + (1.0 if kept < proposed else 0.0)
        self.serial_rounds = 0


def expected_tokens(rate: float, rows: int) -> float:
    """Tokens a window of `rows` rows yields on average when each draft stands with probability `rate`."""
    return sum(rate ** i for i in range(rows))


@dataclasses.dataclass(frozen=True)
class DraftPolicy:
    """adaptive: rows from the stream's acceptance (the module doc); else every window gets the round's cap."""
    adaptive: bool = True
    copy_costs: tuple[tuple[int, float], ...] = tuple(COPY_COSTS.items())
    block_costs: tuple[tuple[int, float], ...] = tuple(BLOCK_COSTS.items())
    decay: float = 0.9
    probe: int = 16  # copy drafts: serial rounds before a 2-row window tries again

    @classmethod
    def parse(cls, name: str, costs: str | None = None) -> "DraftPolicy":
        """--draft-policy NAME [--draft-costs JSON]: costs as {"copy": {"ROWS": ROUNDS, ...}, "block": {...}}
        (either part may be left out: it keeps the defaults), e.g. from `python -m qwen_jax bench --draft-rows` on
        the machine and model being served."""
        if name not in ("adaptive", "always"):
            raise ValueError(f"--draft-policy must be adaptive or always, got {name!r}")
        fields = {"adaptive": name == "adaptive"}
        if costs:
            fields.update(_parse_costs(costs))
        return cls(**fields)

    def rows(self, acc: Acceptance, choices: tuple[int, ...], cap: int, *, block: bool) -> int:
        """The rows of a stream's next window, at most cap: one of `choices` (the compiled row buckets; cap where a
        bucket exceeds it), or 0 for a serial round (copy drafts only: no window beats a serial round, and the
        stream has not yet gone `probe` serial rounds since its last window)."""
        fits = sorted({min(r, cap) for r in choices if min(r, cap) >= 2})
        if not fits:
            return 0
        if not self.adaptive:
            return fits[-1]
        costs = dict(self.block_costs if block else self.copy_costs)
        rate = acc.rate()
        best = max(fits, key=lambda r: (expected_tokens(rate, r) / _cost(costs, r), -r))
        if block or expected_tokens(rate, best) > _cost(costs, best):
            return best
        return fits[0] if acc.serial_rounds >= self.probe else 0


def _cost(costs: dict[int, float], rows: int) -> float:
    """A window's cost at `rows`: the table's entry, or the next larger row count's (a call runs a row bucket)."""
    if rows in costs:
        return costs[rows]
    larger = [r for r in costs if r >= rows]
    return costs[min(larger)] if larger else costs[max(costs)]


def _parse_costs(text: str) -> dict[str, tuple[tuple[int, float], ...]]:
    import json
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--draft-costs is not JSON: {e}") from None
    if not isinstance(raw, dict) or not raw or set(raw) - {"copy", "block"}:
        raise ValueError('--draft-costs must be an object with "copy" and/or "block", each {"ROWS": ROUNDS, ...}')
    out = {}
    for kind, table in raw.items():
        try:
            pairs = tuple(sorted((int(r), float(c)) for r, c in table.items()))
        except (AttributeError, TypeError, ValueError):
            raise ValueError(f'--draft-costs "{kind}" must map row counts to decode rounds, got {table!r}') from None
        if not pairs or any(r < 2 or not c > 0 for r, c in pairs):
            raise ValueError(f'--draft-costs "{kind}": row counts must be >= 2 and rounds > 0, got {table!r}')
        out[f"{kind}_costs"] = pairs
    return out
