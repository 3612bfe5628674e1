"""The ``ranksafe`` command: ``demo``, ``verify``, ``ls`` and ``doctor``.

``verify`` and ``ls`` are local and read-only. ``doctor`` is meant for the launcher
(``torchrun --nproc_per_node=N -m ranksafe doctor ROOT``) and also runs as one process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from . import remote
from .checkpoint_file import load_file, verify_file
from .commit import MANIFEST, AtomicDir, verify_step
from .errors import CorruptCheckpoint, UntrustedCheckpoint
from .steps import StepStatus, list_steps


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _file_size(path: str) -> int:
    if remote.is_url(path):
        return remote.Remote.of(path).size()
    return os.path.getsize(path)


def _kind(path: str) -> str:
    """``file``, ``step`` (a step directory: it holds a manifest), ``root`` (it holds step directories) or
    ``directory``; for local paths and URLs alike."""
    if remote.is_url(path):
        target = remote.Remote.of(path)
        if target.fs.isfile(target.path):
            return "file"
        listed = target.names()
        return "step" if MANIFEST in listed else "root" if list_steps(path) else "directory"
    if not os.path.isdir(path):
        return "file"
    return "step" if os.path.exists(os.path.join(path, MANIFEST)) else "root" if list_steps(path) else "directory"


def _uncommitted(step_dir: str) -> str | None:
    """Why a directory that holds a manifest is not a committed step, by its name; None when it may be one."""
    name = os.path.basename(step_dir.rstrip("/"))
    if name.endswith(AtomicDir.PARTIAL):
        return "not committed: a save in progress, or what a crashed one left (the next save removes it)"
    if name.endswith(AtomicDir.OLD):
        return "not committed: a step set aside while it was saved again (the manager puts it back if need be)"
    return None


def verify(path: str) -> int:
    """Check a checkpoint file (footer, or zip structure for stock files) or a step directory (manifest)."""
    try:
        kind = _kind(path)
        if kind == "root":
            print(
                f"BAD {path}: a checkpoint root, not a step: `ranksafe ls {path} --deep` checks every step",
                file=sys.stderr,
            )
            return 1
        if kind == "step" and (uncommitted := _uncommitted(path)):
            print(f"BAD {path}: {uncommitted}", file=sys.stderr)
            return 1
        if kind == "directory":  # as `ls` lists a step directory without its manifest: incomplete
            print(f"BAD {path}: no {MANIFEST}: not a committed step (a save that never committed, or no step at all)",
                  file=sys.stderr)  # fmt: skip
            return 1
        if kind != "file":
            manifest = verify_step(path, deep=True)
            files = manifest["files"]
            total = sum(meta["size"] for meta in files.values())
            print(f"OK {path}: step {manifest.get('step')}, {len(files)} files, {_size(total)}, checksums verified")
        elif verify_file(path):
            print(f"OK {path}: {_size(_file_size(path))}, crc32 verified")
        else:  # a stock torch.save file: only a full read can check it
            with contextlib.suppress(UntrustedCheckpoint):  # readable, holds pickled objects: still sound
                load_file(path, verify=False)
            print(f"OK {path}: {_size(_file_size(path))}, no ranksafe footer, archive readable")
    except (CorruptCheckpoint, OSError, ValueError) as e:
        print(f"BAD {e}", file=sys.stderr)
        return 1
    return 0


def ls(root: str, deep: bool) -> int:
    """List the step directories under ``root`` with their status, size and time; exit 1 if one is corrupt."""
    if not remote.is_url(root) and not os.path.isdir(root):
        print(f"BAD {root}: {'not a directory' if os.path.exists(root) else 'does not exist'}", file=sys.stderr)
        return 1
    try:
        steps = list_steps(root, deep=deep)
    except (OSError, ValueError) as e:
        print(f"BAD {root}: {e}", file=sys.stderr)
        return 1
    print(f"{'step':>10}  {'status':<10}  {'size':>10}  {'time':<19}  path")
    for s in steps:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.time)) if s.time else "-"
        print(f"{s.step:>10}  {s.status:<10}  {_size(s.size):>10}  {when:<19}  {s.path}")
        if s.error:
            print(f"{'':>10}  {s.error}")
    if not steps:
        print(f"(no step directories under {root})")
    return 1 if any(s.status is StepStatus.CORRUPT for s in steps) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ranksafe", description="Safe saving and loading in distributed training.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="multi-process CPU demo: naive saving versus ranksafe")
    demo.add_argument("--ranks", type=int, default=4, help="number of processes (default 4)")
    demo.add_argument("--rounds", type=int, default=10, help="save rounds per process (default 10)")
    p = sub.add_parser("verify", help="check a checkpoint file or step directory; exit 1 on any problem")
    p.add_argument("path")
    p = sub.add_parser("ls", help="list step directories: committed, incomplete, corrupt (exit 1 if one is corrupt)")
    p.add_argument("root")
    p.add_argument("--deep", action="store_true", help="also verify every checksum")
    p = sub.add_parser("doctor", help="storage topology, collective latency, write bandwidth (under torchrun)")
    p.add_argument("root")
    p.add_argument("--megabytes", type=int, default=64, help="size of the bandwidth probe (default 64)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.ranks < 2 or args.rounds < 1:
            parser.error("demo: --ranks must be at least 2 (it shows ranks racing) and --rounds at least 1")
        from .demo import run

        return run(ranks=args.ranks, rounds=args.rounds)
    if args.command == "doctor" and args.megabytes < 1:
        parser.error("doctor: --megabytes must be at least 1")
    if args.command == "verify":
        return verify(args.path)
    if args.command == "ls":
        return ls(args.root, args.deep)
    from .doctor import run as doctor

    return doctor(args.root, args.megabytes)


if __name__ == "__main__":
    sys.exit(main())
