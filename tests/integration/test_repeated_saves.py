"""Repeated saves through a real Checkpointer (uploader processes, shared memory, the snapshot
kept in memory) store what the live state holds at each save, whatever changed since the last:
the walk a repeated save takes over (``_codec.recall``) and the slab a first save writes through
its file (``_stage.written``) never store a stale or misplaced byte."""

from __future__ import annotations

import os

import pytest
import torch

import mpckpt
from mpckpt._stage import written
from mpckpt.errors import BudgetError
from tests.conftest import assert_same


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(32, 32), torch.nn.LayerNorm(32))])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _step(model, opt, 0)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _live(state: dict) -> dict:
    """What a fresh load of ``state`` must give: its state dicts now, copied."""
    return {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}


def _clone(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, _clone(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


@pytest.mark.parametrize("keep", [True, False])
def test_each_save_stores_the_state_as_it_is_when_the_model_changes_between_saves(tmp_path, keep):
    model, opt = _model()
    extra = {"a": torch.ones(3), "b": torch.zeros(2)}
    state = {"model": model, "optim": opt, "epoch": 0, "extra": extra}
    expected = {}
    changes = [
        lambda: None,
        lambda: setattr(model[0], "weight", torch.nn.Parameter(torch.randn(32, 32))),        # replaced
        lambda: setattr(model[2].weight, "data", torch.randn(32, 32)),                       # new memory
        lambda: model.add_module("head", torch.nn.Linear(32, 3)),                            # a module added
        lambda: opt.add_param_group({"params": list(model.head.parameters()), "lr": 0.5}),  # a param group
        lambda: opt.load_state_dict(opt.state_dict()),                                       # new state tensors
        lambda: model[4].register_buffer("count", torch.tensor(7, dtype=torch.int64)),      # a buffer added
        lambda: setattr(model[4].count, "data", torch.arange(3)),                            # same object, new shape
        lambda: extra.update(c=extra.pop("b")),                                              # a key renamed
        lambda: extra.update(a=torch.ones(3, dtype=torch.float64)),                          # same key, new dtype
        lambda: None,
    ]
    with mpckpt.Checkpointer(tmp_path / "run", workers=2, keep_in_memory=keep) as ckpt:
        for step, change in enumerate(changes):
            change()
            _step(model, opt, step + 1)
            state["epoch"] = step
            ckpt.save(step, state).result(60)
            expected[step] = _clone(_live(state))
    for step, want in expected.items():
        assert_same(mpckpt.load(tmp_path / "run", step=step), want)


def test_a_state_of_many_dtypes_comes_back_exactly_after_repeated_saves(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16)).to(torch.bfloat16)
    model[1].num_batches_tracked = torch.tensor(3)  # int64
    master = torch.nn.ParameterList([torch.nn.Parameter(p.detach().float()) for p in model.parameters()])
    opt = torch.optim.Adam(master.parameters(), lr=1e-3)
    counters = {f"layer{i}": torch.tensor(i, dtype=torch.int64) for i in range(5)}
    state = {"model": model, "master": master, "optim": opt, "counters": counters}
    with mpckpt.Checkpointer(tmp_path / "run", workers=2) as ckpt:
        for step in range(3):
            for p in master.parameters():
                p.grad = torch.full_like(p, 0.1 * (step + 1))
            opt.step()
            with torch.no_grad():
                for p, q in zip(model.parameters(), master.parameters(), strict=True):
                    p.copy_(q)
            counters["layer0"] += 1
            if step == 2:
                counters["layer1"] = torch.tensor(1, dtype=torch.int32)  # a counter of another dtype
            ckpt.save(step, state).result(60)
            want = _clone(_live(state))
            assert_same(mpckpt.load(tmp_path / "run", step=step), want)
    assert {t.dtype for t in mpckpt.load(tmp_path / "run")["model"].values()} == {torch.bfloat16, torch.int64}


def test_a_first_save_into_new_shared_memory_writes_it_whole_or_fails_clearly(tmp_path, monkeypatch):
    """The slab a first save makes is filled through its file; /dev/shm running out during that
    is a BudgetError from the save (never a SIGBUS), and the next save succeeds."""
    model, opt = _model()
    state = {"model": model, "optim": opt}
    made = []
    fill = written.write_wave

    def watched(flat, layout, index, slab, **kw):
        made.append(slab)
        return fill(flat, layout, index, slab, **kw)

    def full(*args: object) -> int:
        raise OSError(28, "No space left on device")

    real = os.pwritev
    monkeypatch.setattr("mpckpt._save.saving.write_wave", watched)
    with mpckpt.Checkpointer(tmp_path / "run", workers=2) as ckpt:
        ckpt.wait()
        monkeypatch.setattr(written.os, "pwritev", full)
        with pytest.raises(BudgetError, match="no room in /dev/shm"):
            ckpt.save(0, state)
        assert made and made[0].sparse  # never written through its map
        monkeypatch.setattr(written.os, "pwritev", real)
        ckpt.save(1, state).result(60)
        assert not made[-1].sparse
        st = os.stat(f"/dev/shm/{made[-1].name}")
        assert st.st_blocks * 512 >= made[-1].capacity  # every page allocated: later saves copy through the map
        _step(model, opt, 5)
        ckpt.save(2, state).result(60)
        want = _clone(_live(state))
    assert mpckpt.Checkpointer(tmp_path / "run", read_only=True).steps() == [1, 2]
    assert_same(mpckpt.load(tmp_path / "run", step=2), want)


def test_a_large_tensor_that_turns_non_contiguous_is_stored_as_it_reads_now(tmp_path):
    """The kept snapshot's hashing copy takes large tensors byte for byte only while they are
    contiguous, an answer it keeps for repeated saves of the same tensors: a transposed view of the
    same storage (same address, new shape and strides) must be asked again, never copied as the
    bytes lie."""
    base = torch.arange(512 * 1024, dtype=torch.float32).reshape(1024, 512)  # 2 MiB: copied by memmove
    with mpckpt.Checkpointer(tmp_path, workers=2) as ckpt:
        ckpt.save(0, {"w": base, "b": torch.ones(3)}, mode="sync")
        ckpt.save(1, {"w": base.t(), "b": torch.ones(3)}, mode="sync")
        ckpt.save(2, {"w": base, "b": torch.ones(3)}, mode="sync")
    assert_same(mpckpt.load(tmp_path, step=0)["w"], base)
    assert_same(mpckpt.load(tmp_path, step=1)["w"], base.t().contiguous())
    assert_same(mpckpt.load(tmp_path, step=2)["w"], base)
