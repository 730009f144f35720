"""How each strategy of ``bench/goodput.py`` checkpoints and restores, one class each, for ``goodput_worker.py``.

``Mpckpt`` (``storage``, ``memory``, ``peer``), ``Dcp`` (``dcp.async_save`` every N steps), ``Torchsave``
(``torch.save`` every N steps, blocking: the loop waits for the write) and ``Bare`` (no checkpoint: the
uninterrupted reference). DCP and torch.save write where mpckpt does: the S3 bucket behind the fault
proxy (through fsspec, with the same storage options) or the disk, ``ROOT/step_<n>``, the newest
three kept; a step counts once its marker is there (DCP's ``.metadata``, torch.save's ``done``).
Every saver records its commits and errors as events; a restart restores the newest step every
rank can read (an all_reduce of the minimum).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import torch
import torch.distributed as dist

import mpckpt
from mpckpt.errors import MpckptError

KEEP = 3


def storage_options() -> dict[str, Any]:
    return json.loads(os.environ.get("GOODPUT_STORAGE_OPTIONS") or "null") or {}


class Mpckpt:
    """The mpckpt strategies: open, restore, save per step, stop."""

    def __init__(self, args: argparse.Namespace, state: dict[str, Any]) -> None:
        options = storage_options() or None
        if args.root.startswith("ctl://"):
            import tests.backends  # noqa: F401  (registers ctl://)
        self.args, self.state, self.futures = args, state, []
        self.ckpt = mpckpt.Checkpointer(args.root, storage_options=options, keep_last=KEEP, workers=1, timeout_s=60,
                                        keep_in_memory=args.strategy != "storage",
                                        peer_copies=1 if args.strategy == "peer" else 0,
                                        memory_budget=args.budget, preemption=True)

    def restore(self) -> tuple[int | None, str | None]:
        step = self.ckpt.restore(self.state)
        last = self.ckpt.last_restore
        return step, None if last is None or step is None else last.source

    def save(self, step: int, events: Any, last: bool) -> None:
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

    def poll(self, events: Any) -> None:
        for item in [f for f in self.futures if f[2].done()]:
            self.futures.remove(item)
            step, mode, future = item
            events("commit", step=step, mode=mode, status=future.stats.status)

    @property
    def preempted(self) -> bool:
        return self.ckpt.preempted

    def uploader_pids(self) -> list[int]:
        return self.ckpt.uploader_pids

    def close(self, events: Any) -> None:
        try:
            self.ckpt.close()
        except MpckptError as e:
            events("save_error", step=None, error=f"close: {type(e).__name__}: {e}"[:400])
        self.poll(events)


class _Folders:
    """``ROOT/step_<n>`` folders on the run's storage (a local path or a URL fsspec opens), a marker file each."""

    def __init__(self, args: argparse.Namespace, marker: str) -> None:
        import fsspec

        self.args, self.marker, self.options = args, marker, storage_options()
        self.fs, self.base = fsspec.core.url_to_fs(args.root, **self.options)
        self.base = self.base.rstrip("/")
        self._preempted = False
        signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, *_: Any) -> None:
        self._preempted = True

    @property
    def preempted(self) -> bool:
        return self._preempted

    def url(self, step: int) -> str:
        return self.args.root.rstrip("/") + f"/step_{step}"

    def path(self, step: int) -> str:
        return f"{self.base}/step_{step}"

    def complete(self) -> list[int]:
        try:
            self.fs.invalidate_cache()
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.base, detail=False)]
        except FileNotFoundError:
            return []
        steps = sorted(int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit())
        return [s for s in steps if self.fs.exists(f"{self.path(s)}/{self.marker}")]

    def agreed(self) -> int | None:
        """The newest complete step every rank sees (collective), or None."""
        try:
            steps = self.complete()
        except Exception:  # noqa: BLE001 (storage down at the restart: this rank sees none)
            steps = []
        found = torch.tensor([steps[-1] if steps else -1])
        dist.all_reduce(found, op=dist.ReduceOp.MIN)
        return None if found.item() < 0 else int(found.item())

    def prune(self) -> None:
        """The newest ``KEEP`` complete folders stay (rank 0; errors recorded by the caller)."""
        for old in self.complete()[:-KEEP]:
            self.fs.rm(self.path(old), recursive=True)

    def uploader_pids(self) -> list[int]:
        return []


class Dcp(_Folders):
    """The DCP baseline: ``dcp.async_save`` every N steps into ``ROOT/step_<n>``, restart from the newest."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__(args, ".metadata")
        self.model, self.opt, self.pending = model, opt, None
        self.group = dist.new_group(backend="gloo")  # async_save's collectives never share the training's group

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def _writer(self, step: int) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        if "://" in self.args.root:
            return FsspecWriter(self.url(step), sync_files=False, **self.options)
        return FileSystemWriter(self.url(step))

    def _reader(self, step: int) -> Any:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(self.url(step), **self.options) if "://" in self.args.root else FileSystemReader(self.url(step))

    def restore(self) -> tuple[int | None, str | None]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        step = self.agreed()
        if step is None:
            return None, None
        state = self._state()
        dcp.load(state, storage_reader=self._reader(step), process_group=self.group)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return step, "storage"

    def save(self, step: int, events: Any, last: bool) -> None:
        import torch.distributed.checkpoint as dcp

        if not (last or step % self.args.every == 0):
            return
        self.poll(events, wait=True)  # one in flight at a time, as DCP's docs advise
        try:
            if last:
                dcp.save(self._state(), storage_writer=self._writer(step), process_group=self.group)
                events("commit", step=step, mode="sync", status="committed")
                return
            self.pending = (step, dcp.async_save(self._state(), storage_writer=self._writer(step),
                                                 process_group=self.group))
        except Exception as e:  # noqa: BLE001 (recorded; the run goes on, as a training loop would)
            events("save_error", step=step, error=f"{type(e).__name__}: {e}"[:400])

    def poll(self, events: Any, wait: bool = False) -> None:
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

        if self.pending is None or not (wait or self.pending[1].done()):
            return
        step, future = self.pending
        self.pending = None
        try:
            future.result(timeout=300)
            events("commit", step=step, mode="async", status="committed")
            if dist.get_rank() == 0:
                self.prune()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 (recorded; the run goes on)
            events("save_error", step=step, error=f"{type(e).__name__}: {e}"[:400])

    def close(self, events: Any) -> None:
        self.poll(events, wait=True)


class Torchsave(_Folders):
    """``torch.save`` every N steps, blocking, as DDP users write it: rank 0 writes ``state.pt`` (the module's
    and the optimizer's state dicts), then ``done``; every rank reads it back at a restart."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__(args, "done")
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise SystemExit("goodput: the torchsave strategy saves a DDP model (--parallel ddp)")
        self.model, self.opt = model, opt

    def restore(self) -> tuple[int | None, str | None]:
        step = self.agreed()
        if step is None:
            return None, None
        with self.fs.open(f"{self.path(step)}/state.pt", "rb") as f:
            state = torch.load(f, weights_only=True)
        self.model.module.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])
        return step, "storage"

    def save(self, step: int, events: Any, last: bool) -> None:
        if not (last or step % self.args.every == 0):
            return
        ok = torch.tensor([1])
        if dist.get_rank() == 0:
            try:
                self.fs.makedirs(self.path(step), exist_ok=True)
                with self.fs.open(f"{self.path(step)}/state.pt", "wb") as f:
                    torch.save({"model": self.model.module.state_dict(), "optim": self.opt.state_dict()}, f)
                with self.fs.open(f"{self.path(step)}/done", "wb") as f:
                    f.write(b"")
                self.prune()
            except Exception as e:  # noqa: BLE001 (recorded; the run goes on)
                events("save_error", step=step, error=f"{type(e).__name__}: {e}"[:400])
                ok[0] = 0
        dist.broadcast(ok, 0)  # the others wait for the write, as a blocking save makes them
        if ok.item():
            events("commit", step=step, mode="sync", status="committed")

    def poll(self, events: Any) -> None:
        pass

    def close(self, events: Any) -> None:
        pass


class Bare:
    """No checkpoint (the uninterrupted reference)."""

    preempted = False

    def restore(self) -> tuple[int | None, str | None]:
        return None, None

    def save(self, step: int, events: Any, last: bool) -> None:
        pass

    def poll(self, events: Any) -> None:
        pass

    def uploader_pids(self) -> list[int]:
        return []

    def close(self, events: Any) -> None:
        pass


def saver_for(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer,
              state: dict[str, Any]) -> Any:
    if args.strategy == "none":
        return Bare()
    if args.strategy == "dcp":
        return Dcp(args, model, opt)
    if args.strategy == "torchsave":
        return Torchsave(args, model, opt)
    return Mpckpt(args, state)
