"""Bad and hostile input: one case a row; each gets a clear error and nothing on disk changes."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import fractions
import hashlib
import json
import os
import struct
import threading

import numpy
import pytest
import torch

import mpckpt
from mpckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    StateError,
    StepOrderError,
    UnsupportedFormatError,
)


def tree_digest(root) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


class Opaque:
    pass


def _local_dataclass() -> object:
    @dataclasses.dataclass
    class Local:
        x: int = 1

    return Local()


class _OtherZone(datetime.tzinfo):
    def utcoffset(self, dt: object) -> datetime.timedelta:
        return datetime.timedelta(hours=1)


def _quantized() -> torch.Tensor:
    return torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)


BAD_STATES = [
    ("object", lambda: {"x": Opaque()}, StateError, "x"),
    ("set of objects", lambda: {"x": {1, Opaque()}}, StateError, r"x\.\d.*Opaque"),
    ("decimal", lambda: {"d": decimal.Decimal("1.5")}, StateError, r"'d'.*Decimal.*float\(\)"),
    ("local dataclass", lambda: {"cfg": _local_dataclass()}, StateError, r"'cfg'.*inside a function.*asdict"),
    ("object array", lambda: {"a": numpy.array([None, 1])}, StateError, r"'a'.*dtype object.*tolist"),
    ("other tzinfo", lambda: {"t": datetime.datetime(2024, 1, 1, tzinfo=_OtherZone())}, StateError,
     r"'t'.*_OtherZone.*datetime\.timezone"),
    ("lambda", lambda: {"fn": lambda: 1}, StateError, "fn"),
    ("sparse", lambda: {"s": torch.eye(3).to_sparse()}, StateError, "s.*to_dense"),
    ("meta", lambda: {"m": torch.empty(3, device="meta")}, StateError, "m.*meta"),
    ("quantized", lambda: {"q": _quantized()}, StateError, "q.*quantized"),
    ("nested", lambda: {"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}, StateError, "n.*nested"),
    ("tuple key", lambda: {(1, 2): torch.ones(1)}, StateError, r"\(1, 2\)"),
    ("object key", lambda: {Opaque(): 1}, StateError, "Opaque"),
    ("nan key", lambda: {float("nan"): 1}, StateError, "nan"),
    ("deep bad value", lambda: {"a": {"b": [1, Opaque()]}}, StateError, r"a\.b\.1"),
    ("None state", lambda: None, StateError, "None"),
]


@pytest.mark.parametrize("name,make,exc,match", BAD_STATES, ids=[r[0] for r in BAD_STATES])
def test_state_that_cannot_be_stored(tmp_path, name, make, exc, match):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(0, {"ok": torch.ones(2)}, mode="sync")
        before = tree_digest(tmp_path)
        with pytest.raises(exc, match=match):
            ckpt.save(1, make())
        assert tree_digest(tmp_path) == before
        ckpt.save(2, {"ok": torch.ones(2)})  # the checkpointer is still usable
    assert ckpt.steps() == [0, 2]


def test_cycle_is_refused(tmp_path):
    state: dict = {"a": 1}
    state["self"] = state
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        with pytest.raises(StateError, match="cycle"):
            ckpt.save(0, state)


BAD_SETTINGS = [
    ("budget abc", {"memory_budget": "abc"}, "memory_budget"),
    ("budget -1", {"memory_budget": -1}, "memory_budget"),
    ("budget 0", {"memory_budget": 0}, "memory_budget"),
    ("budget tiny", {"memory_budget": "10KiB"}, "memory_budget.*1MiB"),
    ("budget bool", {"memory_budget": True}, "memory_budget"),
    ("workers 0", {"workers": 0}, "workers"),
    ("workers x", {"workers": "x"}, "workers"),
    ("policy", {"policy": "sometimes"}, "policy"),
    ("timeout", {"timeout_s": -3}, "timeout_s"),
    ("start method", {"start_method": "teleport"}, "start_method"),
    ("keep_last", {"keep_last": 0}, "keep_last"),
]


@pytest.mark.parametrize("name,kwargs,match", BAD_SETTINGS, ids=[r[0] for r in BAD_SETTINGS])
def test_bad_settings_fail_before_anything_is_written(tmp_path, name, kwargs, match):
    root = tmp_path / "run"
    with pytest.raises(ConfigError, match=match):
        mpckpt.Checkpointer(root, **kwargs)
    assert not root.exists()


BAD_ENV = [
    ("MPCKPT_MEMORY_BUDGET", "lots"),
    ("MPCKPT_MEMORY_BUDGET", "-5GiB"),
    ("MPCKPT_MEMORY_BUDGET", "1.5.2GiB"),
    ("MPCKPT_WORKERS", "two"),
    ("MPCKPT_WORKERS", "1000"),
    ("MPCKPT_POLICY", "maybe"),
    ("MPCKPT_TIMEOUT_S", "soon"),
    ("MPCKPT_OVERLAP", "perhaps"),
]


@pytest.mark.parametrize("var,value", BAD_ENV)
def test_malformed_environment_variables_are_named(tmp_path, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=var):
        mpckpt.Checkpointer(tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_budget_from_environment_and_fraction(tmp_path, monkeypatch):
    monkeypatch.setenv("MPCKPT_MEMORY_BUDGET", "48MiB")
    monkeypatch.setenv("MPCKPT_WORKERS", "3")
    with mpckpt.Checkpointer(tmp_path) as ckpt:
        assert ckpt.config.memory_budget_bytes == 48 << 20 and ckpt.config.workers == 3
        assert len(ckpt.uploader_pids) == 3
    with mpckpt.Checkpointer(tmp_path, memory_budget="32MiB", workers=1) as ckpt:  # argument beats env
        assert ckpt.config.memory_budget_bytes == 32 << 20 and ckpt.config.workers == 1


@pytest.mark.parametrize("steps", [(3, 3), (5, 2)])
def test_step_that_repeats_or_goes_backwards(tmp_path, steps):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(steps[0], {"x": torch.ones(1)}, mode="sync")
        before = tree_digest(tmp_path)
        with pytest.raises(StepOrderError, match=f"step {steps[1]}"):
            ckpt.save(steps[1], {"x": torch.zeros(1)})
        assert tree_digest(tmp_path) == before
    # also across runs: a new checkpointer continues from what is committed
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        with pytest.raises(StepOrderError):
            ckpt.save(steps[0], {"x": torch.zeros(1)})
    assert mpckpt.load(tmp_path)["x"].item() == 1


@pytest.mark.parametrize("step", [-1, "3", 2.5, None, True])
def test_step_must_be_a_nonnegative_int(tmp_path, step):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        with pytest.raises(ConfigError, match="step"):
            ckpt.save(step, {"x": torch.ones(1)})


def test_root_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=str(blocker)):
        mpckpt.Checkpointer(blocker / "run")


def test_unknown_scheme_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nosuchproto"):
        mpckpt.Checkpointer("nosuchproto://bucket/run")


def test_bad_mode_and_metrics(tmp_path):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        with pytest.raises(ConfigError, match="mode"):
            ckpt.save(0, {"x": torch.ones(1)}, mode="later")
        with pytest.raises(ConfigError, match="metrics"):
            ckpt.save(0, {"x": torch.ones(1)}, metrics=[1, 2])
        with pytest.raises(ConfigError, match="NO_UPLOAD"):
            ckpt.save(0, {"x": torch.ones(1)}, mode="no_upload")


def test_second_writer_is_refused_with_a_clear_error(tmp_path):
    with mpckpt.Checkpointer(tmp_path, workers=1):
        with pytest.raises(mpckpt.errors.LockedError, match=r"another Checkpointer of this process.*close\(\)"):
            mpckpt.Checkpointer(tmp_path, workers=1)
    with mpckpt.Checkpointer(tmp_path, workers=1):  # released at exit
        pass


# -- hostile storage: what a loader must refuse -------------------------------------------------

def _saved(tmp_path, state=None):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(1, state or {"w": torch.arange(100, dtype=torch.float32)}, mode="sync")
    folder = tmp_path / "step_0000000001"
    shard = next(p for p in folder.iterdir() if p.suffix == ".safetensors")
    return folder, shard


def _rewrite_manifest(folder, mutate):
    """Change the manifest and re-sign it, as a hostile writer could."""
    from mpckpt.format.manifest import checksum

    body = json.loads((folder / "manifest.json").read_text())
    body.pop("manifest_checksum")
    mutate(body)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["manifest_checksum"] = checksum(canonical.encode())
    (folder / "manifest.json").write_text(json.dumps(body))


def test_newer_format_version_is_refused(tmp_path):
    folder, _ = _saved(tmp_path)
    _rewrite_manifest(folder, lambda b: b.update(format_version=99))
    with pytest.raises(UnsupportedFormatError, match="version 99.*Upgrade"):
        mpckpt.load(tmp_path)
    with pytest.raises(UnsupportedFormatError, match="version 99"):
        mpckpt.load(tmp_path, step=1)


@pytest.mark.parametrize("name", ["../escape.safetensors", "/etc/passwd"])
def test_manifest_paths_that_escape_are_refused(tmp_path, name):
    folder, _ = _saved(tmp_path)
    _rewrite_manifest(folder, lambda b: b["files"].update({name: {"size": 1, "xxh3_64": "00"}}))
    with pytest.raises(CorruptCheckpointError, match="escape|absolute"):
        mpckpt.load(tmp_path)


def _rewrite_shard_header(shard, header: dict) -> None:
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    body = data[8 + n:]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text + body)


@pytest.mark.parametrize("header,match", [
    ({"w": {"dtype": "F32", "shape": [100], "data_offsets": [0, 1 << 40]}}, "outside"),
    ({"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 400]}}, "needs"),
    ({"w": {"dtype": "EVIL", "shape": [100], "data_offsets": [0, 400]}}, "dtype"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 400]}}, "shape"),
])
def test_safetensors_header_with_absurd_sizes_or_offsets(tmp_path, header, match):
    from mpckpt.format.safetensors import parse_header

    _, shard = _saved(tmp_path)
    _rewrite_shard_header(shard, header)
    data = shard.read_bytes()
    with pytest.raises(CorruptCheckpointError, match=match):
        parse_header(data, path=str(shard), file_size=len(data))
    with pytest.raises(CorruptCheckpointError):
        mpckpt.load(tmp_path)  # the checksum catches it first, naming the file


def test_header_length_claiming_more_than_the_file(tmp_path):
    from mpckpt.format.safetensors import parse_header

    with pytest.raises(CorruptCheckpointError, match="claims"):
        parse_header(struct.pack("<Q", 1 << 50) + b"{}", path="x.safetensors", file_size=10)


def test_skeleton_cannot_smuggle_a_pickle(tmp_path):
    import base64
    import pickle

    folder, _ = _saved(tmp_path)
    ran = threading.Event()
    payload = base64.b64encode(pickle.dumps(Opaque())).decode()
    skeleton = json.loads((folder / "skeleton.json").read_text())
    skeleton["tree"] = {"__mpckpt__": "pickle", "v": payload}
    data = json.dumps(skeleton).encode()
    (folder / "skeleton.json").write_bytes(data)
    from mpckpt.format.manifest import checksum

    _rewrite_manifest(folder, lambda b: b["files"]["skeleton.json"].update(size=len(data), xxh3_64=checksum(data)))
    with pytest.raises(StateError, match="allow_pickle"):
        mpckpt.load(tmp_path)
    assert not ran.is_set()
    assert isinstance(mpckpt.load(tmp_path, allow_pickle=True), Opaque)


def test_pickle_only_when_opted_in(tmp_path):
    with mpckpt.Checkpointer(tmp_path, workers=1, allow_pickle=True) as ckpt:
        ckpt.save(0, {"obj": fractions.Fraction(1, 3), "set": {1, 2, 3}}, mode="sync")
    with pytest.raises(StateError, match="allow_pickle"):
        mpckpt.load(tmp_path)
    loaded = mpckpt.load(tmp_path, allow_pickle=True)
    assert loaded == {"obj": fractions.Fraction(1, 3), "set": {1, 2, 3}}
    skeleton = (tmp_path / "step_0000000000" / "skeleton.json").read_text()
    assert skeleton.count('"pickle"') == 1  # the set is stored as itself even so
