"""Managing checkpoints around a run: read-only browsing, mixed kinds, branching, preemption."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import mpckpt
from mpckpt.checkpoint import Checkpoint
from mpckpt.errors import ConfigError, StateError, StepOrderError
from tests.states import filled_state


def small_state(value: float) -> dict:
    return filled_state(value, (64,), step=int(value))


def test_a_read_only_checkpointer_browses_and_restores_while_another_writes(tmp_path):
    with mpckpt.Checkpointer(tmp_path, workers=1) as writer:
        writer.save(1, small_state(1), mode="sync")
        reader = mpckpt.Checkpointer(tmp_path, read_only=True)  # no writer lock: opens beside the writer
        assert reader.read_only and reader.steps() == [1] and reader.latest_step == 1
        writer.save(2, small_state(2), mode="sync")
        assert reader.steps() == [1, 2]  # looks at the root anew
        state = small_state(0)
        assert reader.restore(state) == 2 and torch.equal(state["w"], torch.full((64,), 2.0))
        assert reader.load(1)["step"] == 1
        for refused in (lambda: reader.save(3, state), lambda: reader.prepare(state),
                        lambda: reader.report({"loss": 1.0}), lambda: reader.should_save(3)):
            with pytest.raises(ConfigError, match="read_only=True.*never saves"):
                refused()
        reader.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_0000000001", "step_0000000002"]
    with pytest.raises(ConfigError, match="read_only=True with keep_last"):
        mpckpt.Checkpointer(tmp_path, read_only=True, keep_last=2)
    with pytest.raises(ConfigError, match="read_only='yes'"):
        mpckpt.Checkpointer(tmp_path, read_only="yes")  # type: ignore[arg-type]


def test_a_read_only_restore_beside_a_writer_whose_retention_deletes(tmp_path):
    with mpckpt.Checkpointer(tmp_path, workers=1, keep_last=1) as writer:
        writer.save(0, small_state(0), mode="sync")
        stop = threading.Event()

        def write() -> None:
            step = 1
            while not stop.is_set():
                writer.save(step, small_state(step), mode="sync")
                step += 1

        thread = threading.Thread(target=write)
        thread.start()
        try:
            with mpckpt.Checkpointer(tmp_path, read_only=True) as reader:
                for _ in range(30):
                    state = small_state(-1)
                    step = reader.restore(state)
                    assert step is not None and state["step"] == step  # always a whole, matching checkpoint
                    assert torch.equal(state["w"], torch.full((64,), float(step)))
        finally:
            stop.set()
            thread.join()


def test_restore_skips_directory_checkpoints_and_says_what_they_are(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    (files / "notes.txt").write_text("hello")
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:
        ckpt.save(1, small_state(1), mode="sync")
        ckpt.report({"loss": 0.5}, checkpoint=Checkpoint.from_directory(files), step=2, mode="sync")
        assert ckpt.latest_step == 2
        state = small_state(0)
        assert ckpt.restore(state) == 1 and state["step"] == 1  # the newest *state*
        with pytest.raises(StateError, match=r"step 2 .* is a directory checkpoint.*checkpoint\(2\)\.to_directory"):
            ckpt.restore(state, step=2)


def test_going_on_from_an_earlier_step(tmp_path):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, small_state(step))
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        state = small_state(0)
        assert ckpt.restore(state, step=3) == 3 and state["step"] == 3
        with pytest.raises(StepOrderError, match=r"step 4 is not after the last saved step 5.*discard_newer=True"):
            ckpt.save(4, state)
        with pytest.raises(ConfigError, match="discard_newer=True needs step="):
            ckpt.restore(state, discard_newer=True)
        assert ckpt.restore(state, step=3, discard_newer=True) == 3
        assert ckpt.steps() == [1, 2, 3] and not (tmp_path / "step_0000000005").exists()
        ckpt.save(4, small_state(40), mode="sync")
    assert mpckpt.load(tmp_path)["step"] == 40


def test_preemption_signals_are_parsed_and_checked(tmp_path):
    from mpckpt._preemption import parse_signals

    assert parse_signals(True) == (signal.SIGTERM,) and parse_signals(False) == ()
    assert parse_signals(["SIGUSR1", "usr2", signal.SIGTERM]) == (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
    for bad, why in ((["SIGNOPE"], "not a signal"), ([signal.SIGKILL], "cannot be caught"), ([], "names no signal"),
                     (3.5, "give True")):
        with pytest.raises(ConfigError, match=why):
            parse_signals(bad)


TRAINER = textwrap.dedent("""
    import signal, sys, time, torch, mpckpt

    def earlier_handler(signum, frame):
        print("earlier handler called", flush=True)

    if __name__ == "__main__":
        signal.signal(signal.SIGTERM, earlier_handler)  # e.g. a framework's own handler
        model = torch.nn.Linear(256, 256)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        state = {"model": model, "optim": opt}
        with mpckpt.Checkpointer(sys.argv[1], trigger=mpckpt.EveryNSteps(10**9), preemption=True) as ckpt:
            print("uploaders", *ckpt.uploader_pids, flush=True)
            for step in range(1, 10**7):
                model(torch.randn(8, 256)).sum().backward()
                opt.step()
                opt.zero_grad()
                stop = ckpt.preempted  # read before save: a signal may arrive at any moment
                saved = ckpt.save(step, state)
                if step == 3:
                    print("ready", flush=True)
                if stop:
                    assert saved is not None and saved.done()  # saved, and committed before save returned
                    print("saved", step, flush=True)
                    print("restarts", ckpt.stats.worker_restarts, flush=True)
                    break
                time.sleep(0.01)  # the scenario: a training step (a signal may come at any moment)
        print("closed", flush=True)
""")


@pytest.mark.parametrize(("signals", "sig", "whole_group"), [
    ("True", signal.SIGTERM, True),            # Kubernetes, SLURM's default: the whole process group
    ("['SIGUSR1']", signal.SIGUSR1, False),    # SLURM --signal=USR1@120 to the trainer alone
])
def test_a_preempted_run_saves_once_more_even_when_the_whole_group_is_signalled(tmp_path, signals, sig, whole_group):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.replace("preemption=True", f"preemption={signals}"))
    root = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as a scheduler's job has
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not any(line.startswith("ready") for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, lines
            lines.append(proc.stdout.readline().strip())
        if whole_group:
            os.killpg(proc.pid, sig)  # the trainer, its uploaders and the fork server alike
        else:
            os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines += out.split("\n")
    assert proc.returncode == 0, lines
    assert ("earlier handler called" in lines) == (sig == signal.SIGTERM) and "closed" in lines
    assert "restarts 0" in lines  # the uploaders lived through the group's SIGTERM
    (saved,) = [int(line.split()[1]) for line in lines if line.startswith("saved ")]
    assert mpckpt.Checkpointer(root, read_only=True).steps() == [saved]
    assert "model" in mpckpt.load(root)


def test_retention_keeps_a_checkpoint_while_this_process_reads_it(tmp_path):
    with mpckpt.Checkpointer(tmp_path, workers=1, keep_last=1) as ckpt:
        ckpt.save(1, small_state(1), mode="sync")
        with ckpt._rt.reading(1):  # what load() and restore() hold while they read step 1
            ckpt.save(2, small_state(2), mode="sync")
            ckpt.wait()
            assert ckpt.steps() == [1, 2] and ckpt.load(1)["step"] == 1  # KeepLast(1) waits for the reader
        ckpt.save(3, small_state(3), mode="sync")
        ckpt.wait()
        assert ckpt.steps() == [3]
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_0000000003"]


def test_discard_newer_lets_a_run_that_got_to_a_step_another_way_save_on(tmp_path):
    """``ckpt.discard_newer(step)``: what a framework's own resume (or a fresh start) needs."""
    root = tmp_path / "run"
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        for step in range(4):
            ckpt.save(step, {"w": torch.full((4,), float(step))})
        assert ckpt.discard_newer(1) == [2, 3]  # waits for the pending saves first
        assert ckpt.steps() == [0, 1]
        ckpt.save(2, {"w": torch.full((4,), 20.0)})  # step 2 again, the new branch's
        with pytest.raises(mpckpt.errors.ConfigError):
            ckpt.discard_newer(-1)
    assert mpckpt.load(root)["w"].tolist() == [20.0] * 4
    assert not (root / "step_0000000003").exists()


def test_discard_newer_keep_moves_the_newer_aside_whole_and_saving_goes_on(tmp_path):
    """``discard_newer(step, keep=True)``: nothing deleted; each newer checkpoint is moved, whole, to
    ``superseded.step_*`` (no longer a checkpoint: ``ls`` says so), and its step is saved again."""
    root = tmp_path / "run"
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        for step in range(4):
            ckpt.save(step, {"w": torch.full((4,), float(step))})
        assert ckpt.discard_newer(1, keep=True) == [2, 3]  # waits for the pending saves first
        assert ckpt.steps() == [0, 1]
        ckpt.save(2, {"w": torch.full((4,), 20.0)})
    assert mpckpt.load(root)["w"].tolist() == [20.0] * 4
    aside = sorted(p.name for p in root.iterdir() if p.name.startswith("superseded."))
    assert [a.split(".")[1] for a in aside] == ["step_0000000002", "step_0000000003"], aside
    for name, value in zip(aside, (2.0, 3.0), strict=True):  # what it held, verified: a copy reads as a checkpoint
        copy = tmp_path / "copies" / name.split(".")[1]
        shutil.copytree(root / name, copy)
        assert mpckpt.load(copy)["w"].tolist() == [value] * 4
    listed = subprocess.run([sys.executable, "-m", "mpckpt.cli", "ls", str(root)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert f"set aside: {aside[0]}/ (a checkpoint a run going on from an older step went back past" in listed.stderr
