"""A small training run for the exact-resume test; it resumes from its checkpoint root when there is one.

Run as ``python -m tests.integration.exact_trainer ROOT [--num-workers N] [--plain] [--step-sleep S]``.
A model with dropout, AdamW and a cosine learning rate trains on a shuffled dataset whose items are
augmented with random noise when loaded (in DataLoader workers with ``--num-workers``), with
``mpckpt.RNGState`` and the data position in the state, saving every ``SAVE_EVERY`` steps. With
``--plain`` the data comes from a plain ``DataLoader(shuffle=True)`` and the state has no data
position: the control that shows the test sees a resume that is not exact.

It prints ``resumed <step> <epoch> <consumed>`` (the first step it runs, and where in the data it
starts) and then, for every step, ``step <step> <epoch> <loss as float.hex> <sha256 of the parameters
after the step> <sha256 of the batch>``.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time

import numpy
import torch
from torch.utils.data import DataLoader, Dataset

import mpckpt

N_SAMPLES, BATCH, EPOCHS, SAVE_EVERY = 60, 8, 3, 3
BATCHES_PER_EPOCH = -(-N_SAMPLES // BATCH)  # the last batch of an epoch is short
TOTAL_STEPS = BATCHES_PER_EPOCH * EPOCHS


class Noisy(Dataset):
    """Fixed inputs and targets; every load adds noise from torch's and Python's global generators."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(N_SAMPLES, 16, generator=g)
        self.y = torch.randn(N_SAMPLES, 4, generator=g)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] * (1 + 0.1 * random.random()) + 0.1 * torch.randn(16), self.y[i]


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()

    torch.manual_seed(0)  # every generator RNGState saves starts seeded, or two runs differ from the start
    random.seed(0)
    numpy.random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=TOTAL_STEPS)
    dataset = mpckpt.SeededDataset(Noisy())
    state: dict[str, object] = {"model": model, "optim": opt, "sched": sched, "rng": mpckpt.RNGState()}
    loader: mpckpt.ResumableLoader | DataLoader
    if args.plain:
        loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=args.num_workers)
    else:
        sampler = mpckpt.ResumableSampler(dataset, shuffle=True, seed=7)
        loader = mpckpt.ResumableLoader(DataLoader(dataset, batch_size=BATCH, sampler=sampler,
                                                   num_workers=args.num_workers))
        state["data"] = loader

    with mpckpt.Checkpointer(args.root, workers=1, trigger=mpckpt.EveryNSteps(SAVE_EVERY)) as ckpt:
        last = ckpt.restore(state)
        step = 0 if last is None else last + 1
        where = (loader.epoch, loader.consumed) if isinstance(loader, mpckpt.ResumableLoader) else (-1, -1)
        print("resumed", step, *where, flush=True)
        while step < TOTAL_STEPS:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                epoch = loader.epoch if isinstance(loader, mpckpt.ResumableLoader) else -1
                print("step", step, epoch, loss.item().hex(), digest(*model.parameters()), digest(x, y), flush=True)
                ckpt.save(step, state, force=step == TOTAL_STEPS - 1)
                step += 1
                if step == TOTAL_STEPS:
                    break
                time.sleep(args.step_sleep)  # the scenario: a slower training step


if __name__ == "__main__":
    main()
