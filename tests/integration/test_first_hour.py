"""What a new user meets in the first hour: uploader environment and names, scripts without a
main guard or read from standard input, unclosed Checkpointers, errors raised once.

Everything runs for real: uploader processes, shared memory, moto's S3 server, scripts in
subprocesses.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch

import mpckpt
from harness.servers import S3_KEY, S3_SECRET
from mpckpt._system import shm as _shm
from mpckpt.errors import ConfigError, LockedError, UploadError
from tests.backends import ctl_url
from tests.conftest import assert_same

REPO = Path(__file__).resolve().parents[2]


def _run_script(code: str, *, cwd: Path, stdin: bool = False, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``code`` as a user's script: a file (``python train.py``) or ``python - < train.py``."""
    script = cwd / "train.py"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if stdin:
        with open(script) as f:
            return subprocess.run([sys.executable, "-"], stdin=f, cwd=cwd, env=env, capture_output=True,
                                  text=True, timeout=timeout)
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


# -- the uploaders' environment ------------------------------------------------------------------

@pytest.mark.s3
def test_credentials_set_after_the_first_checkpointer_reach_the_uploaders(tmp_path, moto_server, monkeypatch):
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    with mpckpt.Checkpointer(tmp_path / "local", workers=1) as ckpt:  # the fork server starts without credentials
        ckpt.save(0, {"x": torch.ones(3)})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEY)  # as a notebook cell would, later
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    url = "s3://first-hour-env/run"
    options = {"client_kwargs": {"endpoint_url": moto_server}, "create": True}  # no key, no secret
    state = {"w": torch.arange(10.0), "step": 1}
    with mpckpt.Checkpointer(url, storage_options=options, workers=2) as ckpt:
        ckpt.save(1, state).result(60)
    assert_same(state, mpckpt.load(url, storage_options=options))


def test_the_first_save_fails_when_the_uploaders_cannot_write(tmp_path):
    options = {"writable_only_in_pid": os.getpid()}  # this process may write, its uploaders may not
    root = ctl_url(tmp_path / "ck")
    state = {"w": torch.ones(3)}
    # the uploaders start beside the open and the restore; the first save does not wait for them (a
    # restarted job's first save costs no more than any other): its future says why not, and every save
    # after that is refused
    with mpckpt.Checkpointer(root, storage_options=options, workers=2) as ckpt:
        assert ckpt.restore(state) is None
        first = ckpt.save(1, state)
        with pytest.raises(UploadError, match="the uploader processes did not start: .* cannot write there"):
            first.result(60)
        with pytest.raises(ConfigError, match="uploader processes cannot write there") as info:
            ckpt.save(2, state)
        with pytest.raises(ConfigError, match="uploader processes cannot write there"):
            ckpt.save(3, state)  # the close after them does not raise it again
    message = str(info.value)
    assert str(tmp_path / "ck") in message and "permission denied" in message
    assert not [name for name in os.listdir(tmp_path / "ck") if name.startswith("step_")]  # nothing written
    unused = mpckpt.Checkpointer(root, storage_options=options, workers=1)
    with pytest.raises(ConfigError, match="uploader processes cannot write there"):
        unused.close()  # never saved: the close raises it, once
    with mpckpt.Checkpointer(tmp_path / "ck", workers=1) as ckpt:  # nothing was left locked
        assert ckpt.latest_step is None


def test_uploader_processes_are_named_in_ps(tmp_path):
    root = tmp_path / "named"
    with mpckpt.Checkpointer(root, workers=2) as ckpt:
        titles = sorted(" ".join(psutil.Process(pid).cmdline()).strip() for pid in ckpt.uploader_pids)
        names = {psutil.Process(pid).name() for pid in ckpt.uploader_pids}
    assert titles == [f"mpckpt-uploader 0 {root}", f"mpckpt-uploader 1 {root}"]
    assert names == {"mpckpt-uploader"}  # the kernel's name: 15 characters


# -- scripts ---------------------------------------------------------------------------------------

_SCRIPT_BODY = """
    import sys
    import torch
    import mpckpt

    root = sys.argv[1] if len(sys.argv) > 1 else "ck"
    model = torch.nn.Linear(8, 8)
    with mpckpt.Checkpointer(root, workers=2) as ckpt:
        for step in range(3):
            ckpt.save(step, {"model": model, "step": step})
    print("saved", mpckpt.load(root)["step"])
"""


@pytest.mark.parametrize("how", ["file without a main guard", "standard input"])
def test_a_script_without_main_guard_or_from_stdin_just_works(tmp_path, how):
    done = _run_script(_SCRIPT_BODY, cwd=tmp_path, stdin=how == "standard input")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved 2" in done.stdout
    assert "Error" not in done.stderr, done.stderr[-3000:]  # no child re-ran the script
    assert mpckpt.load(tmp_path / "ck")["step"] == 2


def test_a_script_that_forgets_to_close_still_commits_at_exit(tmp_path):
    done = _run_script("""
        import os
        import torch
        import mpckpt

        ckpt = mpckpt.Checkpointer("ck", workers=1)
        ckpt.save(0, {"w": torch.full((1000,), 7.0)})
        ckpt.save(1, {"w": torch.full((1000,), 8.0)})
        print("pid", os.getpid())
        # no close(), no `with`: the program just ends
    """, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    pid = int(done.stdout.split()[-1])
    assert torch.equal(mpckpt.load(tmp_path / "ck")["w"], torch.full((1000,), 8.0))
    assert not [n for n in _shm.list_segments() if n.startswith(f"{_shm.PREFIX}{pid}-")]


# -- notebooks: unclosed and re-opened Checkpointers ----------------------------------------------

def test_an_unreachable_checkpointer_lets_go_of_everything(tmp_path):
    root = tmp_path / "nb"
    ckpt = mpckpt.Checkpointer(root, workers=2)
    ckpt.save(0, {"w": torch.arange(100.0)})
    children = [psutil.Process(pid) for pid in ckpt.uploader_pids]
    mine = f"{_shm.PREFIX}{os.getpid()}-"
    assert any(n.startswith(mine) for n in _shm.list_segments())
    with pytest.warns(ResourceWarning, match="not closed"):
        del ckpt
        gc.collect()
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    assert not any(n.startswith(mine) for n in _shm.list_segments())
    with mpckpt.Checkpointer(root, workers=1) as again:  # the lock was released
        assert again.latest_step == 0  # and the pending save was committed first
    assert torch.equal(mpckpt.load(root)["w"], torch.arange(100.0))


def test_running_the_cell_again_says_how_to_close_the_first(tmp_path):
    root = tmp_path / "nb"
    ckpt = mpckpt.Checkpointer(root, workers=1)
    try:
        with pytest.raises(LockedError) as info:
            ckpt = mpckpt.Checkpointer(root, workers=1)  # noqa: F841 -- the old one is still bound
        message = str(info.value)
        assert "this process" in message and "close()" in message
        assert f"{Path(__file__).name}:" in message  # where the first one was opened
    finally:
        ckpt.close()
    with mpckpt.Checkpointer(root, workers=1):
        pass


def test_dropping_an_unclosed_one_and_opening_again_works(tmp_path):
    root = tmp_path / "nb"
    ckpt = mpckpt.Checkpointer(root, workers=1)
    ckpt.save(0, {"w": torch.ones(4)})
    with pytest.warns(ResourceWarning):
        ckpt = None  # the cell's variable is bound to something else; the collector has not run yet
        with mpckpt.Checkpointer(root, workers=1) as again:
            assert again.latest_step == 0


# -- errors surface once ---------------------------------------------------------------------------

def test_an_error_raised_by_report_is_not_raised_again(tmp_path):
    folder = Path("/dev/shm") / f"mpckpt-test-{os.getpid()}-report"
    root = tmp_path / "ck"
    root.mkdir()
    if not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat(root).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test folder")
    folder.mkdir()
    try:
        (folder / "weights.bin").write_bytes(b"x" * 100)
        with mpckpt.Checkpointer(root, workers=1) as ckpt:
            with pytest.raises(ConfigError, match="same filesystem"):
                ckpt.report({"loss": 1.0}, checkpoint=mpckpt.Checkpoint.from_directory(folder), step=0,
                            mode="no_upload")
            ckpt.wait()  # raised above, once: not again here, nor at the end of the block
            ckpt.save(1, {"x": torch.ones(2)})
        assert mpckpt.load(root)["x"].tolist() == [1.0, 1.0]
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
