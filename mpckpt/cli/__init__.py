"""The ``mpckpt`` command: list, describe, verify, export and clean up checkpoint folders.

    mpckpt ls ROOT [--json]     committed checkpoints with step, commit time, size, files and
                                metrics; folders that cannot be read are listed as damaged
    mpckpt info ROOT STEP       one checkpoint: its tensors by dotted state path (dtype, shape,
                                bytes, shard), its other values, or a directory's files
    mpckpt verify ROOT [--step] check that checkpoints would load: every file's size and
                                checksum, the skeleton and every shard header
    mpckpt export ROOT STEP --to FILE.safetensors|FILE.pt [--prefix model.]
                                the state's tensors by dotted path in one safetensors file, or
                                the nested state torch.save'd; never replaces a file unless --force
    mpckpt stats ROOT [--plot FILE.png]
                                what each save cost (blocked, persist, bytes, MB/s), as recorded
                                in its manifest
    mpckpt gc [ROOT ...]        remove shared memory of dead trainers, and staging and
                                manifest-less folders and shared files no checkpoint uses under
                                each ROOT (takes the writer lock, so it refuses while a live
                                trainer writes there); never removes a folder that has a
                                manifest, damaged or not
    mpckpt rm ROOT STEP [STEP ...] [--damaged]
                                delete checkpoints (the newest too; damaged ones only with
                                --damaged), then the shared files no checkpoint uses any more;
                                the others stay loadable (takes the writer lock, as gc does)

``--json`` (ls, info, stats) prints one JSON document instead of the table. Every ROOT is a
path or any URL a Checkpointer takes (``--storage-options`` for credentials and endpoints).

Exit status: 0 on success; 1 when a root cannot be read, a checkpoint does not verify or a
folder is damaged, or a root is locked; 2 on bad arguments: what argparse refuses, a step
that is not there (info, export, rm: the message names the steps there are), a damaged step
or one whose folder another checkpoint reads given to rm without what it needs, an export target
that exists (without --force) or has an unknown suffix, a prefix that names nothing,
--storage-options that is not JSON. ``verify --step`` of a step that is not there is a
failed check: 1. Everything printed that comes from storage (file names, metrics, error
messages quoting them) has its control characters escaped, so a hostile manifest cannot
drive the terminal.

This module owns the argument parser and the dispatch; each command is one module with a
``run(args) -> int`` (``ls``, ``info``, ``verify``, ``export``, ``stats``, ``gc``, ``rm``), and
``_common`` holds what they share: the escaping, opening a root, finding a step, turning an
``MpckptError`` into exit status 1 (``BadArguments``: 2), times, sizes and dotted paths.
"""

from __future__ import annotations

import argparse

from mpckpt.cli import export, gc, info, ls, rm, stats, verify
from mpckpt.cli._common import exit_status, route_library_log

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpckpt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage-options", help="JSON object of storage options (credentials, endpoint ...)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list committed checkpoints")
    p.add_argument("root")
    p.add_argument("--json", action="store_true", help="a JSON list of objects, one per step")
    p.set_defaults(fn=ls.run)
    p = sub.add_parser("info", help="the tensors and values of one checkpoint (no tensor data read)")
    p.add_argument("root")
    p.add_argument("step", type=_step)
    p.add_argument("--json", action="store_true", help="one JSON object: tensors, values, files")
    p.set_defaults(fn=info.run)
    p = sub.add_parser("verify", help="check that checkpoints would load")
    p.add_argument("root")
    p.add_argument("--step", type=_step)
    p.set_defaults(fn=verify.run)
    p = sub.add_parser("export", help="write one checkpoint's state to a .safetensors or .pt file")
    p.add_argument("root")
    p.add_argument("step", type=_step)
    p.add_argument("--to", required=True, metavar="FILE", help="FILE.safetensors (tensors by dotted path) or FILE.pt")
    p.add_argument("--prefix", metavar="PATH", help="export only this part of the state (e.g. model.), "
                   "the prefix stripped from every name")
    p.add_argument("--force", action="store_true", help="replace FILE if it exists")
    p.add_argument("--copy-tied", action="store_true", help="write every name of a tied tensor with its own "
                   "copy (default: keep the first, list the others in the metadata, as safetensors does)")
    p.add_argument("--allow-pickle", action="store_true", help="load pickled values (runs code from storage)")
    p.set_defaults(fn=export.run)
    p = sub.add_parser("stats", help="what each save cost: blocked ms, persist ms, bytes, MB/s")
    p.add_argument("root")
    p.add_argument("--json", action="store_true", help="a JSON list of objects, one per step")
    p.add_argument("--plot", metavar="FILE.png", help="draw the figures (needs matplotlib)")
    p.set_defaults(fn=stats.run)
    p = sub.add_parser("gc", help="remove orphaned shared memory and incomplete folders")
    p.add_argument("roots", nargs="*")
    p.set_defaults(fn=gc.run)
    p = sub.add_parser("rm", help="delete checkpoints; the others stay loadable")
    p.add_argument("root")
    p.add_argument("steps", type=_step, nargs="+", metavar="STEP")
    p.add_argument("--damaged", action="store_true", help="also delete the damaged ones named (otherwise kept: "
                   "they may be recoverable)")
    p.set_defaults(fn=rm.run)
    return parser


def _step(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step (a non-negative integer)") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step (a non-negative integer)")
    return step


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default: ``sys.argv[1:]``) names; return its exit status."""
    args = _parser().parse_args(argv)
    route_library_log()
    return exit_status(args.fn, args)
