"""What ``mpckpt.load`` and ``restore`` hand out: tensors that own their memory, read without numpy.

Real Checkpointers write real files under ``tmp_path``; then:

- every loaded tensor owns its storage (offset 0, no bigger than itself), so C++ entry points
  that ignore storage offsets work (``torch.set_rng_state``) and ``torch.save`` of part of a
  loaded state writes that part only; tensors that shared storage when saved share it again;
- a tensor split over several shard files comes back bit for bit;
- the checksum still covers every byte of a shard: header padding and entries no tensor uses;
- ``mpckpt verify`` and ``Checkpoint.to_directory`` stream files and still catch a flipped
  byte, and a damaged file never appears under its real name;
- the whole read path works where numpy cannot be imported (torch does not need it).

Things that can crash the interpreter on the old behaviour (``set_rng_state``) and the
numpy-free runs happen in a subprocess, with the same ``mpckpt`` as this test.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import mpckpt
from mpckpt._read import verified, whole
from mpckpt.cli import main
from mpckpt.errors import CorruptCheckpointError
from mpckpt.format.manifest import FileEntry, Manifest, checksum
from mpckpt.format.safetensors import HeaderEntry, build_header, parse_header
from mpckpt.storage.local import LocalBackend
from tests.conftest import assert_same, make_model, train_step

STEP_DIR = "step_0000000000"


def _tensors(value: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{path}.{i}")


def assert_owns_memory(t: torch.Tensor, path: str) -> None:
    assert t.storage_offset() == 0, (path, t.storage_offset())
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (path, t.untyped_storage().nbytes())


def _save(root, state: Any, **options: Any) -> None:
    options = {"workers": 1, "memory_budget": "64MiB", **options}
    with mpckpt.Checkpointer(root, **options) as ckpt:
        ckpt.save(0, state, mode="sync")


def _shards(root) -> list[str]:
    return sorted(n for n in os.listdir(root / STEP_DIR) if n.endswith(".safetensors"))


def _python(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run a fresh interpreter that imports the same mpckpt as this test."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(mpckpt.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
           "MPCKPT_PROGRESS": "0"}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=here, timeout=300)


def _run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return _python("-c", textwrap.dedent(code), *args)


def _trained_state() -> dict[str, Any]:
    model, opt = make_model(width=64)
    train_step(model, opt, 0)
    return {"model": model, "optim": opt}


# -- tensors own their memory ------------------------------------------------------------------

def test_loaded_rng_state_goes_into_set_rng_state(tmp_path):
    state = _trained_state()
    state["rng"] = torch.get_rng_state()  # after the model and optimizer: deep inside a shard
    _save(tmp_path, state)
    torch.set_rng_state(state["rng"])
    expected = torch.rand(8).tolist()
    result = _run_python("""
        import json, sys, torch, mpckpt
        loaded = mpckpt.load(sys.argv[1])
        torch.set_rng_state(loaded["rng"])
        print(json.dumps(torch.rand(8).tolist()))
    """, str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


def test_every_loaded_tensor_owns_its_memory(tmp_path):
    state = _trained_state()
    state["rng"] = torch.get_rng_state()
    state["extra"] = {
        "complex": torch.randn(3, 4, dtype=torch.complex128),
        "half": torch.randn(5, dtype=torch.bfloat16),
        "mask": torch.rand(7) > 0.5,
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "noncontig": torch.arange(60, dtype=torch.float32).view(6, 10)[:, ::3],
    }
    _save(tmp_path, state)
    loaded = mpckpt.load(tmp_path)
    found = list(_tensors(loaded))
    assert len(found) > 20
    for path, t in found:
        assert_owns_memory(t, path)
    assert torch.equal(loaded["extra"]["noncontig"], state["extra"]["noncontig"])
    assert torch.equal(loaded["extra"]["complex"], state["extra"]["complex"])

    model2, opt2 = make_model(width=64, seed=1)
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        assert ckpt.restore({"model": model2, "optim": opt2}, strict=False) == 0  # a part of what was saved
    for path, t in _tensors(opt2.state_dict()["state"]):  # e.g. Adam keeps the loaded "step" tensors
        assert_owns_memory(t, f"optim{path}")
    assert_same(state["model"].state_dict(), model2.state_dict())


def test_torch_save_of_a_loaded_model_holds_the_weights_only(tmp_path):
    model, opt = make_model(width=256, depth=4)
    train_step(model, opt, 0)  # Adam's moments: twice the weights, in the same shard
    _save(tmp_path, {"model": model, "optim": opt})
    assert len(_shards(tmp_path)) == 1
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    out = io.BytesIO()
    torch.save(mpckpt.load(tmp_path)["model"], out)
    assert weights < out.tell() < weights + (64 << 10), (out.tell(), weights)


def test_tied_weights_and_views_of_one_storage_come_back_shared(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    tied = Tied()
    emb = torch.randn(10, 4)
    flat = torch.arange(20, dtype=torch.float32)
    w = torch.randn(6, 4)
    state = {"big": torch.randn(1000), "tied": tied, "embed": emb, "lm_head": emb,
             "a": flat[:10].view(2, 5), "b": flat[5:].view(3, 5), "w": w, "wt": w.t()}
    _save(tmp_path, state)
    loaded = mpckpt.load(tmp_path)

    assert loaded["embed"] is loaded["lm_head"]
    assert_owns_memory(loaded["embed"], "embed")
    t = loaded["tied"]
    assert t["embed.weight"].untyped_storage().data_ptr() == t["head.weight"].untyped_storage().data_ptr()
    assert_owns_memory(t["embed.weight"], "tied")
    assert torch.equal(t["head.weight"], tied.head.weight.detach())

    a, b = loaded["a"], loaded["b"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert a.untyped_storage().nbytes() == 20 * 4  # the span both views cover, not a shard
    assert torch.equal(a, state["a"]) and torch.equal(b, state["b"])
    a[1, 0] = -1.0  # element 5 of the shared storage
    assert b[0, 0] == -1.0

    assert loaded["w"].untyped_storage().data_ptr() == loaded["wt"].untyped_storage().data_ptr()
    assert loaded["w"].untyped_storage().nbytes() == w.numel() * 4
    assert torch.equal(loaded["wt"], w.t()) and torch.equal(loaded["w"], w)
    assert_owns_memory(loaded["big"], "big")


def test_a_tensor_split_over_several_shards_round_trips(tmp_path):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(900_000, generator=g)  # 3.4 MiB of one storage, seen through two views
    state = {
        "big": torch.randn(1000, 1000, generator=g),  # 3.8 MiB with a 2 MiB budget: several waves
        "complex": torch.randn(300, 300, dtype=torch.complex128, generator=g),
        "small": torch.randn(10, generator=g),
        "head": base[:600_000].view(600, 1000),
        "tail": base[300_000:],
    }
    _save(tmp_path, state, memory_budget="2MiB", workers=2)
    skeleton = json.loads((tmp_path / STEP_DIR / "skeleton.json").read_text())
    split = [leaf for leaf in skeleton["leaves"] if len(leaf["parts"]) > 1]
    assert len(split) == 3, [leaf["name"] for leaf in skeleton["leaves"]]
    assert all(len({part[0] for part in leaf["parts"]}) > 1 for leaf in split)  # over several files
    loaded = mpckpt.load(tmp_path)
    assert_same(state, loaded)
    for key in ("big", "complex", "small"):
        assert_owns_memory(loaded[key], key)
    assert loaded["head"].untyped_storage().data_ptr() == loaded["tail"].untyped_storage().data_ptr()
    assert loaded["head"].untyped_storage().nbytes() == base.numel() * 4


def test_small_reads_gathered_and_big_ones_split(tmp_path, monkeypatch):
    """Tiny read sizes: every tensor spans several reads, small ones are gathered and copied."""
    state = _trained_state()
    state["rng"] = torch.get_rng_state()
    state["odd"] = torch.randn(1001, dtype=torch.float64)
    _save(tmp_path, state, workers=2)
    monkeypatch.setattr(whole, "_READ_CHUNK", 1000)
    monkeypatch.setattr(whole, "_SMALL", 700)
    monkeypatch.setattr(whole, "_GATHER", 2500)
    monkeypatch.setattr(verified, "HEAD_BYTES", 16)
    monkeypatch.setattr(verified, "STREAM_CHUNK", 777)
    loaded = mpckpt.load(tmp_path)
    assert_same(state["model"].state_dict(), loaded["model"])
    assert_same(state["optim"].state_dict(), loaded["optim"])
    assert torch.equal(loaded["rng"], state["rng"]) and torch.equal(loaded["odd"], state["odd"])
    for path, t in _tensors(loaded):
        assert_owns_memory(t, path)
    _flip_at(tmp_path / STEP_DIR / _shards(tmp_path)[0], -1)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        mpckpt.load(tmp_path)


# -- the checksum covers every byte --------------------------------------------------------------

def _flip_at(path, index: int, value: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[index] = value if value is not None else data[index] ^ 0x5A
    path.write_bytes(bytes(data))


def _header_of(path):
    data = path.read_bytes()
    return parse_header(data, path=str(path), file_size=len(data))


@pytest.mark.parametrize("where", ["padding", "json"])
def test_a_damaged_shard_header_is_refused(tmp_path, where):
    _save(tmp_path, _trained_state())
    shard = _shards(tmp_path)[0]
    path = tmp_path / STEP_DIR / shard
    header_len = _header_of(path).header_len
    raw = path.read_bytes()[:header_len]
    assert raw.endswith(b" ")  # the JSON is padded with spaces to a block
    if where == "padding":
        _flip_at(path, header_len - 1, ord("\n"))  # still valid JSON: only the checksum can tell
    else:
        _flip_at(path, raw.index(b'"dtype"') + 1)
    with pytest.raises(CorruptCheckpointError) as info:
        mpckpt.load(tmp_path)
    assert shard in str(info.value) and STEP_DIR in str(info.value)
    if where == "padding":
        assert "checksum" in str(info.value)


def _append_unused_entry(root, shard: str) -> bytes:
    """Rewrite ``shard`` with one more safetensors entry that no tensor uses; fix the manifest."""
    path = root / STEP_DIR / shard
    data = path.read_bytes()
    header = _header_of(path)
    body = data[header.header_len:]
    extra = bytes(range(256)) * 40
    entries = sorted(header.entries.values(), key=lambda e: e.start)
    entries.append(HeaderEntry("unused", "U8", (len(extra),), len(body), len(body) + len(extra)))
    new = build_header(entries, header.metadata, align=4096) + body + extra
    path.write_bytes(new)
    manifest_path = root / STEP_DIR / "manifest.json"
    manifest = Manifest.from_bytes(manifest_path.read_bytes(), path=str(manifest_path))
    manifest.files[shard] = FileEntry(len(new), checksum(new))
    manifest_path.write_bytes(manifest.to_bytes())
    return extra


def test_entries_no_tensor_uses_are_read_and_hashed(tmp_path):
    state = _trained_state()
    _save(tmp_path, state)
    shard = _shards(tmp_path)[0]
    extra = _append_unused_entry(tmp_path, shard)
    assert_same(state["model"].state_dict(), mpckpt.load(tmp_path)["model"])
    _flip_at(tmp_path / STEP_DIR / shard, -len(extra) // 2)
    with pytest.raises(CorruptCheckpointError, match=f"{shard}: checksum"):
        mpckpt.load(tmp_path)


# -- verify and to_directory stream --------------------------------------------------------------

def _record_read_sizes(monkeypatch) -> list[int]:
    sizes: list[int] = []
    original = LocalBackend.read_into

    def read_into(self: LocalBackend, relpath: str, offset: int, out: memoryview) -> None:
        sizes.append(len(out))
        original(self, relpath, offset, out)

    monkeypatch.setattr(LocalBackend, "read_into", read_into)
    return sizes


def test_verify_command_streams_and_catches_a_flipped_byte(tmp_path, monkeypatch, capsys):
    _save(tmp_path, _trained_state())
    monkeypatch.setattr(verified, "STREAM_CHUNK", 4096)
    monkeypatch.setattr(verified, "HEAD_BYTES", 4096)  # verify also parses every shard header
    sizes = _record_read_sizes(monkeypatch)
    assert main(["verify", str(tmp_path)]) == 0
    assert "step 0: ok" in capsys.readouterr().out
    assert 0 < max(sizes) <= 4096 < max(os.path.getsize(tmp_path / STEP_DIR / s) for s in _shards(tmp_path))

    ok = _python("-m", "mpckpt.cli", "verify", str(tmp_path))
    assert ok.returncode == 0, ok.stderr
    assert "step 0: ok" in ok.stdout
    shard = _shards(tmp_path)[0]
    _flip_at(tmp_path / STEP_DIR / shard, -3)
    bad = _python("-m", "mpckpt.cli", "verify", str(tmp_path))
    assert bad.returncode == 1
    assert shard in bad.stderr and "checksum" in bad.stderr


def test_to_directory_copies_verified_files_and_never_a_damaged_one(tmp_path, monkeypatch):
    root = tmp_path / "run"
    _save(root, _trained_state(), workers=2)
    monkeypatch.setattr(verified, "STREAM_CHUNK", 4096)  # many chunks per file
    sizes = _record_read_sizes(monkeypatch)
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        stored = ckpt.checkpoint(0)
        out = stored.to_directory(tmp_path / "out")
        assert 0 < max(sizes) <= 4096  # streamed: no file is held whole
        for rel in stored.files():
            assert (root / STEP_DIR / rel).read_bytes() == open(os.path.join(out, rel), "rb").read(), rel
        assert sorted(os.listdir(out)) == stored.files()

        shard = _shards(root)[-1]
        _flip_at(root / STEP_DIR / shard, -5)
        dest = tmp_path / "again"
        with pytest.raises(CorruptCheckpointError, match=f"{shard}: checksum"):
            stored.to_directory(dest)
        assert not (dest / shard).exists()
        assert not [n for n in os.listdir(dest) if shard in n]  # no partial file left either


# -- no numpy ------------------------------------------------------------------------------------

def test_the_read_path_never_imports_numpy(tmp_path):
    state = _trained_state()
    state["rng"] = torch.get_rng_state()
    flat = torch.arange(20, dtype=torch.float32)
    state["views"] = {"a": flat[:10].view(2, 5), "b": flat[5:].view(3, 5)}
    state["complex"] = torch.randn(4, dtype=torch.complex128)
    root = tmp_path / "run"
    _save(root, state)
    result = _run_python("""
        import sys
        sys.modules["numpy"] = None  # any `import numpy` now fails
        import warnings
        warnings.simplefilter("ignore")  # torch says once that numpy is missing
        import torch, mpckpt
        from mpckpt.cli import main
        from tests.conftest import make_model

        root, out = sys.argv[1], sys.argv[2]
        loaded = mpckpt.load(root)
        torch.set_rng_state(loaded["rng"])
        assert torch.equal(loaded["views"]["b"], torch.arange(5, 20, dtype=torch.float32).view(3, 5))
        model, opt = make_model(width=64, seed=1)
        with mpckpt.Checkpointer(root, workers=1) as ckpt:
            assert ckpt.restore({"model": model, "optim": opt}, strict=False) == 0  # a part of what was saved
            ckpt.checkpoint(0).to_directory(out)
        for name, value in loaded["model"].items():
            assert torch.equal(model.state_dict()[name], value), name
        assert main(["verify", root]) == 0
        assert "numpy" not in sys.modules or sys.modules["numpy"] is None
        print("read path ok without numpy")
    """, str(root), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "read path ok without numpy" in result.stdout
    assert sorted(os.listdir(tmp_path / "out")) == sorted(set(os.listdir(root / STEP_DIR)) - {"manifest.json"})
