"""Security faults: shared memory others could read or guess, hostile segment names, leaked secrets.

- Every slab of a live Checkpointer is mode 0600 and named ``mpckpt-<pid>-<owner token>-<32 hex>``:
  128 random bits that differ between slabs, after the 128-bit token of its owner file (mode
  0600 too). Hostile entries in /dev/shm and the owner protocol: ``test_hostile_shm.py``.
- ``Segment.attach`` (what uploaders do with a name from a job) refuses any other name, so a
  job cannot make an uploader open ``../x`` or another program's segment.
- An az:// Checkpointer with an account key, logging at DEBUG, that fails: the key appears in
  no log record and nowhere in the exception (message, notes, causes).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import traceback

import pytest
import torch

import mpckpt
from harness.servers import AZURITE_ACCOUNT, AZURITE_KEY
from mpckpt import _testing
from mpckpt._system import shm as _shm

NAME = re.compile(r"^mpckpt-(\d+)-([0-9a-f]{32})-([0-9a-f]+)$")


def _slab_names(ckpt: mpckpt.Checkpointer) -> list[str]:
    return [slab.name for slab in _testing.slabs(ckpt)]


def test_slabs_are_private_and_unguessable(tmp_path):
    state = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    tokens = []
    for run in ("a", "b"):
        with mpckpt.Checkpointer(tmp_path / run, workers=1, memory_budget="16MiB") as ckpt:
            ckpt.prepare(state)
            ckpt.save(0, state)
            names = _slab_names(ckpt)
            assert names
            for name in names:
                mode = os.stat(os.path.join(_shm.SHM_DIR, name)).st_mode
                assert stat.S_IMODE(mode) == 0o600, (name, oct(mode))
                m = NAME.match(name)
                assert m, name
                assert int(m.group(1)) == os.getpid()
                assert len(m.group(3)) * 4 >= 128, name  # hex digits x 4 bits
                tokens.append(m.group(3))
                owner_file = os.path.join(_shm.SHM_DIR, f"mpckpt-{m.group(1)}-{m.group(2)}.owner")
                assert stat.S_IMODE(os.lstat(owner_file).st_mode) == 0o600, owner_file
            ckpt.wait()
    assert len(set(tokens)) == len(tokens), tokens  # no two slabs, in one or two checkpointers, share a token


_TOKEN = "0" * 32


@pytest.mark.parametrize("name", ["../x", "other-segment", "mpckpt-1-../../etc/passwd", "/mpckpt-1-" + "0" * 32,
                                  "mpckpt-1-" + "0" * 31, "mpckpt-1-" + "G" * 32, "mpckpt-x-" + "0" * 32, "",
                                  "mpckpt-1-" + "0" * 32,  # an older mpckpt's form: never attached
                                  f"mpckpt-1-{_TOKEN}.owner", f"mpckpt-1-{_TOKEN}-" + "0" * 31,
                                  f"/mpckpt-1-{_TOKEN}-" + "0" * 32, f"mpckpt-1-{_TOKEN}-" + "0" * 32 + "\n",
                                  f"mpckpt-1-{_TOKEN}-../" + "0" * 29])
def test_attach_refuses_foreign_names(name):
    with pytest.raises(ValueError, match="not an mpckpt shared-memory segment name"):
        _shm.Segment.attach(name, 4096)


def test_reap_touches_only_mpckpt_segments():
    foreign = os.path.join(_shm.SHM_DIR, f"not-mpckpt-{os.getpid()}")
    with open(foreign, "wb") as f:
        f.write(b"x")
    try:
        _shm.reap_orphans()
        assert os.path.exists(foreign)
    finally:
        os.unlink(foreign)


# -- credentials in logs and errors ------------------------------------------------------------

def _endpoint(connection_string: str) -> str:
    parts = dict(p.split("=", 1) for p in connection_string.split(";") if p)
    return parts["BlobEndpoint"].rstrip("/")


def _everything(caplog: pytest.LogCaptureFixture, error: BaseException | None) -> str:
    text = [r.getMessage() for r in caplog.records]
    text += [repr(r.args) for r in caplog.records]
    text += [str(getattr(r, "exc_text", "") or "") for r in caplog.records]
    if error is not None:
        text.append("".join(traceback.format_exception(error)))
        text.append(repr(error))
    return "\n".join(text)


@pytest.mark.azure
@pytest.mark.parametrize("how", ["account_key", "connection_string"])
def test_account_key_never_reaches_logs_or_errors(azurite_server, caplog, how, tmp_path):
    caplog.set_level(logging.DEBUG)  # mpckpt, azure.core http logging, everything
    if how == "account_key":
        options = {"account_url": _endpoint(azurite_server), "account_name": AZURITE_ACCOUNT,
                   "account_key": AZURITE_KEY}
    else:
        options = {"connection_string": azurite_server}
    url = f"az://missing-{os.getpid()}-{how.replace('_', '-')}/run"
    with pytest.raises(mpckpt.errors.ConfigError) as info:  # the container does not exist, no create=True
        mpckpt.Checkpointer(url, storage_options=options, workers=1)
    assert "create=True" in str(info.value)
    assert caplog.records, "expected DEBUG records from the failed open"
    text = _everything(caplog, info.value)
    assert AZURITE_KEY not in text
    assert AZURITE_KEY[:24] not in text  # not even a prefix of it

    # and a working one that then fails in the background: still nothing
    caplog.clear()
    good = dict(options, create=True)
    url = f"az://ok-{os.getpid()}-{how.replace('_', '-')}/run"
    error = None
    with mpckpt.Checkpointer(url, storage_options=good, workers=1) as ckpt:
        ckpt.save(0, {"x": torch.ones(4)}, mode="sync")
        try:
            ckpt.save(0, {"x": torch.ones(4)})  # a step that does not advance
        except mpckpt.errors.StepOrderError as e:
            error = e
    assert error is not None
    text = _everything(caplog, error)
    assert AZURITE_KEY not in text and AZURITE_KEY[:24] not in text
