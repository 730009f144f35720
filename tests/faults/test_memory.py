"""Memory faults: a state far larger than the budget, and a /dev/shm smaller than the budget.

- A 1 GiB state under a 64 MiB budget streams through the budget in pieces: the shared memory
  of this process, sampled from outside every 2 ms, never exceeds the budget, and the
  checkpoint loads back bit for bit.
- /dev/shm is checked when the Checkpointer opens (``config.fit_budget_to_shm``): with less free space than
  the smaller of the budget and 64 MiB it refuses with a ``ConfigError`` saying what to do;
  with less than the budget it warns and lowers the effective budget to what is there.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import mpckpt
import mpckpt.config
from mpckpt.errors import ConfigError
from tests.integration.test_core import ShmSampler

MiB = 1 << 20


def big_state() -> dict[str, torch.Tensor]:
    # 16 x 64 MiB float32 = 1 GiB; arange + a per-tensor offset is fast and makes every tensor distinct
    n = 16 * MiB
    return {f"layer{i:02d}": torch.arange(n, dtype=torch.float32).add_(i * 0.5) for i in range(16)}


def test_one_gib_through_a_64_mib_budget(tmp_path):
    budget = 64 * MiB
    state = big_state()
    with ShmSampler() as sampler:
        with mpckpt.Checkpointer(tmp_path, memory_budget="64MiB", workers=2) as ckpt:
            future = ckpt.save(0, state)
            ckpt.wait(timeout_s=300)
            peak_reported = ckpt.stats.peak_shm_bytes
        assert future.result(0).name == "step_0000000000"
    assert 0 < sampler.peak <= budget, sampler.peak
    assert 0 < peak_reported <= budget, peak_reported
    loaded = mpckpt.load(tmp_path, step=0)
    assert list(loaded) == list(state)
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape, key
        assert torch.equal(loaded[key], value), key


def _shm_free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(mpckpt.config, "shm_free_bytes", lambda: free)


@pytest.mark.parametrize("free_mib", [0, 1, 63])
def test_dev_shm_below_64_mib_is_a_config_error(tmp_path, monkeypatch, free_mib):
    _shm_free(monkeypatch, free_mib * MiB)
    with pytest.raises(ConfigError) as info:
        mpckpt.Checkpointer(tmp_path / "run", memory_budget="1GiB", workers=1)
    message = str(info.value)
    assert "/dev/shm" in message
    assert "--shm-size" in message and "memory_budget" in message  # what to do about it
    assert f"{free_mib} MiB" in message


def test_dev_shm_below_a_small_budget_is_a_config_error(tmp_path, monkeypatch):
    _shm_free(monkeypatch, 8 * MiB)
    with pytest.raises(ConfigError, match="/dev/shm"):
        mpckpt.Checkpointer(tmp_path / "run", memory_budget="16MiB", workers=1)


def test_dev_shm_between_64_mib_and_the_budget_warns_and_lowers_the_budget(tmp_path, monkeypatch):
    free = 200 * MiB
    _shm_free(monkeypatch, free)
    with pytest.warns(UserWarning, match="/dev/shm has 200 MiB free"):
        ckpt = mpckpt.Checkpointer(tmp_path / "run", memory_budget="1GiB", workers=1)
    with ckpt:
        budget = ckpt.config.memory_budget_bytes
        assert 64 * MiB <= budget <= free
        # the lowered budget is the one in force: a state above it still saves, streamed
        state = {f"t{i}": torch.arange(16 * MiB, dtype=torch.float32) + i for i in range(4)}  # 256 MiB
        ckpt.save(0, state)
        ckpt.wait(timeout_s=120)
        assert ckpt.stats.peak_shm_bytes <= budget
    loaded = mpckpt.load(tmp_path / "run")
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


def test_enough_dev_shm_is_silent(tmp_path, monkeypatch):
    _shm_free(monkeypatch, 2 << 30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mpckpt.Checkpointer(tmp_path / "run", memory_budget="1GiB", workers=1) as ckpt:
            assert ckpt.config.memory_budget_bytes == 1 << 30
