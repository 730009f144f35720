"""What a save costs after it returns: the training steps right behind it, and the trainer's CPU.

``save()``'s blocked time is what ``save_overhead.py`` and ``compare.py`` measure. What a save
leaves running once it returned (uploads, keeping the snapshot in memory, its record) is paid by
the steps that follow and by the CPU the training process spends on it. Per mode, in a fresh
process (the 5,424-tensor model state of ``save_overhead.py``: 1 GiB, ``Linear(512, 512)`` +
``LayerNorm`` blocks and Adam), after ``prepare``:

  steps   ``--saves`` ASYNC saves; after each, ``--steps`` fixed training-like steps (``--work``
          matrix products of 1024 x 1024 on torch's threads) are timed one by one, then the save
          is waited for; the median of each position after the save, against the median of the
          same step with no save in flight (timed first)
  cpu     then ``--saves`` more saves with no steps between them: the training process's CPU
          time (user + system, every thread) per save, from the call to the end of ``wait()``
          (its uploaders are other processes: not counted)

Modes: ``kept`` (the default: the snapshot kept in memory) and ``unkept``
(``keep_in_memory=False``). ``--pythonpath`` runs the children with another checkout:

    .venv/bin/python bench/after_save.py
    .venv/bin/python bench/after_save.py --pythonpath /tmp/before --label before
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from typing import Any

import _harness as h

MODES = ["kept", "unkept"]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(mode: str, saves: int, steps: int, work: int, gib: float) -> dict[str, Any]:
    import torch
    from save_overhead import build

    import mpckpt

    state, _ = build("model", gib)
    a = torch.randn(1024, 1024)

    def step() -> float:
        started = time.perf_counter()
        for _ in range(work):
            a @ a
        return (time.perf_counter() - started) * 1e3

    plain = [step() for _ in range(5 * steps)]
    after: list[list[float]] = [[] for _ in range(steps)]
    cpu: list[float] = []
    with tempfile.TemporaryDirectory(dir=h.RESULTS_DIR) as root, \
            mpckpt.Checkpointer(os.path.join(root, mode), workers=2, keep_last=1,
                                keep_in_memory=mode == "kept") as ckpt:
        ckpt.prepare(state)
        ckpt.save(0, state).result(600)
        ckpt.wait(600)
        for s in range(1, saves + 1):
            future = ckpt.save(s, state)
            for i in range(steps):
                after[i].append(step())
            future.result(600)
            ckpt.wait(600)
        for s in range(saves + 1, 2 * saves + 1):  # (no steps: what the CPU time is is the save's alone)
            cpu_before = _cpu_s()
            ckpt.save(s, state).result(600)
            ckpt.wait(600)
            cpu.append((_cpu_s() - cpu_before) * 1e3)
    return {"mode": mode, "mpckpt": mpckpt.__file__, "plain_step_ms": h.median(plain),
            "after_ms": [h.median(col) for col in after], "cpu_ms": cpu, "cpu_ms_median": h.median(cpu)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="steps timed after each save")
    p.add_argument("--work", type=int, default=6, help="1024 x 1024 matrix products per step")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--pythonpath", default=None, help="a checkout whose mpckpt the children import")
    p.add_argument("--label", default="this checkout")
    p.add_argument("--out", default=os.path.join(h.RESULTS_DIR, "after_save.json"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        h.emit_result(child(args.child, args.saves, args.steps, args.work, args.gib))
        return
    os.makedirs(h.RESULTS_DIR, exist_ok=True)
    rows = h.run_each(__file__, [m for m in args.modes.split(",") if m],
                      ["--saves", str(args.saves), "--steps", str(args.steps), "--work", str(args.work), "--gib",
                       str(args.gib)], label=args.label, repeats=args.repeats, pythonpath=args.pythonpath)
    h.write_json(args.out, {"benchmark": "after_save", "args": vars(args), "machine": h.machine_info(), "rows": rows})
    print("| checkout | mode | plain step ms | steps after a save, ms (1st, 2nd, ...) | trainer CPU ms per save "
          "| other procs CPU % |")
    print("|---|---|---:|---|---:|---:|")
    for r in rows:
        steps = ", ".join(f"{v:.1f}" for v in r["after_ms"])
        print(f"| {args.label} | {r['mode']} | {r['plain_step_ms']:.1f} | {steps} | {r['cpu_ms_median']:.0f} "
              f"| {r.get('foreign_cpu_pct', '-')} |")


if __name__ == "__main__":
    main()
