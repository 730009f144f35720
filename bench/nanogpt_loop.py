"""A real small training loop on CPU, checkpointed five ways: what each costs the whole loop.

The model is a GPT of nanoGPT's CPU size (its shakespeare-char recipe on a laptop: 4 layers,
4 heads, 128 wide, 64-token context, batch 12, a 65-symbol vocabulary, tied embeddings, AdamW;
0.8 M parameters, 9.8 MB of state with Adam's moments) trained on synthetic symbols for
``--iters`` iterations (600). Every case runs in a fresh process, and the cases take turns
(``--rounds`` of each, 3): the median per case is the figure.

- ``none``: no checkpoint at all;
- ``torch_save``: nanoGPT's own, ``torch.save`` of model, optimizer, iteration every ``--every``;
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` every ``--every`` (each waits for the
  one before, as DCP asks);
- ``mpckpt_idle``: a Checkpointer opened and restored (an empty root), never saving;
- ``mpckpt_async``: ``save`` every ``--every`` (ASYNC);
- ``mpckpt_async_low``, ``mpckpt_async_normal`` (by name only): ASYNC with the uploaders at that
  ``uploader_priority`` instead of the default ``idle``;
- ``mpckpt_memory``: ``save`` every iteration, ``mode="memory"`` (kept in shared memory for a
  restart, nothing uploaded), and every ``--every``-th ASYNC (docs/guide/restoring.md, "Restarting from memory after a crash").

``loop_s`` is the loop's wall time, saves included (``x none``: over the median of ``none``; ``x none,
from step medians``: the same ratio from the median step at each position after a save plus the
saves' blocked time, which moves far less with the machine) (``training_s``: less the time the saves
blocked, what the steps took with the checkpointer working beside them); ``drain_s`` what the end waits for what is
still in flight (the close, or DCP's last future), apart. ``ctx_switches`` is the process's
voluntary context switches (all its threads) during the loop: an OpenMP team that stopped
spin-waiting shows there first. ``training_wait_s`` / ``training_slices``: how long the training
thread and its OpenMP workers waited for a core and in how many time slices they ran
(``/proc/<tid>/schedstat``): a background thread or process that preempts them shows there. The
second table gives the step time (its save apart) by where the step falls after the last save.

Usage: python bench/nanogpt_loop.py [--iters 600] [--every 10] [--rounds 3] [--cases a,b] [--pythonpath CHECKOUT]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.nn as nn
import torch.nn.functional as F
from _harness import emit_result, machine_info, markdown_table, median, run_each, target_dir, wait_for_quiet, write_json

CASES = ("none", "torch_save", "dcp_async", "mpckpt_idle", "mpckpt_async", "mpckpt_memory")
PRIORITIES = ("mpckpt_async_low", "mpckpt_async_normal")  # asked for by name: ASYNC, the uploaders at that priority
VOCAB, CONTEXT, WIDTH, LAYERS, HEADS, BATCH = 65, 64, 128, 4, 4, 12


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(WIDTH), SelfAttention()
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tokens.weight  # tied, as nanoGPT's
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02 / (math.sqrt(2 * LAYERS) if name.endswith("out.weight") else 1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).view(-1, VOCAB), targets.view(-1))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-3, betas=(0.9, 0.99))


def _child(case: str, args: argparse.Namespace) -> None:
    torch.manual_seed(1337)
    data = torch.randint(0, VOCAB, (1 << 20,))
    model = GPT()
    opt = _optimizer(model)
    folder = tempfile.mkdtemp(prefix=f"nanogpt-{case}-", dir=args.dir)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "iter_num": 0}
    ckpt = None
    if case.startswith("mpckpt"):
        import mpckpt

        priority = case.rsplit("_", 1)[1] if case in PRIORITIES else None
        ckpt = mpckpt.Checkpointer(os.path.join(folder, "root"), workers=1, uploader_priority=priority)
        ckpt.restore(state)
    pending = None
    blocked: list[float] = []

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - CONTEXT - 1, (BATCH,))
        return (torch.stack([data[i:i + CONTEXT] for i in ix]), torch.stack([data[i + 1:i + 1 + CONTEXT] for i in ix]))

    x, y = batch()
    model(x, y).backward()  # (the training thread's OpenMP team exists before its threads are counted)
    opt.zero_grad(set_to_none=True)
    steps: list[float] = []
    sched0 = _training_sched()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    for it in range(args.iters):
        step_started = time.perf_counter()
        x, y = batch()
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        state["iter_num"] = it
        due = (it + 1) % args.every == 0
        t0 = time.perf_counter()
        steps.append(t0 - step_started)
        if case == "torch_save" and due:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": it},
                       os.path.join(folder, "ckpt.pt"))
        elif case == "dcp_async" and due:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            if pending is not None:
                pending.result()
            model_sd, optim_sd = get_state_dict(model, opt)
            pending = dcp.async_save({"model": model_sd, "optimizer": optim_sd},
                                     checkpoint_id=os.path.join(folder, f"iter{it}"))
        elif case in ("mpckpt_async", *PRIORITIES) and due:
            assert ckpt is not None
            ckpt.save(it, state)
        elif case == "mpckpt_memory":
            assert ckpt is not None
            ckpt.save(it, state, mode="async" if due else "memory")
        else:
            continue
        blocked.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - started
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    sched1 = _training_sched()
    t0 = time.perf_counter()
    if pending is not None:
        pending.result()
    if ckpt is not None:
        ckpt.close()
    drain_s = time.perf_counter() - t0
    shutil.rmtree(folder, ignore_errors=True)
    emit_result({"case": case, "loop_s": loop_s, "drain_s": drain_s, "step_ms": 1e3 * loop_s / args.iters,
                 "saves": len(blocked), "blocked_s": sum(blocked), "blocked_ms_median": 1e3 * median(blocked) if blocked else 0.0,
                 "ctx_switches": ru1.ru_nvcsw - ru0.ru_nvcsw, "loss": loss.item(),
                 # a step's time (the save apart) by where it falls after the last save due: 1 = right after
                 "step_ms_by_position": [1e3 * median(steps[k::args.every]) for k in range(args.every)],
                 "training_wait_s": (sched1[0] - sched0[0]) / 1e9, "training_slices": sched1[1] - sched0[1]})


def _cycle_ms(runs: list[dict[str, Any]], iters: int, every: int) -> float:
    """What ``every`` iterations cost, saves included, from medians: the median step at each
    position after a save, summed, plus the time the saves blocked per ``every`` iterations (their
    mean: the first save counts). Steps are hundreds of samples per run where the loop is one, so
    this moves far less with the machine than the loop time does (the ``x none`` of the loops)."""
    steps = sum(median([r["step_ms_by_position"][k] for r in runs]) for k in range(every))
    return steps + median([1e3 * r["blocked_s"] / iters * every for r in runs])


def _training_sched() -> tuple[int, int]:
    """Nanoseconds the training thread and its OpenMP workers (every thread that is not another
    Python thread) waited for a core, and the time slices they ran in (``/proc/<tid>/schedstat``;
    zeros where there is none). A thread that preempts them shows here."""
    others = {t.native_id for t in threading.enumerate() if t is not threading.main_thread()}
    wait = slices = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            if int(tid) not in others:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    _, waited, ran = map(int, f.read().split())
                wait, slices = wait + waited, slices + ran
    except OSError:
        pass
    return wait, slices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child")
    ap.add_argument("--iters", type=int, default=600)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--pythonpath", default=None, help="a checkout whose mpckpt the children import")
    args = ap.parse_args()
    if args.child:
        _child(args.child, args)
        return
    folder, remove = target_dir(args.dir, "nanogpt-")
    cases = args.cases.split(",")
    print(f"waiting for a quiet machine (busy {wait_for_quiet(120):.0f}%)", file=sys.stderr)
    runs = run_each(__file__, cases, ["--iters", str(args.iters), "--every", str(args.every), "--dir", folder],
                    label="case", repeats=args.rounds, pythonpath=args.pythonpath)
    if remove:
        shutil.rmtree(folder, ignore_errors=True)
    base = median([r["loop_s"] for r in runs if r["case"] == "none"]) if "none" in cases else math.nan
    base_cycle = _cycle_ms([r for r in runs if r["case"] == "none"], args.iters, args.every) if "none" in cases else math.nan
    rows = []
    for case in cases:
        mine = [r for r in runs if r["case"] == case]
        loop = median([r["loop_s"] for r in mine])
        rows.append({"case": case, "loop_s": loop, "vs_none": loop / base,
                     "cycle_vs_none": _cycle_ms(mine, args.iters, args.every) / base_cycle,
                     "loops": " / ".join(f"{r['loop_s']:.1f}" for r in mine),
                     "drain_s": median([r["drain_s"] for r in mine]),
                     "blocked_ms": median([r["blocked_ms_median"] for r in mine]),
                     "training_s": median([r["loop_s"] - r["blocked_s"] for r in mine]),
                     "ctx_switches": median([r["ctx_switches"] for r in mine]),
                     "training_wait_s": median([r["training_wait_s"] for r in mine]),
                     "training_slices": median([r["training_slices"] for r in mine]),
                     "after_save": " ".join(f"{median([r['step_ms_by_position'][k] for r in mine]):.1f}"
                                            for k in range(args.every)),
                     "foreign_cpu_pct": max(r["foreign_cpu_pct"] for r in mine)})
    print(markdown_table(rows, [("case", "case", 0), ("loop_s", "loop s (median)", 2), ("vs_none", "x none", 3),
                                ("loops", "each run's loop s", 0), ("drain_s", "drain s", 2),
                                ("blocked_ms", "blocked ms / save", 2),
                                ("training_s", "loop s less blocked", 2), ("ctx_switches", "vol. ctx switches", 0),
                                ("foreign_cpu_pct", "other CPU % (max)", 1)]))
    print()
    print(markdown_table(rows, [("case", "case", 0), ("cycle_vs_none", "x none, from step medians", 3),
                                ("training_wait_s", "training threads' wait for a core s", 2),
                                ("training_slices", "their time slices", 0),
                                ("after_save", "step ms by iteration after the save (1st ... last)", 0)]))
    if args.json:
        write_json(args.json, {"machine": machine_info(), "iters": args.iters, "every": args.every,
                               "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
