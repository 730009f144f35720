"""Values beyond tensors, and strict restore, through a real Checkpointer on local disk.

- numpy arrays and scalars, namedtuples, sets, Enum members, pathlib paths, datetime values,
  dataclass instances and OrderedDicts come back as what they were, from ``mpckpt.load`` and
  from ``restore`` (in place where the live state holds tensors or arrays), without pickle;
- a class that is gone or renamed is a ``StateError`` naming the class and the key, and
  ``mpckpt.load(..., classes=False)`` still reads the checkpoint; ``mpckpt verify`` checks it
  without importing anything;
- ``restore`` is strict by default (keys missing on either side are named, a module's too);
  ``strict=False`` restores what matches and leaves the rest.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import enum
import importlib
import io
import json
import pathlib
import sys
import typing
import zoneinfo

import numpy as np
import pytest
import torch

import mpckpt
from mpckpt.cli import main
from mpckpt.errors import StateError
from mpckpt.format.manifest import checksum
from tests.test_bad_input import _rewrite_manifest


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Perm(enum.Flag):
    READ = 1
    WRITE = 2


Point = collections.namedtuple("Point", "x y")


class Batch(typing.NamedTuple):
    ids: torch.Tensor
    size: int = 0


@dataclasses.dataclass
class Schedule:
    lr: float
    warmup: torch.Tensor
    milestones: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Frozen:
    name: str
    weights: torch.Tensor


@dataclasses.dataclass
class Outer:
    inner: Schedule
    color: Color
    counts: collections.OrderedDict


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    return {
        "np": {
            "f32": rng.standard_normal((3, 4)).astype(np.float32),
            "i64": rng.integers(0, 100, 7),
            "u16": rng.integers(0, 60000, 5).astype(np.uint16),
            "f16": rng.standard_normal(4).astype(np.float16),
            "c128": (rng.standard_normal(3) + 1j * rng.standard_normal(3)),
            "bool": rng.integers(0, 2, 6).astype(bool),
            "big_endian": np.arange(4, dtype=">i4") + seed,
            "reversed": np.arange(6.0)[::-1] + seed,
            "read_only": np.broadcast_to(np.arange(3) + seed, (2, 3)),
            "scalar_0d": np.array(1.5 + seed),
            "empty": np.zeros((0, 3), dtype=np.float32),
        },
        "scalars": [np.float32(1.5 + seed), np.float64(2.25 + seed), np.int64(7 + seed), np.uint8(200),
                    np.bool_(seed % 2 == 0), np.complex64(1 + 2j), np.float16(0.5), np.str_(f"s{seed}"),
                    np.float32("nan")],
        "point": Point(seed, torch.randn(2, generator=g)),
        "batch": Batch(torch.arange(4) + seed, size=4 + seed),
        "sets": (set(range(seed + 3)), frozenset({"a", f"b{seed}", (1, 2)})),
        "enums": [Color.RED if seed == 0 else Color.GREEN, Level.HIGH, Perm.READ | Perm.WRITE, Perm.READ],
        "paths": [pathlib.PurePosixPath(f"/data/{seed}"), pathlib.Path(f"runs/{seed}"),
                  pathlib.PureWindowsPath(rf"C:\data\{seed}")],
        "times": [
            dt.datetime(2024, 5, 1 + seed, 12, 30, 15, 123456),
            dt.datetime(2024, 5, 1, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30))),
            dt.datetime(2024, 5, 1, tzinfo=dt.timezone(dt.timedelta(hours=-2), "LAB")),
            dt.datetime(2024, 11, 3, 1, 30, tzinfo=zoneinfo.ZoneInfo("America/New_York"), fold=1),
            dt.date(2020, 2, 29), dt.time(23, 59, 59, 1, tzinfo=dt.timezone.utc),
            dt.timedelta(days=-1, seconds=5 + seed, microseconds=7),
        ],
        "schedule": Schedule(0.1 * (seed + 1), torch.full((3,), float(seed)), [10, 20 + seed]),
        "frozen": Frozen(f"f{seed}", torch.full((2,), float(seed))),
        "outer": Outer(Schedule(1.0, torch.zeros(1) + seed), Color.RED,
                       collections.OrderedDict([("z", seed), ("a", 2), ("m", 3)])),
        "ordered": collections.OrderedDict([("second", torch.ones(2) * seed), ("first", 1)]),
        "buffer": _buffer(bytes(range(seed, seed + 40)) + b"\xff\x00", 5 + seed),  # raw bytes, no pickle
    }


def _buffer(data: bytes, position: int) -> io.BytesIO:
    buffer = io.BytesIO(data)
    buffer.seek(position)
    return buffer


def assert_equal(a, b, path="") -> None:
    """Equal values of the same type (arrays: dtype, shape and bits; tensors: bits)."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for k in a:
            assert_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{path}.{i}")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_equal(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (path, a, b)
    elif isinstance(a, io.BytesIO):
        assert a.getvalue() == b.getvalue() and a.tell() == b.tell(), (path, a.getvalue(), b.getvalue())
    elif isinstance(a, dt.datetime | dt.time):
        assert a == b and a.fold == b.fold and a.tzinfo == b.tzinfo and a.tzname() == b.tzname(), (path, a, b)
    else:
        assert a == b, (path, a, b)


def test_values_come_back_as_they_were_from_load_and_restore(tmp_path):
    state = make_state(0)
    state["np"]["again"] = state["np"]["f32"]  # the same array twice: stored once, memory shared on load
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:  # allow_pickle is off
        ckpt.save(0, state, mode="sync")
    skeleton = (tmp_path / "step_0000000000" / "skeleton.json").read_text()
    assert '"pickle"' not in skeleton
    assert len(json.loads(skeleton)["leaves"]) == 17  # 11 arrays, 6 tensors: "again" is not another

    loaded = mpckpt.load(tmp_path)
    assert_equal(state, loaded)
    assert np.shares_memory(loaded["np"]["again"], loaded["np"]["f32"])
    assert loaded["enums"][0] is Color.RED and loaded["enums"][1] is Level.HIGH
    assert list(loaded["outer"].counts) == ["z", "a", "m"] and list(loaded["ordered"]) == ["second", "first"]

    live = make_state(1)  # the same structure, other values
    live["np"]["again"] = live["np"]["f32"]
    arrays = {k: live["np"][k] for k in ("f32", "i64", "u16", "c128")}
    tensors = (live["point"].y, live["batch"].ids, live["schedule"].warmup, live["frozen"].weights,
               live["ordered"]["second"])
    schedule = live["schedule"]
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        assert ckpt.restore(live) == 0
    assert_equal(state, live)
    for k, arr in arrays.items():  # same shape and dtype: overwritten in place
        assert live["np"][k] is arr, k
    for before, after in zip(tensors, (live["point"].y, live["batch"].ids, live["schedule"].warmup,
                                       live["frozen"].weights, live["ordered"]["second"]), strict=True):
        assert before is after  # tensors inside namedtuples, dataclasses and OrderedDicts: in place
    assert live["schedule"] is schedule  # a dataclass is updated in place, a frozen one replaced


def test_an_array_of_another_shape_or_dtype_takes_its_slot(tmp_path):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(0, {"a": np.arange(5, dtype=np.int32), "b": np.ones(3), "c": [np.zeros(2)]}, mode="sync")
        live = {"a": np.zeros(2, dtype=np.int32), "b": np.zeros(3, dtype=np.float32), "c": [np.ones(2)]}
        kept = live["c"][0]
        ckpt.restore(live)
    assert live["a"].tolist() == [0, 1, 2, 3, 4] and live["b"].dtype == np.float64
    assert live["c"][0] is kept and kept.tolist() == [0.0, 0.0]


def test_a_class_that_is_gone_is_a_clear_error_and_classes_false_still_loads(tmp_path, monkeypatch):
    here, original = sys.modules[__name__], Schedule
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(0, {"run": {"sched": Schedule(0.5, torch.ones(2), [3])}, "color": Color.GREEN,
                      "pt": Point(1, 2)}, mode="sync")
    monkeypatch.delattr(here, "Schedule")
    with pytest.raises(StateError, match=r"'run\.sched'.*dataclass.*test_values\.Schedule.*importable.*classes=False"):
        mpckpt.load(tmp_path)
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt, pytest.raises(StateError, match="Schedule"):
        ckpt.restore({"run": {"sched": None}, "color": None, "pt": None})
    plain = mpckpt.load(tmp_path, classes=False)
    assert plain["run"]["sched"]["milestones"] == [3] and torch.equal(plain["run"]["sched"]["warmup"], torch.ones(2))
    assert plain["color"] == "GREEN" and plain["pt"] == {"x": 1, "y": 2}
    assert main(["verify", str(tmp_path)]) == 0  # verify imports no class

    monkeypatch.setattr(here, "Schedule", Frozen, raising=False)  # another dataclass under the old name: other fields
    with pytest.raises(StateError, match=r"'run\.sched'.*Schedule has no field lr, warmup, milestones now "
                                         r"and a new field name, weights without a default"):
        mpckpt.load(tmp_path)
    monkeypatch.setattr(here, "Schedule", Point)  # not a dataclass at all
    with pytest.raises(StateError, match=r"Schedule, which cannot be found now \(that name now holds"):
        mpckpt.load(tmp_path)
    monkeypatch.setattr(here, "Schedule", original)
    monkeypatch.setattr(here, "Color", enum.Enum("Color", {"RED": "red"}))  # a member removed
    with pytest.raises(StateError, match=r"'color'.*Color has no member 'GREEN' now.*classes=False"):
        mpckpt.load(tmp_path)


def test_a_module_that_is_not_imported_is_never_imported_by_a_load(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mpckpt_gone_mod.py").write_text(
        "import enum\nclass Mode(enum.Enum):\n    TRAIN = 1\n")
    import mpckpt_gone_mod  # type: ignore[import-not-found]

    root = tmp_path / "run"
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        ckpt.save(0, {"mode": mpckpt_gone_mod.Mode.TRAIN}, mode="sync")
    monkeypatch.delitem(sys.modules, "mpckpt_gone_mod")  # as in a fresh process that never imported it
    with pytest.raises(StateError, match=r"'mode'.*Enum member.*mpckpt_gone_mod\.Mode.*not imported.*"
                                         r"`import mpckpt_gone_mod` before loading"):
        mpckpt.load(root)
    assert "mpckpt_gone_mod" not in sys.modules  # the checkpoint named it; mpckpt did not import it
    assert mpckpt.load(root, classes=False) == {"mode": "TRAIN"}
    again = importlib.import_module("mpckpt_gone_mod")  # the user imports it: the load works
    assert mpckpt.load(root) == {"mode": again.Mode.TRAIN}


def test_classes_that_cannot_be_found_again_are_refused_at_save(tmp_path):
    @dataclasses.dataclass
    class Local:
        x: int

    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        with pytest.raises(StateError, match=r"'cfg'.*Local.*inside a function.*dataclasses\.asdict"):
            ckpt.save(0, {"cfg": Local(1)})
        with pytest.raises(StateError, match=r"'arr'.*dtype object.*tolist"):
            ckpt.save(0, {"arr": np.array([{}, 1], dtype=object)})
        with pytest.raises(StateError, match=r"'when'.*datetime64.*item"):
            ckpt.save(0, {"when": np.datetime64("2024-01-01")})
    with mpckpt.Checkpointer(tmp_path, workers=1, allow_pickle=True) as ckpt:  # opted in: pickled
        ckpt.save(0, {"arr": np.array(["a", None], dtype=object)}, mode="sync")
    assert mpckpt.load(tmp_path, allow_pickle=True)["arr"].tolist() == ["a", None]


def test_numpy_is_imported_on_load_only_for_numpy_values(tmp_path, monkeypatch):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(0, {"x": torch.ones(2), "when": dt.date(2024, 1, 1)}, mode="sync")
        ckpt.save(1, {"x": torch.ones(2), "a": np.ones(2)}, mode="sync")
    monkeypatch.setitem(sys.modules, "numpy", None)  # as if numpy were not installed
    assert mpckpt.load(tmp_path, step=0)["when"] == dt.date(2024, 1, 1)
    with pytest.raises(StateError, match=r"'a'.*numpy is not installed"):
        mpckpt.load(tmp_path, step=1)


def test_verify_checks_the_new_nodes(tmp_path, capsys):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(0, make_state(0), mode="sync")
    assert main(["verify", str(tmp_path)]) == 0
    folder = tmp_path / "step_0000000000"
    doc = json.loads((folder / "skeleton.json").read_text())
    node = doc["tree"]["v"][doc["tree"]["k"].index("np")]["v"][0]
    assert node["__mpckpt__"] == "ndarray"
    node["dtype"] = "<i2"  # says int16, its tensor is float32
    data = json.dumps(doc).encode()
    (folder / "skeleton.json").write_bytes(data)
    _rewrite_manifest(folder, lambda b: b["files"]["skeleton.json"].update(size=len(data), xxh3_64=checksum(data)))
    assert main(["verify", str(tmp_path)]) == 1
    assert "ndarray" in capsys.readouterr().err


# -- strict restore --------------------------------------------------------------------------

def _model(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(layers)
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])


def test_restore_is_strict_about_keys_and_names_them(tmp_path):
    model = _model()
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(0, {"model": model, "step": 0, "extra": {"a": 1, "b": 2}}, mode="sync")
        with pytest.raises(StateError, match=r"step 0 of .* does not match the state: the state has 1 key \('epoch'\) that the "
                                             r"checkpoint lacks; the checkpoint has 2 keys \('extra\.a', 'extra\.b'\)"
                                             r" that the state lacks.*strict=False"):
            ckpt.restore({"model": _model(), "step": 0, "epoch": 0, "extra": {}})
        with pytest.raises(StateError, match=r"state has 4 keys \('model\.2\.weight', 'model\.2\.bias', 'more', 'x'\)"):
            ckpt.restore({"model": _model(3), "step": 0, "extra": {"a": 0, "b": 0}, "more": [1], "x": 2})
        with pytest.raises(StateError, match=r"checkpoint has 2 keys \('model\.1\.weight', 'model\.1\.bias'\)"):
            ckpt.restore({"model": _model(1), "step": 0, "extra": {"a": 0, "b": 0}})
        many = {f"k{i}": i for i in range(12)}
        with pytest.raises(StateError, match=r"state has 12 keys \('k0',.*'k4' and 7 more\)"):
            ckpt.restore({"model": _model(), "step": 0, "extra": {"a": 0, "b": 0}, **many})


def test_strict_false_restores_what_matches_and_leaves_the_rest(tmp_path):
    model = _model()
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(0, {"model": model, "step": 5, "extra": {"a": 1}, "only_saved": 1}, mode="sync")
        bigger = _model(3)
        third = bigger[2].weight.detach().clone()
        live = {"model": bigger, "step": 0, "extra": {"a": 0, "new": 9}, "only_live": "kept"}
        assert ckpt.restore(live, strict=False) == 0
    assert live["step"] == 5 and live["extra"] == {"a": 1, "new": 9} and live["only_live"] == "kept"
    assert "only_saved" not in live
    assert torch.equal(bigger[0].weight, model[0].weight) and torch.equal(bigger[2].weight, third)


def test_lists_of_tensors_are_keys_lists_of_values_are_values(tmp_path):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(0, {"ema": [torch.ones(2), torch.ones(2) * 2], "history": [0.5, 0.4, 0.3]}, mode="sync")
        history = []
        live = {"ema": [torch.zeros(2), torch.zeros(2), torch.zeros(2)], "history": history}
        with pytest.raises(StateError, match=r"state has 1 key \('ema\.2'\)"):
            ckpt.restore(live)
        live = {"ema": [torch.zeros(2), torch.zeros(2), torch.zeros(2)], "history": history}
        ckpt.restore(live, strict=False)
    assert [t.tolist() for t in live["ema"]] == [[1.0, 1.0], [2.0, 2.0], [0.0, 0.0]]
    assert live["history"] is history and history == [0.5, 0.4, 0.3]  # a list of values: in place, any length


class Stateful:
    """An object with state_dict()/load_state_dict(strict=) that is not a module."""

    def __init__(self) -> None:
        self.value, self.strict = 0, None

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        self.value, self.strict = state["value"], strict


def test_strict_is_passed_to_load_state_dict_that_takes_it(tmp_path):
    saved = Stateful()
    saved.value = 7
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(0, {"obj": saved, "rng": mpckpt.RNGState()}, mode="sync")
        for strict in (True, False):
            live = {"obj": Stateful(), "rng": mpckpt.RNGState()}  # RNGState.load_state_dict takes no strict
            ckpt.restore(live, strict=strict)
            assert live["obj"].value == 7 and live["obj"].strict is strict
