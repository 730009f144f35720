"""The package with only its ``install_requires``: every module imports, and the whole round
trip (save, restore, load, the ``mpckpt`` command) works.

The test venv has every test extra, which once hid a read path that needed numpy from the
tests while ``restore()`` failed for everyone who installed mpckpt alone (numpy is now one of
``install_requires``: torch warns without it on every import, and safetensors needs it to write
``mpckpt export``'s file, which died with a raw ``ModuleNotFoundError``). This test
builds a separate venv (``.venv-minimal``, rebuilt when ``install_requires`` changes) with
torch==2.13.0 and ``pip install -e .`` and nothing else, and runs there.
"""

from __future__ import annotations

import configparser
import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-minimal"
TORCH = "torch==2.13.0"


def _install_requires() -> str:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg["options"]["install_requires"].strip()


def _minimal_python() -> Path:
    """A venv holding torch and mpckpt's install_requires only (made once per requirement set)."""
    stamp = hashlib.sha256(f"{TORCH}\n{_install_requires()}".encode()).hexdigest()
    python = VENV / "bin" / "python"
    marker = VENV / "mpckpt-requirements.sha256"
    if python.exists() and marker.exists() and marker.read_text() == stamp:
        return python
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    for args in ([TORCH], ["-e", str(REPO)]):
        done = subprocess.run(pip + args, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.fail(f"pip install {' '.join(args)} failed in {VENV}:\n{done.stderr[-3000:]}")
    marker.write_text(stamp)
    return python


_ROUND_TRIP = """
    import importlib, importlib.util, pkgutil, subprocess, sys
    import mpckpt

    for extra in ("pytest", "lightning", "moto", "matplotlib"):  # nothing of the test extras
        assert importlib.util.find_spec(extra) is None, f"{extra} is installed: this venv must hold install_requires only"
    optional = {"mpckpt.storage.azure"}  # needs the azure extra; it must say so when missing
    for info in pkgutil.walk_packages(mpckpt.__path__, "mpckpt."):
        try:
            importlib.import_module(info.name)
        except ImportError as e:
            framework = info.name.startswith("mpckpt.integrations.")  # each needs its framework's extra
            if info.name not in optional and not framework:
                raise
            if framework:
                extra = info.name.rsplit(".", 1)[1].lstrip("_").split("_")[0]  # (lightning_dcp: lightning's)
                assert f"pip install 'mpckpt[{extra}]'" in str(e), (info.name, e)  # the install hint
            print("optional", info.name, e)
    print("imported every module")

    import torch
    from mpckpt.errors import ConfigError

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    import datetime
    state = {"model": model, "optim": opt, "rng": torch.get_rng_state(), "epoch": 3,
             "started": datetime.date(2024, 1, 1), "tags": {"a", "b"}}  # values module, without numpy
    with mpckpt.Checkpointer(sys.argv[1], workers=2) as ckpt:
        ckpt.save(0, state)
        ckpt.save(1, state)
    model2 = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 2))
    state2 = {"model": model2, "optim": torch.optim.AdamW(model2.parameters()), "rng": torch.get_rng_state(), "epoch": 0,
              "started": None, "tags": set()}
    with mpckpt.Checkpointer(sys.argv[1], workers=1) as ckpt:
        assert ckpt.restore(state2) == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    loaded = mpckpt.load(sys.argv[1])
    assert loaded["epoch"] == 3 and state2["started"] == loaded["started"] == datetime.date(2024, 1, 1)
    assert state2["tags"] == loaded["tags"] == {"a", "b"}
    torch.set_rng_state(loaded["rng"])
    try:
        mpckpt.Checkpointer("az://container/run")
    except ConfigError as e:
        assert "mpckpt[azure]" in str(e), e
    exported = sys.argv[1] + "-model.safetensors"
    for command in (["ls", sys.argv[1]], ["verify", sys.argv[1]],
                    ["export", sys.argv[1], "1", "--to", exported, "--prefix", "model."]):  # the command-line guide's try-out
        done = subprocess.run([sys.executable, "-m", "mpckpt.cli", *command], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "Warning" not in done.stderr, done.stderr  # torch's "Failed to initialize NumPy" once was here
    from safetensors.torch import load_file
    weights = load_file(exported)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items()), sorted(weights)
    print("round trip OK")
"""


def test_install_requires_alone_are_enough(tmp_path):
    python = _minimal_python()
    script = tmp_path / "round_trip.py"
    script.write_text(textwrap.dedent(_ROUND_TRIP))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(python), str(script), str(tmp_path / "ck")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert "imported every module" in done.stdout
    assert "round trip OK" in done.stdout
