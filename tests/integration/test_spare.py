"""``mpckpt._spare``, the warm spare of ``python -m mpckpt.run``, as its launcher drives it: a real
process, started with one environment, handed a rank's environment and command on its stdin.

What a replacement must not tell apart from a fresh ``python script.py`` (or ``python -m
module``): ``__name__``, ``sys.argv``, ``sys.path[0]``, ``os.environ`` (the order's, whole), an
empty stdin, and the exit code (``sys.exit``'s, 1 for an uncaught exception). A spare whose
launcher no longer needs it (its stdin closed without an order) ends with 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.launch import worker_env

BOUND_S = 120
SCRIPT = '''
import json, os, sys
print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "rank": os.environ.get("RANK"),
                  "only_in_start": os.environ.get("ONLY_IN_START"), "stdin": sys.stdin.read(),
                  "torch_loaded": "torch" in sys.modules}))
sys.exit(int(os.environ["EXIT_CODE"]))
'''


def spare(cwd: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-u", "-m", "mpckpt._spare"], cwd=cwd, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=worker_env(ONLY_IN_START="1"))


def order(proc: subprocess.Popen[bytes], env: dict[str, str], argv: list[str]) -> tuple[int, str, str]:
    out, err = proc.communicate((json.dumps({"env": env, "argv": argv}) + "\n").encode(), timeout=BOUND_S)
    return proc.returncode, out.decode(), err.decode()


def test_a_spare_runs_a_script_as_python_would_with_the_ranks_environment(tmp_path):
    script = tmp_path / "scripts" / "train.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    env = worker_env(RANK="3", EXIT_CODE="3")
    code, out, err = order(spare(tmp_path), env, [str(script), "--lr", "3"])
    assert code == 3, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {"name": "__main__", "argv": [str(script), "--lr", "3"], "path0": str(script.parent),
                    "rank": "3", "only_in_start": None, "stdin": "", "torch_loaded": True}, seen


def test_a_spare_runs_a_module_as_python_m_would(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(SCRIPT)
    code, out, err = order(spare(tmp_path), worker_env(RANK="0", EXIT_CODE="0"), ["-m", "pkg.train", "x"])
    assert code == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert (seen["name"], seen["argv"][1:], seen["path0"], seen["rank"]) == ("__main__", ["x"], str(tmp_path), "0")
    assert seen["argv"][0].endswith("train.py"), seen


def test_an_uncaught_exception_exits_1_and_a_spare_never_ordered_exits_0(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("raise RuntimeError('a bug in the script')\n")
    code, _, err = order(spare(tmp_path), worker_env(), [str(script)])
    assert code == 1 and "RuntimeError: a bug in the script" in err, err
    idle = spare(tmp_path)
    _, err_idle = idle.communicate(b"", timeout=BOUND_S)
    assert idle.returncode == 0, err_idle.decode()
