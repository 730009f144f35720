"""``mpckpt export ROOT STEP --to DIR --format hf`` and ``mpckpt.export_hf``, run as the real command
on checkpoints a real Checkpointer wrote, read back by transformers' ``from_pretrained`` and
safetensors' ``load_file``.

- A tiny GPT-2 with tied embeddings, saved as ``MpckptCallback`` saves it (``model`` beside the
  config text and the training state), exports with ``--prefix model.`` to ``model.safetensors``,
  ``config.json`` and ``generation_config.json``; ``from_pretrained(DIR)`` gives every tensor
  bit for bit, the output layer tied to the embedding again.
- With a small ``--max-shard-size``: shards named and filled as huggingface_hub's
  ``split_torch_state_dict_into_shards`` names and fills them, an index with the total size and
  every name, each file readable by ``load_file``; ``from_pretrained`` gives the same weights.
- A state that is one model's weights exports without ``--prefix`` (and says config.json is
  missing); one that holds more is refused naming ``--prefix model.``.
- Bad arguments are status 2 before anything is written (a folder that is not empty, an unknown
  step, a prefix that names nothing, a size that is not one); ``--force`` replaces a folder of
  model files only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import mpckpt  # noqa: E402
from mpckpt.errors import ConfigError  # noqa: E402
from mpckpt.integrations._transformers_folder import model_files  # noqa: E402
from tests.conftest import assert_same  # noqa: E402
from tests.integration.test_cli_more import cli  # noqa: E402

transformers.logging.set_verbosity_error()
REPO = Path(__file__).resolve().parents[2]




def tiny_gpt2(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=96, n_positions=16, n_embd=16, n_layer=2, n_head=2, tie_word_embeddings=True)
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, GPT2LMHeadModel]:
    """A root whose steps 1 and 2 hold what MpckptCallback saves (the weights changed in between),
    and one whose step 5 is the model's state_dict alone."""
    base = tmp_path_factory.mktemp("export_hf")
    model = tiny_gpt2(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.MonkeyPatch.context() as env:  # the autouse clean environment is per test
        for name in [n for n in os.environ if n.startswith("MPCKPT_")]:
            env.delenv(name)
        with mpckpt.Checkpointer(base / "trainer", workers=1) as ckpt:
            for step in (1, 2):
                with torch.no_grad():
                    model.transformer.h[0].mlp.c_fc.weight.add_(1.0)
                ckpt.save(step, {"format": "mpckpt-transformers-1", "model": model, "optimizer": opt,
                                 "trainer_state": "{}", **model_files(model, None)}, mode="sync")
        with mpckpt.Checkpointer(base / "plain", workers=1) as ckpt:
            ckpt.save(5, model.state_dict(), mode="sync")
    return base / "trainer", base / "plain", model


def assert_weights(folder: Path, model: GPT2LMHeadModel) -> None:
    """``from_pretrained(folder)`` is ``model``: every tensor bit for bit, the head tied again."""
    loaded = GPT2LMHeadModel.from_pretrained(folder)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert_same(dict(model.state_dict()), dict(loaded.state_dict()))


def test_one_file_with_the_config_loads_with_from_pretrained(roots, tmp_path):
    root, _, model = roots
    target = tmp_path / "gpt2"
    done = cli("export", root, 2, "--to", target, "--format", "hf", "--prefix", "model.")
    assert done.returncode == 0, done.stderr
    assert "lm_head.weight -> transformer.wte.weight" in done.stdout and "config.json" in done.stdout
    assert sorted(os.listdir(target)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["gpt2"]  # no temporary folder left beside it
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "lm_head.weight": "transformer.wte.weight"}
    tensors = load_file(str(target / "model.safetensors"))
    assert set(tensors) == set(model.state_dict()) - {"lm_head.weight"}
    assert json.loads((target / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert_weights(target, model)


def test_sharded_files_and_index_as_huggingface_hub_writes_them(roots, tmp_path):
    root, _, model = roots
    target = tmp_path / "sharded"
    done = cli("export", root, "latest", "--to", target, "--format", "hf", "--prefix", "model",
               "--max-shard-size", 4096)  # c_fc.weight is 4096 bytes: it fits, alone
    assert done.returncode == 0, done.stderr
    index = json.loads((target / "model.safetensors.index.json").read_text())
    shards = sorted(f for f in os.listdir(target) if f.endswith(".safetensors"))
    assert len(shards) > 2 and "model.safetensors" not in shards
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert set(index) == {"metadata", "weight_map"} and set(index["weight_map"].values()) == set(shards)
    weights = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert index["metadata"] == {"total_size": sum(t.numel() * t.element_size() for t in weights.values())}
    read: dict[str, torch.Tensor] = {}
    for shard in shards:  # every file on its own, and the index says where each name is
        part = load_file(str(target / shard))
        assert all(index["weight_map"][name] == shard for name in part)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 4096 or len(part) == 1
        read.update(part)
    assert_same(weights, {name: read[name] for name in weights})
    hub = pytest.importorskip("huggingface_hub")
    split = hub.split_torch_state_dict_into_shards(weights, max_shard_size=4096)
    assert index["weight_map"] == split.tensor_to_filename  # the same files, filled the same way
    assert_weights(target, model)


def test_python_function_and_a_model_state_without_prefix(roots, tmp_path):
    root, plain, model = roots
    folder = mpckpt.export_hf(root, to=tmp_path / "py", prefix="model.")  # the newest step
    assert folder == tmp_path / "py"
    assert_weights(folder, model)
    with pytest.raises(ConfigError, match=r"--prefix model\. \(prefix='model\.' in Python\)"):
        mpckpt.export_hf(root, 2, to=tmp_path / "no_prefix")
    assert not (tmp_path / "no_prefix").exists()

    done = cli("export", plain, 5, "--to", tmp_path / "plain", "--format", "hf")  # the state is the weights
    assert done.returncode == 0, done.stderr
    assert "holds no config.json" in done.stdout
    assert os.listdir(tmp_path / "plain") == ["model.safetensors"]
    model.config.save_pretrained(tmp_path / "plain")  # what the message says to do
    assert_weights(tmp_path / "plain", model)


def test_bad_arguments_are_status_2_and_write_nothing(roots, tmp_path):
    root, _, _ = roots
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    done = cli("export", root, 2, "--to", busy, "--format", "hf", "--prefix", "model.")
    assert done.returncode == 2 and f"--to {busy} is a folder that is not empty" in done.stderr
    done = cli("export", root, 2, "--to", busy, "--format", "hf", "--prefix", "model.", "--force")
    assert done.returncode == 2 and "notes.txt" in done.stderr  # --force never replaces what is not a model's
    assert os.listdir(busy) == ["notes.txt"]

    new = tmp_path / "new"
    for args, said in [
        ((9, "--prefix", "model."), "no checkpoint of step 9"),
        ((2, "--prefix", "nothing."), "--prefix 'nothing.': step 2 has nothing at 'nothing'"),
        ((2,), "name the model with --prefix model."),
        ((2, "--prefix", "model.", "--max-shard-size", "lots"), "--max-shard-size 'lots' is not a size"),
    ]:
        done = cli("export", root, *args, "--to", new, "--format", "hf")
        assert done.returncode == 2 and said in done.stderr, (args, done.stderr)
        assert not new.exists()
    done = cli("export", root, 2, "--to", tmp_path / "m.safetensors", "--max-shard-size", "1GB")
    assert done.returncode == 2 and "--max-shard-size is for --format hf" in done.stderr
    assert sorted(os.listdir(tmp_path)) == ["busy"]  # nothing written, no temporary folder left


def test_force_replaces_a_folder_of_model_files_whole(roots, tmp_path):
    root, _, model = roots
    target = tmp_path / "model"
    assert cli("export", root, 1, "--to", target, "--format", "hf", "--prefix", "model.",
               "--max-shard-size", "4KB").returncode == 0
    assert len(os.listdir(target)) > 4
    done = cli("export", root, 2, "--to", target, "--format", "hf", "--prefix", "model.")
    assert done.returncode == 2 and "not empty" in done.stderr
    done = cli("export", root, 2, "--to", target, "--format", "hf", "--prefix", "model.", "--force")
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(target)) == ["config.json", "generation_config.json", "model.safetensors"]  # no old shard
    assert os.listdir(tmp_path) == ["model"]
    assert_weights(target, model)


def test_help_names_the_format():
    done = cli("export", "--help")
    assert done.returncode == 0 and "--format {dcp,hf}" in done.stdout and "--max-shard-size" in done.stdout
    assert "from_pretrained" in done.stdout


def test_shards_are_filled_as_huggingface_hub_fills_them_at_every_size(roots):
    """The split at every limit around the tensors' sizes (a tensor exactly at the limit, one past it)."""
    hub = pytest.importorskip("huggingface_hub")
    from mpckpt.cli._export_hf import shards

    weights = {k: v for k, v in roots[2].state_dict().items() if k != "lm_head.weight"}
    sizes = {t.numel() * t.element_size() for t in weights.values()}
    limits = sorted({n + d for n in sizes for d in (-1, 0, 1)} | {s + t for s in sizes for t in sizes})
    for limit in limits:
        split = hub.split_torch_state_dict_into_shards(weights, max_shard_size=limit)
        assert [list(names) for names in split.filename_to_tensors.values()] == shards(weights, limit), limit
