"""``mpckpt stats ROOT [--json] [--plot FILE.png]``: what each save cost, from its manifest.

Per committed step: how long the training loop was blocked in ``save``, the snapshot (the
copy into shared memory), the time from the end of the snapshot until the manifest was
written (persist), the bytes of the state and the bytes written, and MB/s (bytes written per
second of persist): the figures the committer recorded in the manifest (``Manifest.figures``).
A checkpoint written by an mpckpt that did not record them says "not recorded"; blocked is
not recorded for a save that waited for its own commit (``mode=SYNC``).

``--plot`` draws the same figures with matplotlib, an optional dependency (``pip install
matplotlib``); without it the command says so and writes nothing. Damaged steps are listed
and make the status 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

from mpckpt.cli._common import backend_for, complain, iso_time, say, say_json, scan_root
from mpckpt.errors import ConfigError, MpckptError
from mpckpt.format.manifest import FIGURES, Manifest

_NOT_RECORDED = "not recorded"


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
        _plot(pyplot, rows, args.plot, note=complain if args.json else say)
    return 1 if problems else 0


def figures_row(m: Manifest) -> dict[str, Any]:
    """One step's figures; each None where the manifest does not have it."""
    figures: dict[str, Any] = dict(m.figures) if m.figures is not None else dict.fromkeys(FIGURES)
    persist, written = figures.get("persist_ms"), figures.get("written_bytes")
    mb_per_s = round(written / 1e6 / (persist / 1e3), 1) if persist and written is not None else None
    return {"step": m.step, "time": iso_time(m.created_unix), "kind": m.kind, "recorded": m.figures is not None,
            **figures, "mb_per_s": mb_per_s}


def _cell(value: Any, fmt: str) -> str:
    """``value`` formatted, or a dash as wide (``fmt``: width.precision f)."""
    return format(value, fmt) if value is not None else "-".rjust(int(fmt.split(".")[0] or 0))


def _say_table(rows: list[dict[str, Any]]) -> None:
    say(f"{'STEP':>10}  {'TIME':<25}  {'BLOCKED ms':>10}  {'SNAPSHOT ms':>11}  {'PERSIST ms':>10}  "
        f"{'STATE MiB':>10}  {'WRITTEN MiB':>11}  {'MB/s':>8}")
    for r in rows:
        if not r["recorded"]:
            say(f"{r['step']:>10}  {r['time']:<25}  {_NOT_RECORDED} (written by an mpckpt that did not keep "
                "a save's figures in its manifest)")
            continue
        state = None if r["bytes"] is None else r["bytes"] / 2**20
        written = None if r["written_bytes"] is None else r["written_bytes"] / 2**20
        say(f"{r['step']:>10}  {r['time']:<25}  {_cell(r['blocked_ms'], '10.1f')}  {_cell(r['snapshot_ms'], '11.1f')}  "
            f"{_cell(r['persist_ms'], '10.1f')}  {_cell(state, '10.1f')}  {_cell(written, '11.1f')}  "
            f"{_cell(r['mb_per_s'], '8.1f')}")
    recorded = [r for r in rows if r["recorded"]]
    if recorded:
        medians = {key: _median(recorded, key) for key in ("blocked_ms", "persist_ms", "mb_per_s")}
        say(f"{len(recorded)} of {len(rows)} steps recorded; median blocked {_cell(medians['blocked_ms'], '.1f')} ms, "
            f"persist {_cell(medians['persist_ms'], '.1f')} ms, {_cell(medians['mb_per_s'], '.1f')} MB/s")
    if any(r["recorded"] and r["blocked_ms"] is None for r in rows):
        say("blocked '-': the save had not returned when its manifest was written (mode=SYNC waits for it)")


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


def _plot(pyplot: Any, rows: list[dict[str, Any]], path: str, *, note: Callable[[str], None]) -> None:
    rows = [r for r in rows if r["recorded"]]
    if not rows:
        note(f"no step has recorded figures; {path} not written")
        return
    fig, (times, rate) = pyplot.subplots(2, 1, sharex=True, figsize=(8, 6))
    for key, label in (("blocked_ms", "blocked in save"), ("snapshot_ms", "snapshot"), ("persist_ms", "persist")):
        points = [(r["step"], r[key]) for r in rows if r[key] is not None]
        if points:
            times.plot(*zip(*points, strict=True), marker="o", label=label)
    times.set_ylabel("ms")
    times.legend()
    points = [(r["step"], r["mb_per_s"]) for r in rows if r["mb_per_s"] is not None]
    if points:
        rate.plot(*zip(*points, strict=True), marker="o", color="tab:green")
    rate.set_ylabel("MB/s written")
    rate.set_xlabel("step")
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
