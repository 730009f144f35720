"""bench/goodput_heal.py: a healed restart is its parts, and healing at the relaunch's cost gains nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    if name not in sys.modules:  # goodput_heal imports goodput_model by name; dataclasses look it up
        spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


gm = _load("goodput_model")
gh = _load("goodput_heal")

CELLS = [(h, m, n) for h in gh.HEALS for m in gm.MODELS for n in gm.SIZES]


def _acc_bytes(model: str, n: int, p: dict[str, float]) -> float:
    return gm.MODELS[model] * p["bytes_per_param"] / n


@pytest.mark.parametrize("model", list(gm.MODELS))
@pytest.mark.parametrize("n", gm.SIZES)
def test_a_healed_process_failure_costs_detection_the_heal_and_a_memory_restore(model, n):
    p = dict(gh.DEFAULTS, node_loss_fraction=0.0)
    parts = (p["detect_s"] + p["heal_start_s"] + p["reform_s"] + p["heal_rebuild_s"]
             + _acc_bytes(model, n, p) / (p["mem_restore_gbps"] * 1e9))
    for strategy in gh.HEALS:
        assert gh.evaluate(strategy, model, n, p).restart_s == pytest.approx(parts, rel=1e-12)


@pytest.mark.parametrize("n", gm.SIZES)
def test_a_healed_node_loss_costs_the_spare_node_the_heal_and_the_peer_copy(n):
    p = dict(gh.DEFAULTS, node_loss_fraction=1.0, pair_loss_fraction=0.0)
    parts = (p["detect_s"] + p["replace_s"] + p["heal_start_s"] + p["reform_s"] + p["heal_rebuild_s"]
             + _acc_bytes("70B", n, p) / (p["peer_gbps"] * 1e9))
    assert gh.evaluate("heal_peer", "70B", n, p).restart_s == pytest.approx(parts, rel=1e-12)
    # without healing across nodes, the node loss is the relaunch's, restoring from the peer
    assert gh.evaluate("heal_peer_process", "70B", n, p).restart_s == pytest.approx(
        gm.evaluate("mpckpt_peer", "70B", n, p).restart_s, rel=1e-12)


@pytest.mark.parametrize("strategy,model,n", CELLS)
def test_healing_at_the_relaunchs_cost_meets_the_relaunch(strategy, model, n):
    p = dict(gh.DEFAULTS)
    p["relaunch_s"] = gh.heal_s(p)
    base = gh.HEALS[strategy][0]
    assert gh.evaluate(strategy, model, n, p).goodput == pytest.approx(gm.evaluate(base, model, n, p).goodput, rel=1e-12)


@pytest.mark.parametrize("strategy,model,n", CELLS)
def test_healing_cheaper_than_the_relaunch_gains_and_changes_only_the_restart(strategy, model, n):
    p = dict(gh.DEFAULTS)
    healed, relaunched = gh.evaluate(strategy, model, n, p), gm.evaluate(gh.HEALS[strategy][0], model, n, p)
    assert gh.heal_s(p) < p["relaunch_s"]
    assert healed.restart_s < relaunched.restart_s and healed.goodput > relaunched.goodput
    assert (healed.lost_s, healed.overhead, healed.interval_steps) == (
        relaunched.lost_s, relaunched.overhead, relaunched.interval_steps)


def test_what_healing_refuses_relaunches():
    # every failure a node loss: heal_memory has no copy to heal from; every node loss a pair loss: nor has heal_peer
    for strategy, p in (("heal_memory", dict(gh.DEFAULTS, node_loss_fraction=1.0)),
                        ("heal_peer", dict(gh.DEFAULTS, node_loss_fraction=1.0, pair_loss_fraction=1.0))):
        base = gh.HEALS[strategy][0]
        assert gh.evaluate(strategy, "70B", 10_000, p).restart_s == pytest.approx(
            gm.evaluate(base, "70B", 10_000, p).restart_s, rel=1e-12)


def test_main_prints_the_table_and_the_sensitivity(capsys):
    assert gh.main(["--sensitivity-accelerators", "10000"]) == 0
    out = capsys.readouterr().out
    assert "| 70B | 10,000 |" in out and "Sensitivity, 70B on 10,000" in out
