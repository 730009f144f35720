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

This module owns the argument parser and the dispatch; ``ls``, ``verify`` and ``gc`` each
own one command (a ``run(args) -> int``), and ``_common`` what they share: the escaping,
opening a root, and turning an ``MpckptError`` into exit status 1.
"""

from __future__ import annotations

import argparse

from mpckpt.cli import gc, ls, verify
from mpckpt.cli._common import exit_status, route_library_log

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpckpt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage-options", help="JSON object of storage options (credentials, endpoint ...)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list committed checkpoints")
    p.add_argument("root")
    p.set_defaults(fn=ls.run)
    p = sub.add_parser("verify", help="check that checkpoints would load")
    p.add_argument("root")
    p.add_argument("--step", type=int)
    p.set_defaults(fn=verify.run)
    p = sub.add_parser("gc", help="remove orphaned shared memory and incomplete folders")
    p.add_argument("roots", nargs="*")
    p.set_defaults(fn=gc.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default: ``sys.argv[1:]``) names; return its exit status."""
    args = _parser().parse_args(argv)
    route_library_log()
    return exit_status(args.fn, args)
