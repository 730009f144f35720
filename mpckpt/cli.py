"""The ``mpckpt`` command: list, verify and clean up checkpoint folders.

    mpckpt ls ROOT              committed checkpoints with step, size, files and metrics
    mpckpt verify ROOT [--step] read every file of a checkpoint and check its checksum
    mpckpt gc [ROOT ...]        remove shared memory of dead trainers, and staging and
                                manifest-less folders under each ROOT (takes the writer lock,
                                so it refuses while a live trainer writes there)

Exit status: 0 on success, 1 when a checkpoint does not verify or a folder is locked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from mpckpt import _shm
from mpckpt._ledger import scan
from mpckpt.errors import MpckptError
from mpckpt.format.manifest import checkpoint_name
from mpckpt.storage import open_backend, spec_for_url


def _backend(root: str, options: str | None) -> Any:
    return open_backend(spec_for_url(root, json.loads(options) if options else None))


def cmd_ls(args: argparse.Namespace) -> int:
    backend = _backend(args.root, args.storage_options)
    for step, m in sorted(scan(backend, clean=False).items()):
        size = sum(e.size for e in m.files.values() if e.ref is None)
        print(f"{step:>10}  {m.kind:<9} {size / 2**20:>10.1f} MiB  {len(m.files):>4} files  {json.dumps(m.metrics)}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from mpckpt.restore import stream_verified

    backend = _backend(args.root, args.storage_options)
    committed = scan(backend, clean=False)
    steps = [args.step] if args.step is not None else sorted(committed)
    bad = 0
    for step in steps:
        manifest = committed.get(step)
        if manifest is None:
            print(f"step {step}: no committed checkpoint", file=sys.stderr)
            bad += 1
            continue
        try:
            for rel in manifest.files:
                stream_verified(backend, checkpoint_name(step), manifest, rel)  # in chunks, never whole
        except MpckptError as e:
            print(f"step {step}: {e}", file=sys.stderr)
            bad += 1
        else:
            print(f"step {step}: ok ({len(manifest.files)} files)")
    return 1 if bad else 0


def cmd_gc(args: argparse.Namespace) -> int:
    undecided: list[str] = []
    for name in _shm.reap_orphans(undecided=undecided):
        print(f"removed orphaned shared memory {name}")
    for name in undecided:
        print(f"left shared memory {name} alone: it has no owner file (an mpckpt before owner files made it), "
              "and only root in the host's PID namespace can see whether a process still uses it; run "
              "`mpckpt gc` there, or remove it by hand once no trainer of an older mpckpt runs", file=sys.stderr)
    status = 0
    for root in args.roots:
        backend = _backend(root, args.storage_options)
        try:
            lock = backend.acquire_writer_lock(f"mpckpt gc pid {os.getpid()}")
        except MpckptError as e:
            print(f"{root}: {e}", file=sys.stderr)
            status = 1
            continue
        try:
            for name in backend.cleanup_incomplete():
                print(f"{root}: removed staging folder {name}")
            before = set(backend.list_names())
            scan(backend, clean=True)
            for name in sorted(before - set(backend.list_names())):
                print(f"{root}: removed incomplete checkpoint {name}")
        finally:
            lock.release()
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpckpt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage-options", help="JSON object of storage options (credentials, endpoint ...)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list committed checkpoints")
    p.add_argument("root")
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("verify", help="check every file's checksum")
    p.add_argument("root")
    p.add_argument("--step", type=int)
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("gc", help="remove orphaned shared memory and incomplete folders")
    p.add_argument("roots", nargs="*")
    p.set_defaults(fn=cmd_gc)
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except MpckptError as e:
        print(f"mpckpt: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
