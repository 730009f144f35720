"""What ``bench/goodput.py``'s runs add up to: the invariants checked against the uninterrupted run, the tables.

Every figure comes from the ranks' events (``bench/goodput_worker.py``) and from reading back what
storage holds after the run:

- ``wrong``: a restore whose state (every rank's hash) differs from the uninterrupted run's at that
  step, or a stored checkpoint whose full weights differ from it; ``diverged``: a step trained after
  a restore whose hash differs (it would show a restore that was wrong in a way the hash missed);
- ``lost``: a checkpoint committed to storage and then unreadable, missing while retention should
  keep it (fewer than three newer ones are listed), or passed over by a restore that went back past it;
- ``final_exact``: every rank's last state equals the uninterrupted run's at that step, bit for bit;
- ``goodput``: the uninterrupted run's wall time to the final step over this run's (both from their
  first launch: one start-up each).
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter, defaultdict
from typing import Any

PHASES = ("detection", "relaunch", "imports", "group", "build", "open", "restore", "first_step", "first_save")


def final_step(run: dict[str, Any]) -> int | None:
    stopped = [e for e in run["events"] if e["event"] == "stopped" and e["rank"] == 0]
    return stopped[-1]["step"] if stopped else None


def _reference(ref: dict[str, Any]) -> tuple[dict, dict, dict]:
    hashes, full, times = {}, {}, {}
    for e in ref["events"]:
        if e["event"] == "step":
            hashes[(e["rank"], e["step"])] = e["hash"]
            if e["rank"] == 0:
                full[e["step"]], times[e["step"]] = e.get("full"), e["t"]
    return hashes, full, times


def _model_digest(model: dict[str, Any]) -> str:
    from goodput_worker import digest

    return digest(model)


def stored(run: dict[str, Any], full: dict[int, str], read_options: dict[str, Any] | None) -> dict[str, Any]:
    """Read back every checkpoint storage lists; compare its full weights with the uninterrupted run's."""
    import mpckpt

    root, out = run["root"], {"listed": [], "unreadable": [], "wrong": [], "errors": []}
    if run["strategy"] in ("dcp", "torchsave"):
        return _stored_folders(run, full, read_options, out)
    if root.startswith("ctl://"):
        import tests.backends  # noqa: F401
    try:
        with mpckpt.Checkpointer(root, read_only=True, storage_options=read_options) as view:
            out["listed"] = list(view.steps())
    except Exception as e:  # noqa: BLE001 (the root itself unreadable: every commit is lost)
        out["errors"].append(f"open: {type(e).__name__}: {e}"[:300])
        return out
    for step in out["listed"]:
        _judge(step, lambda step=step: mpckpt.load(root, step=step, storage_options=read_options), full, out)
    return out


def _judge(step: int, read: Any, full: dict[int, str], out: dict[str, Any]) -> None:
    """Read committed ``step`` with ``read()``: unreadable, or wrong against the reference's digest."""
    try:
        state = read()
    except Exception as e:  # noqa: BLE001
        out["unreadable"].append(step)
        out["errors"].append(f"step {step}: {type(e).__name__}: {e}"[:300])
        return
    if full.get(step) is not None and _model_digest(state["model"]) != full[step]:
        out["wrong"].append(step)


def _stored_folders(run: dict[str, Any], full: dict[int, str], read_options: dict[str, Any] | None,
                    out: dict[str, Any]) -> dict[str, Any]:
    """DCP's and torch.save's ``ROOT/step_<n>`` folders, through fsspec as the job wrote them."""
    import fsspec
    import torch

    root, strategy = run["root"], run["strategy"]
    options = (read_options or {}) if "://" in root else {}
    fs, base = fsspec.core.url_to_fs(root, **options)
    marker = ".metadata" if strategy == "dcp" else "done"
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)]
    except FileNotFoundError:
        names = []
    for name in sorted(n for n in names if n.startswith("step_") and n[5:].isdigit()):
        step, folder = int(name[5:]), f"{base.rstrip('/')}/{name}"
        if not fs.exists(f"{folder}/{marker}"):
            continue
        out["listed"].append(step)
        if strategy == "dcp":
            def read(url: str = f"{root.rstrip('/')}/{name}") -> Any:
                from torch.distributed.checkpoint import FileSystemReader
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
                from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

                reader = FsspecReader(url, **options) if "://" in url else FileSystemReader(url)
                return _load_state_dict_from_keys(storage_reader=reader)
        else:
            def read(folder: str = folder) -> Any:
                with fs.open(f"{folder}/state.pt", "rb") as f:
                    return torch.load(f, weights_only=True)
        _judge(step, read, full, out)
    return out


def summarize(run: dict[str, Any], ref: dict[str, Any], read_options: dict[str, Any] | None) -> dict[str, Any]:
    hashes, full, times = _reference(ref)
    events = run["events"]
    s: dict[str, Any] = {"strategy": run["strategy"]}
    stopped = {e["rank"]: e for e in events if e["event"] == "stopped"}
    end = stopped.get(0, {}).get("step")
    s["final_step"] = end
    s["final_exact"] = end is not None and len(stopped) == 2 and all(
        stopped[r]["hash"] == hashes.get((r, end)) for r in stopped)
    wall = stopped[0]["t"] - run["launches"][0] if 0 in stopped else None
    ref_wall = times[end] - ref["launch"] if end in times else None
    s["wall_s"], s["ref_wall_s"] = wall, ref_wall
    s["steps_per_s"] = (end + 1) / wall if wall else None
    s["ref_steps_per_s"] = (end + 1) / ref_wall if ref_wall else None
    s["goodput"] = ref_wall / wall if wall and ref_wall else None
    restores = [e for e in events if e["event"] == "restored" and e["step"] is not None]
    s["wrong_restores"] = [(e["rank"], e["step"]) for e in restores if e["hash"] != hashes.get((e["rank"], e["step"]))]
    s["diverged"] = sorted({(e["rank"], e["step"]) for e in events if e["event"] == "step"
                            and (e["rank"], e["step"]) in hashes and e["hash"] != hashes[(e["rank"], e["step"])]})
    commits = [e for e in events if e["event"] == "commit" and e["rank"] == 0]
    durable = [e for e in commits if e["status"] == "committed" and e["mode"] != "memory"]
    s["committed"] = len(durable)
    s["memory_saves"] = sum(1 for e in commits if e["status"] in ("committed", "in_memory") and e["mode"] == "memory")
    s["failed_saves"] = sum(1 for e in commits if e["status"] == "failed")
    s["save_errors"] = sum(1 for e in events if e["event"] == "save_error")
    passed_over = []
    starts = [e for e in events if e["event"] == "restored" and e["rank"] == 0]
    for e in starts:
        newest = max((c["step"] for c in durable if c["t"] < e["t"]), default=None)
        if newest is not None and (e["step"] is None or e["step"] < newest):
            passed_over.append({"restored": e["step"], "newest_commit": newest})
    at_rest = stored(run, full, read_options)
    listed = at_rest["listed"]  # retention keeps the newest three (commits a killed rank never saw included)
    missing = sorted({c["step"] for c in durable if c["step"] not in listed
                      and sum(1 for other in listed if other > c["step"]) < 3})
    s["at_rest"] = at_rest
    s["lost"] = len(passed_over) + len(at_rest["unreadable"]) + len(missing) + (1 if at_rest["errors"] and not
                                                                                 at_rest["listed"] and durable else 0)
    s["lost_detail"] = {"passed_over": passed_over, "unreadable": at_rest["unreadable"], "missing": missing}
    s["wrong"] = len(s["wrong_restores"]) + len(at_rest["wrong"])
    s["hangs"] = run["hangs"]
    s["unplanned"] = len(run["unplanned"])
    s["failures"] = dict(Counter(f["kind"] for f in run["failures"] if not f["skipped"]))
    s["skipped"] = dict(Counter(f["kind"] for f in run["failures"] if f["skipped"]))
    by_kind: dict[str, list] = defaultdict(list)
    for f in run["failures"]:
        if not f["skipped"]:
            by_kind[f["kind"]].append(f)
    s["by_kind"] = {k: {"n": len(fs), "lost_med": _med([f["steps_lost"] for f in fs]),
                        "lost_max": max((f["steps_lost"] or 0) for f in fs),
                        "recovery_med": _med([f["recovery_s"] for f in fs]),
                        "recovery_max": max((f["recovery_s"] for f in fs if f["recovery_s"] is not None), default=None),
                        "sources": dict(Counter(src for f in fs for src in f["sources"])),
                        "breakdown_med": _phases([f.get("breakdown") or {} for f in fs])}
                    for k, fs in sorted(by_kind.items())}
    s["blocked_med"] = _med([e["s"] for e in events if e["event"] == "saved" and e["rank"] == 0])
    s["blocked_max"] = max((e["s"] for e in events if e["event"] == "saved" and e["rank"] == 0), default=None)
    return s


def _phases(breakdowns: list[dict[str, float]]) -> dict[str, float | None]:
    """Each phase's median over the failures that have it."""
    names = [k for k in PHASES if any(k in b for b in breakdowns)]
    return {k: _med([b.get(k) for b in breakdowns]) for k in names}


def _med(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def write(result: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


def _fmt(v: Any, d: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{d}f}"
    return str(v)


def tables(result: dict[str, Any]) -> str:
    lines = [f"\nseed {result['seed']}, storage {result['storage']}, {result['duration_s']:.0f} s of failures per "
             f"strategy; kinds: {', '.join(result['kinds'])}",
             *(f"skipped kind {k}: {why}" for k, why in result.get("skipped_kinds", {}).items()), "",
             "| strategy | wall s | final step | steps/s | goodput | failures | committed | memory saves | save errors "
             "| lost | wrong | diverged | hangs | unplanned ends | final state exact |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for run in result["runs"]:
        s = run["summary"]
        lines.append(f"| {s['strategy']} | {_fmt(s['wall_s'], 0)} | {s['final_step']} | {_fmt(s['steps_per_s'])} | "
                     f"{_fmt(s['goodput'])} | {sum(s['failures'].values())} | {s['committed']} | {s['memory_saves']} | "
                     f"{s['save_errors']} | {s['lost']} | {s['wrong']} | {len(s['diverged'])} | {s['hangs']} | "
                     f"{s['unplanned']} | {'yes' if s['final_exact'] else 'NO'} |")
    ref = result["runs"][0]["summary"] if result["runs"] else None
    if ref:
        lines.append(f"\nthe uninterrupted run: {_fmt(ref['ref_steps_per_s'])} steps/s")
    lines += ["", "| strategy | failure | n | steps lost (median) | (max) | failure to next step s (median) | (max) "
              "| restored from (ranks) |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for run in result["runs"]:
        s = run["summary"]
        for kind, k in s["by_kind"].items():
            src = ", ".join(f"{n} {c}" for n, c in k["sources"].items()) or "-"
            lines.append(f"| {s['strategy']} | {kind} | {k['n']} | {_fmt(k['lost_med'], 0)} | {k['lost_max']} | "
                         f"{_fmt(k['recovery_med'], 1)} | {_fmt(k['recovery_max'], 1)} | {src} |")
    lines += ["", "the failure to the next training step by phase, medians in s (rank 0; `first_save` is the "
              "loop's time in the first save after the restart, after that step):", "",
              "| strategy | failure | " + " | ".join(PHASES) + " |", "|---|---|" + "---:|" * len(PHASES)]
    for run in result["runs"]:
        s = run["summary"]
        for kind, k in s["by_kind"].items():
            b = k.get("breakdown_med") or {}
            if b:
                lines.append(f"| {s['strategy']} | {kind} | " + " | ".join(_fmt(b.get(p)) for p in PHASES) + " |")
    lines += ["", "| strategy | loop blocked in save, median s | (max) |", "|---|---:|---:|"]
    lines += [f"| {r['summary']['strategy']} | {_fmt(r['summary'].get('blocked_med'), 3)} | "
              f"{_fmt(r['summary'].get('blocked_max'), 2)} |" for r in result["runs"]]
    return "\n".join(lines)
