"""The Hugging Face Trainer's own synchronous save vs ``MpckptCallback``, on the same GPT-2.

    .venv/bin/python bench/transformers_bench.py                 # 4 layers x 512: ~460 MB of state
    .venv/bin/python bench/transformers_bench.py --layers 6 --width 768 --steps 16 --every 4

Each case trains the same GPT-2 (built from a config, no download) for ``--steps`` optimizer
steps, saving every ``--every`` steps, in a fresh subprocess:

- ``none``: no saves (the loop's own time);
- ``hf``: the Trainer saves itself (``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``,
  ``rng_state.pth``, ``trainer_state.json`` into ``checkpoint-N``);
- ``mpckpt``: ``MpckptCallback(root, workers=2)`` (ASYNC: a copy into shared memory, written by
  the uploader processes); ``mpckpt-overlap``: the same with ``overlap=True``.

What the training thread waits per save is timed by two timing callbacks placed around the
saving one (so it is measured the same way for both): for ``hf`` from the ``on_step_end`` of the
save step to ``on_save`` (``_save_checkpoint`` runs in between; nothing logs or evaluates),
for mpckpt the time our callback spends in the event that takes the snapshot. The final save
is left out of the per-save figures (mpckpt also waits for every commit there: ``end wait``).
The ratio is the median HF save over the median mpckpt save. The callback makes the shared
memory of the saves once, after the first optimizer step (``prepare``): reported as ``once``. ``resume_path`` (materializing the
Trainer's folder from the last checkpoint) is timed too. Results go to stdout as a markdown
table and, with ``--json``, to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("none", "hf", "mpckpt", "mpckpt-overlap")


def run_case(case: str, opts: argparse.Namespace, where: str) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from mpckpt.integrations.transformers import MpckptCallback, resume_path

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    transformers.set_seed(0)
    config = GPT2Config(n_layer=opts.layers, n_embd=opts.width, n_head=8, vocab_size=50257, n_positions=opts.seq)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": row, "labels": row.clone()}
            for row in torch.randint(0, 50257, (opts.batch * opts.steps, opts.seq), generator=g)]

    marks: dict[str, list[tuple[str, int, float]]] = {"pre": [], "post": []}

    class Mark(TrainerCallback):  # type: ignore[misc]
        def __init__(self, side: str) -> None:
            self.side = side

        def _mark(self, event: str, state: Any) -> None:
            marks[self.side].append((event, state.global_step, time.perf_counter()))

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._mark("step_begin", state)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._mark("step_end", state)

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._mark("epoch_end", state)

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._mark("save", state)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._mark("train_end", state)

    root = os.path.join(where, "mpckpt")
    saving: list[Any] = []
    if case.startswith("mpckpt"):
        saving = [MpckptCallback(root, workers=2, overlap=case == "mpckpt-overlap")]
    args = TrainingArguments(
        output_dir=os.path.join(where, "hf"), max_steps=opts.steps, per_device_train_batch_size=opts.batch,
        save_strategy="no" if case == "none" else "steps", save_steps=opts.every, logging_strategy="no",
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Mark("pre"), *saving, Mark("post")])
    unique = {t.data_ptr(): t for t in model.state_dict().values()}  # the tied lm_head counted once
    state_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started

    pre = {(e, s): t for e, s, t in marks["pre"]}
    post = {(e, s): t for e, s, t in marks["post"]}
    saves_ms: list[float] = []
    last = opts.steps
    save_steps = [s for s in range(opts.every, last, opts.every)]
    if case == "hf":
        saves_ms = [(pre[("save", s)] - post[("step_end", s)]) * 1e3 for s in save_steps]
        end_ms = (pre[("save", last)] - post[("step_end", last)]) * 1e3
    elif case.startswith("mpckpt"):
        # the snapshot of step s is taken in our on_step_begin of the step after it
        saves_ms = [(post[("step_begin", s)] - pre[("step_begin", s)]) * 1e3 for s in save_steps]
        end_ms = (post[("train_end", last)] - pre[("train_end", last)]) * 1e3
    else:
        end_ms = 0.0
    result: dict[str, Any] = {"case": case, "wall_s": wall, "saves_ms": saves_ms, "end_ms": end_ms,
                              "params": sum(p.numel() for p in model.parameters())}
    if case.startswith("mpckpt"):
        futures = saving[0].futures
        result["once_ms"] = (post[("step_end", 1)] - pre[("step_end", 1)]) * 1e3  # prepare(): shared memory, once
        result["snapshot_ms"] = [f.stats.snapshot_ms for f in futures]
        result["blocked_ms"] = [f.stats.blocked_ms for f in futures]
        result["persist_ms"] = [f.stats.persist_ms for f in futures]
        result["written_bytes"] = max(f.stats.bytes for f in futures)
        t0 = time.perf_counter()
        resume_path(root, directory=os.path.join(where, "resume"))
        result["resume_path_ms"] = (time.perf_counter() - t0) * 1e3
    if case == "hf":
        folder = os.path.join(where, "hf", f"checkpoint-{last}")
        result["written_bytes"] = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
    result["model_bytes"] = state_bytes
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--where", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.case:
        print("RESULT " + json.dumps(run_case(opts.case, opts, opts.where)), flush=True)
        return
    base = opts.dir or tempfile.mkdtemp(prefix="mpckpt-hf-bench-")
    results = []
    for case in opts.cases.split(","):
        where = os.path.join(base, case)
        shutil.rmtree(where, ignore_errors=True)
        os.makedirs(where)
        argv = [sys.executable, os.path.abspath(__file__), "--case", case, "--where", where,
                *(f"--{k}={getattr(opts, k)}" for k in ("layers", "width", "seq", "batch", "steps", "every"))]
        out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not line:
            sys.exit(f"case {case} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        results.append(json.loads(line[0][len("RESULT "):]))
        shutil.rmtree(where, ignore_errors=True)
        os.system("sync")
    by = {r["case"]: r for r in results}
    none_wall = by.get("none", {}).get("wall_s")
    print(f"GPT-2 {opts.layers} layers x {opts.width}, {results[0]['params'] / 1e6:.1f} M parameters; "
          f"{opts.steps} steps, a save every {opts.every}; {os.cpu_count()} CPUs")
    print()
    print("| case | per save, median ms (each) | end of train ms | train() s | slower than no saves | written MB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        each = ", ".join(f"{x:.0f}" for x in r["saves_ms"])
        med = f"{statistics.median(r['saves_ms']):.1f} ({each})" if r["saves_ms"] else "-"
        slower = f"{(r['wall_s'] / none_wall - 1) * 100:+.0f}%" if none_wall else "-"
        written = f"{r['written_bytes'] / 2**20:.0f}" if "written_bytes" in r else "-"
        print(f"| {r['case']} | {med} | {r['end_ms']:.0f} | {r['wall_s']:.1f} | {slower} | {written} |")
    if "hf" in by:
        hf = statistics.median(by["hf"]["saves_ms"])
        for case in ("mpckpt", "mpckpt-overlap"):
            if case in by:
                ours = statistics.median(by[case]["saves_ms"])
                print(f"\n{case}: the Trainer waits {hf / ours:.1f}x less per save than with its own save "
                      f"({hf:.0f} ms -> {ours:.1f} ms); shared memory made once at step 1: "
                      f"{by[case]['once_ms']:.0f} ms; resume_path {by[case]['resume_path_ms']:.0f} ms")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"options": vars(opts), "results": results}, f, indent=2)
    if not opts.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
