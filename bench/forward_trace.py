"""``python -m bench.forward_trace FILE [--since S] [--until S] [--json OUT]``: the timeline of a
forward trace (``EPD_FORWARD_TRACE=FILE`` in the environment of ``epd serve`` or ``epd bench
--model``: one JSON line per model forward of every role on the host, ``epd/forward_trace.py``).

Prints, on one clock from the first forward (or ``--since`` seconds after it, up to ``--until``):
one row per forward, where a run of decode steps with the same rows and nothing riding them is
one row (their count and their mean length); the encoder's forwards indented. Then each role's
forwards, busy seconds (the share of the span), CPU seconds and CPU per busy second (a two-thread
team that computes all along gives 2.0; less is time its threads waited). What docs/BENCHMARKS.md
read a W1 wave from: the encoder's images one after another on one core, the prefill steps beside
it on the other, then the decode phase ("Issue 18 on the AMD EPYC, a third time").
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict


def load(path: str) -> list[dict]:
    """The trace's lines, in the order the forwards started (a torn or foreign line is skipped)."""
    forwards = []
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and {"start", "end", "cpu_s", "role"} <= record.keys():
                forwards.append(record)
    return sorted(forwards, key=lambda r: r["start"])


def _kind(record: dict) -> str:
    if "images" in record:
        return f"vision {record['images']} image(s), {record.get('patches', '?')} patches"
    return f"{record.get('rows', 0)} decode rows + {record.get('prefill_tokens', 0)} prompt tokens " \
           f"in {record.get('prompts', 0)} chunk(s)"


def timeline(forwards: list[dict]) -> list[dict]:
    """Rows of the timeline: consecutive decode-only steps of one role with the same rows folded."""
    rows: list[dict] = []
    for record in forwards:
        decode_only = "images" not in record and not record.get("prefill_tokens")
        last = rows[-1] if rows else None
        if (decode_only and last is not None and last["decode_only"] and last["role"] == record["role"]
                and last["rows"] == record.get("rows", 0)):
            last["end"] = record["end"]
            last["count"] += 1
            last["cpu_s"] += record["cpu_s"]
            continue
        rows.append({"role": record["role"], "start": record["start"], "end": record["end"], "count": 1,
                     "cpu_s": record["cpu_s"], "threads": record.get("threads", []), "kind": _kind(record),
                     "decode_only": decode_only, "rows": record.get("rows", 0), "vision": "images" in record})
    return rows


def per_role(forwards: list[dict]) -> dict[str, dict]:
    span = (max(r["end"] for r in forwards) - min(r["start"] for r in forwards)) if forwards else 0.0
    roles: dict[str, dict] = defaultdict(lambda: {"forwards": 0, "busy_s": 0.0, "cpu_s": 0.0})
    for record in forwards:
        entry = roles[record["role"]]
        entry["forwards"] += 1
        entry["busy_s"] += record["end"] - record["start"]
        entry["cpu_s"] += record["cpu_s"]
    for entry in roles.values():
        entry["busy_share"] = entry["busy_s"] / span if span else 0.0
        entry["cpu_per_busy_s"] = entry["cpu_s"] / entry["busy_s"] if entry["busy_s"] else 0.0
    return dict(roles)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--since", type=float, default=0.0, help="seconds after the first forward")
    parser.add_argument("--until", type=float, default=float("inf"), help="seconds after the first forward")
    parser.add_argument("--json", help="write the timeline and the per-role figures here")
    args = parser.parse_args(argv)
    forwards = load(args.file)
    if not forwards:
        raise SystemExit(f"{args.file}: no forwards (was EPD_FORWARD_TRACE set for the stack?)")
    origin = forwards[0]["start"]
    forwards = [r for r in forwards if args.since <= r["start"] - origin <= args.until]
    if not forwards:
        raise SystemExit(f"{args.file}: no forwards between {args.since} and {args.until} s")
    rows = timeline(forwards)
    for row in rows:
        length = row["end"] - row["start"]
        each = f"{row['count']} x {length / row['count'] * 1e3:.0f} ms" if row["count"] > 1 else f"{length:.3f} s"
        threads = "->".join(str(t) for t in row["threads"])
        print(f"{'    ' if row['vision'] else ''}{row['start'] - origin:8.2f} {row['end'] - origin:8.2f}  "
              f"{row['role']:<12} {each:<16} cpu {row['cpu_s']:6.2f} s  threads {threads:<5} {row['kind']}")
    roles = per_role(forwards)
    print("\nrole          forwards   busy s  busy share   cpu s  cpu/busy")
    for name, entry in sorted(roles.items()):
        print(f"{name:<12} {entry['forwards']:9d} {entry['busy_s']:8.2f} {entry['busy_share']:11.2f} "
              f"{entry['cpu_s']:7.2f} {entry['cpu_per_busy_s']:9.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"origin": origin, "timeline": rows, "roles": roles}, out, indent=1)


if __name__ == "__main__":
    try:
        main()
        sys.stdout.flush()  # here, where a reader that went away (`... | head`) is caught
    except BrokenPipeError:
        from control.cli import quiet_closed_pipe

        quiet_closed_pipe()
        sys.exit(141)
