"""The long fault campaign: kill uploaders and trainers at random instants, count what happens.

Run ``.venv/bin/python scripts/soak.py --trials 20`` from the repository root. Two campaigns:

- ``uploader``: while several saves of a few-MiB state are in flight (their writes slowed by
  the ``ctl://`` backend's delay rule, to widen the window), one uploader process is SIGKILLed
  at a random instant. Every save must either commit or fail with an ``UploadError`` naming
  its step; no wait may exceed ``--bound-s``; every committed checkpoint must load bit for bit.
- ``trainer``: the training process is SIGKILLed mid-upload (``tests/faults/test_trainer_killed``);
  reopening must find the latest committed checkpoint, verified, with no gap before it.

Prints a summary table and writes it to ``bench/results/soak.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

import mpckpt  # noqa: E402
from mpckpt.errors import UploadError, WaitTimeoutError  # noqa: E402
from tests.backends import ctl_url  # noqa: E402
from tests.conftest import assert_same  # noqa: E402

SAVES_PER_TRIAL = 6


@dataclass
class Tally:
    campaign: str
    trials: int = 0
    faults_injected: int = 0
    saves_committed: int = 0
    saves_failed_cleanly: int = 0
    committed_lost: int = 0
    wrong_returned: int = 0
    hangs: int = 0
    unclear_errors: int = 0
    uploaders_replaced: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def state_for(step: int, mib: int = 4) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + step)
    n = mib * (1 << 20) // 4 // 2
    return {"w": torch.randn(n, generator=g), "m": torch.randn(n, generator=g).to(torch.bfloat16),
            "v": torch.randn(n // 2, generator=g), "step": step}


def _clear(error: BaseException, step: int | None = None) -> bool:
    """An UploadError that names a step (the given one, when known)."""
    if not isinstance(error, UploadError):
        return False
    if step is None:
        return getattr(error, "step", None) is not None and f"step {error.step}" in str(error)
    return f"step {step}" in str(error)


def uploader_trial(trial: int, rng: random.Random, tally: Tally, bound_s: float, *,
                   workdir: str | None = None) -> None:
    """One uploader SIGKILLed at a random instant while saves are in flight."""
    with tempfile.TemporaryDirectory(prefix="mpckpt-soak-", dir=workdir) as tmp:
        root, markers = os.path.join(tmp, "run"), os.path.join(tmp, "m")
        os.makedirs(markers)
        opts = {"delay": {r"step_\d+\..*shard": rng.uniform(0.05, 0.25)}, "marker_dir": markers}
        futures: dict[int, Any] = {}
        errors: list[BaseException] = []
        ckpt = mpckpt.Checkpointer(ctl_url(root), workers=2, memory_budget="64MiB", storage_options=opts,
                                   timeout_s=bound_s)
        victim: dict[str, int] = {}

        def kill() -> None:
            time.sleep(rng.uniform(0.0, 0.8))
            pid = rng.choice(ckpt.uploader_pids)
            try:
                os.kill(pid, signal.SIGKILL)
                victim["pid"] = pid
            except ProcessLookupError:
                pass

        killer = threading.Thread(target=kill, daemon=True)
        try:
            killer.start()
            for step in range(SAVES_PER_TRIAL):
                try:
                    futures[step] = ckpt.save(step, state_for(step))
                except UploadError as e:  # an earlier save's failure surfacing here
                    errors.append(e)
                time.sleep(rng.uniform(0.0, 0.1))
            killer.join()
            try:
                ckpt.wait(timeout_s=bound_s)
            except WaitTimeoutError as e:
                tally.hangs += 1
                tally.notes.append(f"uploader trial {trial}: {e}")
            except UploadError as e:
                errors.append(e)
        finally:
            try:
                ckpt.close()
            except UploadError as e:
                errors.append(e)
            except WaitTimeoutError as e:
                tally.hangs += 1
                tally.notes.append(f"uploader trial {trial}: close: {e}")
        tally.faults_injected += "pid" in victim
        tally.uploaders_replaced += ckpt.stats.worker_restarts
        for e in errors:
            if not _clear(e):
                tally.unclear_errors += 1
                tally.notes.append(f"uploader trial {trial}: unclear error {type(e).__name__}: {e}")
        committed_steps = set()
        for step, fut in futures.items():
            if not fut.done():
                tally.hangs += 1
                tally.notes.append(f"uploader trial {trial}: step {step} never resolved")
                continue
            exc = fut.exception(0)
            if exc is None:
                tally.saves_committed += 1
                committed_steps.add(step)
            elif _clear(exc, step):
                tally.saves_failed_cleanly += 1
            else:
                tally.unclear_errors += 1
                tally.notes.append(f"uploader trial {trial}: step {step}: {type(exc).__name__}: {exc}")
        with mpckpt.Checkpointer(root, workers=1) as again:
            on_storage = set(again.steps())
        tally.committed_lost += len(committed_steps - on_storage)
        for step in sorted(committed_steps & on_storage):
            try:
                assert_same(state_for(step), mpckpt.load(root, step=step))
            except (AssertionError, mpckpt.errors.MpckptError) as e:
                tally.wrong_returned += 1
                tally.notes.append(f"uploader trial {trial}: step {step} loads wrong: {type(e).__name__}: {e}")


def trainer_trial(trial: int, rng: random.Random, tally: Tally) -> None:
    """The training process SIGKILLed mid-upload, then reopened (twice, like the CI test)."""
    from tests.faults.test_trainer_killed import check_recovery, kill_trainer_mid_upload

    with tempfile.TemporaryDirectory(prefix="mpckpt-soak-") as tmp:
        root, markers = os.path.join(tmp, "run"), os.path.join(tmp, "m")
        os.makedirs(markers)
        previous = -1
        for _ in range(2):
            try:
                pid = kill_trainer_mid_upload(root, markers, rng)
            except AssertionError as e:
                tally.notes.append(f"trainer trial {trial}: {e}")
                tally.hangs += 1
                continue
            tally.faults_injected += 1
            try:
                latest = check_recovery(root, pid)
            except AssertionError as e:
                tally.wrong_returned += 1
                tally.notes.append(f"trainer trial {trial}: recovery: {e}")
                continue
            with mpckpt.Checkpointer(root, workers=1) as again:
                steps = again.steps()
            # the trainer saves 0, 1, 2, ... and resumes at latest + 1: committed steps have no gaps
            gaps = sorted(set(range(latest + 1)) - set(steps))
            if gaps or latest < previous:
                tally.committed_lost += len(gaps) + (latest < previous)
                tally.notes.append(f"trainer trial {trial}: steps {steps}, latest {latest} after {previous}")
            tally.saves_committed += latest - previous
            previous = max(previous, latest)


def run(campaign: str, trials: int, seed: int, bound_s: float) -> Tally:
    tally = Tally(campaign)
    start = time.monotonic()
    for trial in range(trials):
        rng = random.Random(seed * 1000 + trial)
        if campaign == "uploader":
            uploader_trial(trial, rng, tally, bound_s)
        else:
            trainer_trial(trial, rng, tally)
        tally.trials += 1
        print(f"  {campaign} trial {trial + 1}/{trials} done ({time.monotonic() - start:.0f} s)", flush=True)
    tally.seconds = round(time.monotonic() - start, 1)
    return tally


COLUMNS = ["campaign", "trials", "faults_injected", "saves_committed", "saves_failed_cleanly", "committed_lost",
           "wrong_returned", "hangs", "unclear_errors", "uploaders_replaced", "seconds"]


def table(tallies: list[Tally]) -> str:
    rows = [COLUMNS] + [[str(getattr(t, c)) for c in COLUMNS] for t in tallies]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="trials of each campaign (default 20)")
    parser.add_argument("--uploader-trials", type=int, default=None)
    parser.add_argument("--trainer-trials", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bound-s", type=float, default=60.0, help="the longest any wait may take")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "soak.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("MPCKPT_PROGRESS", "0")
    tallies = [
        run("uploader", args.trials if args.uploader_trials is None else args.uploader_trials, args.seed, args.bound_s),
        run("trainer", args.trials if args.trainer_trials is None else args.trainer_trials, args.seed, args.bound_s),
    ]
    print(table(tallies))
    for t in tallies:
        for note in t.notes:
            print(f"note: {note}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"tallies": [asdict(t) for t in tallies], "seed": args.seed, "bound_s": args.bound_s,
                   "saves_per_uploader_trial": SAVES_PER_TRIAL, "when": time.strftime("%Y-%m-%dT%H:%M:%S")},
                  f, indent=2)
    bad = sum(t.committed_lost + t.wrong_returned + t.hangs + t.unclear_errors for t in tallies)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
