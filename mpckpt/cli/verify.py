"""``mpckpt verify ROOT [--step N]``: check that checkpoints would load.

Every file's size and checksum, the skeleton and every shard header are checked, without
building tensors. One line per step; the status is 1 when any step is damaged, missing or
does not verify, and when the folder holds no checkpoint (nothing checked proves nothing).
ROOT may also be a plain torch.distributed.checkpoint folder (no --step): every item is read
and checked against its metadata (DCP stores no checksums).

This module owns the report; the checks are ``_read.load.verify_checkpoint``'s.
"""

from __future__ import annotations

import argparse

from mpckpt.cli import _dcp
from mpckpt.cli._common import backend_for, complain, say, scan_root
from mpckpt.errors import MpckptError
from mpckpt.format.dcp_metadata import is_dcp_folder
from mpckpt.format.manifest import checkpoint_name


def run(args: argparse.Namespace) -> int:
    from mpckpt._read.load import verify_checkpoint  # torch: only this command needs it

    backend = backend_for(args.root, args.storage_options)
    if is_dcp_folder(backend):  # a plain torch.distributed.checkpoint folder: _dcp checks it
        return _dcp.verify(backend, args)
    committed, problems = scan_root(backend)
    steps = [args.step] if args.step is not None else sorted({*committed, *problems})
    if not steps:  # nothing checked is no proof that anything loads (scan_root said where roots are)
        return 1
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
