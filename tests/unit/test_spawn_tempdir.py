"""Uploaders start under a temporary directory too deep for the fork server's Unix socket."""

from __future__ import annotations

import torch

import mpckpt
from mpckpt._system.spawn import forkserver_socket_fits


def test_the_socket_path_limit_is_judged_from_the_temporary_directory():
    assert forkserver_socket_fits("/tmp")
    assert not forkserver_socket_fits("/tmp/" + "d" * 80)


def test_a_deep_temporary_directory_still_saves(tmp_path, monkeypatch):
    deep = tmp_path / ("t" * 90)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    assert not forkserver_socket_fits()
    state = {"w": torch.arange(8.0)}
    with mpckpt.Checkpointer(tmp_path / "root", workers=1, start_method="forkserver") as ckpt:
        ckpt.save(0, state).result(timeout=60)
    with mpckpt.Checkpointer(tmp_path / "root", read_only=True) as view:
        assert view.steps() == [0]
