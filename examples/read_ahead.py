"""A loop that reads its next batch ahead (as nanoGPT's train.py does) and resumes exactly.

nanoGPT draws the first batch before the loop and, inside each step, the next batch right after
the forward pass, so that drawing it overlaps the backward pass on a GPU::

    X, Y = get_batch("train")              # before the loop
    while True:
        ...                                # evaluate and save here: X, Y are already drawn
        logits, loss = model(X, Y)
        X, Y = get_batch("train")          # the next step's batch, drawn now
        loss.backward(); optimizer.step()

At every save the batch the next step trains on is already drawn, from torch's global generator,
which the saved ``RNGState`` holds *after* that draw. A resume that draws a batch afresh draws the
one after it: the resumed run trains on other batches than the uninterrupted one, with no error.
The batch drawn ahead is loop state like any other: it goes into the ``LoopState``, and the loop
trains on ``loop.x, loop.y``::

    loop = mpckpt.LoopState(iter_num=0, x=None, y=None)
    state = {"model": model, "optim": opt, "rng": mpckpt.RNGState(), "loop": loop}
    last = ckpt.restore(state)
    if last is None:
        loop.x, loop.y = get_batch()       # a fresh run draws its first batch; a resume has it
    ...
        loss = model(loop.x, loop.y)
        loop.x, loop.y = get_batch()       # read ahead, into the state the next save stores

``python examples/read_ahead.py`` trains a small character model for 60 steps, saving every 10 into
``runs/read_ahead``; kill it and run it again and it goes on exactly. ``--trace`` prints every step
as ``step <n> <loss as float.hex>`` (tests/integration/test_read_ahead.py compares them);
``--forget-batch`` draws the batch afresh on resume instead (what a script that does not save it
does), for the test to catch.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.nn import functional as F

import mpckpt

VOCAB, CONTEXT, BATCH, WIDTH = 32, 16, 8, 32


class CharModel(nn.Module):
    """A small next-character model: embeddings, one MLP block, a head tied to the embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.mlp = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(4 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        x = x + self.mlp(x)
        return F.cross_entropy(self.head(x).view(-1, VOCAB), targets.view(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="runs/read_ahead", help="checkpoint folder or URL (default: runs/read_ahead)")
    parser.add_argument("--steps", type=int, default=60, help="training steps in all (default: 60)")
    parser.add_argument("--every", type=int, default=10, help="save every N steps (default: 10)")
    parser.add_argument("--trace", action="store_true", help="print every step's loss")
    parser.add_argument("--crash-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: die once committed
    parser.add_argument("--forget-batch", action="store_true", help=argparse.SUPPRESS)  # tests: the bug to catch
    args = parser.parse_args()

    data = torch.randint(VOCAB, (20_000,), generator=torch.Generator().manual_seed(7))  # the "corpus"

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - CONTEXT - 1, (BATCH,))  # torch's global generator, as nanoGPT
        return (torch.stack([data[i:i + CONTEXT] for i in ix]), torch.stack([data[i + 1:i + 1 + CONTEXT] for i in ix]))

    torch.manual_seed(1337)
    model = CharModel()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loop = mpckpt.LoopState(iter_num=0, x=None, y=None)
    state = {"model": model, "optim": opt, "rng": mpckpt.RNGState(), "loop": loop}
    with mpckpt.Checkpointer(args.root, workers=1) as ckpt:
        last = ckpt.restore(state)
        if last is None or args.forget_batch:
            loop.x, loop.y = get_batch()  # a fresh run draws its first batch; a resume has the one drawn ahead
        print("resumed", -1 if last is None else last, flush=True)
        for it in range(0 if last is None else last + 1, args.steps):
            loss = model(loop.x, loop.y)
            loop.x, loop.y = get_batch()  # read ahead: the next step's batch, into the state
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loop.iter_num = it
            if args.trace:
                print("step", it, loss.item().hex(), flush=True)
            if (it + 1) % args.every == 0:
                ckpt.save(it, state, metrics={"loss": loss.item()})
                if it == args.crash_after:
                    ckpt.wait()
                    os._exit(1)  # as a kill would, once this step is committed
    print(f"done: step {args.steps - 1}, loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
