"""Blocked time of ``save()`` for a state on a CUDA device (run where a GPU exists).

A model of ``--gib`` GiB of float32 parameters plus Adam state on ``cuda:0``, ``--saves``
ASYNC saves (eager, then overlapped), each timed from the call to its return, the previous
commit waited for outside the timing; the floor is a bare device-to-host copy of every
tensor into page-locked memory allocated beforehand. Prints one JSON line.

    python bench/gpu_save.py --gib 1 --saves 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import mpckpt


def state_on_gpu(gib: float, tensors: int) -> dict:
    per = int(gib * (1 << 30) / 3 / 4 / tensors)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(per, device="cuda")) for _ in range(tensors)])
    opt = torch.optim.Adam(model.parameters())
    sum(p.sum() for p in model).backward()
    opt.step()
    return {"model": model, "optim": opt}


def floor_ms(state: dict, saves: int) -> list[float]:
    sources = [t for t in state["model"].state_dict().values()]
    sources += [t for s in state["optim"].state.values() for t in s.values() if t.is_cuda]
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in sources]
    out = []
    for _ in range(saves):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, s in zip(dst, sources, strict=True):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def saves_ms(state: dict, saves: int, overlap: bool) -> list[float]:
    out = []
    with tempfile.TemporaryDirectory() as d, mpckpt.Checkpointer(d, workers=2, overlap=overlap) as ckpt:
        ckpt.prepare(state)
        for step in range(saves):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ckpt.save(step, state)
            out.append((time.perf_counter() - t0) * 1e3)
            ckpt.wait()
        loaded = mpckpt.load(d)
        assert torch.equal(loaded["model"]["0"], state["model"][0].detach().cpu())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--saves", type=int, default=8)
    args = p.parse_args()
    state = state_on_gpu(args.gib, args.tensors)
    result = {"device": torch.cuda.get_device_name(0), "gib": args.gib, "tensors": args.tensors}
    for name, figures in [("floor", floor_ms(state, args.saves)), ("eager", saves_ms(state, args.saves, False)),
                          ("overlap", saves_ms(state, args.saves, True))]:
        result[name] = {"first_ms": round(figures[0], 1), "median_ms": round(statistics.median(figures[1:]), 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
