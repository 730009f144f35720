"""One rank of ``bench/goodput.py``'s training job, under torchrun on a simulated node (``harness.nodes``).

``goodput_worker.py --strategy S --root ROOT --out OUT [options]``: an MLP of ``--depth`` Linear layers
``--width`` wide under FSDP2 or DDP (``--parallel``; gloo, CPU) with AdamW, data drawn per step and
rank from a generator seeded with both (``harness.job.train_step``, ``--batch`` rows), so every
step's state is known: the same on every attempt and in an uninterrupted run. Each step is paced to
at least ``--step-ms`` (a sleep after the real compute stands for an accelerator's).

What it writes, one JSON object a line, into ``OUT/events-r<rank>.jsonl`` (the bench reads them as
they come): ``start`` (pid, launch; the process group formed, with the times the interpreter started
and the imports ended), ``built`` (model and optimizer), ``opened`` (the checkpointer), ``restored``
(step, where from, the restored local state's hash), ``step`` (step, wall time, the local state's
hash after the step; with ``--full-hash`` the full model's hash too), ``saved`` (the time the loop
spent in ``save``), ``commit`` (a save resolved: step, mode, status), ``save_error`` (an error a save
raised or reported: the run goes on, as a training loop would), ``preempted``, ``stopped`` (the
bench's stop file seen: the state's hash at the last step). ``OUT/uploaders-r<rank>.json`` holds the
uploaders' pids, rewritten when they change.

Strategies (``goodput_savers.py``): ``none`` (no checkpoint: the uninterrupted reference),
``storage`` (async saves every ``--every`` steps, ``keep_in_memory=False``), ``memory``
(``mode="memory"`` every step, async every ``--every``), ``peer`` (the same with
``peer_copies=1``), ``dcp`` (``dcp.async_save`` every ``--every`` steps), ``torchsave``
(``torch.save`` every ``--every`` steps, blocking; DDP only). Every rank agrees each step (one
all_reduce) on whether to stop: the stop file or a preemption signal (``preemption=True``; for DCP
and torch.save a SIGTERM handler). A preempted rank saves that step and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

STARTED = time.time()  # before torch's import: the relaunch's breakdown tells the interpreter from the imports

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_DIR)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import xxhash  # noqa: E402
from goodput_savers import saver_for  # noqa: E402

from harness.job import IN, OUT_DIM, init_group, parallel, train_step  # noqa: E402

IMPORTED = time.time()


def local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def digest(tensors: dict[str, Any]) -> str:
    """A hash of named tensors (and plain values), in key order: dtype, shape and bytes."""
    h = xxhash.xxh3_128()
    for key in sorted(tensors):
        value = tensors[key]
        h.update(key.removeprefix("module.").encode())  # DDP's wrapper named or not: the same weights
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy() if t.numel() else b"")  # no copy
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def local_hash(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """This rank's part of the state: its FSDP2 shards of the weights and of AdamW's state."""
    flat = {f"model.{k}": local(v) for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        flat.update({f"optim.{i}.{k}": local(v) for k, v in s.items()})
    return digest(flat)


def full_model_hash(model: torch.nn.Module) -> str:
    """The full (unsharded) weights' hash, as ``mpckpt.load(root, step)["model"]`` gives them (collective)."""
    from torch.distributed.tensor import DTensor

    return digest({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()})


class Events:
    def __init__(self, out: Path, rank: int) -> None:
        self.file = open(out / f"events-r{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 (closed at exit)
        self.uploaders_path, self.pids = out / f"uploaders-r{rank}.json", None

    def __call__(self, kind: str, **fields: Any) -> None:
        self.file.write(json.dumps({"event": kind, "t": time.time(), **fields}) + "\n")

    def uploaders(self, pids: list[int]) -> None:
        if pids != self.pids:
            self.pids = pids
            tmp = self.uploaders_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(pids))
            os.replace(tmp, self.uploaders_path)


def watch_uploaders(saver: Any, events: Events) -> None:
    """The uploaders' pids into their file, once a second, off the loop (asking waits for their start)."""
    while True:
        events.uploaders(saver.uploader_pids())
        time.sleep(1.0)


def build(args: argparse.Namespace, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP of ``--depth`` Linear layers ``--width`` wide, under DDP or FSDP2, with AdamW."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(IN, args.width), torch.nn.ReLU()]
    for _ in range(args.depth - 2):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(args.width, OUT_DIM))
    return parallel(torch.nn.Sequential(*layers), args.parallel, world)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["none", "storage", "memory", "peer", "dcp", "torchsave"], required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--step-ms", type=float, default=100)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--parallel", choices=["fsdp", "ddp"], default="fsdp")
    parser.add_argument("--budget", default="256MiB")
    parser.add_argument("--max-steps", type=int, default=1_000_000)
    parser.add_argument("--launch", type=int, default=0)
    parser.add_argument("--full-hash", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = init_group()
    events = Events(args.out, rank)
    events("start", pid=os.getpid(), launch=args.launch, python=STARTED, imported=IMPORTED)
    model, opt = build(args, world)
    state = {"model": model, "optim": opt}
    events("built")
    saver = saver_for(args, model, opt, state)
    events("opened")
    restored, source = saver.restore()
    events("restored", step=restored, source=source, hash=local_hash(model, opt) if restored is not None else None)
    stop_file, watcher = args.out / "stop", None
    for step in range(0 if restored is None else restored + 1, args.max_steps):
        began = time.monotonic()
        train_step(model, opt, step, rank, batch=args.batch)
        flag = torch.tensor([2 if saver.preempted else 1 if stop_file.exists() else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops (and saves) at the same step
        fields: dict[str, Any] = {"hash": local_hash(model, opt)}
        if args.full_hash:
            fields["full"] = full_model_hash(model)
        events("step", step=step, **fields)
        if flag.item() == 1:
            events("stopped", step=step, hash=fields["hash"])
            break
        saving = time.monotonic()
        saver.save(step, events, last=flag.item() == 2)
        events("saved", step=step, s=time.monotonic() - saving)
        if watcher is None:
            watcher = threading.Thread(target=watch_uploaders, args=(saver, events), daemon=True)
            watcher.start()
        if flag.item() == 2:
            events("preempted", step=step)
            break
        time.sleep(max(0.0, args.step_ms / 1e3 - (time.monotonic() - began)))
    saver.close(events)
    events("closed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
