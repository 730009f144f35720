"""One rank of ``test_nodes``'s jobs, under torchrun on a simulated node: ``nodes_probe.py OUT [--hold]``.

Joins the gloo group, gathers every rank's ``(hostname, st_dev of /dev/shm)`` and writes it to
``OUT/probe-r<rank>.json``. ``--hold``: then writes ``/dev/shm/probe-r<rank>``, starts a child process
(as an uploader would be) and waits: rank 0 for ever, the others to receive from rank 0 what it never
sends, which fails when the test loses rank 0's node under them.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    out, hold = Path(sys.argv[1]), "--hold" in sys.argv[2:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    seen: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (socket.gethostname(), os.stat("/dev/shm").st_dev))
    (out / f"probe-r{rank}.json").write_text(json.dumps({"rank": rank, "pid": os.getpid(), "seen": seen}))
    if not hold:
        dist.destroy_process_group()
        return
    Path(f"/dev/shm/probe-r{rank}").write_bytes(b"x" * 4096)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])  # lives until its node is lost
    (out / f"held-r{rank}.json").write_text(json.dumps({"pid": os.getpid(), "child": child.pid}))
    if rank == 0:
        while True:
            time.sleep(1)  # until its node is lost
    dist.recv(torch.zeros(1), src=0)  # never sent: fails when node 0 is lost


if __name__ == "__main__":
    main()
