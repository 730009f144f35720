"""Unit tests of the pure parts: settings, sizes, layout, headers, manifests, retention, API."""

from __future__ import annotations

import dataclasses
import json
import math
import types

import pytest
import torch

import mpckpt
from mpckpt._codec.snapshot import flatten
from mpckpt._stage import layout as _layout
from mpckpt.config import BudgetPolicy, Config, parse_bytes
from mpckpt.errors import ConfigError, CorruptCheckpointError
from mpckpt.format.manifest import FileEntry, Manifest, checkpoint_name, checksum, step_of
from mpckpt.format.safetensors import HeaderEntry, build_header, parse_header
from mpckpt.policies.retention import KeepAny, KeepBest, KeepEvery, KeepInterval, KeepLast, KeepNewerThan


@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 << 20), ("8GiB", 8 << 30), ("1.5GB", 1_500_000_000), ("1048576", 1 << 20),
    (" 2 kib ", 2048), (4096, 4096), ("0.5", 500), (0.25, 250),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text, setting="memory_budget", available=1000) == expected


@pytest.mark.parametrize("bad", ["abc", "-1", "0", "1.5B5", "", "nan", "inf", "3 parsecs", None, [1]])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ConfigError, match="memory_budget"):
        parse_bytes(bad, setting="memory_budget", available=1000)


def test_config_argument_beats_environment_beats_default():
    env = {"MPCKPT_MEMORY_BUDGET": "64MiB", "MPCKPT_WORKERS": "3", "MPCKPT_POLICY": "skip"}
    cfg = Config.resolve(environ=env)
    assert (cfg.memory_budget_bytes, cfg.workers, cfg.policy) == (64 << 20, 3, BudgetPolicy.SKIP)
    cfg = Config.resolve(memory_budget="32MiB", workers=1, policy="coalesce", environ=env)
    assert (cfg.memory_budget_bytes, cfg.workers, cfg.policy) == (32 << 20, 1, BudgetPolicy.COALESCE)
    cfg = Config.resolve(environ={})
    assert cfg.memory_budget_bytes >= 1 << 20 and cfg.workers == 2 and cfg.policy is BudgetPolicy.BLOCK


def _leaves(sizes):
    return [types.SimpleNamespace(name=f"t{i}", code="F32", stored_shape=(n,), nbytes=4 * n)
            for i, n in enumerate(sizes)]


def test_layout_balances_shards_across_workers():
    layout = _layout.plan_layout(_leaves([1000, 900, 800, 100, 100, 50]), budget_bytes=1 << 30, workers=2)
    assert len(layout.waves) == 1
    loads = [s.nbytes for s in layout.waves[0].shards]
    assert len(loads) == 2 and max(loads) - min(loads) <= 4 * 1000


def test_layout_streams_a_state_larger_than_the_budget_in_waves():
    budget = 4 << 20
    mib = (1 << 20) // 4  # float32 elements in one MiB
    layout = _layout.plan_layout(_leaves([mib] * 6 + [3 * mib]), budget_bytes=budget, workers=2)
    assert len(layout.waves) > 2
    assert all(w.nbytes <= budget // 2 for w in layout.waves)
    chunks = [p for w in layout.waves for s in w.shards for p in s.pieces if p.chunk]
    assert chunks and {p.key.split("#")[0] for p in chunks} == {"t6"}
    assert sum(p.nbytes for p in chunks) == 3 << 20


def test_layout_keeps_every_piece_aligned_to_its_element_size():
    leaves = [types.SimpleNamespace(name=f"t{i}", code=code, stored_shape=(n,), nbytes=n * size)
              for i, (code, size, n) in enumerate([("U8", 1, 3), ("F64", 8, 5), ("F16", 2, 7), ("F32", 4, 1)])]
    layout = _layout.plan_layout(leaves, budget_bytes=1 << 30, workers=1)
    for shard in layout.waves[0].shards:
        for p in shard.pieces:
            assert p.offset % p.itemsize == 0


def test_header_round_trip_and_validation():
    header = build_header([HeaderEntry("a", "F32", (2, 2), 0, 16), HeaderEntry("b", "U8", (3,), 16, 19)], {"k": "v"})
    assert len(header) % 8 == 0
    parsed = parse_header(header, path="x", file_size=len(header) + 19)
    assert parsed.entries["b"].end == 19 and parsed.metadata == {"k": "v"}
    with pytest.raises(CorruptCheckpointError, match="data section"):
        parse_header(header, path="x", file_size=len(header) + 25)  # trailing bytes no tensor covers
    hole = build_header([HeaderEntry("a", "F32", (1,), 4, 8)])
    with pytest.raises(CorruptCheckpointError, match="hole"):
        parse_header(hole, path="x", file_size=len(hole) + 8)


def test_manifest_round_trip_and_tamper_detection():
    m = Manifest(step=3, seq=1, kind="state", files={"a.safetensors": FileEntry(10, "ab"), "s.json": FileEntry(2, "cd", ref="step_0000000001")},
                 metrics={"loss": 0.5, "bad": float("nan")})
    data = m.to_bytes()
    back = Manifest.from_bytes(data, path="m")
    assert back.files == m.files and back.metrics["loss"] == 0.5 and math.isnan(back.metrics["bad"])
    assert back.location("step_0000000003", "s.json") == "step_0000000001/s.json"
    body = json.loads(data)
    body["step"] = 4
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        Manifest.from_bytes(json.dumps(body).encode(), path="m")
    with pytest.raises(CorruptCheckpointError, match="torn"):
        Manifest.from_bytes(data[: len(data) // 2], path="m")


def test_manifest_figures_are_optional_and_only_numbers():
    plain = Manifest(step=3, seq=1, kind="state", files={}, created_unix=5.0)
    assert "figures" not in json.loads(plain.to_bytes())  # a manifest without them is as before
    assert Manifest.from_bytes(plain.to_bytes(), path="m").figures is None
    figures = {"blocked_ms": 1.5, "snapshot_ms": 1.0, "persist_ms": 20.25, "bytes": 100, "written_bytes": 90}
    back = Manifest.from_bytes(dataclasses.replace(plain, figures=figures).to_bytes(), path="m")
    # no new version for it; the figures a manifest lacks (those an older mpckpt did not record) are None
    assert back.figures == {**figures, "durable_ms": None, "waiting": None}
    assert back.format_version == plain.format_version
    odd = dataclasses.replace(plain, figures={"blocked_ms": None, "persist_ms": "fast", "bytes": True, "x": 1})
    assert Manifest.from_bytes(odd.to_bytes(), path="m").figures == dict.fromkeys(back.figures)
    body = json.loads(plain.to_bytes())
    del body["manifest_checksum"]
    body["figures"] = [1]
    body["manifest_checksum"] = checksum(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    with pytest.raises(CorruptCheckpointError, match="figures"):
        Manifest.from_bytes(json.dumps(body).encode(), path="m")


def test_checkpoint_names():
    assert checkpoint_name(42) == "step_0000000042"
    assert step_of("step_0000000042") == 42 and step_of(".tmp.step_1") is None and step_of("step_x") is None


def _records(steps, losses=None):
    return [(s, types.SimpleNamespace(metrics={"loss": (losses or {}).get(s)} if losses else {},
                                      created_unix=100.0 + s)) for s in steps]


def test_retention_policies_are_pure_and_combine():
    recs = _records([1, 2, 3, 4, 5], {1: 0.1, 2: 0.5, 3: 0.4, 4: 0.9, 5: 0.8})
    assert KeepLast(2).keep(recs) == [False, False, False, True, True]
    assert KeepBest(1, "loss").keep(recs) == [True, False, False, False, True]  # the newest is always kept
    assert KeepEvery(2).keep(recs) == [False, True, False, True, True]
    assert KeepNewerThan(1.5, clock=lambda: 105.0).keep(recs) == [False, False, False, True, True]
    either = KeepLast(1) | KeepBest(1, "loss")
    assert either.keep(recs) == [True, False, False, False, True]
    assert KeepAny(KeepLast(1), KeepBest(1, "loss")).keep(recs) == either.keep(recs)
    assert KeepBest(2, "loss", "max").keep(recs) == [False, False, False, True, True]
    assert repr(either | KeepEvery(2)) == "KeepLast(1) | KeepBest(1, 'loss', 'min') | KeepEvery(2)"
    assert KeepLast(3).keep([]) == []
    for bad in (lambda: KeepLast(0), lambda: KeepEvery(-1), lambda: KeepBest(1, "loss", "low"),
                lambda: KeepNewerThan(0), lambda: KeepLast(True)):
        with pytest.raises(ConfigError):
            bad()


def test_keep_interval_thins_out_evenly_and_stably():
    recs = [(s, types.SimpleNamespace(metrics={}, created_unix=t)) for s, t in
            [(1, 0.0), (2, 20.0), (3, 59.0), (4, 61.0), (5, 100.0), (6, 130.0), (7, 200.0)]]
    decided = KeepInterval(60).keep(recs)
    assert decided == [True, False, False, True, False, True, True]  # 0, 61, 130 (>= 60 apart), newest
    survivors = [r for r, keep in zip(recs, decided, strict=True) if keep]
    assert KeepInterval(60).keep(survivors) == [True] * len(survivors)  # applied again: the same ones
    assert repr(KeepInterval(60) | KeepLast(2)) == "KeepInterval(60) | KeepLast(2)"
    for bad in (0, -1, float("inf"), float("nan"), True, "60"):
        with pytest.raises(ConfigError, match="KeepInterval"):
            KeepInterval(bad)


def test_keep_best_can_keep_what_has_no_metric_yet():
    recs = _records([1, 2, 3, 4], {1: 0.5, 3: 0.1})
    assert KeepBest(1, "loss").keep(recs) == [False, False, True, True]
    assert KeepBest(1, "loss", keep_missing=True).keep(recs) == [False, True, True, True]
    assert repr(KeepBest(1, "loss", keep_missing=True)) == "KeepBest(1, 'loss', 'min', keep_missing=True)"
    with pytest.raises(ConfigError, match="keep_missing"):
        KeepBest(1, "loss", keep_missing="yes")


def test_triggers_are_pure_and_combine():
    from mpckpt.policies.triggers import Moment, Schedule

    def at(step, last_step=None, last_time=0.0, now=0.0):
        return Moment(step, last_step, last_time, now)

    assert [mpckpt.EveryNSteps(4).due(at(s)) for s in range(9)] == [s % 4 == 0 for s in range(9)]
    every_minute = mpckpt.EveryNSeconds(60)
    assert not every_minute.due(at(1, now=59.9)) and every_minute.due(at(1, now=60.0))
    assert every_minute.due(at(7, last_step=3, last_time=100.0, now=160.5))
    either = mpckpt.EveryNSteps(10) | every_minute
    assert either.due(at(10, now=1.0)) and either.due(at(11, now=61.0)) and not either.due(at(11, now=1.0))
    assert repr(either | mpckpt.EveryNSteps(3)) == "EveryNSteps(10) | EveryNSeconds(60) | EveryNSteps(3)"
    schedule = Schedule(every_minute, opened=1000.0)
    assert not schedule.due(5, 1030.0) and schedule.due(5, 1060.0)
    schedule.saved(5, 1060.0)
    assert not schedule.due(6, 1100.0) and schedule.due(6, 1120.0)
    assert Schedule(None, opened=0.0).due(1, 0.0)  # no trigger: always due
    for bad in (lambda: mpckpt.EveryNSteps(0), lambda: mpckpt.EveryNSteps(2.5), lambda: mpckpt.EveryNSeconds(0),
                lambda: mpckpt.EveryNSeconds(float("inf")), lambda: mpckpt.EveryNSteps(True)):
        with pytest.raises(ConfigError):
            bad()


def test_flatten_keeps_int_keys_and_tuples_json_safe():
    flat = flatten({0: {"m": torch.ones(2)}, "betas": (0.9, 0.99), "lr": 1e-3})
    text = json.dumps(flat.tree, allow_nan=False)
    assert '"tuple"' in text and len(flat.leaves) == 1


def test_public_api_is_exactly_all():
    assert sorted(mpckpt.__all__) == sorted(set(mpckpt.__all__))
    for name in mpckpt.__all__:
        assert getattr(mpckpt, name) is not None
    with pytest.raises(AttributeError):
        mpckpt.NotAThing  # noqa: B018
    assert set(dir(mpckpt)) == set(mpckpt.__all__)
