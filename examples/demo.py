"""The mpckpt demo: a small training loop with asynchronous checkpoints into a local folder.

For every save it prints how long the loop was blocked next to what torch.save of the same
state costs, then restores the last checkpoint into a fresh model and optimizer and checks
that every tensor came back bit for bit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

import mpckpt


def build(width: int, depth: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def torch_save_ms(state: dict, folder: str) -> float:
    path = os.path.join(folder, "torch_save.pt")
    started = time.perf_counter()
    torch.save({k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    ms = (time.perf_counter() - started) * 1e3
    os.unlink(path)
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", default=None, help="checkpoint folder (default: a temporary one)")
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="mpckpt-demo-")
    os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)  # --root runs/demo in a fresh clone
    scratch = tempfile.mkdtemp(prefix="mpckpt-demo-torch-save-", dir=os.path.dirname(os.path.abspath(root)))
    try:
        run(args, root, scratch)
    finally:  # also when the demo fails: nothing of it is left in the temp folder
        shutil.rmtree(scratch, ignore_errors=True)
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: str, scratch: str) -> None:
    model, opt = build(args.width, args.depth)
    x, y = torch.randn(64, args.width), torch.randint(0, 10, (64,))
    state = {"model": model, "optim": opt, "epoch": 0}
    print(f"mpckpt demo: checkpoints in {root}")
    with mpckpt.Checkpointer(root, workers=2) as ckpt:
        last = ckpt.restore(state)  # None on a fresh folder; also warms shared memory
        first = 0 if last is None else last + 1
        print(f"{'step':>5} {'loss':>8} {'blocked ms':>11} {'torch.save ms':>14} {'MiB':>7}")
        for step in range(first, first + args.steps):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["epoch"] = step
            if step % args.every == 0 or step == first + args.steps - 1:
                fut = ckpt.save(step, state, metrics={"loss": loss.item()})
                ref = torch_save_ms(state, scratch)
                print(f"{step:>5} {loss.item():>8.4f} {fut.stats.blocked_ms:>11.1f} {ref:>14.1f} "
                      f"{fut.stats.bytes / 2**20:>7.1f}")
    # Leaving the block waited for every upload; now prove the last checkpoint restores exactly.
    print(f"committed steps: {ckpt.steps()}  best by loss: {ckpt.best(2)}")
    print(f"median blocked {ckpt.stats.median('blocked_ms'):.1f} ms, "
          f"median persist {ckpt.stats.median('persist_ms'):.1f} ms")
    model2, opt2 = build(args.width, args.depth)
    state2 = {"model": model2, "optim": opt2, "epoch": -1}
    with mpckpt.Checkpointer(root, workers=1) as again:
        restored = again.restore(state2)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True))
    opt_a, opt_b = opt.state_dict()["state"], opt2.state_dict()["state"]
    same_opt = all(torch.equal(opt_a[k][n], opt_b[k][n]) for k in opt_a for n in opt_a[k])
    plain = mpckpt.load(root)
    print(f"restored step {restored} (epoch {state2['epoch']}): model identical={same}, optimizer identical={same_opt}; "
          f"mpckpt.load gives keys {sorted(plain)}")
    if not (same and same_opt and restored == state2["epoch"]):
        raise SystemExit("demo FAILED: the restored state differs")
    print("demo OK")

if __name__ == "__main__":
    main()
