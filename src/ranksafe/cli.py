"""The ``ranksafe`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ranksafe", description="Safe saving and loading in distributed training.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="multi-process CPU demo: naive saving versus ranksafe")
    demo.add_argument("--ranks", type=int, default=4, help="number of processes (default 4)")
    demo.add_argument("--rounds", type=int, default=10, help="save rounds per process (default 10)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run(ranks=args.ranks, rounds=args.rounds)
    return 2


if __name__ == "__main__":
    sys.exit(main())
