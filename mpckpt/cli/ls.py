"""``mpckpt ls ROOT [--json]``: committed checkpoints with step, time, kind, size, files and metrics.

A folder that cannot be read is listed as damaged, with the reason on stderr, and makes
the status 1.

``kept`` says why a checkpoint is kept whatever the writer's retention policy says: the
newest committed one (``"latest"``), one whose files a later checkpoint uses
(``"referenced"``), a damaged one (``"damaged"``: never deleted, it may be recoverable).
The policy itself (``KeepLast``, ``KeepBest`` ...) lives in the writing process and is not
recorded with the checkpoints, so ``[]`` means only that: kept by the policy, or no policy.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from mpckpt.cli._common import backend_for, complain, iso_time, own_bytes, say, say_json, scan_root, total_bytes
from mpckpt.format.manifest import Manifest
from mpckpt.format.names import step_of


def run(args: argparse.Namespace) -> int:
    backend = backend_for(args.root, args.storage_options)
    committed, problems = scan_root(backend)
    rows = listing(committed, problems)
    if args.json:
        say_json(rows)
    else:
        for row in rows:
            _say_row(row)
    for step in sorted(problems):
        complain(f"step {step}: {problems[step]}")
    return 1 if problems else 0


def listing(committed: dict[int, Manifest], problems: dict[int, Exception]) -> list[dict[str, Any]]:
    """One object per step, oldest first: what ``ls --json`` prints."""
    latest = max(committed, default=None)
    referenced = {step_of(e.ref) for m in committed.values() for e in m.files.values() if e.ref}
    rows: list[dict[str, Any]] = []
    for step in sorted({*committed, *problems}):
        if step in problems:
            rows.append({"step": step, "time": None, "created_unix": None, "kind": None, "bytes": None,
                         "stored_bytes": None, "files": None, "metrics": None, "kept": ["damaged"],
                         "damaged": str(problems[step])})
            continue
        m = committed[step]
        kept = [why for why, yes in (("latest", step == latest), ("referenced", step in referenced)) if yes]
        rows.append({"step": step, "time": iso_time(m.created_unix), "created_unix": m.created_unix, "kind": m.kind,
                     "bytes": total_bytes(m), "stored_bytes": own_bytes(m), "files": len(m.files),
                     "metrics": m.metrics, "kept": kept, "damaged": None})
    return rows


def _say_row(row: dict[str, Any]) -> None:
    if row["damaged"] is not None:
        say(f"{row['step']:>10}  DAMAGED   {row['damaged']}")
        return
    # the size is what the folder itself holds; files referenced from earlier ones are counted there
    say(f"{row['step']:>10}  {row['time']:<25}  {row['kind']:<9} {row['stored_bytes'] / 2**20:>10.1f} MiB  "
        f"{row['files']:>4} files  {json.dumps(row['metrics'])}")
