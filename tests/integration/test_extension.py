"""The public seams of ``mpckpt.extension`` as an integration uses them, in one process: real
uploader processes, real files, a real side process.

- ``ranks``: one process is rank 0 of 1, not distributed.
- ``save_agreed`` commits the step (the future resolves to it) and refuses a step not after the
  last one; ``check_writer`` refuses a read-only Checkpointer, ``check_open`` a closed one.
- ``holding`` keeps a step that retention would delete until the block ends.
- ``source_of`` + ``load_tree`` read the state back bit for bit; a flipped byte on storage is a
  ``CorruptCheckpointError``, never the wrong value.
- ``with_metrics`` shows more metrics without writing; ``side_process`` runs a function on the
  committed checkpoint in another process and returns what it returned.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import mpckpt
from mpckpt import extension
from mpckpt.errors import ConfigError, CorruptCheckpointError, MpckptError, StepOrderError
from tests.conftest import assert_same
from tests.states import random_state


def _state(seed: int) -> dict[str, torch.Tensor]:
    return random_state(seed, {"w": (256, 64), "b": (64,)})


def _metrics_and_step(checkpoint: mpckpt.Checkpoint) -> dict[str, float]:
    return {"seen_step": float(checkpoint.step or -1), "tag": float(checkpoint.metrics["tag"])}


def test_one_process_saves_reads_and_holds_through_the_seams(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with mpckpt.Checkpointer(root, keep_last=1, workers=1) as ckpt:
        assert extension.ranks(ckpt) == extension.Ranks(0, 1, None) and not extension.ranks(ckpt).distributed
        future = extension.save_agreed(ckpt, 3, _state(3), metrics={"loss": torch.tensor(0.5)})
        assert future.result(extension.commit_timeout_s(ckpt)).name is not None
        assert ckpt.latest_step == 3 and ckpt.checkpoint(3).metrics["loss"] == 0.5
        with pytest.raises(StepOrderError, match="step 3 is not after the last saved step 3"):
            extension.save_agreed(ckpt, 3, _state(3))
        with extension.holding(ckpt, 3):
            extension.save_agreed(ckpt, 4, _state(4)).result(60)
            assert ckpt.steps() == [3, 4], "retention (keep_last=1) deleted a step held for reading"
            source = extension.source_of(ckpt.checkpoint(3))
            assert_same(extension.load_tree(source, allow_pickle=False), _state(3))
        assert ckpt.steps() == [4], "the step held for reading outlived its hold (retention ran only at commits)"
        ckpt.wait()
        assert not (root / "step_0000000003").exists()
        ckpt.save(5, _state(5))
        ckpt.wait()
        assert ckpt.steps() == [5]
        more = extension.with_metrics(ckpt.checkpoint(5), {"tag": 7.0})
        assert more.metrics["tag"] == 7.0 and "tag" not in ckpt.checkpoint(5).metrics
        parts = extension.stored_parts(more)
        proc = extension.side_process(ckpt, _metrics_and_step)
        try:
            got = proc.validate(5, parts.name, parts.manifest, timeout_s=120, abandoned=lambda: False)
        finally:
            proc.close()
        assert got == {"seen_step": 5.0, "tag": 7.0}
    with pytest.raises(MpckptError, match="closed"):
        extension.check_open(ckpt)
    with mpckpt.Checkpointer(root, read_only=True) as reader:
        with pytest.raises(ConfigError, match="read_only=True"):
            extension.check_writer(reader)
        data = next(p for p in (root / "step_0000000005").rglob("*.safetensors"))
        with open(data, "r+b") as f:
            f.seek(os.path.getsize(data) - 8)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(CorruptCheckpointError):
            extension.load_tree(extension.source_of(reader.checkpoint(5)), allow_pickle=False)
    with pytest.raises(ConfigError, match="Checkpointer"):
        extension.ranks(object())  # type: ignore[arg-type]
