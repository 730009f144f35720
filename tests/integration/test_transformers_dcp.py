"""MpckptCallback under DDP (torchrun, 2 CPU ranks, gloo), and FSDP.

One job (this file run under torchrun): a tiny GPT-2 with dropout trains 8 steps without a stop
(``whole``), then again with a stop after step 5 and a resume (``resume_path`` on every rank) from
step 4, mid-epoch. Rank 1 draws once more from torch's generator at every step, so the ranks'
generators differ. The test compares, on each rank, the losses of the steps after the resume, the
final weights and the final state of torch's generator with the uninterrupted run's
(``torch.equal``): only every rank's own generators, restored to the same rank, give that.
FSDP: accelerate sets FSDP up on accelerators only (on CPU it drops the plugin and trains
unsharded), so ``MpckptCallback`` refuses FSDP arguments at ``train()`` before the first step,
naming the ways on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if __name__ != "__main__":
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

import transformers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from mpckpt.errors import ConfigError  # noqa: E402
from mpckpt.integrations.transformers import MpckptCallback, resume_path  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB, SEQ, N_TRAIN, BATCH, MAX_STEPS = 64, 16, 24, 4, 8  # 2 ranks: 3 optimizer steps an epoch


def dataset(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


class Recording(Trainer):  # type: ignore[misc]
    """Keeps this rank's loss of every step; on rank 1 one more draw from torch's generator per step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: dict[int, torch.Tensor] = {}

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        if self.args.process_index == 1:
            torch.rand(1)  # the ranks' generators differ from here on
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses[self.state.global_step + 1] = loss.detach().clone()
        return loss


class Stop(Exception):
    pass


class StopAfter(TrainerCallback):  # type: ignore[misc]
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise Stop(f"stopped after step {self.step}")


def trainer(out: Path, callbacks: list[Any], **overrides: Any) -> Recording:
    transformers.set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    settings: dict[str, Any] = dict(output_dir=str(out / "hf"), max_steps=MAX_STEPS, per_device_train_batch_size=BATCH,
                                    learning_rate=1e-3, warmup_steps=2, save_strategy="steps", save_steps=2,
                                    logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                                    dataloader_num_workers=0)
    settings.update(overrides)
    return Recording(model=model, args=TrainingArguments(**settings), train_dataset=dataset(N_TRAIN, 1),
                     callbacks=callbacks)


def _record(t: Recording, path: Path) -> None:
    torch.save({"losses": t.losses, "weights": {k: v.detach().clone() for k, v in t.model.state_dict().items()},
                "rng": torch.get_rng_state()}, path)


def _job(out: Path) -> None:
    rank = int(os.environ["RANK"])
    whole = trainer(out / "whole", [MpckptCallback(out / "whole" / "ckpt", workers=1)])
    whole.train()
    _record(whole, out / f"whole_{rank}.pt")
    root = out / "cut" / "ckpt"
    stopped = MpckptCallback(root, workers=1)
    try:
        trainer(out / "cut", [stopped, StopAfter(5)]).train()
    except Stop:
        stopped.close()  # rank 0: every pending save committed
    torch.distributed.barrier()
    folder = resume_path(root)
    assert folder is not None
    resumed = trainer(out / "cut", [MpckptCallback(root, workers=1)])
    resumed.train(resume_from_checkpoint=folder)
    _record(resumed, out / f"resumed_{rank}.pt")
    fsdp = trainer(out / "fsdp", [MpckptCallback(out / "fsdp" / "ckpt", workers=1)], max_steps=2, fsdp="full_shard",
                   fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"})
    try:
        fsdp.train()
        refused: dict[str, Any] = {"type": None}
    except ConfigError as e:
        refused = {"type": type(e).__name__, "message": str(e)}
    refused.update(global_step=fsdp.state.global_step, root=(out / "fsdp" / "ckpt").exists())
    if rank == 0:
        (out / "done.json").write_text(json.dumps({"folder": sorted(os.listdir(folder)), "fsdp": refused,
                                                   "step": resumed.state.global_step}))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          os.path.abspath(__file__), "job", str(out)], env=env, capture_output=True, text=True,
                         timeout=400, cwd=os.getcwd())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return out


def test_ddp_resume_restores_every_ranks_generators(job: Path) -> None:
    done = json.loads((job / "done.json").read_text())
    assert done["step"] == MAX_STEPS
    ranks = []
    for rank in (0, 1):
        whole = torch.load(job / f"whole_{rank}.pt", weights_only=True)
        resumed = torch.load(job / f"resumed_{rank}.pt", weights_only=True)
        assert sorted(resumed["losses"]) == list(range(5, MAX_STEPS + 1))  # resumed from step 4
        for step, loss in resumed["losses"].items():
            assert torch.equal(loss, whole["losses"][step]), (rank, step)
        for key, value in whole["weights"].items():
            assert torch.equal(value, resumed["weights"][key]), (rank, key)
        assert torch.equal(whole["rng"], resumed["rng"]), rank
        ranks.append(whole["rng"])
    assert not torch.equal(ranks[0], ranks[1])  # the ranks' generators differ: each got its own back
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(done["folder"])  # the Trainer's per-rank files


def test_fsdp_is_refused_before_the_first_step(job: Path) -> None:
    """A Trainer given FSDP arguments (under torchrun): refused at train(), naming the ways on."""
    refused = json.loads((job / "done.json").read_text())["fsdp"]
    assert refused["type"] == "ConfigError" and refused["global_step"] == 0 and not refused["root"]
    for name in ("SHARDED_STATE_DICT", "on CPU", "DDP", "StorageWriter", "MpckptFSDPStrategy"):
        assert name in refused["message"]


if __name__ == "__main__":
    if sys.argv[1] == "job":
        _job(Path(sys.argv[2]))
