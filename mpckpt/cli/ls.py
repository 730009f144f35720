"""``mpckpt ls ROOT [--json]``: committed checkpoints with step, time, kind, size, files and metrics.

The table starts with a header row; ``--json`` is the list alone. A folder that cannot be
read is listed as damaged, with the reason on stderr, and makes the status 1. A folder with
no checkpoint lists nothing (``[]``) and says so on stderr, naming the checkpoint roots
below it: status 0, an empty listing being an answer (a root that does not exist is 1).

Sizes say what deleting a checkpoint frees and what it depends on: ``stored_bytes`` is what
its own folder holds, ``shared_bytes`` what it lists in ``shared/`` (frozen shards written
once, which live as long as any checkpoint lists them: ``shared_files``, and for each of
those the steps that list it in ``shared_users``), and ``uses_steps`` the earlier checkpoints
whose folders it reads files from (roots written before shared files).

``kept`` says why a checkpoint is kept whatever the writer's retention policy says: the
newest committed one (``"latest"``), one whose folder a later checkpoint reads files from
(``"referenced"``; only in roots written before shared files), a damaged one
(``"damaged"``: never deleted, it may be recoverable). The policy itself (``KeepLast``,
``KeepBest`` ...) lives in the writing process and is not recorded with the checkpoints, so
``[]`` means only that: kept by the policy, or no policy.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from mpckpt._commit.shared import shared_users
from mpckpt.cli._common import (
    backend_for,
    complain,
    iso_time,
    own_bytes,
    say,
    say_json,
    scan_root,
    shared_bytes,
    total_bytes,
)
from mpckpt.errors import MpckptError
from mpckpt.format.manifest import Manifest
from mpckpt.format.names import SUPERSEDED_PREFIX, is_aside_name, step_of

# the table's first line; each name stands over its column (SIZE: the checkpoint's own folder)
HEADER = f"{'STEP':>10}  {'TIME (UTC)':<25}  {'KIND':<9} {'SIZE':>14}  {'FILES':>10}  METRICS"


def run(args: argparse.Namespace) -> int:
    backend = backend_for(args.root, args.storage_options)
    committed, problems = scan_root(backend)
    rows = listing(committed, problems)
    if args.json:
        say_json(rows)
    elif rows:  # none: scan_root said why on stderr, and stdout stays empty
        say(HEADER)
        for row in rows:
            _say_row(row)
    for step in sorted(problems):
        complain(f"step {step}: {problems[step]}")
    for name in _set_aside(backend):
        why = ("a checkpoint a run going on from an older step went back past" if name.startswith(SUPERSEDED_PREFIX)
               else "a damaged checkpoint restore(fallback=True) went back past")
        complain(f"set aside: {name}/ ({why}; no longer a checkpoint, kept for a look: delete that folder when done)")
    return 1 if problems else 0


def _set_aside(backend: Any) -> list[str]:
    """The folders of checkpoints a run moved aside (``format.names.aside_name``: damaged, superseded)."""
    try:
        return [name for name in backend.list_names() if is_aside_name(name)]
    except MpckptError:
        return []  # the listing above already said what is wrong with the root


def listing(committed: dict[int, Manifest], problems: dict[int, Exception]) -> list[dict[str, Any]]:
    """One object per step, oldest first: what ``ls --json`` prints."""
    latest = max(committed, default=None)
    referenced = {step_of(name) for m in committed.values() for name in m.referenced_folders()}
    users = shared_users(committed)
    rows: list[dict[str, Any]] = []
    for step in sorted({*committed, *problems}):
        if step in problems:
            rows.append({"step": step, "time": None, "created_unix": None, "kind": None, "bytes": None,
                         "stored_bytes": None, "shared_bytes": None, "shared_files": None, "shared_users": None,
                         "uses_steps": None, "files": None, "ranks": None, "metrics": None, "kept": ["damaged"],
                         "damaged": str(problems[step])})
            continue
        m = committed[step]
        kept = [why for why, yes in (("latest", step == latest), ("referenced", step in referenced)) if yes]
        shared = sorted(m.shared_files())
        uses = sorted(s for s in (step_of(name) for name in m.referenced_folders()) if s is not None)
        rows.append({"step": step, "time": iso_time(m.created_unix), "created_unix": m.created_unix, "kind": m.kind,
                     "bytes": total_bytes(m), "stored_bytes": own_bytes(m), "shared_bytes": shared_bytes(m),
                     "shared_files": shared, "shared_users": {p: users[p] for p in shared}, "uses_steps": uses,
                     "files": len(m.files), "ranks": m.world_size, "metrics": m.metrics, "kept": kept,
                     "damaged": None})
    return rows


def _say_row(row: dict[str, Any]) -> None:
    if row["damaged"] is not None:
        say(f"{row['step']:>10}  DAMAGED   {row['damaged']}")
        return
    # own folder first; what it lists elsewhere (shared/, or an earlier folder) after it
    depends = ""
    if row["shared_files"]:
        others = sorted({s for p in row["shared_files"] for s in row["shared_users"][p]} - {row["step"]})
        also = f", also used by steps {_steps(others)}" if others else ""
        depends += f" + {row['shared_bytes'] / 2**20:.1f} MiB shared ({len(row['shared_files'])} files{also})"
    if row["uses_steps"]:
        depends += f" + files of steps {_steps(row['uses_steps'])}"
    if row["ranks"] > 1:
        depends += f"  (saved by {row['ranks']} ranks)"
    say(f"{row['step']:>10}  {row['time']:<25}  {row['kind']:<9} {row['stored_bytes'] / 2**20:>10.1f} MiB  "
        f"{row['files']:>4} files  {json.dumps(row['metrics'])}{depends}")


def _steps(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:8]))
    return shown if len(steps) <= 8 else f"{shown} and {len(steps) - 8} more"
