"""``python -m chaos``: run the fault scenarios and print a matrix of outcomes (markdown)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from .scenarios import SCENARIOS, Outcome, run_scenario

COLUMNS = ("hang", "torn", "lost", "wrong", "unseen")


def matrix(results: dict[str, list[Outcome]], seconds: dict[str, float]) -> str:
    head = "| scenario | runs | hangs | torn files | lost commits | wrong weights | error not on every rank | time |"
    rows = [head, "|" + " --- |" * 8]
    for name, outcomes in results.items():
        ran = [o for o in outcomes if o.skipped is None]
        if not ran:
            rows.append(f"| {name} | skipped: {outcomes[0].skipped} | | | | | | |")
            continue
        counts = " | ".join(str(sum(getattr(o, c) for o in ran)) for c in COLUMNS)
        rows.append(f"| {name} | {len(ran)} | {counts} | {seconds[name]:.0f}s |")
    return "\n".join(rows)


def run(runs: int, only: list[str] | None = None) -> tuple[dict[str, list[Outcome]], dict[str, float]]:
    results, seconds = {}, {}
    with tempfile.TemporaryDirectory(prefix="ranksafe-chaos-") as root:
        for name in only or SCENARIOS:
            start = time.monotonic()
            results[name] = run_scenario(name, runs, root)
            seconds[name] = time.monotonic() - start
    return results, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="runs per scenario (default 3)")
    parser.add_argument("--long", action="store_true", help="the long run: 25 runs per scenario")
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="only these (repeatable)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every run's outcome")
    args = parser.parse_args(argv)
    results, seconds = run(25 if args.long else args.runs, args.scenario)
    if args.verbose:
        for name, outcomes in results.items():
            for i, o in enumerate(outcomes):
                print(f"{name}[{i}]: {o}")
    print(matrix(results, seconds))
    bad = sum(o.bad for outcomes in results.values() for o in outcomes)
    print(f"\n{'OK' if bad == 0 else 'FAILED'}: {bad} bad outcome(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
