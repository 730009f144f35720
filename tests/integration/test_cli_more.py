"""The mpckpt command's ls --json, info, export and stats, run as the real command on
checkpoints a real Checkpointer wrote; and their exit statuses (1 on damage, 2 on bad arguments)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model

import mpckpt
from mpckpt.catalog import read_manifest
from mpckpt.cli import main
from mpckpt.format.manifest import MANIFEST_NAME, SKELETON_NAME, FileEntry, checkpoint_name, checksum
from mpckpt.storage.local import LocalBackend
from tests.commands import mpckpt_command
from tests.conftest import assert_same

REPO = Path(__file__).resolve().parents[2]


cli = mpckpt_command  # the command as a user runs it


class Tied(torch.nn.Module):
    """A language-model shape: the output layer is the embedding (tied weights); a frozen part."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(32, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)  # its shard is referenced by later saves
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tied]:
    """Steps 1 (sync), 2 (async) and 3 (sync) of a tied model and its optimizer; 1 and 3 kept."""
    root = tmp_path_factory.mktemp("run")
    model = Tied()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with pytest.MonkeyPatch.context() as env:  # the autouse clean environment is per test
        for name in [n for n in os.environ if n.startswith("MPCKPT_")]:
            env.delenv(name)
        ckpt = mpckpt.Checkpointer(root, workers=1, keep=mpckpt.KeepLast(1) | mpckpt.KeepBest(1, "loss", "max"))
    with ckpt:
        for step, mode in ((1, "sync"), (2, "async"), (3, "sync")):
            with torch.no_grad():
                model.body[0].weight.add_(1.0)
            ckpt.save(step, {"model": model, "optim": opt, "epoch": step}, metrics={"loss": 1.0 / step}, mode=mode)
    return root, model


def test_ls_json_says_when_and_why_kept(run):
    root, _ = run
    done = cli("ls", root, "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["step"] for r in rows] == [1, 3]  # the newest, and the highest loss
    for row in rows:
        assert {"step", "time", "bytes", "metrics", "kept", "kind", "files", "damaged"} <= set(row)
        when = datetime.datetime.fromisoformat(row["time"])
        assert when.utcoffset() == datetime.timedelta(0)
        assert abs((datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()) < 3600
        assert row["kind"] == "state" and row["damaged"] is None and row["files"] >= 2 and row["bytes"] > 0
    assert rows[0]["kept"] == [] and rows[1]["kept"] == ["latest"]  # step 1: by the policy, not recorded
    assert rows[1]["metrics"] == {"loss": pytest.approx(1 / 3)}
    # the frozen shard, written by step 1, lives in shared/ and both list it
    assert rows[1]["stored_bytes"] < rows[1]["bytes"] == rows[1]["stored_bytes"] + rows[1]["shared_bytes"]
    assert len(rows[1]["shared_files"]) == 1 and rows[1]["shared_files"] == rows[0]["shared_files"]
    assert rows[1]["shared_files"][0].startswith(f"shared/{checkpoint_name(1)}.") and rows[1]["uses_steps"] == []
    human = cli("ls", root)
    assert human.returncode == 0 and rows[1]["time"] in human.stdout


def test_info_lists_tensors_by_state_path_without_reading_them(run):
    root, model = run
    done = cli("info", root, 3, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    tensors = {t["name"]: t for t in doc["tensors"]}
    for name, t in model.state_dict().items():
        entry = tensors[f"model.{name}"]
        assert entry["dtype"] == "float32" and entry["shape"] == list(t.shape) and entry["bytes"] == t.numel() * 4
        assert entry["shards"] and all(s.startswith(("step_", "shared/")) for s in entry["shards"])
    assert tensors["model.head.weight"]["shares"] == "model.embed.weight"  # tied: one storage
    assert tensors["model.frozen.weight"]["shards"][0].startswith(f"shared/{checkpoint_name(1)}.")  # not rewritten
    assert {"name": "epoch", "type": "int", "value": 3} in doc["values"]
    assert any(v["name"] == "optim.param_groups.0.lr" and v["value"] == 0.001 for v in doc["values"])
    human = cli("info", root, 3)
    assert human.returncode == 0
    assert "model.body.0.weight" in human.stdout and "epoch = 3" in human.stdout
    assert "same storage as model.embed.weight" in human.stdout


def test_export_safetensors_with_tied_weights_loads_back_into_the_model(run, tmp_path):
    root, model = run
    target = tmp_path / "model.safetensors"
    done = cli("export", root, 3, "--to", target, "--prefix", "model.")
    assert done.returncode == 0, done.stderr
    assert "head.weight -> embed.weight" in done.stdout
    with safe_open(str(target), "pt") as f:
        metadata = f.metadata()
        assert set(f.keys()) == set(model.state_dict()) - {"head.weight"}
    assert metadata == {"format": "pt", "head.weight": "embed.weight"}  # safetensors.torch.save_model's convention

    fresh = Tied(seed=1)
    missing, unexpected = fresh.load_state_dict(load_file(str(target)), strict=False)
    assert missing == ["head.weight"] and unexpected == []  # the dropped tied name, and only it
    assert fresh.head.weight is fresh.embed.weight
    assert_same(model.state_dict(), fresh.state_dict())
    again = Tied(seed=2)
    load_model(again, str(target))  # safetensors' own loader, strict: it ties the names itself
    assert_same(model.state_dict(), again.state_dict())

    copies = tmp_path / "copies.safetensors"
    assert cli("export", root, 3, "--to", copies, "--prefix", "model", "--copy-tied").returncode == 0
    strict = Tied(seed=3)
    strict.load_state_dict(load_file(str(copies)))  # every key is there
    assert_same(model.state_dict(), strict.state_dict())
    assert sorted(os.listdir(tmp_path)) == ["copies.safetensors", "model.safetensors"]  # no temporary file left


def test_export_pt_is_the_nested_state_and_never_overwrites_unless_forced(run, tmp_path):
    root, _ = run
    target = tmp_path / "state.pt"
    assert cli("export", root, 3, "--to", target).returncode == 0
    assert_same(mpckpt.load(root, step=3), torch.load(target, weights_only=True))

    target.write_bytes(b"mine")
    refused = cli("export", root, 3, "--to", target)
    assert refused.returncode == 2 and "--force" in refused.stderr
    assert target.read_bytes() == b"mine"
    assert cli("export", root, 1, "--to", target, "--prefix", "optim", "--force").returncode == 0
    assert_same(mpckpt.load(root, step=1)["optim"], torch.load(target, weights_only=True))
    assert sorted(os.listdir(tmp_path)) == ["state.pt"]


@pytest.mark.parametrize("argv, says", [
    (["info", "{root}", "7"], "committed steps: 1, 3"),
    (["export", "{root}", "7", "--to", "{tmp}/x.pt"], "committed steps: 1, 3"),
    (["export", "{root}", "3", "--to", "{tmp}/x.npz"], ".safetensors"),
    (["export", "{root}", "3", "--to", "{tmp}/x.pt", "--prefix", "modle."], "model, optim, epoch"),
    (["export", "{root}", "3", "--to", "{tmp}/no/such/x.pt"], "does not exist"),
    (["export", "{root}", "3"], "--to"),  # argparse
    (["info", "{root}", "three"], "not a step"),
    (["--storage-options", "{{", "ls", "{root}"], "not a JSON object"),
])
def test_bad_arguments_are_status_2(run, tmp_path, capsys, argv, says):
    root, _ = run
    argv = [a.format(root=root, tmp=tmp_path) for a in argv]
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own refusals
        status = e.code
    assert status == 2
    assert says in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_damage_is_status_1_for_every_command(tmp_path, capsys):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"x": torch.ones(4) * step})
    manifest = tmp_path / checkpoint_name(2) / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes()[:-40])  # torn
    for argv in (["ls", "--json"], ["info", "2"], ["export", "2", "--to", str(tmp_path / "x.pt")], ["stats"]):
        argv.insert(1, str(tmp_path))
        assert main(argv) == 1, argv
        assert "manifest" in capsys.readouterr().err
    assert main(["info", str(tmp_path), "1"]) == 0  # the other step is fine
    assert not (tmp_path / "x.pt").exists()
    done = cli("ls", tmp_path, "--json")
    rows = json.loads(done.stdout)
    assert done.returncode == 1 and rows[1]["step"] == 2 and "manifest" in rows[1]["damaged"]
    assert rows[1]["kept"] == ["damaged"] and rows[0]["kept"] == ["latest"]


@pytest.mark.parametrize("skeleton", [
    b'{"version": 1, "tree": {"__mpckpt__": "tensor", "id": 7}, "table": [], "leaves": []}',
    b'{"version": 1, "tree": ' + b"[" * 100_000 + b"]" * 100_000 + b', "table": [], "leaves": []}',
    b'{"version": 1, "tree": {"x": 1}, "table": [{"leaf": 0}], "leaves": [{"shape": [-1], "dtype": "float32"}]}',
    b"not json",
])
def test_info_of_a_forged_skeleton_is_damage_not_a_traceback(tmp_path, skeleton):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(1, {"x": torch.ones(4)})
    folder = tmp_path / checkpoint_name(1)
    (folder / SKELETON_NAME).write_bytes(skeleton)  # and a manifest that vouches for it
    m = read_manifest(LocalBackend(str(tmp_path)), checkpoint_name(1))
    files = {**m.files, SKELETON_NAME: FileEntry(len(skeleton), checksum(skeleton))}
    (folder / MANIFEST_NAME).write_bytes(dataclasses.replace(m, files=files).to_bytes())
    done = cli("info", tmp_path, 1)
    assert done.returncode == 1 and "skeleton" in done.stderr, done


def test_stats_reads_the_figures_each_save_recorded(tmp_path):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(1, {"x": torch.ones(1000)}, mode="sync")
        ckpt.save(2, {"x": torch.zeros(2000)})
        ckpt.wait()
        save2 = ckpt.stats.saves[-1]
    # a checkpoint of an mpckpt that did not record figures: step 3, rewritten without them
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(3, {"x": torch.ones(10)})
    backend = LocalBackend(str(tmp_path))
    old = dataclasses.replace(read_manifest(backend, checkpoint_name(3)), figures=None)
    (tmp_path / checkpoint_name(3) / MANIFEST_NAME).write_bytes(old.to_bytes())
    assert_same(mpckpt.load(tmp_path, step=3), {"x": torch.ones(10)})  # it loads as before

    done = cli("stats", tmp_path, "--json", "--plot", tmp_path / "stats.png")
    assert done.returncode == 0, done.stderr
    rows = {r["step"]: r for r in json.loads(done.stdout)}
    assert rows[1]["recorded"] and rows[1]["blocked_ms"] is None  # a SYNC save waits for its own commit
    two = rows[2]
    assert two["recorded"] and two["bytes"] == 8000 and two["written_bytes"] == save2.written_bytes
    assert 0 < two["persist_ms"] <= save2.persist_ms  # the ledger's figure also counts the manifest's write
    # None only if the commit beat the return of save (the manifest is written before it is known)
    assert two["blocked_ms"] in (None, pytest.approx(save2.blocked_ms, abs=1e-3))
    assert two["mb_per_s"] > 0 and two["snapshot_ms"] >= 0
    assert not rows[3]["recorded"] and rows[3]["persist_ms"] is None and rows[3]["time"]
    assert (tmp_path / "stats.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    human = cli("stats", tmp_path)
    assert human.returncode == 0
    line3 = next(line for line in human.stdout.splitlines() if line.split()[:1] == ["3"])
    assert "not recorded" in line3


def test_stats_plot_without_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(1, {"x": torch.ones(4)})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert main(["stats", str(tmp_path), "--plot", str(tmp_path / "p.png")]) == 1
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_info_of_a_directory_checkpoint_lists_its_files(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "weights.bin").write_bytes(b"x" * 100)
    with mpckpt.Checkpointer(tmp_path / "root", workers=1) as ckpt:
        ckpt.report({"loss": 0.5}, checkpoint=mpckpt.Checkpoint.from_directory(src), step=5, mode="sync")
    assert main(["info", str(tmp_path / "root"), "5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "directory" and doc["tensors"] == []
    assert [(f["path"], f["bytes"]) for f in doc["files"]] == [("config.json", 2), ("sub/weights.bin", 100)]
    assert main(["export", str(tmp_path / "root"), "5", "--to", str(tmp_path / "x.pt")]) == 2
    assert "directory checkpoint" in capsys.readouterr().err
