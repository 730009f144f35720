"""``mpckpt stats ROOT [--json] [--plot FILE.png]``: what each save cost, from its manifest.

Per committed step: how long the training loop was blocked in ``save``, the snapshot (the
copy into shared memory), the time from the end of the snapshot until the manifest was
written (persist), how long after the save it became durable and how many later saves were
waiting then (taken, not yet durable: what a crash at that moment would have lost on top), the
bytes of the state and the bytes written, and MB/s (bytes written per second of persist): the
figures the committer recorded in the manifest (``Manifest.figures``). A checkpoint written by
an mpckpt that did not record them says "not recorded" (for all of them, or for durable and
waiting alone, which came later); blocked is not recorded for a save that waited for its own
commit (``mode=SYNC``).

``--plot`` draws the same figures with matplotlib, an optional dependency (``pip install
matplotlib``); without it the command says so and writes nothing. Below them it draws the
metrics saved with each checkpoint (``save(..., metrics={"loss": ...})``) over the steps, one
panel per metric (the ``MAX_METRIC_PANELS`` most often recorded). Damaged steps are listed and
make the status 1.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from collections.abc import Callable
from typing import Any

from mpckpt.cli._common import backend_for, complain, iso_time, say, say_json, scan_root
from mpckpt.errors import ConfigError, MpckptError
from mpckpt.format.manifest import FIGURES, Manifest

_NOT_RECORDED = "not recorded"
MAX_METRIC_PANELS = 4


def run(args: argparse.Namespace) -> int:
    pyplot = _pyplot() if args.plot else None  # before any work: a missing matplotlib is said first
    backend = backend_for(args.root, args.storage_options)
    committed, problems = scan_root(backend)
    rows = [figures_row(m) for _, m in sorted(committed.items())]
    if args.json:
        say_json(rows)
    else:
        _say_table(rows)
    for step in sorted(problems):
        complain(f"step {step}: DAMAGED: {problems[step]}")
    if pyplot is not None:  # with --json, stdout holds the JSON document only
        metrics = metric_series(list(committed.values()))
        _plot(pyplot, rows, metrics, args.plot, note=complain if args.json else say)
    return 1 if problems else 0


def figures_row(m: Manifest) -> dict[str, Any]:
    """One step's figures; each None where the manifest does not have it."""
    figures: dict[str, Any] = {**dict.fromkeys(FIGURES), **(m.figures or {})}
    persist, written = figures.get("persist_ms"), figures.get("written_bytes")
    mb_per_s = round(written / 1e6 / (persist / 1e3), 1) if persist and written is not None else None
    return {"step": m.step, "time": iso_time(m.created_unix), "kind": m.kind, "recorded": m.figures is not None,
            **figures, "mb_per_s": mb_per_s}


def metric_series(manifests: list[Manifest]) -> dict[str, list[tuple[int, float]]]:
    """Each numeric metric over the steps that recorded it (booleans and non-finite values left
    out), the metrics most steps recorded first."""
    series: dict[str, list[tuple[int, float]]] = {}
    for m in sorted(manifests, key=lambda m: m.step):
        for name, value in m.metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                series.setdefault(str(name), []).append((m.step, float(value)))
    return dict(sorted(series.items(), key=lambda item: (-len(item[1]), item[0])))


def _cell(value: Any, fmt: str) -> str:
    """``value`` formatted, or a dash as wide (``fmt``: width.precision f)."""
    return format(value, fmt) if value is not None else "-".rjust(int(fmt.split(".")[0] or 0))


def _say_table(rows: list[dict[str, Any]]) -> None:
    say(f"{'STEP':>10}  {'TIME':<25}  {'BLOCKED ms':>10}  {'SNAPSHOT ms':>11}  {'PERSIST ms':>10}  "
        f"{'DURABLE ms':>12}  {'WAITING':>7}  {'STATE MiB':>10}  {'WRITTEN MiB':>11}  {'MB/s':>8}")
    for r in rows:
        if not r["recorded"]:
            say(f"{r['step']:>10}  {r['time']:<25}  {_NOT_RECORDED} (written by an mpckpt that did not keep "
                "a save's figures in its manifest)")
            continue
        state = None if r["bytes"] is None else r["bytes"] / 2**20
        written = None if r["written_bytes"] is None else r["written_bytes"] / 2**20
        durable = _cell(r["durable_ms"], "12.1f") if r["durable_ms"] is not None else f"{_NOT_RECORDED:>12}"
        say(f"{r['step']:>10}  {r['time']:<25}  {_cell(r['blocked_ms'], '10.1f')}  {_cell(r['snapshot_ms'], '11.1f')}  "
            f"{_cell(r['persist_ms'], '10.1f')}  {durable}  {_cell(r['waiting'], '7.0f')}  {_cell(state, '10.1f')}  "
            f"{_cell(written, '11.1f')}  {_cell(r['mb_per_s'], '8.1f')}")
    recorded = [r for r in rows if r["recorded"]]
    if recorded:
        medians = {key: _median(recorded, key) for key in ("blocked_ms", "persist_ms", "mb_per_s", "durable_ms")}
        waiting = [r["waiting"] for r in recorded if r["waiting"] is not None]
        lag = (f"; durable a median {medians['durable_ms'] / 1e3:.2f} s after the save, at most {max(waiting)} later "
               "saves waiting" if medians["durable_ms"] is not None and waiting else "")
        say(f"{len(recorded)} of {len(rows)} steps recorded; median blocked {_cell(medians['blocked_ms'], '.1f')} ms, "
            f"persist {_cell(medians['persist_ms'], '.1f')} ms, {_cell(medians['mb_per_s'], '.1f')} MB/s{lag}")
    if any(r["recorded"] and r["blocked_ms"] is None for r in rows):
        say("blocked '-': the save had not returned when its manifest was written (mode=SYNC waits for it)")
    if any(r["recorded"] and r["durable_ms"] is None for r in rows):
        say(f"durable {_NOT_RECORDED}: written by an mpckpt that did not keep how long a save took to become "
            "durable")


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else None


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ConfigError("--plot draws with matplotlib, which is not installed: pip install matplotlib") from e
    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as pyplot

    return pyplot


def _plot(pyplot: Any, rows: list[dict[str, Any]], metrics: dict[str, list[tuple[int, float]]], path: str, *,
          note: Callable[[str], None]) -> None:
    """The figures (two panels: times, MB/s), then one panel per metric; whichever there are."""
    rows = [r for r in rows if r["recorded"]]
    shown = dict(list(metrics.items())[:MAX_METRIC_PANELS])
    if not rows and not shown:
        note(f"no step has recorded figures or metrics; {path} not written")
        return
    panels = (2 if rows else 0) + len(shown)
    fig, axes = pyplot.subplots(panels, 1, sharex=True, figsize=(8, 3 * panels), squeeze=False)
    axes = list(axes[:, 0])
    if rows:
        _plot_figures(rows, axes.pop(0), axes.pop(0))
    for ax, (name, points) in zip(axes, shown.items(), strict=True):
        ax.plot(*zip(*points, strict=True), marker=".", color="tab:purple")
        ax.set_ylabel(name)
    axes_all = fig.get_axes()
    axes_all[-1].set_xlabel("step")
    if len(metrics) > len(shown):
        note(f"plotted {len(shown)} of {len(metrics)} metrics: {', '.join(shown)}")
    fig.tight_layout()
    root, ext = os.path.splitext(path)
    tmp = f"{root}.mpckpt-plot-{os.getpid()}{ext or '.png'}"  # the suffix tells matplotlib the format
    try:
        fig.savefig(tmp)
        os.replace(tmp, path)
    except (OSError, ValueError) as e:
        raise MpckptError(f"cannot write the plot {path}: {e}") from e
    finally:
        pyplot.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    note(f"wrote {path}")


def _plot_figures(rows: list[dict[str, Any]], times: Any, rate: Any) -> None:
    for key, label in (("blocked_ms", "blocked in save"), ("snapshot_ms", "snapshot"), ("persist_ms", "persist"),
                       ("durable_ms", "save to durable")):
        points = [(r["step"], r[key]) for r in rows if r[key] is not None]
        if points:
            times.plot(*zip(*points, strict=True), marker="o", label=label)
    times.set_ylabel("ms")
    times.legend()
    points = [(r["step"], r["mb_per_s"]) for r in rows if r["mb_per_s"] is not None]
    if points:
        rate.plot(*zip(*points, strict=True), marker="o", color="tab:green")
    rate.set_ylabel("MB/s written")
