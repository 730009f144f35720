"""The pictures of ``bench/goodput.py``'s result: a timeline per strategy and the recovery times.

``PREFIX-timeline.png``: one panel per strategy, rank 0's step over wall time (from the first
launch), each failure a vertical line in its kind's colour, each restart's first step a marker in
the colour of where its restore came from (the farthest any rank read: peer, storage, memory; or
nothing: from scratch).
``PREFIX-recovery.png``: for the failures that end the job, the time from the failure to the first
training step after it, every failure a dot, per strategy, split by kind.

    .venv/bin/python bench/goodput_plot.py bench/results/goodput-s3.json docs/goodput-s3
"""

from __future__ import annotations

import json
import sys
from typing import Any

KIND_COLOURS = {"rank_kill": "tab:red", "node_loss": "black", "preempt": "tab:purple", "uploader_kill": "tab:olive",
                "storage_outage": "tab:orange", "storage_latency": "gold", "disk_full": "tab:brown",
                "disk_slow": "tab:pink"}
SOURCE_COLOURS = {"memory": "tab:green", "peer": "tab:cyan", "storage": "tab:blue", None: "grey"}


def draw(result: dict[str, Any], prefix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    for run in runs:  # results written before events carried their launch
        current: dict[int, int] = {}
        for e in run["events"]:
            if e["event"] == "start":
                current[e["rank"]] = e["launch"]
            e["launch"] = current.get(e["rank"], 0)
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.4 * len(runs) + 0.8), sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        t0 = run["launches"][0]
        steps = [(e["t"] - t0, e["step"]) for e in run["events"] if e["event"] == "step" and e["rank"] == 0]
        ax.plot([t for t, _ in steps], [s for _, s in steps], ".", ms=1.5, color="tab:gray")
        for f in run["failures"]:
            if f["at"] is not None and not f["skipped"]:
                ax.axvline(f["at"] - t0, color=KIND_COLOURS.get(f["kind"], "k"), lw=1.2, alpha=0.8)
                if f["window_s"]:
                    ax.axvspan(f["at"] - t0, f["at"] - t0 + f["window_s"], color=KIND_COLOURS.get(f["kind"], "k"),
                               alpha=0.12)
        restores = [e for e in run["events"] if e["event"] == "restored"]
        for e in restores:
            if e["rank"] == 0:  # a relaunch: coloured by the farthest source any rank read (peer, storage, memory)
                sources = {o["source"] for o in restores if o["launch"] == e["launch"]}
                source = next((k for k in ("peer", "storage", "memory") if k in sources), None)
                first = next(((t, s) for t, s in steps if t > e["t"] - t0), None)
                if first is not None:
                    ax.plot(*first, "o", ms=6, color=SOURCE_COLOURS[source])
        s = run.get("summary", {})
        goodput = s.get("goodput")
        ax.set_title(f"{run['strategy']}: goodput {goodput:.2f}" if goodput else run["strategy"], fontsize=9, loc="left")
        ax.set_ylabel("step")
    axes[-1, 0].set_xlabel("wall time from the first launch (s)")
    handles = [plt.Line2D([], [], color=c, lw=2, label=k) for k, c in KIND_COLOURS.items()
               if any(f["kind"] == k for r in runs for f in r["failures"])]
    handles += [plt.Line2D([], [], marker="o", ls="", color=c, label=f"restored from {k or 'nothing'}")
                for k, c in SOURCE_COLOURS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle(f"goodput under failures: seed {result['seed']}, storage {result['storage']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    paths = [f"{prefix}-timeline.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.6))
    kinds = sorted({f["kind"] for r in runs for f in r["failures"] if f["recovery_s"] is not None})
    for i, run in enumerate(runs):
        for j, kind in enumerate(kinds):
            values = [f["recovery_s"] for f in run["failures"] if f["kind"] == kind and f["recovery_s"] is not None]
            x = i + (j - (len(kinds) - 1) / 2) * 0.18
            ax.plot([x] * len(values), values, "o", ms=5, alpha=0.7, color=KIND_COLOURS.get(kind, "k"),
                    label=kind if i == 0 else None)
    ax.set_xticks(range(len(runs)), [r["strategy"] for r in runs])
    ax.set_ylabel("failure to next training step (s)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(f"recovery time per failure that ends the job (seed {result['seed']}, storage {result['storage']})",
                 fontsize=9)
    fig.tight_layout()
    paths.append(f"{prefix}-recovery.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print("\n".join(draw(json.load(f), sys.argv[2])))
