"""A single-process restore reads a checkpoint straight into the live tensors of the state.

Real Checkpointers write real files under ``tmp_path``; ``restore`` then reads them back into
states built anew. Which leaves went in place is seen through ``whole.live_targets`` (wrapped,
not replaced); that they really did is seen in the tensors themselves: the same memory
(``data_ptr``) before and after, an optimizer's moment objects the same Python objects.

- a model and Adam, with and without optimizer state yet, come back bit for bit; what the
  state already has is written in place, moments a fresh optimizer lacks are fresh tensors;
- tied weights, a tensor held under several keys, complex and bfloat16 tensors go in place;
- what cannot go in place is read fresh and applied as before: a live tensor of another dtype
  (converted), a non-contiguous one, a tensor held under keys that differ from the checkpoint's;
  a live tensor of another shape gives the same ``StateError`` as before, and nothing is
  written in place then;
- a shard that does not verify after its bytes went into the live tensors: without fallback
  the error says the state is undefined (``state_changed``); with fallback the older step is
  restored bit for bit over it.
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

import pytest
import torch

import mpckpt
from mpckpt._read import whole
from mpckpt.errors import CorruptCheckpointError, StateError
from tests.conftest import assert_same, make_model, train_step


@pytest.fixture
def in_place(monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """The names of the leaves each read put in place, one set per read."""
    found: list[set[str]] = []
    real = whole.live_targets

    def spy(skeleton: Any, flat: Any) -> Any:
        targets = real(skeleton, flat)
        found.append({skeleton.leaves[i]["name"] for i in targets})
        return targets

    monkeypatch.setattr(whole, "live_targets", spy)
    return found


def _save(root: Any, state: Any, step: int = 0) -> None:
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        ckpt.save(step, state, mode="sync")


def _restore(root: Any, state: Any, **options: Any) -> int | None:
    with mpckpt.Checkpointer(root, workers=1, read_only=True) as ckpt:
        return ckpt.restore(state, **options)


def _moments(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def test_a_model_and_adam_with_state_are_written_in_place(tmp_path, in_place):
    model, opt = make_model(width=256)
    for seed in range(2):
        train_step(model, opt, seed)
    _save(tmp_path, {"model": model, "optim": opt})
    model2, opt2 = make_model(width=256, seed=1)
    train_step(model2, opt2, 7)  # its moments exist: they are written, not replaced
    params = [(p, p.data_ptr(), p._version) for p in model2.parameters()]
    moments = _moments(opt2)
    assert _restore(tmp_path, {"model": model2, "optim": opt2}) == 0
    assert_same(model.state_dict(), model2.state_dict())
    assert_same(opt.state_dict(), opt2.state_dict())
    for p, ptr, version in params:
        assert p.data_ptr() == ptr and p._version > version  # written in place, and torch knows it was
    after = _moments(opt2)
    assert len(after) == len(moments) and all(a is b for a, b in zip(after, moments, strict=True))
    (names,) = in_place
    assert {f"model.{k}" for k in model.state_dict()} <= names
    assert len(names) == len(model.state_dict()) + len(moments)


def test_a_fresh_adam_takes_fresh_moments_and_the_weights_go_in_place(tmp_path, in_place):
    model, opt = make_model(width=128)
    train_step(model, opt, 0)
    _save(tmp_path, {"model": model, "optim": opt})
    model2, opt2 = make_model(width=128, seed=1)  # no optimizer step yet: no moments to write into
    ptrs = [p.data_ptr() for p in model2.parameters()]
    assert _restore(tmp_path, {"model": model2, "optim": opt2}) == 0
    assert_same(model.state_dict(), model2.state_dict())
    assert_same(opt.state_dict(), opt2.state_dict())
    assert ptrs == [p.data_ptr() for p in model2.parameters()]
    for t in _moments(opt2):  # loaded tensors own their memory
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert in_place == [{f"model.{k}" for k in model.state_dict()}]
    train_step(model2, opt2, 1)  # and training goes on from there as from the original
    train_step(model, opt, 1)
    assert_same(model.state_dict(), model2.state_dict())


class _Tied(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(300, 64)
        self.out = torch.nn.Linear(64, 300, bias=False)
        self.out.weight = self.emb.weight


def test_tied_weights_stay_tied_and_go_in_place(tmp_path, in_place):
    model = _Tied(0)
    _save(tmp_path, {"model": model})
    model2 = _Tied(1)
    ptr = model2.emb.weight.data_ptr()
    assert _restore(tmp_path, {"model": model2}) == 0
    assert model2.out.weight is model2.emb.weight and model2.emb.weight.data_ptr() == ptr
    assert_same(model.state_dict(), model2.state_dict())
    assert in_place == [{"model.emb.weight"}]


def test_complex_and_bfloat16_go_in_place_bit_for_bit(tmp_path, in_place):
    g = torch.Generator().manual_seed(3)
    saved = {"c64": torch.randn(64, 33, dtype=torch.complex64, generator=g),
             "c128": torch.randn(17, 9, dtype=torch.complex128, generator=g),
             "bf16": torch.randn(1000, generator=g).to(torch.bfloat16),
             "f16": torch.randn(5, 7, generator=g).to(torch.float16),
             "step": torch.tensor(12)}
    _save(tmp_path, saved)
    live = {k: torch.zeros_like(v) for k, v in saved.items()}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    assert _restore(tmp_path, live) == 0
    assert_same(saved, live)
    assert ptrs == {k: v.data_ptr() for k, v in live.items()}
    assert in_place == [set(saved)]


def test_one_tensor_under_several_keys(tmp_path, in_place):
    t = torch.randn(4096)
    _save(tmp_path, {"a": t, "b": t, "c": {"d": t}})
    u = torch.zeros(4096)
    shared = {"a": u, "b": u, "c": {"d": u}}
    assert _restore(tmp_path, shared) == 0
    assert torch.equal(u, t) and shared["b"] is u and shared["c"]["d"] is u
    assert in_place[-1] == {"a"}
    # held under the same keys, but apart: the paths differ from the checkpoint's, read fresh
    apart = {"a": torch.zeros(4096), "b": torch.zeros(4096), "c": {"d": torch.zeros(4096)}}
    assert _restore(tmp_path, apart) == 0
    assert all(torch.equal(v, t) for v in (apart["a"], apart["b"], apart["c"]["d"]))
    assert in_place[-1] == set()


def test_another_dtype_or_a_non_contiguous_tensor_is_read_fresh(tmp_path, in_place):
    g = torch.Generator().manual_seed(5)
    saved = {"w": torch.randn(64, 32, generator=g), "t": torch.randn(32, 64, generator=g),
             "kept": torch.randn(100, generator=g)}
    _save(tmp_path, saved)
    live = {"w": torch.zeros(64, 32, dtype=torch.float64), "t": torch.zeros(64, 32).t(), "kept": torch.zeros(100)}
    ptr = live["t"].data_ptr()
    assert _restore(tmp_path, live) == 0
    assert torch.equal(live["w"], saved["w"].double()) and live["w"].dtype == torch.float64
    assert torch.equal(live["t"], saved["t"]) and live["t"].data_ptr() == ptr
    assert torch.equal(live["kept"], saved["kept"])
    assert in_place == [{"kept"}]


def test_another_shape_gives_the_same_error_and_writes_nothing_in_place(tmp_path, in_place):
    model, _ = make_model(width=64)
    _save(tmp_path, {"model": model, "w": torch.ones(8, 8)})
    wider, _ = make_model(width=96)
    before = copy.deepcopy(wider.state_dict())
    with pytest.raises(StateError, match="differ in shape"):
        _restore(tmp_path, {"model": wider, "w": torch.zeros(8, 8)})
    assert_same(before, wider.state_dict())  # the leaves of matching shape were not read into it either
    live = {"model": make_model(width=64)[0], "w": torch.zeros(4, 8)}
    with pytest.raises(StateError, match=r"shape \(8, 8\) in the checkpoint, \(4, 8\) in memory"):
        _restore(tmp_path, live)
    assert in_place == [set(), set()]


def test_a_state_that_a_save_would_refuse_is_read_fresh(tmp_path, in_place):
    model, _ = make_model()
    _save(tmp_path, {"model": model})
    model2, _ = make_model(seed=1)
    assert _restore(tmp_path, {"model": model2, "args": argparse.Namespace(lr=1.0)}, strict=False) == 0
    assert_same(model.state_dict(), model2.state_dict())
    assert in_place == []  # the live state does not flatten: nothing to read into


# -- a shard that does not verify after its bytes went in place ------------------------------------

def _flip_shard(folder: Any) -> None:
    (shard,) = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
    data = bytearray((folder / shard).read_bytes())
    data[int(len(data) * 0.7)] ^= 0x5A  # inside the tensor data, past the header
    (folder / shard).write_bytes(bytes(data))


@pytest.fixture
def damaged_newest(tmp_path) -> tuple[Any, dict[str, Any]]:
    """Two checkpoints of a model and Adam, the newest with a flipped byte; and the older one's values."""
    root = tmp_path / "run"
    model, opt = make_model(width=128)
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        train_step(model, opt, 0)
        ckpt.save(1, {"model": model, "optim": opt}, mode="sync")
        older = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
        train_step(model, opt, 1)
        ckpt.save(2, {"model": model, "optim": opt}, mode="sync")
    _flip_shard(root / "step_0000000002")
    return root, older


def _live() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, opt = make_model(width=128, seed=9)
    train_step(model, opt, 9)  # moments too go in place
    return model, opt


def test_without_fallback_the_error_says_the_state_is_undefined(damaged_newest, in_place):
    root, _ = damaged_newest
    model, opt = _live()
    with mpckpt.Checkpointer(root, workers=1) as ckpt, pytest.raises(CorruptCheckpointError) as info:
        ckpt.restore({"model": model, "optim": opt})
    message = str(info.value)
    assert info.value.state_changed is True
    assert "partly overwritten, the state is undefined" in message, message
    assert "The live state was not changed" not in message
    assert "The newest intact checkpoint is step 1" in message and "fallback=True" in message
    assert in_place and in_place[0]


def test_with_fallback_the_older_step_is_restored_over_it_bit_for_bit(damaged_newest, in_place):
    root, older = damaged_newest
    model, opt = _live()
    moments = _moments(opt)
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        assert ckpt.restore({"model": model, "optim": opt}, fallback=True) == 1
    assert_same(older, {"model": model.state_dict(), "optim": opt.state_dict()})
    assert all(a is b for a, b in zip(_moments(opt), moments, strict=True))
    assert len(in_place) == 2 and in_place[0] == in_place[1]  # the damaged step, then the older one
