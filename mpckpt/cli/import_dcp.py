"""``mpckpt import-dcp FOLDER ROOT --step N [--allow-pickle]``: a plain torch.distributed.checkpoint
(DCP) folder as a new committed step of an mpckpt root, so a run goes on under mpckpt without
retraining.

FOLDER is what ``dcp.save(sd, checkpoint_id=FOLDER)`` wrote with DCP's default writer (one
process or any number of ranks: ``.metadata`` and ``.distcp`` files). Its state is read as
``mpckpt.load(FOLDER)`` reads it (every tensor whole, its metadata by a restricted unpickler
that admits only DCP's own classes, every item by ``torch.load(weights_only=True)``; a folder
that asks for anything else is refused before anything is written, naming the file and what it
asked for) and saved as step N by a ``Checkpointer`` on ROOT: shards, skeleton and a manifest
with every file's checksum, committed as any save is. Afterwards
``Checkpointer(ROOT).restore(state)`` and ``mpckpt.load(ROOT)`` give its tensors, and ``mpckpt export ROOT N --to DIR
--format dcp`` writes it back as a DCP folder.

A committed step is never overwritten: a step already in ROOT, or one not after its newest, is
refused (status 2) with the steps there are, before anything is read or written. A trainer
that writes to ROOT holds its writer lock: the import then refuses (status 1) and waits for
nothing. ``--allow-pickle`` unpickles what the restricted readers refuse (runs code from FOLDER:
only for a folder you trust).

This module owns the command; reading the folder is ``_read.dcp_folder``'s, saving the
``Checkpointer``'s.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from mpckpt._futures import size_text
from mpckpt.cli._common import BadArguments, backend_for, say, scan_quietly, steps_there
from mpckpt.errors import StepOrderError
from mpckpt.format.dcp_metadata import METADATA_NAME, is_dcp_folder
from mpckpt.storage import open_backend, spec_for_url


def run(args: argparse.Namespace) -> int:
    from mpckpt._read.dcp_folder import DcpFolder  # torch: only this command and a DCP folder need it

    options = _options(args)
    source = backend_for(args.folder, args.storage_options)
    if not is_dcp_folder(source):
        raise BadArguments(f"{args.folder} holds no {METADATA_NAME}: it is not a torch.distributed.checkpoint folder "
                           "(what dcp.save(state_dict, checkpoint_id=FOLDER) writes)")
    folder = DcpFolder(source, allow_pickle=args.allow_pickle)  # a metadata file that asks for code: refused here
    _check_step_free(args.root, args.step, options)
    state = folder.load()  # every item read and checked before the root is touched
    tensors = [e for e in folder.entries if e.dtype is not None]
    import mpckpt

    try:
        with mpckpt.Checkpointer(args.root, workers=1, keep_in_memory=False, storage_options=options) as ckpt:
            future = ckpt.save(args.step, state, mode=mpckpt.UploadMode.SYNC, force=True)  # (no trigger here)
            assert future is not None, "a forced save always returns its future"
            result = future.result()
    except StepOrderError as e:  # a step committed meanwhile by another writer
        raise BadArguments(f"step {args.step}: {e}") from e
    say(f"imported {source.url} into {args.root} as step {args.step}: {len(tensors)} tensors "
        f"({size_text(sum(e.nbytes for e in tensors))}), {len(folder.entries) - len(tensors)} other values; "
        f"committed as {result.name} with every file's checksum")
    return 0


def _options(args: argparse.Namespace) -> dict[str, Any] | None:
    import json

    return json.loads(args.storage_options) if args.storage_options else None  # checked by backend_for first


def _check_step_free(root: str, step: int, options: dict[str, Any] | None) -> None:
    """``BadArguments`` when ROOT has step ``step`` or a newer one committed (nothing is written)."""
    spec = spec_for_url(root, options)
    if spec.scheme == "file" and not os.path.isdir(spec.root):
        return  # a new root: the Checkpointer makes it
    committed, problems = scan_quietly(open_backend(spec))
    there = sorted({*committed, *problems})
    if step in there:
        raise BadArguments(f"step {step} is already committed in {root}, and a committed step is never overwritten; "
                           f"choose another --step ({steps_there(there)})")
    if there and step < there[-1]:
        raise BadArguments(f"step {step} is not after the newest step {there[-1]} of {root}; steps must increase "
                           f"there: choose a --step above {there[-1]}, or import into another root")
