"""What healing in place (``python -m mpckpt.run`` + ``mpckpt.heal``) saves at 1,000-100,000 accelerators.

bench/goodput_model.py prices every restart as detection + a relaunch of the whole job + the
restore. Healing keeps the survivors' processes: on a lost rank only a replacement process starts
(its imports and CUDA context: one process, not the whole job), every rank forms the communicator
again for the new generation (still paid by all N ranks), builds again what held the old group
(a DDP wrapper, an FSDP model sharded on the new mesh) and opens the checkpointer, and the restore
reads the newest step every rank holds. This module applies the model's formulas to that restart:

- heal cost ``H = heal_start_s + reform_s + heal_rebuild_s``: it takes the place of ``relaunch_s``
  for every failure healing takes; detection, the spare node of a node loss and the restore from
  the tier are the model's own;
- a process-only failure heals and restores from memory (the dead process's kept snapshot on the
  same node);
- a node loss heals with a spare node (``replace_s``) and the peer copy (``mpckpt_peer``); without
  copies (``mpckpt_memory``) every copy of a step went with the node: it relaunches to storage;
- a pair loss relaunches to storage (healing refuses it: no rank holds the step).

Lost work and blocked time do not change: healing changes only the restart. The model's
``evaluate`` uses ``relaunch_s`` once, in the restart of every kind of failure, so the healed
restart is ``evaluate`` with ``relaunch_s = H`` plus, for the share of failures healing refuses,
the difference ``relaunch_s - H`` (tests/unit/test_goodput_heal.py checks it against the parts).

    python3 bench/goodput_heal.py                       # the table and the sensitivity
    python3 bench/goodput_heal.py --reform-s 150 --relaunch-s 300
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import goodput_model as gm

# ---------------------------------------------------------------------------------------------
# Measured on the 2-core VM: bench/heal_in_job.py --repeats 5 (docs/guide/healing.md, "Figures"):
# a 2-rank DDP job on gloo, 9.8 MB of state per rank, rank 1 SIGKILLed after the job ran 10 s
# (mpckpt.run's warm spare ready); medians, seconds.
# ---------------------------------------------------------------------------------------------
HEAL_MEASURED_VM: dict[str, float] = {
    "detect_s": 0.06,                  # the survivor's collective fails on the closed connection
    "replacement_start_s": 0.11,       # kill -> the replacement (the warm spare) runs the script
    "imports_s": 0.0,                  # of it, Python + torch: loaded by the spare beforehand
    "leave_s": 0.04,                   # the survivor leaves the failed open and group
    "form_s": 0.03,                    # re-forming the group
    "rebuild_open_restore_s": 0.20,    # DDP wrapped again, the checkpointer opened, restored from memory
    "restore_s": 0.10,                 # of it, the survivor's restore from memory (about)
    "first_step_s": 0.10,
    "heal_total_s": 0.44,              # kill -> the next training step on every rank
    "relaunch_total_s": 3.05,          # the same under torchrun --max-restarts 1, restoring from memory
    "cold_heal_total_s": 3.02,         # healing with --spares 0: the replacement imports Python and torch
}

# ---------------------------------------------------------------------------------------------
# Assumed for a datacenter (each a flag; none measured on accelerators by this project).
# ---------------------------------------------------------------------------------------------
HEAL_ASSUMED: dict[str, float] = {
    # One process on a node that is up. The warm spare has Python and torch loaded (the VM's start:
    # 0.11 s, 1.7 s cold); left: a CUDA context, the NCCL and cuDNN libraries (the spare does not
    # know its device before its order), what the script imports beyond torch from a shared
    # filesystem. Assumed, and kept where the cold start puts it.
    "heal_start_s": 10.0,
    # The communicator of the new generation at N ranks, paid by every rank. Public figures:
    # 2.5 s for 8 GPUs on one node (NCCL 2.22: NVIDIA/nccl#534, 2024); "2.5-minute init time at
    # large scale (above certain K GPUs)" on NCCL's default init path, at launch or at a restart
    # after a GPU failure (NVIDIA/nccl#1156, 2024); host-side loops quadratic in the ranks cost
    # "several dozens of seconds at 100K scale" (NVIDIA/nccl#1789, 2025, since reduced). No
    # figure at 1,000-100,000 ranks with one scaling law: 60 s at every size (a third of the
    # model's relaunch, which holds an init of its own) is an assumption; the sensitivity below
    # runs it from 5 s to 180 s.
    "reform_s": 60.0,
    # What held the old group built again (DDP wrapper; an FSDP model on the new mesh, no weights
    # initialised: they are restored) and the checkpointer opened: the VM's 1.44 s less its restore.
    "heal_rebuild_s": 10.0,
}
DEFAULTS: dict[str, float] = {**gm.DEFAULTS, **HEAL_ASSUMED}

# name -> (the model's strategy it heals, whether a node loss heals (with the peer copy)).
# heal_peer_process heals process-only failures and relaunches node losses (restoring from the
# peer): what this version does, its heal across nodes not finishing yet (docs/guide/healing.md).
HEALS: dict[str, tuple[str, bool]] = {
    "heal_memory": ("mpckpt_memory", False),
    "heal_peer_process": ("mpckpt_peer", False),
    "heal_peer": ("mpckpt_peer", True),
}
COMPARED = ("mpckpt_memory", "heal_memory", "mpckpt_peer", "heal_peer_process", "heal_peer")


def heal_s(p: dict[str, float]) -> float:
    """What a healed failure pays in place of the whole job's relaunch."""
    return p["heal_start_s"] + p["reform_s"] + p["heal_rebuild_s"]


def refused_share(strategy: str, p: dict[str, float]) -> float:
    """The share of failures healing refuses (every copy of a step lost): they relaunch the job."""
    base, node_loss_heals = HEALS[strategy]
    nf = min(p["node_loss_fraction"], 1.0)
    return nf * min(p["pair_loss_fraction"], 1.0) if node_loss_heals else nf


def evaluate(strategy: str, model: str, n: int, p: dict[str, float]) -> gm.Row:
    """One strategy of the model or a healing one, one model size on n accelerators."""
    if strategy not in HEALS:
        return gm.evaluate(strategy, model, n, p)
    base = HEALS[strategy][0]
    h = heal_s(p)
    healed = gm.evaluate(base, model, n, {**p, "relaunch_s": h})
    restart = healed.restart_s + refused_share(strategy, p) * (p["relaunch_s"] - h)
    return dataclasses.replace(healed, strategy=strategy, restart_s=restart,
                               goodput=gm.goodput(healed.overhead, healed.mtbf_s, restart, healed.lost_s))


def print_vm() -> None:
    m = HEAL_MEASURED_VM
    path = m["replacement_start_s"] + m["rebuild_open_restore_s"] + m["first_step_s"]
    print("The VM (measured, bench/heal_in_job.py): kill to the next step "
          f"{m['heal_total_s']:.2f} s healing in place with a warm spare ({m['cold_heal_total_s']:.2f} s without), "
          f"{m['relaunch_total_s']:.2f} s relaunched by torchrun. Healing's critical path: the replacement started "
          f"{m['replacement_start_s']:.2f} s ({m['imports_s']:.2f} s of it imports; the survivor detected in "
          f"{m['detect_s']:.2f} s) + rebuild, open, restore {m['rebuild_open_restore_s']:.2f} s + the first "
          f"step {m['first_step_s']:.2f} s = {path:.2f} s.\n")


def print_inputs(p: dict[str, float]) -> None:
    print(f"Datacenter (assumed): detection {p['detect_s']:.0f} s; the job's relaunch {p['relaunch_s']:.0f} s; "
          f"a spare node {p['replace_s']:.0f} s; healing: replacement start {p['heal_start_s']:.0f} s + "
          f"communicator re-formed at N ranks {p['reform_s']:.0f} s + rebuild and open "
          f"{p['heal_rebuild_s']:.0f} s = {heal_s(p):.0f} s in place of the relaunch. Failures: "
          f"{1 - p['node_loss_fraction']:.0%} process-only, {p['node_loss_fraction']:.0%} node losses, of "
          f"which {p['pair_loss_fraction']:.0%} pair losses. heal_memory relaunches node losses "
          "(no copy survives); heal_peer heals them from the peer copy.\n")


def print_table(p: dict[str, float]) -> None:
    print("Expected restart per failure and goodput; memory: relaunched / healed; peer: relaunched / "
          "process-only failures healed / node losses healed too.\n")
    print("| model | accelerators | job MTBF | restart, memory | goodput, memory | restart, peer | "
          "goodput, peer | healing gains, points (memory; peer) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for model in gm.MODELS:
        for n in gm.SIZES:
            r = {s: evaluate(s, model, n, p) for s in COMPARED}
            mem, peer = ("mpckpt_memory", "heal_memory"), ("mpckpt_peer", "heal_peer_process", "heal_peer")
            gains = [(r[h].goodput - r[b].goodput) * 100 for h, (b, _) in HEALS.items()]
            print(f"| {model} | {n:,} | {gm.fmt_s(r['mpckpt_memory'].mtbf_s)} | "
                  + " | ".join(" / ".join(f(r[s]) for s in names) for names in (mem,) for f in (_restart, _goodput))
                  + " | "
                  + " | ".join(" / ".join(f(r[s]) for s in names) for names in (peer,) for f in (_restart, _goodput))
                  + f" | {gains[0]:+.1f}; {gains[1]:+.1f} / {gains[2]:+.1f} |")


def _restart(row: gm.Row) -> str:
    return gm.fmt_s(row.restart_s)


def _goodput(row: gm.Row) -> str:
    return f"{row.goodput:.3f}"


REFORM = (5.0, 15.0, 30.0, 60.0, 120.0, 180.0)
RELAUNCH = (60.0, 120.0, 180.0, 300.0, 600.0)


def sensitivity(p: dict[str, float], model: str, n: int) -> list[tuple[float, list[tuple[float, float, float] | None]]]:
    """Per re-form time, per relaunch time: peer's goodput relaunched, healed, and the gain.

    None where healing would cost more than the relaunch: a relaunch starts every process, forms
    the communicator and builds the model, so it never costs less than a heal's parts.
    """
    out: list[tuple[float, list[tuple[float, float, float] | None]]] = []
    for reform in REFORM:
        cells: list[tuple[float, float, float] | None] = []
        for relaunch in RELAUNCH:
            q = {**p, "reform_s": reform, "relaunch_s": relaunch}
            if heal_s(q) > relaunch:
                cells.append(None)
                continue
            a, b = evaluate("mpckpt_peer", model, n, q).goodput, evaluate("heal_peer", model, n, q).goodput
            cells.append((a, b, b - a))
        out.append((reform, cells))
    return out


def print_sensitivity(p: dict[str, float], model: str, n: int) -> None:
    print(f"\nSensitivity, {model} on {n:,} accelerators, the peer tier: goodput relaunched / healed "
          f"(the gain in points) by the communicator's re-form time and the job's relaunch time "
          f"(replacement start {p['heal_start_s']:.0f} s and rebuild {p['heal_rebuild_s']:.0f} s as above; "
          "— where the heal's parts would exceed the relaunch, which holds them all).\n")
    print("| re-form s \\ relaunch s | " + " | ".join(f"{r:.0f}" for r in RELAUNCH) + " |")
    print("|---:|" + "---:|" * len(RELAUNCH))
    for reform, cells in sensitivity(p, model, n):
        print(f"| {reform:.0f} | " + " | ".join("—" if c is None else f"{c[0]:.3f} / {c[1]:.3f} ({c[2] * 100:+.1f})"
                                                for c in cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sensitivity-model", default="70B", choices=list(gm.MODELS))
    parser.add_argument("--sensitivity-accelerators", type=int, nargs="+", default=[10_000, 100_000])
    for key, value in DEFAULTS.items():
        parser.add_argument("--" + key.replace("_", "-"), type=float, default=None, help=f"default {value:g}")
    args = parser.parse_args(argv)
    p = {key: (getattr(args, key) if getattr(args, key) is not None else value) for key, value in DEFAULTS.items()}
    print_vm()
    print_inputs(p)
    print_table(p)
    for n in args.sensitivity_accelerators:
        print_sensitivity(p, args.sensitivity_model, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
