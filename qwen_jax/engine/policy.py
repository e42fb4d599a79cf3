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

Trees (`--draft-tree`): a window of r rows verifies the drafter's r - 1 likeliest continuations, and the path
may go through any child of a node, not just its first. The estimate then keeps, besides the first children that
stood, the later children that stood by sibling rank (`programs.path_ranks`), and q_j = P(the sample is the node's
j-th child) is each count over the same total as a. A tree of n nodes is modelled as the n likeliest paths under
those q's (found best first, the same way the device builds the tree from the drafter's scores), and yields 1 + the
sum of their probabilities (`expected_tree_tokens`; with one child a node, the chain's E(r)). That is the tree the
q's would build; the drafter's own tree can rank children differently, so it is an estimate. Later children that
were never in a window are never counted, so q_j starts at 0 and grows only from windows that held them.

The default costs are the H100's at the 27B's shapes, one stream at 1K of context (BENCHMARKS.md, engine, session
40; the 2- and 8-row block windows interpolated; trees: 16 rows from session 43, 8 from session 42, before
session 43's fixes made trees cheaper, 2 and 4 the block chains'); a small model's windows cost about one round,
which `DraftPolicy(copy_costs=..., block_costs=..., tree_costs=...)` can say, or the engine can measure on the
machine it runs on when it starts (`--draft-costs measure`, `Engine.measure_draft_costs`)."""

from __future__ import annotations

import dataclasses
import heapq

from qwen_jax.programs import MISSED  # a `programs.path_ranks` entry: the path's last row had children, none stood

# decode rounds a window of r rows costs (r: 2, 4, 8, 16)
COPY_COSTS = {2: 1.15, 4: 1.19, 8: 1.47, 16: 1.32}
BLOCK_COSTS = {2: 1.40, 4: 1.46, 8: 1.54, 16: 1.61}
TREE_COSTS = {2: 1.40, 4: 1.46, 8: 1.55, 16: 1.65}
# --draft-costs measure: at least this many windows (and decode rounds) a timing, more up to MEASURE_MAX_WINDOWS
# where the decode round is short (`bench.window_costs`), five timings a row bucket
MEASURE_WINDOWS = 8
MEASURE_MAX_WINDOWS = 64


@dataclasses.dataclass
class Acceptance:
    """A stream's drafts that stood and fell, decayed (see the module doc): stood, its parent's first child (every
    draft of a chain); later, a tree's later children that stood, by sibling rank (1, 2, ...)."""
    stood: float = 0.0
    fell: float = 0.0
    serial_rounds: int = 0  # rounds decoded serially since its last window (copy drafts)
    later: tuple[float, ...] = ()

    def _total(self) -> float:
        return self.stood + sum(self.later) + self.fell + 1.0

    def rate(self) -> float:
        """a: the chance a node's first child stands, given the path to the node stood."""
        return (self.stood + 0.5) / self._total()

    def rates(self, branch: int) -> list[float]:
        """[q_0 = a, q_1, ..., q_(branch-1)]: the chance the sample is a node's j-th child."""
        total = self._total()
        return [self.rate()] + [(self.later[j - 1] if j <= len(self.later) else 0.0) / total
                                for j in range(1, branch)]

    def landed(self, proposed: int, kept: int, decay: float) -> None:
        """A chain window of `proposed` drafts kept its first `kept`."""
        self.landed_ranks([0] * kept + ([MISSED] if kept < proposed else []), decay)

    def landed_ranks(self, ranks, decay: float) -> None:
        """A window landed: `programs.path_ranks` of its stream past the root (each accepted row's sibling rank,
        then MISSED or UNSEEN)."""
        stood, fell, later = 0, 0.0, [0] * len(self.later)
        for x in (int(x) for x in ranks):
            if x < 0:
                fell = 1.0 if x == MISSED else 0.0
                break
            if x == 0:
                stood += 1
            else:
                later += [0] * (x - len(later))
                later[x - 1] += 1
        old = list(self.later) + [0.0] * (len(later) - len(self.later))
        self.stood = self.stood * decay + stood
        self.fell = self.fell * decay + fell
        self.later = tuple(o * decay + n for o, n in zip(old, later))
        self.serial_rounds = 0


def expected_tokens(rate: float, rows: int) -> float:
    """Tokens a window of `rows` rows yields on average when each draft stands with probability `rate`."""
    return sum(rate ** i for i in range(rows))


def expected_tree_tokens(rates: list[float], nodes: int, depth: int | None = None) -> float:
    """Tokens a tree window of `nodes` drafts yields on average when a node's j-th child holds the sample with
    probability rates[j]: 1 + the probabilities of the `nodes` likeliest paths of at most `depth` drafts, found best
    first (a frontier of each found node's first child and the next sibling of each taken one)."""
    total, found = 1.0, 0
    frontier = [(-rates[0], 0, 1.0, 0, 1)] if rates and (depth is None or depth >= 1) else []
    tick = 1  # ties: the earliest entry
    while frontier and found < nodes:
        neg, _, base, rank, d = heapq.heappop(frontier)
        p = -neg
        if p <= 0.0:
            break
        total, found = total + p, found + 1
        if rank + 1 < len(rates):
            heapq.heappush(frontier, (-base * rates[rank + 1], tick, base, rank + 1, d))
            tick += 1
        if depth is None or d < depth:
            heapq.heappush(frontier, (-p * rates[0], tick, p, 0, d + 1))
            tick += 1
    return total


@dataclasses.dataclass(frozen=True)
class DraftPolicy:
    """adaptive: rows from the stream's acceptance (the module doc); else every window gets the round's cap."""
    adaptive: bool = True
    copy_costs: tuple[tuple[int, float], ...] = tuple(COPY_COSTS.items())
    block_costs: tuple[tuple[int, float], ...] = tuple(BLOCK_COSTS.items())
    tree_costs: tuple[tuple[int, float], ...] = tuple(TREE_COSTS.items())
    decay: float = 0.9
    probe: int = 16  # copy drafts: serial rounds before a 2-row window tries again
    # measure > 0: the engine times its own windows when it starts (`Engine.measure_draft_costs`, that many windows
    # a timing) and decides from those costs in place of the tables
    measure: int = 0

    @classmethod
    def parse(cls, name: str, costs: str | None = None) -> "DraftPolicy":
        """--draft-policy NAME [--draft-costs JSON|measure]: costs as {"copy": {"ROWS": ROUNDS, ...}, "block":
        {...}, "tree": {...}} (any part may be left out: it keeps the defaults), e.g. from `python -m qwen_jax bench
        --draft-rows` on the machine and model being served; or `measure`: the engine times its windows at start."""
        if name not in ("adaptive", "always"):
            raise ValueError(f"--draft-policy must be adaptive or always, got {name!r}")
        fields = {"adaptive": name == "adaptive"}
        if costs == "measure":
            if name != "adaptive":
                raise ValueError("--draft-costs measure: only the adaptive --draft-policy reads costs")
            fields["measure"] = MEASURE_WINDOWS
        elif costs:
            fields.update(_parse_costs(costs))
        return cls(**fields)

    def with_costs(self, kind: str, costs: dict[int, float]) -> "DraftPolicy":
        """This policy with `kind`'s ("copy", "block" or "tree") table replaced by measured costs."""
        if kind not in ("copy", "block", "tree"):
            raise ValueError(f"kind must be copy, block or tree, got {kind!r}")
        return dataclasses.replace(self, **{f"{kind}_costs": tuple(sorted(costs.items()))})

    def rows(self, acc: Acceptance, choices: tuple[int, ...], cap: int, *, block: bool, tree: int = 0,
             depth: int | None = None) -> int:
        """The rows of a stream's next window, at most cap: one of `choices` (the compiled row buckets; cap where a
        bucket exceeds it), or 0 for a serial round (copy drafts only: no window beats a serial round, and the
        stream has not yet gone `probe` serial rounds since its last window). tree: block drafts as trees of up to
        that many children a node, at most `depth` drafts deep (the drafter's block - 1)."""
        fits = sorted({min(r, cap) for r in choices if min(r, cap) >= 2})
        if not fits:
            return 0
        if not self.adaptive:
            return fits[-1]
        if block and tree:
            costs, rates = dict(self.tree_costs), acc.rates(tree)
            yields = {r: expected_tree_tokens(rates, r - 1, depth) for r in fits}
        else:
            costs, rate = dict(self.block_costs if block else self.copy_costs), acc.rate()
            yields = {r: expected_tokens(rate, r) for r in fits}
        best = max(fits, key=lambda r: (yields[r] / _cost(costs, r), -r))
        if block or yields[best] > _cost(costs, best):
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
    if not isinstance(raw, dict) or not raw or set(raw) - {"copy", "block", "tree"}:
        raise ValueError('--draft-costs must be an object with any of "copy", "block" and "tree", each '
                         '{"ROWS": ROUNDS, ...}')
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
