"""The instructions a kernel stalls on, from the SASS page of an Nsight Compute report exported as CSV
(``ncu --import r.ncu-rep --page source --csv --print-source sass``; h200_prefill.sh STAGE=gdn_stalls).

    python -m benchmarks.kernels.sass_stalls state_sass.csv [--top 40]

Prints the samples summed by stall reason, the most-sampled instructions (address, share of all warp-stall
samples, its three largest reasons, SASS text) and the samples summed by opcode. The reason columns are the
``stall_*`` ones (not the "(Not Issued)" copies); files without them print no reasons. Column names differ between ncu versions: the sample column is the first whose name starts
with "Warp Stall Sampling (All", the text column the one named "Source".
"""
from __future__ import annotations

import argparse
import csv
import io
from collections import Counter


def read_rows(text: str) -> tuple[list[dict], str]:
    """(rows with 'address', 'source', 'samples', 'reasons' {reason: samples}), the name of the sample column."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Source" in line and "Warp Stall Sampling" in line), None)
    if start is None:
        raise ValueError("no SASS source table with a 'Warp Stall Sampling' column in this file")
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    col = next(c for c in reader.fieldnames if c.startswith("Warp Stall Sampling (All"))
    addr = next((c for c in reader.fieldnames if "Address" in c), None)
    reasons = [c for c in reader.fieldnames if c.startswith("stall_") and "Not Issued" not in c]
    rows = []
    for r in reader:
        try:
            samples = float((r.get(col) or "0").replace(",", ""))
        except ValueError:
            continue
        rows.append({"address": r.get(addr, "") if addr else "", "source": (r.get("Source") or "").strip(),
                     "samples": samples, "reasons": {c[len("stall_"):]: _number(r.get(c)) for c in reasons}})
    return rows, col


def _number(text) -> float:
    try:
        return float((text or "0").replace(",", ""))
    except ValueError:
        return 0.0


def summary(rows: list[dict], top: int) -> str:
    total = sum(r["samples"] for r in rows) or 1.0
    out = [f"{len(rows)} instructions, {total:,.0f} samples"]
    by_reason = Counter()
    for r in rows:
        by_reason.update(r["reasons"])
    reason_total = sum(by_reason.values())
    if reason_total:
        out.append("by reason: " + ", ".join(f"{k} {100 * n / reason_total:.1f}%"
                                              for k, n in by_reason.most_common(10) if n))
    for r in sorted(rows, key=lambda r: -r["samples"])[:top]:
        main = ", ".join(f"{k} {n:.0f}" for k, n in Counter(r["reasons"]).most_common(3) if n)
        out.append(f"{r['address']:>8} {100 * r['samples'] / total:5.1f}%  {r['source']:48s} {main}")
    by_op = Counter()
    for r in rows:
        words = r["source"].split()
        if words and words[0].startswith("@"):          # a predicate guard: the opcode follows it
            words = words[1:]
        by_op[words[0].split(".")[0] if words else "?"] += r["samples"]
    out.append("by opcode: " + ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_op.most_common(12)))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args(argv)
    with open(a.csv, encoding="utf-8", errors="replace") as f:
        rows, _ = read_rows(f.read())
    print(summary(rows, a.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
