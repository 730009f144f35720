"""Real storage servers on 127.0.0.1 for the tests: Azurite (Azure Blob) and moto (S3).

Session-scoped pytest fixtures that conftest files import. Each server gets a free port and a
private data folder, is waited for with a bounded deadline, and is stopped at the end of the
session. A test is skipped only when the server program is not installed at all; a server
that is installed but fails to start fails the tests loudly, with its log.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
AZURITE_BIN = REPO / ".tools" / "node_modules" / ".bin" / "azurite-blob"
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
S3_KEY = S3_SECRET = "testing"
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(proc: subprocess.Popen, port: int, log: Path, name: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{name} exited with code {proc.returncode} before listening; log:\n{log.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    pytest.fail(f"{name} did not listen on 127.0.0.1:{port} within {START_TIMEOUT_S:.0f} s; log:\n{log.read_text()}")


def stop_server(proc: subprocess.Popen) -> None:
    """Terminate a server process, killing it if it does not exit within 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _start(cmd: list[str], port: int, workdir: Path, name: str) -> subprocess.Popen:
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    _wait_for_port(proc, port, log, name)
    return proc


def azurite_connection_string(port: int) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};")


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A running Azurite blob service; yields its connection string."""
    binary = os.environ.get("MPCKPT_TEST_AZURITE") or (str(AZURITE_BIN) if AZURITE_BIN.exists()
                                                      else shutil.which("azurite-blob"))
    if not binary:
        pytest.skip(f"Azurite is not installed ({AZURITE_BIN}); run `bash scripts/setup.sh --test`")
    workdir = tmp_path_factory.mktemp("azurite")
    port = free_port()
    cmd = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(workdir / "data"),
           "--silent", "--skipApiVersionCheck", "--loose"]
    proc = _start(cmd, port, workdir, "azurite")
    try:
        yield azurite_connection_string(port)
    finally:
        stop_server(proc)


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A running moto S3 server; yields its endpoint URL.

    Clients use ``client_kwargs={"endpoint_url": url}`` with key and secret ``"testing"``
    (see ``s3_options``).
    """
    try:
        import moto.server  # noqa: F401
    except ImportError:
        pytest.skip("moto[server] is not installed; run `bash scripts/setup.sh --test`")
    workdir = tmp_path_factory.mktemp("moto")
    port = free_port()
    proc = _start([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port, workdir, "moto")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


def s3_options(endpoint_url: str, **extra: object) -> dict:
    """Storage options for s3fs against the moto server at ``endpoint_url``."""
    return {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": endpoint_url}, **extra}
