"""Settings: every MPCKPT_* variable is read and validated in mpckpt.config, argument > env > default."""

from __future__ import annotations

import dataclasses

import pytest

from mpckpt import config
from mpckpt.config import Config, progress_enabled
from mpckpt.errors import ConfigError

_BUDGET = {"MPCKPT_MEMORY_BUDGET": "64MiB"}  # skip measuring the machine


@pytest.mark.parametrize("bad", ["maybe", "2", "yes please"])
def test_a_bad_direct_io_value_names_the_variable(bad):
    with pytest.raises(ConfigError, match="MPCKPT_DIRECT_IO"):
        Config.resolve(environ={**_BUDGET, "MPCKPT_DIRECT_IO": bad})


def test_a_bad_direct_io_argument_names_the_argument():
    with pytest.raises(ConfigError, match="direct_io='maybe'"):
        Config.resolve(direct_io="maybe", environ=_BUDGET)


def test_direct_io_is_on_by_default_and_an_argument_beats_the_environment():
    assert Config.resolve(environ=_BUDGET).direct_io is True
    assert Config.resolve(environ={**_BUDGET, "MPCKPT_DIRECT_IO": ""}).direct_io is True  # empty = unset
    off = {**_BUDGET, "MPCKPT_DIRECT_IO": "0"}
    assert Config.resolve(environ=off).direct_io is False
    assert Config.resolve(environ={**_BUDGET, "MPCKPT_DIRECT_IO": "false"}).direct_io is False
    assert Config.resolve(direct_io=True, environ=off).direct_io is True
    assert Config.resolve(direct_io=False, environ={**_BUDGET, "MPCKPT_DIRECT_IO": "1"}).direct_io is False


@pytest.mark.parametrize("bad", ["maybe", "2", "nope"])
def test_a_bad_progress_value_names_the_variable(bad):
    with pytest.raises(ConfigError, match="MPCKPT_PROGRESS"):
        progress_enabled({"MPCKPT_PROGRESS": bad})


def test_progress_is_on_by_default_and_follows_the_variable(monkeypatch):
    assert progress_enabled({}) is True
    assert progress_enabled({"MPCKPT_PROGRESS": ""}) is True
    assert progress_enabled({"MPCKPT_PROGRESS": "0"}) is False
    assert progress_enabled({"MPCKPT_PROGRESS": "off"}) is False
    assert progress_enabled({"MPCKPT_PROGRESS": "1"}) is True
    monkeypatch.setenv("MPCKPT_PROGRESS", "0")  # without an argument: the process environment
    assert progress_enabled() is False
    monkeypatch.setenv("MPCKPT_PROGRESS", "maybe")
    with pytest.raises(ConfigError, match="MPCKPT_PROGRESS"):
        progress_enabled()


def test_loading_refuses_a_bad_progress_value(monkeypatch):
    from mpckpt._progress import reading_bar

    monkeypatch.setenv("MPCKPT_PROGRESS", "maybe")
    with pytest.raises(ConfigError, match="MPCKPT_PROGRESS"):
        reading_bar(1, "load")


def test_defaults_are_written_once_and_resolve_uses_them():
    """Each default is the declaration's (``config.SETTINGS``), and what ``resolve`` gives with nothing set."""
    cfg = Config.resolve(environ=_BUDGET)
    for setting in config.SETTINGS:
        if setting.in_config and setting.measure is None:
            assert getattr(cfg, setting.stored_as or setting.name) == setting.default, setting.name
    assert not [f.name for f in dataclasses.fields(Config) if f.default is not dataclasses.MISSING
                and f.name not in ("max_job_attempts", "nice")], "a setting's default belongs to its declaration"
    assert cfg.workers == config.DEFAULT_WORKERS
    assert (cfg.policy, cfg.overlap, cfg.timeout_s, cfg.job_timeout_s, cfg.start_method, cfg.direct_io) == (
        config.DEFAULT_POLICY, config.DEFAULT_OVERLAP, config.DEFAULT_TIMEOUT_S, config.DEFAULT_JOB_TIMEOUT_S,
        config.DEFAULT_START_METHOD, config.DEFAULT_DIRECT_IO)


def test_every_setting_follows_argument_then_environment_then_default():
    env = {**_BUDGET, "MPCKPT_WORKERS": "3", "MPCKPT_POLICY": "skip", "MPCKPT_OVERLAP": "1",
           "MPCKPT_TIMEOUT_S": "60", "MPCKPT_JOB_TIMEOUT_S": "30", "MPCKPT_START_METHOD": "spawn",
           "MPCKPT_DIRECT_IO": "0"}
    cfg = Config.resolve(environ=env)
    assert (cfg.workers, cfg.policy.value, cfg.overlap, cfg.timeout_s, cfg.job_timeout_s, cfg.start_method,
            cfg.direct_io) == (3, "skip", True, 60.0, 30.0, "spawn", False)
    cfg = Config.resolve(workers=1, policy="coalesce", overlap=False, timeout_s=5, job_timeout_s=6,
                         start_method="fork", direct_io=True, environ=env)
    assert (cfg.workers, cfg.policy.value, cfg.overlap, cfg.timeout_s, cfg.job_timeout_s, cfg.start_method,
            cfg.direct_io) == (1, "coalesce", False, 5.0, 6.0, "fork", True)
