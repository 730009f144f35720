"""``python -m mpckpt.run``: torchrun's command line, for a launcher that keeps the surviving ranks.

    python -m mpckpt.run --nproc-per-node 4 [--nnodes 2 --node-rank 0 --rdzv-endpoint HOST:PORT]
                         [--max-restarts 3] train.py [args...]

What it supports of torchrun's flags: ``--nproc-per-node``, ``--nnodes`` (a fixed number),
``--node-rank``, a static rendezvous at ``--rdzv-endpoint HOST:PORT`` or ``--master-addr`` /
``--master-port`` (node 0's launcher hosts the store there), ``--standalone`` (one node, a free
port), ``--max-restarts``, ``--run-id``/``--rdzv-id``, ``--monitor-interval``, ``-m`` (run a
module); and one of its own, ``--spares N`` (warm spare processes kept per node for replacements,
``_spare``; 1 by default, 0 for none). Anything else torchrun takes is refused by name, never ignored. The ranks get the
environment torchrun gives; what the launcher does when a rank dies is ``_supervisor``'s.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence

from mpckpt._supervisor import Plan, Supervisor


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mpckpt.run", allow_abbrev=False,
        description="Start the ranks of a torch.distributed job; when one dies, start a replacement and keep the "
                    "others (they heal in place: mpckpt.heal).")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    p.add_argument("--nnodes", type=str, default="1", help="a fixed number of nodes (no MIN:MAX range)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, help="HOST:PORT of node 0's store")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="static", help="static only")
    p.add_argument("--rdzv-id", "--rdzv_id", "--run-id", "--run_id", dest="run_id", default=None)
    p.add_argument("--master-addr", "--master_addr", default=None)
    p.add_argument("--master-port", "--master_port", type=int, default=None)
    p.add_argument("--standalone", action="store_true", help="one node, the store on a free local port")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=3)
    p.add_argument("--monitor-interval", "--monitor_interval", type=float, default=0.01)
    p.add_argument("--spares", type=int, default=1,
                   help="warm spare processes per node (Python, torch and mpckpt loaded) that become replacements; "
                        "0: a replacement starts from nothing")
    p.add_argument("-m", "--module", action="store_true", help="the script is a module, run as python -m")
    p.add_argument("--no-python", "--no_python", action="store_true", help="run the script as a command")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def parse(argv: Sequence[str]) -> Plan:
    """The launch plan of a command line (``SystemExit(2)`` with a message on a bad one)."""
    parser = _parser()
    a = parser.parse_args(list(argv))
    if not a.nnodes.isdigit() or int(a.nnodes) < 1:
        parser.error(f"--nnodes={a.nnodes}: mpckpt.run takes a fixed number of nodes (torchrun's MIN:MAX elastic "
                     "range is not supported: a replacement takes a dead rank's place, the world size stays)")
    nnodes = int(a.nnodes)
    if a.rdzv_backend != "static":
        parser.error(f"--rdzv-backend={a.rdzv_backend}: mpckpt.run's rendezvous is static (node 0's launcher hosts "
                     "the store at --rdzv-endpoint or --master-addr:--master-port)")
    if a.nproc_per_node < 1 or not 0 <= a.node_rank < nnodes:
        parser.error(f"--nproc-per-node={a.nproc_per_node} must be at least 1 and --node-rank={a.node_rank} "
                     f"between 0 and {nnodes - 1}")
    if a.max_restarts < 0:
        parser.error(f"--max-restarts={a.max_restarts} must be 0 or more")
    if a.spares < 0:
        parser.error(f"--spares={a.spares} must be 0 or more")
    host, port = _endpoint(parser, a, nnodes)
    if a.no_python:
        command = [a.script]
    elif a.module:
        command = [sys.executable, "-u", "-m", a.script]
    else:
        command = [sys.executable, "-u", a.script]
    extra = {"run_id": a.run_id} if a.run_id else {}
    return Plan(argv=[*command, *a.script_args], nproc_per_node=a.nproc_per_node, nnodes=nnodes,
                node_rank=a.node_rank, host=host, port=port, max_restarts=a.max_restarts,
                monitor_interval_s=a.monitor_interval, spares=a.spares, **extra)


def _endpoint(parser: argparse.ArgumentParser, a: argparse.Namespace, nnodes: int) -> tuple[str, int]:
    if a.standalone:
        if nnodes != 1:
            parser.error("--standalone is one node; give --nnodes 1, or --rdzv-endpoint for several")
        return "127.0.0.1", a.master_port or _free_port()
    if a.rdzv_endpoint:
        host, _, port = a.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            parser.error(f"--rdzv-endpoint={a.rdzv_endpoint} must be HOST:PORT")
        return host, int(port)
    if nnodes > 1 and a.master_addr is None:
        parser.error("several nodes need the store's address: --rdzv-endpoint HOST:PORT (or --master-addr and "
                     "--master-port), the same on every node")
    return a.master_addr or "127.0.0.1", a.master_port or (29500 if nnodes > 1 else _free_port())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: Sequence[str] | None = None) -> int:
    return Supervisor(parse(sys.argv[1:] if argv is None else argv)).run()


if __name__ == "__main__":
    sys.exit(main())
