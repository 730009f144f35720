"""A word-level language model (as pytorch/examples' word_language_model) that resumes exactly.

An LSTM reads one long tensor of token ids, cut into batches by index (``batchify`` and
``get_batch``, no DataLoader), and carries its hidden state from one batch to the next. Besides
the model and the optimizer, the loop carries values of its own from step to step: the hidden
state, where in the token tensor the next batch starts, the epoch, a learning rate it divides
by 4 whenever the validation loss does not improve, the best validation loss, the running
total of the loss since the last log line, and a generator of its own that draws each batch's
length (a variable bptt). All of them live in one ``mpckpt.LoopState``, so a run that is killed
and started again goes on exactly as if it never stopped::

    python examples/word_lm.py                  # checkpoints into runs/word_lm every 10 steps
    python examples/word_lm.py --steps 200      # kill it (Ctrl-C, kill -9) and run it again: it resumes

The corpus is made up in the script (a fixed random Markov chain over a small vocabulary), so
nothing is downloaded. ``--trace`` prints every step as ``step <step> <epoch> <lr> <loss> <digest
of the weights>`` (numbers as ``float.hex()``; tests/integration/test_word_lm_resume.py compares them).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import time

import torch
from torch import nn

import mpckpt

VOCAB, TRAIN_TOKENS, VAL_TOKENS = 48, 6_400, 1_600
BATCH, EVAL_BATCH, BPTT, CLIP, LOG_EVERY = 16, 8, 20, 0.25, 10


def corpus(n_tokens: int, *, seed: int) -> torch.Tensor:
    """Token ids from a fixed random Markov chain: each token is followed by one of 3 likely ones."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(VOCAB, (VOCAB, 3), generator=g).tolist()
    choices = torch.randint(3, (n_tokens,), generator=g).tolist()
    noise = (torch.rand(n_tokens, generator=g) < 0.1).tolist()
    random_tokens = torch.randint(VOCAB, (n_tokens,), generator=g).tolist()
    tokens, token = [], 0
    for choice, is_noise, other in zip(choices, noise, random_tokens, strict=True):
        token = other if is_noise else successors[token][choice]
        tokens.append(token)
    return torch.tensor(tokens, dtype=torch.long)


def batchify(data: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``batch_size`` columns, each a contiguous stretch of the corpus: shape (tokens per column, batch)."""
    columns = data.size(0) // batch_size
    return data[:columns * batch_size].view(batch_size, columns).t().contiguous()


def get_batch(source: torch.Tensor, i: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``i`` to ``i + seq_len`` of ``source`` and the tokens that follow each (the targets)."""
    seq_len = min(seq_len, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


class RNNModel(nn.Module):
    """Embedding, a 2-layer LSTM with dropout, and a decoder back to the vocabulary."""

    def __init__(self, *, emsize: int = 32, nhid: int = 64, nlayers: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(VOCAB, emsize)
        self.rnn = nn.LSTM(emsize, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, VOCAB)
        self.nlayers, self.nhid = nlayers, nhid

    def forward(self, tokens: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(output)).view(-1, VOCAB), hidden

    def init_hidden(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, batch_size, self.nhid),
                weight.new_zeros(self.nlayers, batch_size, self.nhid))


def repackage_hidden(hidden: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The hidden state without its history: backpropagation stops at the batch boundary."""
    return tuple(h.detach() for h in hidden)


def epoch_start(seed: int, epoch: int) -> int:
    """Where epoch ``epoch`` starts in the token tensor: a pure function of ``(seed, epoch)``, so
    nothing about it needs saving beyond the epoch (it moves the batch boundaries every epoch)."""
    return int(torch.randint(BPTT // 2, (), generator=torch.Generator().manual_seed(seed * 100_003 + epoch)))


def draw_seq_len(generator: torch.Generator) -> int:
    """A batch's length, drawn from the loop's own generator (which the LoopState saves)."""
    return BPTT + int(torch.randint(-BPTT // 4, BPTT // 4 + 1, (), generator=generator))


def evaluate(model: RNNModel, data: torch.Tensor) -> float:
    """Mean loss per token over ``data`` (dropout off, no generator drawn from)."""
    model.eval()
    total, hidden = 0.0, model.init_hidden(EVAL_BATCH)
    with torch.no_grad():
        for i in range(0, data.size(0) - 1, BPTT):
            tokens, targets = get_batch(data, i, BPTT)
            output, hidden = model(tokens, hidden)
            total += len(tokens) * nn.functional.cross_entropy(output, targets).item()
    model.train()
    return total / (len(data) - 1)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for tensor in model.state_dict().values():
        h.update(tensor.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def seed_all(seed: int) -> None:
    """Seed the generators RNGState saves (dropout draws from torch's), so that two runs are alike."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # RNGState saves NumPy's generator only where NumPy is installed
        return
    numpy.random.seed(seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="runs/word_lm", help="checkpoint folder or URL (default: runs/word_lm)")
    parser.add_argument("--steps", type=int, default=120, help="training steps in all (default: 120, 5 epochs)")
    parser.add_argument("--every", type=int, default=10, help="save every N steps (default: 10)")
    parser.add_argument("--lr", type=float, default=10.0, help="initial learning rate (default: 10)")
    parser.add_argument("--seed", type=int, default=1111)
    parser.add_argument("--trace", action="store_true", help="print every step's loss and a digest of the weights")
    parser.add_argument("--step-sleep", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: a slower loop
    parser.add_argument("--forget-hidden", action="store_true", help=argparse.SUPPRESS)  # tests: the bug to catch
    args = parser.parse_args()

    seed_all(args.seed)
    tokens = corpus(TRAIN_TOKENS + VAL_TOKENS, seed=args.seed)
    train_data, val_data = batchify(tokens[:TRAIN_TOKENS], BATCH), batchify(tokens[TRAIN_TOKENS:], EVAL_BATCH)
    model = RNNModel()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.5)
    # Everything the loop carries from one step to the next, and nowhere else.
    loop = mpckpt.LoopState(
        epoch=0,
        i=epoch_start(args.seed, 0),          # row of train_data where the next batch starts
        lr=args.lr,                           # divided by 4 when the validation loss does not improve
        best_val=math.inf,
        total_loss=0.0,                       # summed since the last log line
        hidden=model.init_hidden(BATCH),      # the LSTM's (h, c), carried across batches
        lengths=torch.Generator().manual_seed(args.seed),  # draws each batch's length
    )
    state = {"model": model, "optim": opt, "rng": mpckpt.RNGState(), "loop": loop}

    keep = mpckpt.KeepLast(2) | mpckpt.KeepBest(1, "val_loss")  # the best model, as the original saves it
    with mpckpt.Checkpointer(args.root, workers=1, keep=keep, trigger=mpckpt.EveryNSteps(args.every)) as ckpt:
        last = ckpt.restore(state)
        if args.forget_hidden:  # what a script that keeps the hidden state out of `loop` resumes with
            loop.hidden = model.init_hidden(BATCH)
        step = 0 if last is None else last + 1
        print("resumed", step, loop.epoch, loop.i, flush=True)
        while step < args.steps:
            loss = train_step(model, opt, loop, train_data)
            metrics = {"loss": loss}
            if step % LOG_EVERY == LOG_EVERY - 1:
                print(f"| epoch {loop.epoch} | step {step} | lr {loop.lr:g} | loss {loop.total_loss / LOG_EVERY:.3f}")
                loop.total_loss = 0.0
            if loop.i >= train_data.size(0) - 1:  # the epoch is over
                metrics["val_loss"] = val_loss = evaluate(model, val_data)
                print(f"| end of epoch {loop.epoch} | step {step} | valid loss {val_loss:.3f} | lr {loop.lr:g}")
                if val_loss < loop.best_val:
                    loop.best_val = val_loss
                else:
                    loop.lr /= 4.0
                loop.epoch += 1
                loop.i = epoch_start(args.seed, loop.epoch)
                loop.hidden = model.init_hidden(BATCH)
            if args.trace:
                print("step", step, loop.epoch, loop.lr.hex(), loss.hex(), digest(model), flush=True)
            # everything of this step is in the state now: a resume starts with the next one
            ckpt.save(step, state, metrics=metrics, force="val_loss" in metrics or step == args.steps - 1)
            step += 1
            time.sleep(args.step_sleep)
    print(f"done: step {step}, best validation loss {loop.best_val:.3f}, best checkpoint {ckpt.best(1, 'val_loss')}")


def train_step(model: RNNModel, opt: torch.optim.Optimizer, loop: mpckpt.LoopState, data: torch.Tensor) -> float:
    """One batch at ``loop.i``; advances ``loop.i``, ``loop.hidden`` and ``loop.total_loss``."""
    tokens, targets = get_batch(data, loop.i, draw_seq_len(loop.lengths))
    for group in opt.param_groups:
        group["lr"] = loop.lr
    output, hidden = model(tokens, loop.hidden)
    loss = nn.functional.cross_entropy(output, targets)
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    loop.hidden = repackage_hidden(hidden)
    loop.i += len(tokens)
    loop.total_loss += loss.item()
    return loss.item()


if __name__ == "__main__":
    main()
