"""Blocked time per Lightning checkpoint save: MpckptCheckpointIO vs AsyncCheckpointIO vs TorchCheckpointIO.

The same LightningModule (an MLP of ``--width`` x ``--layers`` with Adam: about 12 bytes per
parameter in the checkpoint), the same loop (``--steps`` training steps, a ModelCheckpoint save every
``--every`` steps with ``save_top_k=2``), each plugin in a fresh process. "blocked" is the time
``save_checkpoint`` holds the training loop (p50/p90 over every save but each run's first, which is shown
apart: for mpckpt it starts the uploaders and makes the shared memory) (the plugin's call only; Lightning's own
``dump_checkpoint`` before it is the same for all); "fit" is the whole ``trainer.fit`` wall time
(for mpckpt and async it includes waiting for the last writes at teardown: "end s", the plugin's
``teardown``; for mpckpt that is the last commits and the last ``.ckpt`` files written from them),
and "none" runs the same loop without checkpoints. "copy p50" is mpckpt's own snapshot_ms (the copy
into shared memory).

    .venv/bin/python bench/lightning_bench.py                       # every plugin, ~300 MB state
    .venv/bin/python bench/lightning_bench.py --only mpckpt --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

PLUGINS = ("torch", "async", "mpckpt", "none")
# "mpckpt-overlap" (--only mpckpt-overlap): Checkpointer(overlap=True); through Lightning it copies eagerly all the
# same, since Lightning's dict holds state_dict tensors rather than the modules and optimizers it guards
CHOICES = (*PLUGINS, "mpckpt-overlap")


def _run_one(plugin: str, args: argparse.Namespace, folder: str) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from torch import nn

    from mpckpt.integrations.lightning import MpckptCheckpointIO

    torch.manual_seed(0)
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    blocked: list[float] = []
    ended: list[float] = []

    def timed(cls: type) -> type:
        class Timed(cls):  # type: ignore[misc, valid-type]
            def save_checkpoint(self, *a: Any, **kw: Any) -> None:
                t0 = time.perf_counter()
                super().save_checkpoint(*a, **kw)
                blocked.append((time.perf_counter() - t0) * 1e3)

            def teardown(self) -> None:
                t0 = time.perf_counter()
                super().teardown()
                ended.append(time.perf_counter() - t0)
        return Timed

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[nn.Module] = []
            for _ in range(args.layers):
                layers += [nn.Linear(args.width, args.width), nn.ReLU()]
            self.net = nn.Sequential(*layers)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            (x,) = batch
            loss = self.net(x).pow(2).mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            data = torch.utils.data.TensorDataset(torch.randn(args.steps * args.batch, args.width))
            return torch.utils.data.DataLoader(data, batch_size=args.batch)

    plugins: list[Any] = []
    callbacks: list[Any] = []
    if plugin != "none":
        if plugin == "torch":
            io = timed(TorchCheckpointIO)()
        elif plugin == "async":
            io = timed(AsyncCheckpointIO)(TorchCheckpointIO())
        else:
            io = timed(MpckptCheckpointIO)(workers=2, overlap=plugin == "mpckpt-overlap")
        plugins.append(io)
        callbacks.append(ModelCheckpoint(dirpath=folder, monitor="train_loss", save_top_k=2,
                                         every_n_train_steps=args.every))
    trainer = L.Trainer(max_epochs=1, max_steps=args.steps, accelerator="cpu", devices=1, plugins=plugins,
                        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=plugin != "none", num_sanity_val_steps=0)
    model = Net()
    state_mb = sum(p.numel() * p.element_size() for p in model.parameters()) * 3 / 2**20
    t0 = time.perf_counter()
    trainer.fit(model)
    fit_s = time.perf_counter() - t0
    ordered = sorted(blocked[1:])  # the first save separately: it opens what the plugin uses

    def pct(q: float) -> float | None:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None

    snapshot_ms = [s.snapshot_ms for st in getattr(plugins[0], "stats", {}).values() for s in st.saves] if plugins else []
    return {"plugin": plugin, "state_mb": round(state_mb), "saves": len(blocked), "blocked_ms": blocked,
            "mpckpt_snapshot_ms": snapshot_ms, "loadavg": os.getloadavg()[0],
            "p50_ms": pct(0.5), "p90_ms": pct(0.9), "first_ms": blocked[0] if blocked else None, "fit_s": fit_s,
            "teardown_s": sum(ended)}


def _pooled(plugin: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run's later saves pooled (p50, p90), the median first save and fit time."""
    later = sorted(ms for r in runs for ms in r["blocked_ms"][1:])
    firsts = sorted(r["first_ms"] for r in runs if r["first_ms"] is not None)
    fits = sorted(r["fit_s"] for r in runs)
    ends = sorted(r.get("teardown_s", 0.0) for r in runs)

    def pct(values: list[float], q: float) -> float | None:
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    return {"plugin": plugin, "state_mb": runs[0]["state_mb"], "runs": runs, "saves": sum(r["saves"] for r in runs),
            "p50_ms": pct(later, 0.5), "p90_ms": pct(later, 0.9), "first_ms": pct(firsts, 0.5),
            "fit_s": pct(fits, 0.5), "teardown_s": pct(ends, 0.5), "loadavg": sum(r["loadavg"] for r in runs) / len(runs),
            "mpckpt_snapshot_ms": [ms for r in runs for ms in r["mpckpt_snapshot_ms"][1:]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--only", choices=CHOICES, action="append")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each plugin, round robin; figures pooled")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        plugin, folder, out = args._child.split("|")
        with open(out, "w") as f:
            json.dump(_run_one(plugin, args, folder), f)
        return
    runs: dict[str, list[dict[str, Any]]] = {}
    base = args.dir or tempfile.mkdtemp(prefix="mpckpt-lightning-bench-")
    for _ in range(args.repeat):  # round robin: a busy machine's load falls on every plugin alike
        for plugin in args.only or PLUGINS:
            folder = os.path.join(base, plugin)
            shutil.rmtree(folder, ignore_errors=True)
            out = os.path.join(base, f"{plugin}.json")
            child = [sys.executable, os.path.abspath(__file__), "--width", str(args.width), "--layers",
                     str(args.layers), "--batch", str(args.batch), "--steps", str(args.steps), "--every",
                     str(args.every), "--_child", f"{plugin}|{folder}|{out}"]
            subprocess.run(child, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(out) as f:
                runs.setdefault(plugin, []).append(json.load(f))
            shutil.rmtree(folder, ignore_errors=True)
    results = [_pooled(plugin, rs) for plugin, rs in runs.items()]
    bare = next((r["fit_s"] for r in results if r["plugin"] == "none"), None)
    print(f"state {results[-1]['state_mb']} MB, {args.steps} steps, a save every {args.every}")
    print(f"{'plugin':<16}{'saves':>6}{'p50 ms':>10}{'p90 ms':>10}{'first ms':>10}{'fit s':>8}{'vs none':>9}"
          f"{'end s':>7}{'copy p50':>10}")
    for r in results:
        snaps = sorted(r["mpckpt_snapshot_ms"])
        cells = [r["p50_ms"], r["p90_ms"], r["first_ms"]]
        cells_text = "".join(f"{'-' if v is None else f'{v:.1f}':>10}" for v in cells)
        slow = "-" if bare is None else f"{(r['fit_s'] / bare - 1) * 100:+.0f}%"
        snap = f"{snaps[len(snaps) // 2]:.1f}" if snaps else "-"
        print(f"{r['plugin']:<16}{r['saves']:>6}{cells_text}{r['fit_s']:>8.1f}{slow:>9}{r['teardown_s']:>7.1f}"
              f"{snap:>10}")
    print(f"load average during the runs: {[round(r['loadavg'], 1) for r in results]} (on {os.cpu_count()} cores)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "results": results},
                      f, indent=1)
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
