"""The expensive tiers (``tests/conftest.py`` ``TIERS``) name test modules that exist, and each
marker is registered (``--strict-markers`` would refuse an unknown one only where it is used)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import TIERS

TESTS = Path(__file__).resolve().parents[1]


def test_every_tier_names_existing_modules_and_a_registered_marker():
    modules = {p.stem for p in TESTS.rglob("test_*.py")}
    missing = {tier: [m for m in names if m not in modules] for tier, names in TIERS.items()}
    assert not any(missing.values()), f"TIERS names test modules that do not exist: {missing}"
    pyproject = (TESTS.parent / "pyproject.toml").read_text()
    unregistered = [tier for tier in TIERS if f'"{tier}: ' not in pyproject]
    assert not unregistered, f"markers not in pyproject.toml's [tool.pytest.ini_options] markers: {unregistered}"
