"""The short form of the chaos run (``bench/goodput.py``): a 2-node FSDP2 job with ``mode="memory"`` saves every
step, storage (S3 on moto, behind the fault proxy) every 10 and peer copies, under a fixed seed's
four failures, one of each kind (the schedule's first block): a node lost, a preemption (SIGTERM), an uploader
SIGKILLed, an S3 outage.

Only the invariants are asserted, never a duration: no committed checkpoint lost, no wrong state restored or
stored, no step that diverged from the uninterrupted run, no hang (every wait bounded), no job that ended
unasked, and the final state of every rank equal to the uninterrupted run's bit for bit. Skipped, with the
reason, where namespaces are refused (``harness.nodes``) or moto is not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.nodes import REPO, namespaces_unavailable

if (_why := namespaces_unavailable()) is not None:
    pytest.skip(_why, allow_module_level=True)
pytest.importorskip("moto.server", reason="moto[server] is not installed; run `bash scripts/setup.sh --test`")

SEED = 7
KINDS = "node_loss,preempt,uploader_kill,storage_outage"  # rank_kill: the bench (a node loss kills a rank too)
BOUND_S = 600  # the whole run, start-ups and the uninterrupted run included (each wait inside is bounded too)


def test_short_chaos_run_loses_nothing_and_ends_as_the_uninterrupted_run(tmp_path: Path) -> None:
    out = tmp_path / "goodput.json"
    cmd = [sys.executable, str(REPO / "bench" / "goodput.py"), "--failures", "4", "--duration", "300", "--seed",
           str(SEED), "--strategies", "peer", "--kinds", KINDS, "--gap-s", "2,3", "--window-s", "2,3", "--hang-s", "90",
           "--reference-step-ms", "0",
           "--work", str(tmp_path / "work"), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=BOUND_S, cwd=REPO)
    assert done.returncode == 0, f"goodput.py failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    result = json.loads(out.read_text())
    run = result["runs"][0]
    s = run["summary"]
    report = f"{done.stdout}\nfailures: {json.dumps(run['failures'], indent=1)[-4000:]}"
    assert s["failures"] == {kind: 1 for kind in KINDS.split(",")}, report  # one of each, as the seed draws them
    assert s["lost"] == 0, f"{s['lost_detail']}\n{report}"
    assert s["wrong"] == 0, f"{s['wrong_restores']} {s['at_rest']}\n{report}"
    assert s["diverged"] == [], report
    assert s["hangs"] == 0, "\n".join(u["logs"] for u in run["unplanned"])[-6000:]
    assert s["unplanned"] == 0, "\n".join(u["logs"] for u in run["unplanned"])[-6000:]
    assert s["final_exact"], report
    assert s["committed"] > 0, report
