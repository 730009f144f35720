"""One rank of ``bench/goodput.py``'s training job, under torchrun on a simulated node (``harness.nodes``).

``goodput_worker.py --strategy S --root ROOT --out OUT [options]``: FSDP2 (gloo, CPU) on a small MLP
with AdamW, data drawn per step and rank from a generator seeded with both
(``harness.job.train_step``), so every step's state is known: the same on every
attempt and in an uninterrupted run. Each step is paced to ``--step-ms`` (the sleep stands for the
accelerator's compute; it also keeps the 2-core VM usable).

What it writes, one JSON object a line, into ``OUT/events-r<rank>.jsonl`` (the bench reads them as
they come): ``start`` (pid, launch), ``restored`` (step, ``last_restore.source``, the restored local
state's hash), ``step`` (step, wall time, the local state's hash after the step; with ``--full-hash``
the full model's hash too), ``commit`` (a save's future resolved: step, mode, status), ``save_error``
(an ``MpckptError`` raised by ``save``: the run goes on, as a training loop would), ``preempted``,
``stopped`` (the bench's stop file seen: the state's hash at the last step). ``OUT/uploaders-r<rank>.json``
holds the uploaders' pids, rewritten when they change.

Strategies: ``none`` (no checkpoint: the uninterrupted reference), ``storage`` (async saves every
``--every`` steps, ``keep_in_memory=False``), ``memory`` (``mode="memory"`` every step, async every
``--every``), ``peer`` (the same with ``peer_copies=1``), ``dcp`` (``dcp.async_save`` every ``--every``
steps into ``ROOT/step_<n>``, restart from the newest folder with DCP's ``.metadata``). Every rank
agrees each step (one all_reduce) on whether to stop: the stop file or a preemption signal
(``preemption=True``; for DCP a SIGTERM handler of its own). A preempted rank saves that step
(mpckpt: the save after the signal returns after its commit; DCP: ``dcp.save``) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_DIR)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import xxhash  # noqa: E402

import mpckpt  # noqa: E402
from harness.job import IN, OUT_DIM, init_group, parallel, train_step  # noqa: E402
from mpckpt.errors import MpckptError  # noqa: E402

KEEP_DCP = 3


def local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def digest(tensors: dict[str, Any]) -> str:
    """A hash of named tensors (and plain values), in key order: dtype, shape and bytes."""
    h = xxhash.xxh3_128()
    for key in sorted(tensors):
        value = tensors[key]
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
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


class Mpckpt:
    """The mpckpt strategies: open, restore, save per step, stop."""

    def __init__(self, args: argparse.Namespace, state: dict[str, Any]) -> None:
        options = json.loads(os.environ.get("GOODPUT_STORAGE_OPTIONS") or "null")
        if args.root.startswith("ctl://"):
            import tests.backends  # noqa: F401  (registers ctl://)
        self.args, self.state, self.futures = args, state, []
        self.ckpt = mpckpt.Checkpointer(args.root, storage_options=options, keep_last=3, workers=1, timeout_s=60,
                                        keep_in_memory=args.strategy != "storage",
                                        peer_copies=1 if args.strategy == "peer" else 0,
                                        memory_budget="256MiB", preemption=True)

    def restore(self) -> tuple[int | None, str | None]:
        step = self.ckpt.restore(self.state)
        last = self.ckpt.last_restore
        return step, None if last is None or step is None else last.source

    def save(self, step: int, events: Events, last: bool) -> None:
        due = step % self.args.every == 0
        mode = "async" if due or last else "memory"
        if mode == "memory" and self.args.strategy == "storage":
            return
        try:
            future = self.ckpt.save(step, self.state, mode=mode)
        except MpckptError as e:
            events("save_error", step=step, error=f"{type(e).__name__}: {e}"[:400])
            return
        if future is not None:
            self.futures.append((step, mode, future))
        self.poll(events)

    def poll(self, events: Events) -> None:
        for item in [f for f in self.futures if f[2].done()]:
            self.futures.remove(item)
            step, mode, future = item
            events("commit", step=step, mode=mode, status=future.stats.status)

    @property
    def preempted(self) -> bool:
        return self.ckpt.preempted

    def uploader_pids(self) -> list[int]:
        return self.ckpt.uploader_pids

    def close(self, events: Events) -> None:
        try:
            self.ckpt.close()
        except MpckptError as e:
            events("save_error", step=None, error=f"close: {type(e).__name__}: {e}"[:400])
        self.poll(events)


class Dcp:
    """The DCP baseline: ``dcp.async_save`` every N steps into ``ROOT/step_<n>``, restart from the newest."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.args, self.model, self.opt = args, model, opt
        self.root, self.pending = Path(args.root), None
        self.group = dist.new_group(backend="gloo")  # async_save's collectives never share the training's group
        self._preempted = False
        signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, *_: Any) -> None:
        self._preempted = True

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def complete(self) -> list[int]:
        if not self.root.exists():
            return []
        return sorted(int(p.name[5:]) for p in self.root.glob("step_*") if (p / ".metadata").exists())

    def restore(self) -> tuple[int | None, str | None]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        steps = self.complete()
        found = torch.tensor([steps[-1] if steps else -1])
        dist.all_reduce(found, op=dist.ReduceOp.MIN)  # every rank reads the same step
        if found.item() < 0:
            return None, None
        state = self._state()
        dcp.load(state, checkpoint_id=str(self.root / f"step_{found.item()}"), process_group=self.group)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return int(found.item()), "storage"

    def save(self, step: int, events: Events, last: bool) -> None:
        import torch.distributed.checkpoint as dcp

        if not (last or step % self.args.every == 0):
            return
        self.poll(events, wait=True)  # one in flight at a time, as DCP's docs advise
        path = str(self.root / f"step_{step}")
        if last:
            dcp.save(self._state(), checkpoint_id=path, process_group=self.group)
            events("commit", step=step, mode="sync", status="committed")
            return
        self.pending = (step, dcp.async_save(self._state(), checkpoint_id=path, process_group=self.group))

    def poll(self, events: Events, wait: bool = False) -> None:
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

        if self.pending is None or not (wait or self.pending[1].done()):
            return
        step, future = self.pending
        self.pending = None
        try:
            future.result(timeout=120)
            events("commit", step=step, mode="async", status="committed")
        except (Exception, CheckpointException) as e:  # noqa: BLE001 (recorded; the run goes on)
            events("save_error", step=step, error=f"{type(e).__name__}: {e}"[:400])
            return
        if dist.get_rank() == 0:
            for old in self.complete()[:-KEEP_DCP]:
                shutil.rmtree(self.root / f"step_{old}", ignore_errors=True)

    @property
    def preempted(self) -> bool:
        return self._preempted

    def uploader_pids(self) -> list[int]:
        return []

    def close(self, events: Events) -> None:
        self.poll(events, wait=True)


class Bare:
    """No checkpoint (the uninterrupted reference)."""

    preempted = False

    def restore(self) -> tuple[int | None, str | None]:
        return None, None

    def save(self, step: int, events: Events, last: bool) -> None:
        pass

    def poll(self, events: Events) -> None:
        pass

    def uploader_pids(self) -> list[int]:
        return []

    def close(self, events: Events) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["none", "storage", "memory", "peer", "dcp"], required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--step-ms", type=float, default=100)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--max-steps", type=int, default=1_000_000)
    parser.add_argument("--launch", type=int, default=0)
    parser.add_argument("--full-hash", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = init_group()
    events = Events(args.out, rank)
    events("start", pid=os.getpid(), launch=args.launch)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(IN, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, args.width),
                                 torch.nn.ReLU(), torch.nn.Linear(args.width, OUT_DIM))
    model, opt = parallel(layers, "fsdp", world)
    state = {"model": model, "optim": opt}
    events("built")
    saver: Any = (Bare() if args.strategy == "none" else Dcp(args, model, opt) if args.strategy == "dcp"
                  else Mpckpt(args, state))
    events("opened")
    events.uploaders(saver.uploader_pids())
    restored, source = saver.restore()
    events("restored", step=restored, source=source, hash=local_hash(model, opt) if restored is not None else None)
    stop_file = args.out / "stop"
    for step in range(0 if restored is None else restored + 1, args.max_steps):
        began = time.monotonic()
        train_step(model, opt, step, rank)
        flag = torch.tensor([2 if saver.preempted else 1 if stop_file.exists() else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops (and saves) at the same step
        fields: dict[str, Any] = {"hash": local_hash(model, opt)}
        if args.full_hash:
            fields["full"] = full_model_hash(model)
        events("step", step=step, **fields)
        if flag.item() == 1:
            events("stopped", step=step, hash=fields["hash"])
            break
        saver.save(step, events, last=flag.item() == 2)
        events.uploaders(saver.uploader_pids())
        if flag.item() == 2:
            events("preempted", step=step)
            break
        time.sleep(max(0.0, args.step_ms / 1e3 - (time.monotonic() - began)))
    saver.close(events)
    events("closed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
