"""``mpckpt ls ROOT``: committed checkpoints with step, kind, size, files and metrics.

A folder that cannot be read is listed as damaged, with the reason on stderr, and makes
the status 1.
"""

from __future__ import annotations

import argparse
import json

from mpckpt.cli._common import backend_for, complain, say, scan_root


def run(args: argparse.Namespace) -> int:
    backend = backend_for(args.root, args.storage_options)
    committed, problems = scan_root(backend)
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
