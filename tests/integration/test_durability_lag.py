"""How far durability lags behind saving (issue 20, item 5), with real uploader processes.

Uploads are held at a file gate (``gated_backend``), so saves pile up exactly as on a machine
whose cores training keeps busy: taken, in shared memory, not yet durable. The tests check
what is measured (``durable_ms``, ``waiting``: in the stats, the commit log line and the
manifest), the warning when saves pile up, and the ``uploader_priority`` setting as the
kernel sees it. No duration is asserted, only presence and consistency.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import mpckpt
from mpckpt.catalog import read_manifest
from mpckpt.config import Config
from mpckpt.errors import ConfigError
from mpckpt.format.manifest import checkpoint_name
from mpckpt.storage.local import LocalBackend
from tests.integration.gated_backend import gated_url
from tests.states import filled_state


def _state(step: int) -> dict[str, torch.Tensor]:
    return filled_state(float(step), (4096,))


def _lag_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "durability lags" in r.getMessage()]


def _save_held(ckpt: mpckpt.Checkpointer, gate: os.PathLike[str], steps: range) -> list[mpckpt.SaveFuture]:
    """Save ``steps`` while the gate is shut: all of them wait; then open it and wait for all."""
    try:
        futures = [ckpt.save(step, _state(step), metrics={"loss": 1.0 / (step + 1)}, mode="async") for step in steps]
        waiting = ckpt.stats.waiting
        assert not any(f.done() for f in futures)
    finally:
        os.close(os.open(gate, os.O_CREAT | os.O_WRONLY))  # open the gate (whatever failed: never hold the close)
    ckpt.wait()
    assert waiting == len(steps)
    return futures


def test_lag_and_saves_waiting_are_in_the_stats_the_log_line_and_the_manifest(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mpckpt")
    gate, root = tmp_path / "gate", tmp_path / "root"
    with mpckpt.Checkpointer(gated_url(root), storage_options={"gate": str(gate)}, workers=1) as ckpt:
        futures = _save_held(ckpt, gate, range(4))
        assert ckpt.stats.waiting == 0
        results = [f.result() for f in futures]
        summary = ckpt.stats.as_dict()
    assert summary["waiting"] == 0 and summary["median_durable_ms"] > 0
    backend = LocalBackend(str(root))
    lines = [r.getMessage() for r in caplog.records if "committed step" in r.getMessage()]
    for step, result in enumerate(results):
        stats = result.stats
        # every later save was taken before this one could become durable
        assert stats.waiting == 3 - step and stats.as_dict()["waiting"] == 3 - step
        assert stats.durable_ms >= stats.persist_ms and stats.durable_ms >= stats.snapshot_ms > 0
        assert stats.as_dict()["durable_ms"] == pytest.approx(stats.durable_ms, abs=1e-3)
        figures = read_manifest(backend, checkpoint_name(step)).figures
        assert figures is not None and figures["waiting"] == 3 - step
        # the manifest's figure runs to the manifest's write, the stats' to the commit just after it
        assert figures["persist_ms"] <= figures["durable_ms"] <= stats.durable_ms
        assert figures["durable_ms"] >= figures["snapshot_ms"]
        line = next(line for line in lines if f"committed step {step} " in line)
        waiting = "1 save waiting" if step == 2 else f"{3 - step} saves waiting"
        assert f"durable {stats.durable_ms / 1e3:.2f} s after save, {waiting}" in line, line
    assert not _lag_warnings(caplog)  # 3 waiting is not more than a few


def test_a_pile_of_saves_waiting_warns_once_and_again_only_when_it_doubles(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mpckpt")
    gate, root = tmp_path / "gate", tmp_path / "root"
    with mpckpt.Checkpointer(gated_url(root), storage_options={"gate": str(gate)}, workers=1) as ckpt:
        _save_held(ckpt, gate, range(0, 6))  # step 0 commits with 5 later saves waiting
        warnings = _lag_warnings(caplog)
        assert len(warnings) == 1, warnings
        text = warnings[0]
        assert "step 0 became durable" in text and "5 later saves (up to step 5)" in text
        assert "A crash now loses every step since the newest durable one (step 0)" in text  # what it costs
        for advice in ("uploader_priority='low' or 'normal'", "MPCKPT_UPLOADER_PRIORITY", "workers=",
                       "save less often"):
            assert advice in text  # what to do

        gate.unlink()
        _save_held(ckpt, gate, range(6, 12))  # as bad again: no second warning
        assert len(_lag_warnings(caplog)) == 1

        gate.unlink()
        _save_held(ckpt, gate, range(12, 24))  # 11 waiting: twice as bad, said again
        warnings = _lag_warnings(caplog)
        assert len(warnings) == 2 and "step 12 became durable" in warnings[1] and "11 later saves" in warnings[1]
    assert [r.step for r in ckpt.stats.saves if r.status == "committed"] == list(range(24))


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize(("priority", "idle", "nice_above"), [("idle", True, 10), ("low", False, 10),
                                                             ("normal", False, 0), (None, True, 10)])
def test_uploader_priority_sets_the_uploaders_scheduling_and_nice(tmp_path, priority, idle, nice_above):
    own = os.getpriority(os.PRIO_PROCESS, 0)
    with mpckpt.Checkpointer(tmp_path, workers=2, uploader_priority=priority) as ckpt:
        pids = ckpt.uploader_pids
        assert len(pids) == 2
        for pid in pids:
            assert (os.sched_getscheduler(pid) == os.SCHED_IDLE) is idle, priority
            assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, own + nice_above), priority
        ckpt.save(1, _state(1), mode="sync")  # and they still upload


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_uploader_priority_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MPCKPT_UPLOADER_PRIORITY", "Normal")
    own = os.getpriority(os.PRIO_PROCESS, 0)
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        (pid,) = ckpt.uploader_pids
        assert os.sched_getscheduler(pid) != os.SCHED_IDLE and os.getpriority(os.PRIO_PROCESS, pid) == own
    assert Config.resolve(uploader_priority="low", environ={"MPCKPT_UPLOADER_PRIORITY": "normal"},
                          memory_budget="64MiB").uploader_priority.value == "low"  # the argument wins


@pytest.mark.parametrize(("argument", "environ", "named"), [
    ("fast", {}, "uploader_priority='fast'"),
    (3, {}, "uploader_priority=3"),
    (None, {"MPCKPT_UPLOADER_PRIORITY": "realtime"}, "MPCKPT_UPLOADER_PRIORITY='realtime'"),
])
def test_a_bad_uploader_priority_is_a_config_error_naming_the_setting(tmp_path, argument, environ, named):
    root = tmp_path / "root"
    with pytest.raises(ConfigError) as caught:
        mpckpt.Checkpointer(root, uploader_priority=argument, environ=environ)
    message = str(caught.value)
    assert named in message and "'idle'" in message and "'low'" in message and "'normal'" in message
    assert not root.exists()  # refused before anything is written
