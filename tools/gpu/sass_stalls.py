"""Nsight Compute's warp-state samples per SASS instruction, from `ncu --page source --csv --print-source sass`:
the most sampled instructions with their stall columns, then the samples summed by opcode (the mnemonic's first
word, e.g. HGMMA, PRMT, SYNCS), each with its largest stall reasons.

    python3 tools/gpu/sass_stalls.py SOURCE.csv [--top 40]
"""
import argparse
import collections
import csv
import sys


def _num(text: str) -> float:
    text = text.replace(",", "")
    try:
        return float(text)
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    rows = [r for r in csv.reader(open(args.csv, errors="replace")) if len(r) > 3]
    head = rows[0]
    print(len(rows) - 1, "instructions; columns:", " | ".join(head)[:1500])
    col = next((i for i, h in enumerate(head) if "Sampling (All" in h), None)
    if col is None:
        sys.exit("no stall-sampling column")
    total = sum(_num(r[col]) for r in rows[1:]) or 1
    src = next((i for i, h in enumerate(head) if h.strip().lower() == "source"), 1)
    reasons = [i for i, h in enumerate(head) if "stall" in h.lower() and i != col]
    for r in sorted(rows[1:], key=lambda r: -_num(r[col]))[:args.top]:
        extra = " ".join(f"{head[i][:18]}={r[i]}" for i in reasons if _num(r[i]) > 0)[:200]
        print(f"{100 * _num(r[col]) / total:5.1f}%  {r[src][:70]:70s}  {extra}")
    by_op = collections.defaultdict(lambda: collections.Counter())
    for r in rows[1:]:
        words = r[src].split()
        op = next((w for w in words if not w.startswith("@")), "?").split(".")[0]
        by_op[op]["samples"] += _num(r[col])
        by_op[op]["count"] += 1
        for i in reasons:
            by_op[op][head[i]] += _num(r[i])
    print("\nby opcode: % of samples, instructions, the three largest stall columns")
    for op, c in sorted(by_op.items(), key=lambda kv: -kv[1]["samples"])[:25]:
        top = sorted(((v, k) for k, v in c.items() if k not in ("samples", "count")), reverse=True)[:3]
        print(f"{100 * c['samples'] / total:5.1f}%  {op:14s} {int(c['count']):5d}  "
              + "  ".join(f"{k[:28]}={v:.0f}" for v, k in top if v > 0))


if __name__ == "__main__":
    main()
