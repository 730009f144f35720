"""The ``mpckpt`` command: list, verify and clean up checkpoint folders.

    mpckpt ls ROOT              committed checkpoints with step, size, files and metrics;
                                folders that cannot be read are listed as damaged
    mpckpt verify ROOT [--step] check that checkpoints would load: every file's size and
                                checksum, the skeleton and every shard header
    mpckpt gc [ROOT ...]        remove shared memory of dead trainers, and staging and
                                manifest-less folders under each ROOT (takes the writer lock,
                                so it refuses while a live trainer writes there); never
                                removes a folder that has a manifest, damaged or not

Exit status: 0 on success; 1 when a root cannot be read, a checkpoint does not verify or a
folder is damaged, or a root is locked. Everything printed that comes from storage (file
names, metrics, error messages quoting them) has its control characters escaped, so a
hostile manifest cannot drive the terminal.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from mpckpt import _shm
from mpckpt.catalog import recover, scan
from mpckpt.errors import ConfigError, MpckptError
from mpckpt.format.manifest import Manifest, checkpoint_name
from mpckpt.storage import open_backend, spec_for_url


def printable(text: object) -> str:
    """``text`` with control characters (C0, DEL, C1) shown as escapes, never sent raw."""
    return "".join(c if c.isprintable() or c == " " else ascii(c)[1:-1] for c in str(text))


def say(text: object) -> None:
    print(printable(text))


def complain(text: object) -> None:
    print(printable(text), file=sys.stderr)


class _PrintableLog(logging.Handler):
    """The library's log records, escaped like everything else this command prints."""

    def emit(self, record: logging.LogRecord) -> None:
        complain(f"mpckpt: {record.getMessage()}")


def _backend(root: str, options: str | None) -> Any:
    try:
        parsed = json.loads(options) if options else None
    except ValueError as e:
        raise ConfigError(f"--storage-options is not a JSON object ({e})") from e
    spec = spec_for_url(root, parsed)
    if spec.scheme == "file" and not os.path.isdir(spec.root):
        raise ConfigError(f"{spec.root} does not exist; give the folder a Checkpointer wrote to")
    return open_backend(spec)


def _scan(backend: Any, *, clean: bool = False) -> tuple[dict[int, Manifest], dict[int, Exception]]:
    problems: dict[int, Exception] = {}
    return scan(backend, clean=clean, problems=problems), problems


def cmd_ls(args: argparse.Namespace) -> int:
    backend = _backend(args.root, args.storage_options)
    committed, problems = _scan(backend)
    for step in sorted({*committed, *problems}):
        if step in problems:
            say(f"{step:>10}  DAMAGED   {problems[step]}")
            continue
        m = committed[step]
        size = sum(e.size for e in m.files.values() if e.ref is None)
        say(f"{step:>10}  {m.kind:<9} {size / 2**20:>10.1f} MiB  {len(m.files):>4} files  {json.dumps(m.metrics)}")
    for step in sorted(problems):
        complain(f"step {step}: {problems[step]}")
    return 1 if problems else 0


def cmd_verify(args: argparse.Namespace) -> int:
    from mpckpt.restore import verify_checkpoint

    backend = _backend(args.root, args.storage_options)
    committed, problems = _scan(backend)
    steps = [args.step] if args.step is not None else sorted({*committed, *problems})
    bad = 0
    for step in steps:
        manifest = committed.get(step)
        if manifest is None:
            complain(f"step {step}: {problems.get(step, 'no committed checkpoint')}")
            bad += 1
            continue
        try:
            verify_checkpoint(backend, checkpoint_name(step), manifest)
        except MpckptError as e:
            complain(f"step {step}: {e}")
            bad += 1
        else:
            say(f"step {step}: ok ({len(manifest.files)} files)")
    return 1 if bad else 0


def cmd_gc(args: argparse.Namespace) -> int:
    undecided: list[str] = []
    for name in _shm.reap_orphans(undecided=undecided):
        say(f"removed orphaned shared memory {name}")
    for name in undecided:
        complain(f"left shared memory {name} alone: it has no owner file (an mpckpt before owner files made it), "
                 "and only root in the host's PID namespace can see whether a process still uses it; run "
                 "`mpckpt gc` there, or remove it by hand once no trainer of an older mpckpt runs")
    status = 0
    for root in args.roots:
        try:
            status |= _gc_root(root, args.storage_options)
        except MpckptError as e:
            complain(f"{root}: {e}")
            status = 1
    return status


def _gc_root(root: str, options: str | None) -> int:
    backend = _backend(root, options)
    lock = backend.acquire_writer_lock(f"mpckpt gc pid {os.getpid()}")
    try:
        found = recover(backend)  # what opening a Checkpointer there would do
    finally:
        lock.release()
    for name in found.removed_staging:
        say(f"{root}: removed staging folder {name}")
    for name in found.removed_incomplete:
        say(f"{root}: removed incomplete checkpoint {name}")
    for step in sorted(found.damaged):
        complain(f"{root}: kept damaged step {step} (never deleted: it may be recoverable): {found.damaged[step]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpckpt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage-options", help="JSON object of storage options (credentials, endpoint ...)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list committed checkpoints")
    p.add_argument("root")
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("verify", help="check that checkpoints would load")
    p.add_argument("root")
    p.add_argument("--step", type=int)
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("gc", help="remove orphaned shared memory and incomplete folders")
    p.add_argument("roots", nargs="*")
    p.set_defaults(fn=cmd_gc)
    args = parser.parse_args(argv)
    logger = logging.getLogger("mpckpt")
    if not logger.handlers:  # the command reports what the scan would warn about itself
        logger.addHandler(_PrintableLog())
        logger.setLevel(logging.ERROR)
        logger.propagate = False
    try:
        return int(args.fn(args))
    except MpckptError as e:
        complain(f"mpckpt: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
