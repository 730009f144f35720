"""What a new user meets first (issue 20): the command on the wrong folder, ``info`` of the
newest checkpoint, the ``ls`` table's header, plain ``--help``, and the progress bar of a long
read, which is drawn on a real pseudo-terminal only, after a second, and never elsewhere.

The command runs as a user runs it (``python -m mpckpt.cli``, from the folder above the
roots, with the paths a user types); the bar runs in a child process whose stderr is a pty.
"""

from __future__ import annotations

import json
import os
import pty
import select
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mpckpt
from tests.commands import mpckpt_command
from tests.conftest import assert_same

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ["ls", "info", "verify", "export", "stats", "gc", "rm"]


def cli(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m mpckpt.cli ARGS`` run in ``cwd``."""
    return mpckpt_command(*args, cwd=cwd)


def _save(root: Path, steps: list[int]) -> None:
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        for step in steps:
            ckpt.save(step, {"w": torch.full((4,), float(step)), "step": step}, mode="sync")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``runs/`` holding no checkpoint itself: ``exp1`` (steps 1-3), ``exp2`` (step 7) and,
    two levels down, ``group/exp3`` (step 5); ``notes/`` holds none at any depth."""
    top = tmp_path_factory.mktemp("user")
    runs = top / "runs"
    with pytest.MonkeyPatch.context() as env:  # the autouse clean environment is per test
        for name in [n for n in os.environ if n.startswith("MPCKPT_")]:
            env.delenv(name)
        _save(runs / "exp1", [1, 2, 3])
        _save(runs / "exp2", [7])
        _save(runs / "group" / "exp3", [5])
    (runs / "notes" / "deeper").mkdir(parents=True)
    return runs


# -- 1. a folder with no checkpoint says so, and where the roots are ---------------------------------

# the status each command gives for an existing folder with no checkpoint (see mpckpt/cli/__init__.py)
EMPTY_STATUS = {"ls": 0, "stats": 0, "verify": 1, "info": 2, "export": 2}


def _argv(command: str, root: str, tmp: Path) -> list[str]:
    return [command, root, *(["--to", str(tmp / "out.pt")] if command == "export" else [])]


@pytest.mark.parametrize("command", sorted(EMPTY_STATUS))
def test_the_folder_above_the_roots_names_them(runs, tmp_path, command):
    done = cli(*_argv(command, "runs", tmp_path), cwd=runs.parent)
    assert done.returncode == EMPTY_STATUS[command], done
    assert f"no checkpoint in {runs}" in done.stderr
    assert "runs/exp1 (3 checkpoints, newest step 3)" in done.stderr
    assert "runs/exp2 (1 checkpoint, step 7)" in done.stderr
    assert "runs/group/exp3 (1 checkpoint, step 5)" in done.stderr  # two levels below
    assert "notes" not in done.stderr
    assert "mpckpt ls runs/exp1" in done.stderr  # what to run next
    assert not (tmp_path / "out.pt").exists()


def test_ls_of_the_folder_above_prints_no_rows_and_json_an_empty_list(runs):
    table = cli("ls", "runs", cwd=runs.parent)
    assert table.returncode == 0 and table.stdout == ""
    listed = cli("ls", "runs", "--json", cwd=runs.parent)
    assert listed.returncode == 0 and json.loads(listed.stdout) == []
    assert f"no checkpoint in {runs}" in listed.stderr  # the document stays on stdout alone


def test_roots_given_as_absolute_paths_are_named_so(runs, tmp_path):
    done = cli("verify", runs, cwd=tmp_path)  # runs is not below the working folder
    assert done.returncode == 1
    assert f"{runs / 'exp1'} (3 checkpoints, newest step 3)" in done.stderr


@pytest.mark.parametrize("command", sorted(EMPTY_STATUS))
def test_an_empty_folder_says_no_checkpoint_here_or_below(runs, tmp_path, command):
    done = cli(*_argv(command, "runs/notes", tmp_path), cwd=runs.parent)
    assert done.returncode == EMPTY_STATUS[command], done
    assert f"no checkpoint in {runs / 'notes'}" in done.stderr
    assert "nor in the folders one or two levels below" in done.stderr


def test_a_checkpoint_folder_given_as_the_root_is_named(runs):
    done = cli("info", "runs/exp1/step_0000000002", cwd=runs.parent)
    assert done.returncode == 2
    assert "the folder of the checkpoint of step 2 in runs/exp1" in done.stderr
    assert "mpckpt info runs/exp1 2" in done.stderr


def test_gc_and_rm_of_a_folder_no_checkpointer_used_touch_nothing(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "notes.txt").write_text("mine")  # a name a shared file could have
    cleaned = cli("gc", ".", cwd=tmp_path)
    assert cleaned.returncode == 1 and f"nothing removed: no checkpoint in {tmp_path}" in cleaned.stderr
    removed = cli("rm", ".", 3, cwd=tmp_path)
    assert removed.returncode == 2 and f"nothing deleted: no checkpoint in {tmp_path}" in removed.stderr
    assert (tmp_path / "shared" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]  # no lock file left either


def test_gc_of_a_root_with_no_checkpoint_yet_still_cleans(tmp_path):
    (tmp_path / ".tmp.step_0000000001.123.abcd").mkdir()  # a save that never finished
    (tmp_path / ".mpckpt.lock").write_text("")
    done = cli("gc", ".", cwd=tmp_path)
    assert done.returncode == 0 and "removed staging folder .tmp.step_0000000001" in done.stdout, done


@pytest.mark.parametrize("command", [*sorted(EMPTY_STATUS), "gc"])
def test_a_root_that_does_not_exist_is_said_so_with_the_roots_beside_it(runs, tmp_path, command):
    done = cli(*_argv(command, "runs/exp9", tmp_path), cwd=runs.parent)
    assert done.returncode == 1, done
    assert f"{runs / 'exp9'} does not exist" in done.stderr
    assert "no checkpoint in" not in done.stderr  # not an empty listing
    assert "checkpoint roots beside it: runs/exp1 (3 checkpoints, newest step 3)" in done.stderr
    assert done.stdout == ""
    assert not (runs / "exp9").exists()


def test_a_file_given_as_the_root_is_said_so(runs, tmp_path):
    (tmp_path / "model.pt").write_bytes(b"x")
    done = cli("ls", "model.pt", cwd=tmp_path)
    assert done.returncode == 1 and f"{tmp_path / 'model.pt'} is a file, not a folder" in done.stderr


# -- 2. info (and export) of the newest checkpoint ----------------------------------------------------

@pytest.mark.parametrize("latest", [[], ["latest"]])
def test_info_without_a_step_shows_the_newest(runs, latest):
    done = cli("info", "runs/exp1", *latest, cwd=runs.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("step 3: state")
    described = json.loads(cli("info", "runs/exp1", *latest, "--json", cwd=runs.parent).stdout)
    assert described["step"] == 3
    assert cli("info", "runs/exp1", 2, cwd=runs.parent).stdout.startswith("step 2: state")  # a step still works


@pytest.mark.parametrize("latest", [[], ["latest"]])
def test_export_of_the_newest(runs, tmp_path, latest):
    target = tmp_path / "newest.pt"
    done = cli("export", "runs/exp1", *latest, "--to", target, cwd=runs.parent)
    assert done.returncode == 0, done.stderr
    assert "step 3" in done.stdout
    assert_same(mpckpt.load(runs / "exp1"), torch.load(target, weights_only=True))


def test_a_word_that_is_not_a_step_or_latest_is_refused(runs):
    done = cli("info", "runs/exp1", "newest", cwd=runs.parent)
    assert done.returncode == 2 and "'newest' is not a step (a non-negative integer) or latest" in done.stderr


# -- 3. the ls table has a header row; --json has none --------------------------------------------------

def test_ls_table_starts_with_a_header_row(runs):
    lines = cli("ls", "runs/exp1", cwd=runs.parent).stdout.splitlines()
    assert lines[0].split() == ["STEP", "TIME", "(UTC)", "KIND", "SIZE", "FILES", "METRICS"]
    assert [line.split()[0] for line in lines[1:]] == ["1", "2", "3"]
    # the columns line up under their names
    assert lines[0].index("KIND") == lines[1].index("state")
    assert lines[0].index("FILES") == lines[1].index(" files") + 1
    assert [row["step"] for row in json.loads(cli("ls", "runs/exp1", "--json", cwd=runs.parent).stdout)] == [1, 2, 3]


# -- 4. --help is plain text ---------------------------------------------------------------------------

@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_is_plain_text(tmp_path, command):
    done = cli(*([command] if command else []), "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "``" not in done.stdout
    if command is None:  # the commands, their exit statuses
        assert "mpckpt info ROOT [STEP|latest]" in done.stdout and "Exit status" in done.stdout
    else:  # what the command does, not only its arguments
        assert len(done.stdout.splitlines()) > 6 and f"mpckpt {command}" in done.stdout and "ROOT" in done.stdout


# -- 5. the progress bar: on a terminal, after a second, not elsewhere --------------------------------------

def run_in_terminal(script: str, *args: object, env: dict[str, str], tty: bool = True) -> tuple[int, str]:
    """Run ``script`` with its stderr on a new pseudo-terminal (or a pipe): status, stderr."""
    code = textwrap.dedent(script)
    argv = [sys.executable, "-c", code, *map(str, args)]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MPCKPT_")}, "PYTHONPATH": str(REPO), **env}
    if not tty:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
        return done.returncode, done.stderr
    import fcntl
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave, env=env)
    os.close(slave)
    seen = bytearray()
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 300)
            if not ready:
                raise TimeoutError(f"no output for 300 s: {seen[-2000:]!r}")
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child is gone and the terminal closed
                break
            if not data:
                break
            seen += data
    finally:
        os.close(master)
        status = child.wait(timeout=300)
    return status, seen.decode(errors="replace")


_HELPER = """
    import sys, time
    from mpckpt._progress import reading_bar

    pause, total = float(sys.argv[1]), 10 << 20
    bar = reading_bar(total, "mpckpt load step_0000000001")
    print("bar object" if bar is not None else "no bar object", file=sys.stderr, flush=True)
    if bar is not None:
        for _ in range(10):
            time.sleep(pause)  # the scenario: a slow read (the bar shows after a second)
            bar.update(total // 10)
        bar.close()
"""


def test_a_read_longer_than_a_second_draws_a_bar_on_a_terminal():
    status, seen = run_in_terminal(_HELPER, 0.2, env={})
    assert status == 0, seen
    assert "bar object" in seen
    assert "mpckpt load step_0000000001" in seen and "%|" in seen and "/10.5M" in seen


def test_a_quick_read_draws_nothing():
    status, seen = run_in_terminal(_HELPER, 0, env={})
    assert status == 0 and "bar object" in seen, seen
    assert "mpckpt load" not in seen and "%|" not in seen


@pytest.mark.parametrize("where", ["a pipe", "MPCKPT_PROGRESS=0"])
def test_no_bar_off_a_terminal_or_when_turned_off(where):
    env = {"MPCKPT_PROGRESS": "0"} if where == "MPCKPT_PROGRESS=0" else {}
    status, seen = run_in_terminal(_HELPER, 0.2, env=env, tty=where != "a pipe")
    assert status == 0, seen
    assert "no bar object" in seen and "%|" not in seen


def test_a_rank_other_than_0_draws_nothing():
    script = """
        import sys, time
        from mpckpt._progress import reading_bar
        bars = [reading_bar(100, f"rank {rank}", rank=rank) for rank in (0, 1)]
        print([b is not None for b in bars], file=sys.stderr, flush=True)
        bars[0].close()
    """
    status, seen = run_in_terminal(script, env={})
    assert status == 0 and "[True, False]" in seen, seen


# Through the real read paths: a load slowed down (every read waits) in a child on a terminal.
_LOAD = """
    import sys, time
    import mpckpt
    from mpckpt.storage.local import LocalBackend

    pause = float(sys.argv[2])
    read_into = LocalBackend.read_into

    def slow(self, *args, **kwargs):
        time.sleep(pause)  # the scenario: slow storage
        return read_into(self, *args, **kwargs)

    LocalBackend.read_into = slow
    state = mpckpt.load(sys.argv[1])
    print("loaded", sorted(state), file=sys.stderr, flush=True)
"""


@pytest.fixture(scope="module")
def big_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("big")
    with pytest.MonkeyPatch.context() as env:
        for name in [n for n in os.environ if n.startswith("MPCKPT_")]:
            env.delenv(name)
        with mpckpt.Checkpointer(root, workers=1) as ckpt:
            ckpt.save(1, {f"w{i}": torch.ones(1 << 19) * i for i in range(4)}, mode="sync")  # 4 x 2 MiB
    return root


def test_a_slow_load_draws_a_bar_on_a_terminal(big_root):
    status, seen = run_in_terminal(_LOAD, big_root, 1.5, env={})
    assert status == 0 and "loaded" in seen, seen
    assert "mpckpt load step_0000000001" in seen and "%|" in seen


def test_a_load_draws_nothing_off_a_terminal_or_when_turned_off(big_root):
    for env, tty in (({}, False), ({"MPCKPT_PROGRESS": "0"}, True)):
        status, seen = run_in_terminal(_LOAD, big_root, 0.5, env=env, tty=tty)
        assert status == 0 and "loaded" in seen, seen
        assert "%|" not in seen


def test_a_quick_load_draws_nothing(big_root):
    status, seen = run_in_terminal(_LOAD, big_root, 0, env={})
    assert status == 0 and "loaded" in seen, seen
    assert "mpckpt load" not in seen and "%|" not in seen


@pytest.fixture(scope="module")
def ranked_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint in the format a job's ranks write (a one-rank gloo job)."""
    import torch.distributed as dist

    root = tmp_path_factory.mktemp("ranked")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.MonkeyPatch.context() as env:
            for name in [n for n in os.environ if n.startswith("MPCKPT_")]:
                env.delenv(name)
            with mpckpt.Checkpointer(root, workers=1) as ckpt:
                ckpt.save(1, {f"w{i}": torch.ones(1 << 19) * i for i in range(4)}, mode="sync")
    finally:
        dist.destroy_process_group()
    return root


def test_a_slow_load_of_a_multi_rank_checkpoint_draws_a_bar(ranked_root):
    assert (ranked_root / "step_0000000001" / "r00000-skeleton.json").exists()  # the multi-rank format
    status, seen = run_in_terminal(_LOAD, ranked_root, 1.5, env={})
    assert status == 0 and "loaded" in seen, seen
    assert "mpckpt load step_0000000001" in seen and "%|" in seen
