"""Every setting declared once (``config.SETTINGS``) and routed once: the settings page, the
keyword groups, the ``Checkpointer`` signature and ``Config`` all agree with the declaration;
a flat keyword and its group field given different values is an error naming both.

``python -m tests.unit.test_settings`` prints the table the settings page holds.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib

import pytest

import mpckpt
from mpckpt import options
from mpckpt.checkpointer import Checkpointer
from mpckpt.config import SETTINGS, Config
from mpckpt.errors import ConfigError

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guide" / "settings.md"
BEGIN, END = "<!-- settings table: begin -->", "<!-- settings table: end -->"
_BUDGET = {"MPCKPT_MEMORY_BUDGET": "64MiB"}  # skip measuring the machine


def table() -> str:
    """The settings page's table, as the declaration says it."""
    rows = ["| argument | in a group | variable | default | what it does |", "| --- | --- | --- | --- | --- |"]
    for s in SETTINGS:
        group = "—" if s.group is None else f"`{s.group}={options.GROUPS[s.group].__name__}({s.field}=)`"
        rows.append(f"| {'`' + s.name + '`' if s.keyword else '—'} | {group} | "
                    f"{'`' + s.env + '`' if s.env else '—'} | {s.default_doc} | {s.doc} |")
    return "\n".join(rows)


def test_the_settings_page_shows_the_declaration():
    text = PAGE.read_text()
    assert BEGIN in text and END in text, f"{PAGE} lost its table markers"
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert shown == table(), ("docs/guide/settings.md disagrees with mpckpt.config.SETTINGS; paste the output of "
                              "`python -m tests.unit.test_settings` between its markers")


def test_each_setting_is_declared_once_and_config_holds_each():
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    envs = [s.env for s in SETTINGS if s.env]
    assert len(envs) == len(set(envs))
    held = {f.name for f in dataclasses.fields(Config)} - {"max_job_attempts", "nice"}
    assert held == {s.stored_as or s.name for s in SETTINGS if s.in_config}


def test_the_groups_are_the_declared_fields_with_their_types():
    for keyword, kind in options.GROUPS.items():
        declared = {s.field: s.type for s in SETTINGS if s.group == keyword}
        got = {f.name: f.type for f in dataclasses.fields(kind)}
        assert set(got) == set(declared), keyword
        for name, type_ in declared.items():
            assert got[name] == (type_ if type_ == "Any" else f"{type_} | None"), (keyword, name)
            assert getattr(kind(), name) is None  # unset by default: the variable or the default decides
        assert getattr(mpckpt, kind.__name__) is kind


def test_every_declared_keyword_is_a_typed_parameter_of_the_checkpointer():
    params = inspect.signature(Checkpointer.__init__).parameters
    for s in SETTINGS:
        if not s.keyword:
            assert s.name not in params
            continue
        param = params[s.name]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY
        assert param.annotation in (s.type, f"{s.type} | None"), s.name
        assert param.default is None or param.default == s.default, s.name
    for keyword, kind in options.GROUPS.items():
        assert params[keyword].annotation == f"{kind.__name__} | None" and params[keyword].default is None
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_a_group_and_the_flat_keywords_resolve_to_the_same_config():
    grouped = options.gather({}, {
        "memory": mpckpt.Memory(budget="32MiB", policy="skip", overlap=True, keep=False),
        "uploads": mpckpt.Uploads(workers=3, priority="low", start_method="spawn", timeout_s=7),
        "retention": mpckpt.Retention(keep_last=2, trigger=mpckpt.EveryNSteps(5)),
        "job": mpckpt.Job(process_group=False, peer_copies=0)})
    flat = dict(memory_budget="32MiB", policy="skip", overlap=True, keep_in_memory=False, workers=3,
                uploader_priority="low", start_method="spawn", job_timeout_s=7, keep_last=2,
                trigger=grouped["trigger"], process_group=False, peer_copies=0)
    assert grouped == flat
    a, b = Config.resolve(environ={}, **grouped), Config.resolve(environ={}, **flat)
    assert a == b
    assert (a.memory_budget_bytes, a.policy.value, a.overlap, a.keep_in_memory, a.workers, a.uploader_priority.value,
            a.start_method, a.job_timeout_s, a.keep_last, a.process_group) == (
        32 << 20, "skip", True, False, 3, "low", "spawn", 7.0, 2, False)


def test_a_group_field_left_out_falls_back_to_the_variable_then_the_default():
    cfg = Config.resolve(environ={**_BUDGET, "MPCKPT_WORKERS": "4"},
                         **options.gather({}, {"uploads": mpckpt.Uploads(priority="normal")}))
    assert (cfg.workers, cfg.uploader_priority.value, cfg.start_method) == (4, "normal", "forkserver")


def test_one_setting_given_both_ways_agreeing_is_accepted():
    given = options.gather({"memory_budget": "32MiB", "workers": None},
                           {"memory": mpckpt.Memory(budget="32MiB"), "uploads": mpckpt.Uploads(workers=2)})
    assert given["memory_budget"] == "32MiB" and given["workers"] == 2


@pytest.mark.parametrize(("flat", "group", "names"), [
    ({"memory_budget": "4GiB"}, {"memory": mpckpt.Memory(budget="8GiB")}, ("memory_budget='4GiB'", "budget='8GiB'")),
    ({"keep_in_memory": True}, {"memory": mpckpt.Memory(keep=False)}, ("keep_in_memory=True", "keep=False")),
    ({"job_timeout_s": 5}, {"uploads": mpckpt.Uploads(timeout_s=6)}, ("job_timeout_s=5", "Uploads(timeout_s=6)")),
    ({"keep_last": 3}, {"retention": mpckpt.Retention(keep_last=4)}, ("keep_last=3", "Retention(keep_last=4)")),
    ({"peer_copies": 1}, {"job": mpckpt.Job(peer_copies=2)}, ("peer_copies=1", "Job(peer_copies=2)")),
])
def test_one_setting_given_both_ways_differently_is_an_error_naming_both(flat, group, names):
    with pytest.raises(ConfigError) as caught:
        options.gather(flat, group)
    for name in names:
        assert name in str(caught.value)
    assert "once" in str(caught.value)


def test_a_group_of_the_wrong_kind_says_what_to_give(tmp_path):
    with pytest.raises(ConfigError, match=r"memory=\{'budget': '8GiB'\} is not an mpckpt.Memory; give "
                                          r"memory=mpckpt.Memory\(budget=..., policy="):
        Checkpointer(tmp_path / "r", memory={"budget": "8GiB"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="uploads=.*mpckpt.Uploads"):
        Checkpointer(tmp_path / "r", uploads=mpckpt.Memory())  # type: ignore[arg-type]
    assert not (tmp_path / "r").exists()  # refused before anything is written


def test_a_bad_value_in_a_group_names_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="memory_budget='abc'"):
        Checkpointer(tmp_path / "r", memory=mpckpt.Memory(budget="abc"))
    with pytest.raises(ConfigError, match="workers=0"):
        Checkpointer(tmp_path / "r", uploads=mpckpt.Uploads(workers=0))
    with pytest.raises(ConfigError, match="keep=3 is not a retention policy"):
        Checkpointer(tmp_path / "r", retention=mpckpt.Retention(keep=3))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"peer_copies=1 .* keep_in_memory is off"):
        Checkpointer(tmp_path / "r", memory=mpckpt.Memory(keep=False), job=mpckpt.Job(peer_copies=1))
    with pytest.raises(ConfigError, match="unknown setting colour"):
        Config.resolve(environ=_BUDGET, colour="blue")


def test_read_only_refuses_a_retention_group_as_it_does_the_flat_keywords(tmp_path):
    with pytest.raises(ConfigError, match="read_only=True with keep_last, trigger"):
        Checkpointer(tmp_path, read_only=True, retention=mpckpt.Retention(keep_last=2, trigger=mpckpt.EveryNSteps(3)))


def test_the_groups_are_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        mpckpt.Memory().budget = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        mpckpt.Uploads(2)  # type: ignore[misc]


def test_the_pages_grouped_example_resolves_as_it_says(monkeypatch):
    code = PAGE.read_text().split("## In groups", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    opened = {}

    def opening(root, **kwargs):  # what Checkpointer.__init__ routes, without opening the root
        groups = {k: kwargs.pop(k) for k in list(kwargs) if k in options.GROUPS}
        opened["config"] = Config.resolve(environ={}, **options.gather(kwargs, groups))

    monkeypatch.setattr(mpckpt, "Checkpointer", opening)
    exec(code, {"mpckpt": mpckpt})
    cfg = opened["config"]
    assert (cfg.memory_budget_bytes, cfg.policy.value, cfg.overlap, cfg.workers, cfg.uploader_priority.value,
            cfg.job_timeout_s, cfg.peer_copies) == (16 << 30, "skip", True, 4, "low", 600.0, 1)
    assert cfg.keep is not None and cfg.trigger is not None


def test_integrations_see_settings_given_in_groups():
    given = options.given_settings({"retention": mpckpt.Retention(keep_last=2), "workers": 1, "overlap": None})
    assert given == {"keep_last": 2, "workers": 1}


def test_type_checkers_see_every_public_name():
    """Each name in ``__all__`` is imported under TYPE_CHECKING from where it loads lazily (``_WHERE``),
    so that mypy and IDEs see the real class (``export_hf`` aside: its import would close a circle)."""
    tree = ast.parse(pathlib.Path(mpckpt.__file__).read_text())
    static = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                for alias in imp.names:
                    static[alias.asname or alias.name] = f"{imp.module}.{alias.name}" if imp.module != "mpckpt" \
                        else f"mpckpt.{alias.name}"
    public = set(mpckpt.__all__) - {"__version__", "export_hf"}
    assert public <= set(static), sorted(public - set(static))
    for name, where in static.items():
        if name != "errors":
            assert where == f"{mpckpt._WHERE[name]}.{name}", name


if __name__ == "__main__":
    print(table())
