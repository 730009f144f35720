"""``mpckpt stats``: how long each save took to become durable and how many saves were waiting
then (a column, older manifests "not recorded"), and ``--plot`` with the metrics saved with each
checkpoint; run as the real command on checkpoints a real Checkpointer wrote."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import mpckpt
from mpckpt.catalog import read_manifest
from mpckpt.format.manifest import MANIFEST_NAME, checkpoint_name
from mpckpt.storage.local import LocalBackend
from tests.integration.gated_backend import gated_url
from tests.integration.test_cli_more import cli

PNG = b"\x89PNG\r\n\x1a\n"


def _rewrite(root: os.PathLike[str], step: int, change) -> None:
    """Rewrite ``step``'s manifest as an older mpckpt would have written it."""
    manifest = read_manifest(LocalBackend(os.fspath(root)), checkpoint_name(step))
    path = os.path.join(root, checkpoint_name(step), MANIFEST_NAME)
    with open(path, "wb") as f:
        f.write(change(manifest).to_bytes())


def test_stats_shows_the_lag_and_saves_waiting_and_older_manifests_say_not_recorded(tmp_path):
    gate, root = tmp_path / "gate", tmp_path / "root"
    with mpckpt.Checkpointer(gated_url(root), storage_options={"gate": str(gate)}, workers=1) as ckpt:
        try:
            for step in range(1, 4):  # held at the gate: steps 2 and 3 wait for step 1
                ckpt.save(step, {"w": torch.ones(1000) * step}, metrics={"loss": 1.0 / step})
        finally:
            gate.touch()
        ckpt.wait()
        durable = {s.step: s.durable_ms for s in ckpt.stats.saves}
    # step 3 as an mpckpt before durable_ms and waiting wrote it: its other figures only
    _rewrite(root, 3, lambda m: dataclasses.replace(
        m, figures={k: v for k, v in m.figures.items() if k not in ("durable_ms", "waiting")}))

    done = cli("stats", root, "--json")
    assert done.returncode == 0, done.stderr
    rows = {r["step"]: r for r in json.loads(done.stdout)}
    assert [rows[s]["waiting"] for s in (1, 2)] == [2, 1]
    for step in (1, 2):
        assert rows[step]["persist_ms"] <= rows[step]["durable_ms"] <= durable[step]
    assert rows[3]["recorded"] and rows[3]["durable_ms"] is None and rows[3]["waiting"] is None
    assert rows[3]["persist_ms"] is not None  # the figures it has are still shown

    human = cli("stats", root)
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert "DURABLE ms" in lines[0] and "WAITING" in lines[0]
    by_step = {line.split()[0]: line for line in lines[1:4]}
    assert by_step["1"].split()[5:7] == [f"{rows[1]['durable_ms']:.1f}", "2"]
    assert "not recorded" in by_step["3"] and "not recorded" not in by_step["1"]
    assert "at most 2 later saves waiting" in human.stdout
    assert "durable not recorded: written by an mpckpt that did not keep" in human.stdout


def test_plot_draws_the_metrics_saved_with_each_checkpoint(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    from matplotlib import image

    matplotlib.use("Agg")
    with mpckpt.Checkpointer(tmp_path / "plain", workers=1) as ckpt:
        for step in range(1, 4):
            ckpt.save(step, {"w": torch.ones(100) * step})
    with mpckpt.Checkpointer(tmp_path / "trained", workers=1) as ckpt:
        for step in range(1, 4):
            ckpt.save(step, {"w": torch.ones(100) * step}, metrics={"loss": 1.0 / step, "note": "text", "ok": True})
    plain, trained = cli("stats", tmp_path / "plain", "--plot", tmp_path / "plain.png"), \
        cli("stats", tmp_path / "trained", "--plot", tmp_path / "trained.png")
    assert plain.returncode == 0 and trained.returncode == 0, (plain.stderr, trained.stderr)
    heights = {name: image.imread(tmp_path / f"{name}.png").shape[0] for name in ("plain", "trained")}
    assert heights["trained"] > heights["plain"]  # a panel more: the loss over the steps

    # a root of an mpckpt that recorded no figures, only the metrics: the metrics are drawn
    for step in range(1, 4):
        _rewrite(tmp_path / "trained", step, lambda m: dataclasses.replace(m, figures=None))
    done = cli("stats", tmp_path / "trained", "--plot", tmp_path / "metrics.png")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "metrics.png").read_bytes()[:8] == PNG
    assert image.imread(tmp_path / "metrics.png").shape[0] < heights["trained"]  # the metric panel alone


def test_plot_of_a_root_without_figures_or_metrics_writes_nothing(tmp_path):
    pytest.importorskip("matplotlib")
    with mpckpt.Checkpointer(tmp_path / "root", workers=1) as ckpt:
        ckpt.save(1, {"w": torch.ones(10)})
    _rewrite(tmp_path / "root", 1, lambda m: dataclasses.replace(m, figures=None))
    done = cli("stats", tmp_path / "root", "--plot", tmp_path / "p.png")
    assert done.returncode == 0 and "no step has recorded figures or metrics" in done.stdout
    assert not (tmp_path / "p.png").exists()
