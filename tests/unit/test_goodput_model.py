"""Properties of bench/goodput_model.py's analytic model: bounds, monotony, tiers, the --check figures."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "goodput_model.py"
_spec = importlib.util.spec_from_file_location("goodput_model", _PATH)
gm = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("goodput_model", gm)  # dataclasses look the module up by name
_spec.loader.exec_module(gm)

CELLS = [(s, m, n) for s in gm.STRATEGIES for m in gm.MODELS for n in gm.SIZES]


@pytest.mark.parametrize("strategy,model,n", CELLS)
def test_goodput_is_in_0_1(strategy, model, n):
    row = gm.evaluate(strategy, model, n, dict(gm.DEFAULTS))
    assert 0.0 < row.goodput <= 1.0
    assert row.interval_steps >= 1 and row.lost_s >= 0 and row.restart_s > 0


@pytest.mark.parametrize("strategy,model,n", CELLS)
def test_more_frequent_failures_never_raise_goodput(strategy, model, n):
    before = None
    for failures in (50, 419, 1000, 5000, 50000):
        p = dict(gm.DEFAULTS, failures=failures)
        g = gm.evaluate(strategy, model, n, p).goodput
        if before is not None:
            assert g <= before + 1e-12
        before = g


@pytest.mark.parametrize("model", list(gm.MODELS))
@pytest.mark.parametrize("n", gm.SIZES)
@pytest.mark.parametrize("node_loss_fraction", [0.0, 0.3, 0.78, 1.0])
def test_a_memory_tier_never_loses_more_work_than_storage_only(model, n, node_loss_fraction):
    p = dict(gm.DEFAULTS, node_loss_fraction=node_loss_fraction)
    storage = gm.evaluate("mpckpt_storage", model, n, p).lost_s
    for tier in ("mpckpt_memory", "mpckpt_peer"):
        assert gm.evaluate(tier, model, n, p).lost_s <= storage + 1e-9


def test_a_process_crash_with_memory_loses_at_most_a_step():
    p = dict(gm.DEFAULTS, node_loss_fraction=0.0)
    row = gm.evaluate("mpckpt_memory", "70B", 10_000, p)
    assert row.lost_s <= row.step_s


def test_young_daly_grows_with_mtbf():
    values = [gm.young_daly(2.0, m) for m in (60, 600, 3600, 36000, 360000)]
    assert values == sorted(values) and len(set(values)) == len(values)


def test_since_is_about_half_the_interval_and_never_above_the_mtbf():
    assert gm.since(10.0, 1e9) == pytest.approx(5.0, rel=1e-3)
    for tau in (1.0, 100.0, 1e4, 1e6):
        assert 0.0 <= gm.since(tau, 1000.0) <= min(tau, 1000.0)


def test_check_figures_are_finite():
    for run in gm.CHECK_RUNS:
        predicted, own = gm.check_run(run)
        assert math.isfinite(predicted) and math.isfinite(own)
        assert 0.0 < predicted <= 1.0 and 0.0 < own <= 1.0


def test_main_prints_the_table_and_the_check(capsys):
    assert gm.main([]) == 0
    out = capsys.readouterr().out
    assert "| 70B | 10,000 |" in out and "Sensitivity" in out
    assert gm.main(["--check"]) == 0
    assert "long run, S3, peer" in capsys.readouterr().out
