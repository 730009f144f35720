"""The ``mpckpt`` command: list, describe, verify, export and clean up checkpoint folders.

    mpckpt ls ROOT [--json]     committed checkpoints with step, commit time, size, files and
                                metrics, under a header row; folders that cannot be read are
                                listed as damaged
    mpckpt info ROOT [STEP|latest]
                                one checkpoint (the newest without a step): its tensors by
                                dotted state path (dtype, shape, bytes, shard), its other
                                values, or a directory's files; ROOT may be a plain
                                torch.distributed.checkpoint folder (no STEP)
    mpckpt verify ROOT [--step STEP]
                                check that checkpoints would load: every file's size and
                                checksum, the skeleton and every shard header; of a plain
                                torch.distributed.checkpoint folder, every item (DCP
                                stores no checksums)
    mpckpt export ROOT [STEP|latest] --to FILE.safetensors|FILE.pt [--prefix model.]
                                the state's tensors by dotted path in one safetensors file, or
                                the nested state torch.save'd (the newest without a step);
                                never replaces a file unless --force
    mpckpt export ROOT [STEP|latest] --to DIR --format dcp
                                the state as a torch.distributed.checkpoint folder that
                                dcp.load(state_dict, checkpoint_id=DIR) reads, unsharded or
                                sharded; DIR must be new or empty
    mpckpt export ROOT [STEP|latest] --to DIR --format hf [--prefix model.] [--max-shard-size 5GB]
                                one model as a Hugging Face folder from_pretrained(DIR) reads:
                                model.safetensors, or shards and their index past the size,
                                config.json when the checkpoint holds it; DIR new or empty
    mpckpt stats ROOT [--plot FILE.png]
                                what each save cost (blocked, persist, bytes, MB/s), as recorded
                                in its manifest
    mpckpt gc [ROOT ...]        remove shared memory of dead trainers (and the snapshots they
                                kept in memory for each ROOT; with no ROOT, every kept snapshot
                                is listed and none removed), and staging and manifest-less
                                folders and shared files no checkpoint uses under each ROOT
                                (takes the writer lock, so it refuses while a live trainer
                                writes there); never removes a folder that has a manifest
    mpckpt import-dcp FOLDER ROOT --step N
                                a plain torch.distributed.checkpoint folder (dcp.save's
                                .metadata and .distcp files) committed as step N of ROOT,
                                with checksums; its metadata is read without running code
    mpckpt rm ROOT STEP [STEP ...] [--damaged]
                                delete checkpoints (the newest too; damaged ones only with
                                --damaged), then the shared files no checkpoint uses any more;
                                the others stay loadable (takes the writer lock, as gc does)

ROOT is the folder a Checkpointer was given (the one holding the step_* folders), or any URL
a Checkpointer takes (``--storage-options`` for credentials and endpoints). A wrong ROOT is
never an empty listing: a folder that does not exist is said to be missing, with the
checkpoint roots beside it; one that holds no checkpoint makes every command that reads
checkpoints say "no checkpoint in" and the folder's absolute path, with the checkpoint roots
found one or two levels below it, how many checkpoints each holds and its newest step.
``--json`` (ls, info, stats) prints one JSON document instead of the table.

Exit status: 0 on success; 1 when a root does not exist or cannot be read, a checkpoint does
not verify or a folder is damaged, or a root is locked; 2 on bad arguments: what argparse
refuses, a step that is not there (info, export, rm: the message names the steps there are),
a damaged step or one whose folder another checkpoint reads given to rm without what it
needs, an export target that exists (without --force) or has an unknown suffix, a prefix that
names nothing, --storage-options that is not JSON. ``verify --step`` of a step that is not
there is a failed check: 1. A folder that exists but holds no checkpoint: ls and stats 0 (an
empty listing is an answer; the message goes to stderr and ``ls --json`` prints []), verify 1
(nothing checked proves nothing), info, export and rm 2 (no step, not even the newest, is
there), gc 1 when no Checkpointer has used the folder (then nothing in it is touched). Everything printed that comes from storage (file names, metrics, error messages
quoting them) has its control characters escaped, so a hostile manifest cannot drive the
terminal.

This module owns the argument parser, the dispatch and the help, which is this docstring's
paragraphs above this one (and for each command, its module's docstring up to the first
paragraph about the code: ``INVARIANT``, ``This module``) as plain text: the double
backticks dropped, paragraphs wrapped to the terminal, the indented table kept as written.
Each command is one module with a ``run(args) -> int``, imported only when it runs (``ls``, ``info``, ``verify``,
``export``, ``import_dcp``, ``stats``, ``gc``, ``rm``; a module's ``_`` is the command's ``-``;
``_dcp`` and ``_export_dcp`` serve ``info``, ``verify`` and ``export`` for DCP folders, ``_export_hf`` ``export --format hf``); ``_common`` holds what they share: the escaping,
opening a root, finding a step, turning an ``MpckptError`` into exit status 1
(``BadArguments``: 2), times, sizes and dotted paths; ``_roots`` finds the checkpoint roots
below a folder that holds none.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import textwrap
from typing import Any

__all__ = ["main"]

_ROOT_HELP = "the folder a Checkpointer was given (it holds the step_* folders), or its URL"
_LATEST_HELP = "a committed step, or latest (the default: the newest checkpoint)"


def _parser() -> argparse.ArgumentParser:
    intro, _, rest = _help_text(__doc__ or "").partition("\n\n")
    parser = argparse.ArgumentParser(prog="mpckpt", description=intro, epilog=rest, formatter_class=_Formatter)
    parser.add_argument("--storage-options", help="JSON object of storage options (credentials, endpoint ...)")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(module: str, help: str) -> argparse.ArgumentParser:
        name = module.replace("_", "-")  # import_dcp: mpckpt import-dcp
        p = sub.add_parser(name, help=help, description=_help_text(_docstring(module)), formatter_class=_Formatter)
        p.set_defaults(module=module)
        return p

    p = command("ls", "list committed checkpoints")
    p.add_argument("root", metavar="ROOT", help=_ROOT_HELP)
    p.add_argument("--json", action="store_true", help="a JSON list of objects, one per step")
    p = command("info", "the tensors and values of one checkpoint (no tensor data read)")
    p.add_argument("root", metavar="ROOT", help=_ROOT_HELP)
    p.add_argument("step", metavar="STEP", type=_step_or_latest, nargs="?", help=_LATEST_HELP)
    p.add_argument("--json", action="store_true", help="one JSON object: tensors, values, files")
    p = command("verify", "check that checkpoints would load")
    p.add_argument("root", metavar="ROOT", help=_ROOT_HELP)
    p.add_argument("--step", type=_step, help="check this step only")
    p = command("export", "write one checkpoint's state to a .safetensors or .pt file, a DCP or Hugging Face folder")
    p.add_argument("root", metavar="ROOT", help=_ROOT_HELP)
    p.add_argument("step", metavar="STEP", type=_step_or_latest, nargs="?", help=_LATEST_HELP)
    p.add_argument("--to", required=True, metavar="FILE", help="FILE.safetensors (tensors by dotted path) or FILE.pt; "
                   "with --format dcp or hf, a new or empty folder")
    p.add_argument("--format", choices=["dcp", "hf"], help="dcp: a torch.distributed.checkpoint folder that dcp.load "
                   "reads; hf: a Hugging Face model folder that from_pretrained reads (default: from the suffix of --to)")
    p.add_argument("--prefix", metavar="PATH", help="export only this part of the state (e.g. model.), "
                   "the prefix stripped from every name; with --format hf, needed when the state holds more than "
                   "one model's weights ('' for the whole state)")
    p.add_argument("--max-shard-size", metavar="SIZE", help="with --format hf: the most bytes per weights file, as "
                   "save_pretrained takes it (5GB, 500MB; default 5GB): past it, sharded files and an index")
    p.add_argument("--force", action="store_true", help="replace FILE if it exists (with --format hf, a folder of "
                   "model files only)")
    p.add_argument("--copy-tied", action="store_true", help="write every name of a tied tensor with its own "
                   "copy (default: keep the first, list the others in the metadata, as safetensors does)")
    p.add_argument("--allow-pickle", action="store_true", help="load pickled values (runs code from storage)")
    p = command("import_dcp", "bring a torch.distributed.checkpoint folder in as a committed step")
    p.add_argument("folder", metavar="FOLDER", help="a folder dcp.save(state_dict, checkpoint_id=FOLDER) wrote")
    p.add_argument("root", metavar="ROOT", help=_ROOT_HELP)
    p.add_argument("--step", type=_step, required=True, help="the step to commit it as (not in ROOT yet, and after "
                   "its newest)")
    p.add_argument("--allow-pickle", action="store_true", help="unpickle what the restricted readers refuse "
                   "(runs code from FOLDER)")
    p = command("stats", "what each save cost: blocked ms, persist ms, bytes, MB/s")
    p.add_argument("root", metavar="ROOT", help=_ROOT_HELP)
    p.add_argument("--json", action="store_true", help="a JSON list of objects, one per step")
    p.add_argument("--plot", metavar="FILE.png", help="draw the figures (needs matplotlib)")
    p = command("gc", "remove orphaned shared memory and incomplete folders")
    p.add_argument("roots", nargs="*", metavar="ROOT", help=_ROOT_HELP)
    p = command("rm", "delete checkpoints; the others stay loadable")
    p.add_argument("root", metavar="ROOT", help=_ROOT_HELP)
    p.add_argument("steps", type=_step, nargs="+", metavar="STEP", help="a committed step")
    p.add_argument("--damaged", action="store_true", help="also delete the damaged ones named (otherwise kept: "
                   "they may be recoverable)")
    return parser


def _docstring(command: str) -> str:
    """A command module's docstring, read from its source: building the parser imports no command
    (``ls`` or ``gc`` never pay for torch, which ``export`` and ``info`` import)."""
    spec = importlib.util.find_spec(f"{__name__}.{command}")
    source = spec.loader.get_source(spec.name) if spec is not None and spec.loader is not None else None  # type: ignore[attr-defined]
    return (ast.get_docstring(ast.parse(source), clean=False) or "") if source else ""


def _help_text(doc: str) -> str:
    """The user's part of a module docstring as plain text: its paragraphs before the first one
    about the code (``INVARIANT``, ``This module``), without reStructuredText's double backticks."""
    kept = []
    for paragraph in textwrap.dedent(doc).strip("\n").split("\n\n"):
        if paragraph.lstrip().startswith(("INVARIANT", "This module")):
            break
        kept.append(paragraph)
    return re.sub(r"``(.+?)``", r"\1", "\n\n".join(kept), flags=re.DOTALL)


class _Formatter(argparse.HelpFormatter):
    """Help text paragraphs wrapped to the terminal; indented blocks (the command table) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(
            textwrap.indent(paragraph, indent) if paragraph.startswith(" ")
            else textwrap.fill(" ".join(paragraph.split()), width, initial_indent=indent, subsequent_indent=indent)
            for paragraph in text.split("\n\n"))


def _step(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step (a non-negative integer)") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step (a non-negative integer)")
    return step


def _step_or_latest(text: str) -> int | None:
    """A step, or None for ``latest`` (the newest checkpoint)."""
    if text == "latest":
        return None
    try:
        return _step(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step (a non-negative integer) or latest") from None


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default: ``sys.argv[1:]``) names; return its exit status."""
    args = _parser().parse_args(argv)
    from mpckpt.cli._common import exit_status, route_library_log

    route_library_log()
    run: Any = importlib.import_module(f"{__name__}.{args.module}").run  # the named command's module alone
    return exit_status(run, args)
