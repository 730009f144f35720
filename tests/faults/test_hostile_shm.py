"""Foreign and hostile neighbours in /dev/shm: the reaper removes the memory of dead owners only.

The issue: a Checkpointer opened in another PID namespace that shares /dev/shm (a sidecar
container, ``--ipc=host``) judged a live trainer dead by its pid and unlinked its slabs, so
every later save of that trainer failed. Liveness is now the owner file's flock (``_shm``).

- A live trainer in another PID namespace, its pid there unused here: a Checkpointer opened
  here and ``mpckpt gc`` leave its memory alone, it saves again, its checkpoints load; once it
  is SIGKILLed the next reaper removes its segments and owner file.
- The same from the sidecar's side: the reaper runs in a new PID namespace, the trainer here.
- Pid reuse: a dead trainer whose pid (in its namespace) is the pid of a live process here,
  this one, is reaped all the same.
- A SIGKILLed trainer: its segments and owner file go at the next open, or with ``mpckpt gc``.
- A fork child does not inherit ownership: it does not keep its dead parent's memory alive.
- An owner file being created (empty, unlocked) is left alone; one left empty long ago goes.
- A process's reaper never takes its own live segments (flock conflicts within one process
  too); unlinking its last segment removes its owner file.
- Planted entries are never touched nor followed: symlinks named like a segment or an owner
  file (the victim is unchanged, the link stays, an uploader does not map through one),
  near-miss names, directories named like segments (which must not make the open fail).
- Segments of an older mpckpt (no owner file) go only when no process is seen to use them.
- Uploaders refuse to map a segment shorter than the job says (no SIGBUS).

Without ``unshare`` (util-linux, root) the other namespace is simulated: the trainer names its
segments with a pid that is not its own.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import mpckpt
from mpckpt._system import shm as _shm
from mpckpt.cli import main
from tests.states import filled_state

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOUND_S = 120.0  # the longest any step may take on a loaded 2-core machine; never a measurement

TRAINER = r'''
import json, os, sys, types
import torch
import mpckpt
from mpckpt._system import shm as _shm
from mpckpt.cli import main

fake_pid = int(sys.argv[2])
if fake_pid:  # no PID namespace to be had: name the segments as a process of another one would
    shim = types.ModuleType("os")
    shim.__dict__.update(os.__dict__)
    shim.getpid = lambda: fake_pid
    _shm.os = shim

def state(step):
    return {"w": torch.full((128, 128), float(step)), "step": step}

def report(event, step):
    if hasattr(_shm, "segments_of_this_process"):
        mine = _shm.segments_of_this_process()
    else:  # an mpckpt before owner files (the tests must fail there, not crash)
        mine = [n for n in _shm.list_segments() if n.startswith(f"mpckpt-{_shm.os.getpid()}-")]
    owners = sorted({n.rsplit("-", 1)[0] + ".owner" for n in mine})
    owners = [n for n in owners if os.path.lexists(os.path.join(_shm.SHM_DIR, n))]
    print(json.dumps({"event": event, "step": step, "pid": os.getpid(), "segments": mine, "owners": owners}),
          flush=True)

with mpckpt.Checkpointer(sys.argv[1], workers=1) as ckpt:
    step = 0
    ckpt.save(step, state(step))
    ckpt.wait()
    report("ready", step)
    for line in sys.stdin:
        if line.strip() == "save":
            step += 1
            try:
                ckpt.save(step, state(step))
                ckpt.wait()
            except Exception as e:
                print(json.dumps({"event": "failed", "step": step, "error": repr(e)}), flush=True)
                continue
            report("saved", step)
        elif line.strip() == "exit":
            break
print(json.dumps({"event": "closed"}), flush=True)
'''

# pid 1 of a new PID namespace: the trainer it starts gets the pid asked for (ns_last_pid)
LAUNCHER = r'''
import subprocess, sys
want = int(sys.argv[1])
if want > 1:
    try:
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(want - 1))
    except OSError:
        pass
sys.exit(subprocess.call(sys.argv[2:]))
'''

REAPER = r'''
import sys
import mpckpt
from mpckpt.cli import main
with mpckpt.Checkpointer(sys.argv[1], workers=1):
    pass
sys.exit(main(["gc"]))
'''


def state(step: int) -> dict[str, Any]:
    return filled_state(float(step), (128, 128), step=step)  # (TRAINER's own, in its process)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPCKPT_")}
    return {**env, "PYTHONPATH": REPO, "MPCKPT_PROGRESS": "0"}


@functools.cache
def _unshare() -> list[str] | None:
    """The command prefix that runs a process in a new PID namespace, or None if not allowed here."""
    tool = shutil.which("unshare")
    if tool is None or not sys.platform.startswith("linux"):
        return None
    cmd = [tool, "--pid", "--fork", "--mount-proc"]
    try:
        done = subprocess.run([*cmd, sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return cmd if done.returncode == 0 and done.stdout.strip() == "1" else None


def _unused_pid() -> int:
    """A pid no process has here and none will get soon: below the last one handed out."""
    taken = set(psutil.pids())
    try:
        with open("/proc/sys/kernel/ns_last_pid") as f:
            last = int(f.read())
    except OSError:
        last = max(taken)
    return next(p for p in range(last - 1, 300, -1) if p not in taken)


def _path(name: str) -> str:
    return os.path.join(_shm.SHM_DIR, name)


def _exists(name: str) -> bool:
    return os.path.lexists(_path(name))


class Trainer:
    """A real training process, here or in a new PID namespace, driven line by line."""

    def __init__(self, root: Path, tmp: Path, *, ns_pid: int | None = None, here: bool = False) -> None:
        script = tmp / "trainer.py"
        script.write_text(TRAINER)
        self.in_namespace = not here and _unshare() is not None
        trainer = [sys.executable, str(script), str(root)]
        if self.in_namespace:
            launcher = tmp / "launcher.py"
            launcher.write_text(LAUNCHER)
            cmd = [*(_unshare() or []), sys.executable, str(launcher), str(ns_pid or 0), *trainer, "0"]
        else:
            cmd = [*trainer, str(0 if here else ns_pid or _unused_pid())]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def event(self) -> dict[str, Any]:
        deadline = time.monotonic() + BOUND_S
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the trainer said nothing for {BOUND_S:.0f}s") from None
            if line is None:
                raise AssertionError(f"the trainer ended (status {self.proc.wait(BOUND_S)}) without answering")
            if line.startswith("{"):
                return dict(json.loads(line))

    def tell(self, word: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()
        return self.event()

    def sigkill(self) -> None:
        """SIGKILL the training process itself (found in our namespace by its pid in its own)."""
        target = self.proc.pid
        if self.in_namespace:
            target = self._host_pid()
        os.kill(target, signal.SIGKILL)
        self.proc.wait(BOUND_S)  # with it its namespace ends: every process of it is gone

    def _host_pid(self) -> int:
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                with open(f"/proc/{child.pid}/status") as f:
                    nspid = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
            except (OSError, StopIteration):
                continue
            if len(nspid) > 1 and int(nspid[-1]) == self.pid:
                return child.pid
        raise AssertionError(f"no process with pid {self.pid} in the trainer's namespace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # unshare: its namespace's pid 1 goes with it, and so does the rest
            self.proc.wait(BOUND_S)

    def start(self) -> dict[str, Any]:
        ready = self.event()
        assert ready["event"] == "ready", ready
        assert ready["segments"], "the trainer made no shared memory"
        self.pid = int(ready["pid"])
        return ready


def _reap_here(tmp: Path) -> None:
    """What the issue's sidecar did: open a Checkpointer (it reaps), then run ``mpckpt gc``."""
    with mpckpt.Checkpointer(tmp / f"elsewhere-{secrets.token_hex(4)}", workers=1) as ckpt:
        ckpt.save(0, {"x": torch.ones(8)})
    _gc()


def _gc() -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "mpckpt.cli", "gc"], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=BOUND_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _its_memory(report: dict[str, Any]) -> list[str]:
    return [*report["segments"], *report["owners"]]


# -- owners in other PID namespaces ----------------------------------------------------------------

def test_a_live_trainer_in_another_pid_namespace_keeps_its_memory_until_it_dies(tmp_path):
    root = tmp_path / "run"
    trainer = Trainer(root, tmp_path, ns_pid=_unused_pid())
    try:
        ready = trainer.start()
        assert not psutil.pid_exists(trainer.pid) or not trainer.in_namespace, "its pid must mean nothing here"
        _reap_here(tmp_path)
        gone = [n for n in _its_memory(ready) if not _exists(n)]
        assert not gone, f"the shared memory of a live trainer was removed: {gone}"
        assert ready["owners"], "no owner file"
        saved = trainer.tell("save")
        assert saved["event"] == "saved", saved
        assert trainer.tell("save")["event"] == "saved"
        after = trainer.tell("save")
        assert after["event"] == "saved", after
        trainer.sigkill()
    finally:
        trainer.close()
    _reap_here(tmp_path)
    left = [n for n in _its_memory(ready) + _its_memory(after) if _exists(n)]
    assert not left, f"a SIGKILLed trainer's shared memory survived the reaper: {left}"
    for step in range(4):
        assert torch.equal(mpckpt.load(root, step)["w"], state(step)["w"])


def test_a_sidecar_in_another_pid_namespace_leaves_a_live_trainer_alone(tmp_path):
    unshare = _unshare()
    if unshare is None:
        pytest.skip("needs unshare --pid (util-linux, root) to run the reaper in another PID namespace")
    root = tmp_path / "run"
    trainer = Trainer(root, tmp_path, here=True)
    try:
        ready = trainer.start()
        script = tmp_path / "reaper.py"
        script.write_text(REAPER)
        sidecar = subprocess.run([*unshare, sys.executable, str(script), str(tmp_path / "sidecar")], cwd=REPO,
                                 env=_env(), capture_output=True, text=True, timeout=BOUND_S)
        assert sidecar.returncode == 0, sidecar.stderr[-3000:]
        gone = [n for n in _its_memory(ready) if not _exists(n)]
        assert not gone, f"the sidecar removed the shared memory of a live trainer: {gone}"
        assert trainer.tell("save")["event"] == "saved"
        assert trainer.tell("exit")["event"] == "closed"
        assert trainer.proc.wait(BOUND_S) == 0
    finally:
        trainer.close()
    assert [mpckpt.load(root, s)["step"] for s in (0, 1)] == [0, 1]
    assert not [n for n in _its_memory(ready) if _exists(n)], "a closed trainer left shared memory behind"


def test_a_dead_trainer_whose_pid_a_live_process_has_here_is_reaped(tmp_path):
    trainer = Trainer(tmp_path / "run", tmp_path, ns_pid=os.getpid())
    try:
        ready = trainer.start()
        assert all(n.startswith(f"mpckpt-{os.getpid()}-") for n in _its_memory(ready)), ready
        trainer.sigkill()
    finally:
        trainer.close()
    assert psutil.pid_exists(os.getpid())  # the same pid number, alive and older than the segments
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:
        assert ckpt.latest_step == 0
    left = [n for n in _its_memory(ready) if _exists(n)]
    assert not left, f"pid reuse kept a dead trainer's memory: {left}"


def test_this_processs_own_segments_survive_its_own_reaper():
    # flock, unlike fcntl record locks, conflicts between two descriptions in one process too
    seg = _shm.Segment.create(4096)
    try:
        assert _shm.reap_orphans() == []
        assert _shm.segments_of_this_process() == [seg.name]
        owner = seg.name.rsplit("-", 1)[0] + ".owner"
        assert _exists(seg.name) and _exists(owner)
    finally:
        seg.close()
        seg.unlink()
    assert not _exists(seg.name) and not _exists(owner), "the last segment's unlink lets go of the owner file"


# -- dead owners ------------------------------------------------------------------------------------

@pytest.mark.parametrize("reaper", ["open", "gc"])
@pytest.mark.alone  # its gc must be the one that removes the dead trainer's memory
def test_a_sigkilled_trainers_memory_goes_at_the_next_open_or_gc(tmp_path, reaper):
    trainer = Trainer(tmp_path / "run", tmp_path, here=True)
    try:
        ready = trainer.start()
        pid = trainer.proc.pid
        owners = [n for n in os.listdir(_shm.SHM_DIR) if n.startswith(f"mpckpt-{pid}-") and n.endswith(".owner")]
        assert owners, "the trainer holds no owner file"
        trainer.sigkill()
    finally:
        trainer.close()
    if reaper == "open":
        with mpckpt.Checkpointer(tmp_path / "run", workers=1):
            pass
    else:
        out = _gc().stdout
        assert all(f"removed orphaned shared memory {n}" in out for n in ready["segments"]), out
    left = [n for n in os.listdir(_shm.SHM_DIR) if n.startswith(f"mpckpt-{pid}-")]
    assert not left, f"left behind by a dead trainer: {left}"


FORKER = r'''
import json, os, sys, time
from mpckpt._system import shm as _shm
from mpckpt.cli import main
seg = _shm.Segment.create(4096)
owner = seg.name.rsplit("-", 1)[0] + ".owner"
r, w = os.pipe()
child = os.fork()
if child == 0:
    mine = _shm.segments_of_this_process() if hasattr(_shm, "segments_of_this_process") else None
    os.write(w, json.dumps({"child": os.getpid(), "mine": mine}).encode() + b"\n")
    time.sleep(600)  # until the test kills it
    os._exit(0)
said = json.loads(os.fdopen(r).readline())
print(json.dumps({**said, "segment": seg.name, "owner": owner}), flush=True)
time.sleep(600)  # until the test kills it
'''


def test_a_fork_child_does_not_keep_its_dead_parents_memory(tmp_path):
    script = tmp_path / "forker.py"
    script.write_text(FORKER)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=_env(), stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert proc.stdout is not None
        said = json.loads(proc.stdout.readline())
        child = int(said["child"])
        assert said["mine"] == [], "a fork child must own none of its parent's segments"
        assert _exists(said["segment"]) and _exists(said["owner"])
        proc.kill()
        proc.wait(BOUND_S)
        assert psutil.pid_exists(child)  # alive, holding a copy of every descriptor it had at the fork
        removed = _shm.reap_orphans()
        assert said["segment"] in removed
        assert not _exists(said["segment"]) and not _exists(said["owner"])
    finally:
        proc.kill()
        proc.wait(BOUND_S)
        if child is not None:
            os.kill(child, signal.SIGKILL)


def test_an_owner_file_being_created_is_left_alone_and_one_abandoned_long_ago_goes():
    prefix = f"mpckpt-{_unused_pid()}-{secrets.token_hex(16)}"
    owner, segment = _path(prefix + ".owner"), _path(f"{prefix}-{secrets.token_hex(16)}")
    try:
        with open(owner, "x"):  # empty and unlocked: its creator has not taken the lock yet
            pass
        with open(segment, "wb") as f:
            f.write(b"\0" * 4096)
        _shm.reap_orphans()
        assert os.path.exists(owner) and os.path.exists(segment)
        long_ago = time.time() - 86400  # a day: far beyond any creator's pause between open and flock
        os.utime(owner, (long_ago, long_ago))
        _shm.reap_orphans()
        assert not os.path.exists(owner) and not os.path.exists(segment)
    finally:
        for path in (owner, segment):
            if os.path.lexists(path):
                os.unlink(path)


# -- hostile entries -------------------------------------------------------------------------------

def _plant_dead_owner(prefix: str) -> str:
    """An owner file whose owner died: filled, unlocked."""
    with open(_path(prefix + ".owner"), "x") as f:
        f.write("mpckpt owner file of a process that died\n")
    return prefix + ".owner"


def test_symlinks_named_like_segments_or_owner_files_are_never_followed_nor_touched(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    victim.chmod(0o644)
    fake_owner = tmp_path / "fake-owner"  # what a followed owner-file link would lock and judge dead
    fake_owner.write_text("mpckpt owner file of a process that died\n")
    before = {p: (p.read_bytes(), os.stat(p)) for p in (victim, fake_owner)}
    pid = _unused_pid()
    dead, linked = f"mpckpt-{pid}-{secrets.token_hex(16)}", f"mpckpt-{pid}-{secrets.token_hex(16)}"
    links = {
        f"mpckpt-{pid}-{secrets.token_hex(16)}": victim,                   # an older mpckpt's segment name
        f"{dead}-{secrets.token_hex(16)}": victim,                         # a segment of a dead owner
        f"{linked}.owner": fake_owner,                                     # an owner file
        f"mpckpt-{pid}-{secrets.token_hex(16)}.owner": victim,
    }
    planted = [*links, _plant_dead_owner(dead), f"{linked}-{secrets.token_hex(16)}"]
    try:
        for name, target in links.items():
            os.symlink(target, _path(name))
        with open(_path(planted[-1]), "wb") as f:  # a real segment behind the linked owner file
            f.write(b"\0" * 4096)
        _reap_here(tmp_path)
        for name in links:
            assert os.path.islink(_path(name)), f"{name} was removed"
        assert _exists(planted[-1]), "a link named like an owner file was followed"
        for p, (data, st) in before.items():
            now = os.stat(p)
            assert p.read_bytes() == data and (now.st_mode, now.st_mtime_ns, now.st_ino) == \
                (st.st_mode, st.st_mtime_ns, st.st_ino), p
        assert not _exists(planted[-2]), "the dead owner beside the links was not reaped"
        link = next(n for n in links if n.startswith(dead))
        with pytest.raises(OSError) as info:  # and an uploader told to map one does not follow it either
            _shm.Segment.attach(link, len(b"precious"))
        assert info.value.errno == errno.ELOOP
    finally:
        for name in planted:
            if _exists(name):
                os.unlink(_path(name))


def test_near_miss_names_and_directories_are_left_alone_and_do_not_break_the_open(tmp_path):
    pid, hex32 = _unused_pid(), secrets.token_hex(16)
    dead = f"mpckpt-{pid}-{secrets.token_hex(16)}"
    files = [f"mpckpt-{pid}-{hex32}\n", f"mpckpt-{pid}-{hex32[:31]}", f"mpckpt-{pid}-{hex32.upper()}",
             f"mpckpt-{pid}-{hex32}-{hex32[:31]}", f"mpckpt-{pid}-{hex32}-{hex32}.bak", f"Mpckpt-{pid}-{hex32}",
             f"xmpckpt-{pid}-{hex32}", f"mpckpt-{pid}-{hex32}.owner~", f"{dead}-{hex32}\n",
             "mpckpt-" + "".join(chr(0x0660 + int(d)) for d in str(pid)) + f"-{hex32}",  # Arabic-Indic digits
             f"mpckpt--{hex32}", f"mpckpt-{pid}-{hex32}-"]
    dirs = [f"mpckpt-{pid}-{secrets.token_hex(16)}", f"{dead}-{secrets.token_hex(16)}"]
    planted = [*files, *dirs, _plant_dead_owner(dead)]
    try:
        for name in files:
            with open(_path(name), "x") as f:
                f.write("not yours")
        for name in dirs:
            os.mkdir(_path(name))
        _reap_here(tmp_path)  # a Checkpointer opens and gc succeeds beside them
        assert _shm.reap_orphans() == []
        for name in files:
            assert os.path.isfile(_path(name)), f"{name!r} was removed"
        for name in dirs:
            assert os.path.isdir(_path(name)), f"{name!r} was removed"
        assert not _exists(planted[-1]), "the dead owner beside them was not reaped"
    finally:
        for name in planted:
            if os.path.isdir(_path(name)) and not os.path.islink(_path(name)):
                os.rmdir(_path(name))
            elif _exists(name):
                os.unlink(_path(name))


def test_an_uploader_refuses_a_segment_shorter_than_the_job_says():
    name = f"mpckpt-{_unused_pid()}-{secrets.token_hex(16)}-{secrets.token_hex(16)}"
    with open(_path(name), "x") as f:
        f.write("short")
    try:
        with pytest.raises(OSError, match="at least 8192 bytes"):
            _shm.Segment.attach(name, 8192)  # a mapping past the end would SIGBUS at the first read
    finally:
        os.unlink(_path(name))


# -- segments of an older mpckpt ---------------------------------------------------------------------

OLD_TRAINER = r'''
import mmap, os, sys
import _posixshmem
name = sys.argv[1]
fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
os.ftruncate(fd, 4096)
mm = mmap.mmap(fd, 4096)
os.close(fd)
print("ready", flush=True)
sys.stdin.read()
'''


def test_an_older_mpckpts_segment_in_use_is_never_removed(tmp_path):
    # named with a pid unused here, as a live trainer of an older mpckpt in another namespace would be
    name = f"mpckpt-{_unused_pid()}-{secrets.token_hex(16)}"
    script = tmp_path / "old.py"
    script.write_text(OLD_TRAINER)
    proc = subprocess.Popen([sys.executable, str(script), name], env=_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        _reap_here(tmp_path)
        assert os.path.isfile(_path(name)), "an older mpckpt's segment in use was removed"
        used = _shm.files_used_by(proc.pid)
        st = os.stat(_path(name))
        assert used is not None and (st.st_dev, st.st_ino) in used, "its mapping was not seen"
    finally:
        proc.kill()
        proc.wait(BOUND_S)
        if _exists(name):
            os.unlink(_path(name))


def test_an_older_mpckpts_unused_segment_goes_only_when_every_process_can_be_seen(monkeypatch, capsys):
    name = f"mpckpt-{_unused_pid()}-{secrets.token_hex(16)}"
    with open(_path(name), "x") as f:
        f.write("x" * 4096)
    st = os.stat(_path(name))
    try:
        undecided: list[str] = []
        monkeypatch.setattr(_shm, "_files_in_use", lambda: None)  # cannot see every process
        assert _shm.reap_orphans(undecided=undecided) == [] and undecided == [name]
        assert os.path.isfile(_path(name))
        assert main(["gc"]) == 0
        assert f"left shared memory {name} alone" in capsys.readouterr().err
        assert os.path.isfile(_path(name))
        monkeypatch.setattr(_shm, "_files_in_use", lambda: {(st.st_dev, st.st_ino)})  # seen in use
        assert _shm.reap_orphans() == [] and os.path.isfile(_path(name))
        monkeypatch.setattr(_shm, "_files_in_use", set)  # seen: nobody uses it
        assert _shm.reap_orphans() == [name]
        assert not _exists(name)
    finally:
        if _exists(name):
            os.unlink(_path(name))
