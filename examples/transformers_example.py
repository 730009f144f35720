"""Hugging Face Trainer with mpckpt: the Trainer's saves become asynchronous, resume stays exact.

    python examples/transformers_example.py                      # trains 12 steps, saving every 4
    python examples/transformers_example.py --stop-after 6       # stops after step 6 (a "crash")...
    python examples/transformers_example.py                      # ...and this run resumes from step 4
    python examples/transformers_example.py --fresh              # from step 0 again: the old checkpoints go

The only changes to a Trainer script: the callback, and ``resume_path(root)`` as
``resume_from_checkpoint`` (``None`` while the root is empty, so the same line starts the first
run). A fresh run into a root that holds checkpoints is refused before its first step (steps only
increase); ``--fresh`` passes ``discard_newer=True``, which deletes them. A tiny GPT-2 is built
from a config (nothing is downloaded); the data is random tokens.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import mpckpt
from mpckpt.integrations.transformers import MpckptCallback, resume_path


class StopAfter(TrainerCallback):  # type: ignore[misc]
    """Ends the run after ``step`` without the Trainer's last save, as a crash would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise SystemExit(f"stopped after step {self.step}; run again to resume")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "mpckpt-hf-example"),
                        help="where the checkpoints go: a folder or a URL (s3://, az://, ...)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--fresh", action="store_true",
                        help="start from step 0 even if the root holds checkpoints (they are deleted)")
    opts = parser.parse_args()

    transformers.logging.set_verbosity_error()
    transformers.set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": row, "labels": row.clone()} for row in torch.randint(0, 256, (64, 32), generator=g)]
    args = TrainingArguments(output_dir=os.path.join(opts.root, "hf"), max_steps=opts.steps,
                             per_device_train_batch_size=8, learning_rate=1e-3, save_strategy="steps", save_steps=4,
                             save_total_limit=2, logging_steps=2, report_to=[], use_cpu=True, disable_tqdm=True)
    callback = MpckptCallback(os.path.join(opts.root, "ckpt"), workers=1,   # <- the one change
                              discard_newer=opts.fresh)
    callbacks: list[Any] = [callback]
    if opts.stop_after is not None:
        callbacks.append(StopAfter(opts.stop_after))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)

    start = None if opts.fresh else resume_path(os.path.join(opts.root, "ckpt"))  # <- and where to resume from
    print("starting fresh" if start is None else f"resuming from {start}")
    try:
        trainer.train(resume_from_checkpoint=start)
    finally:
        callback.close()  # after a crash: commit what was saved (the finalizer would do it at exit)
    with mpckpt.Checkpointer(os.path.join(opts.root, "ckpt"), read_only=True) as ckpt:
        print(f"committed steps {ckpt.steps()} (save_total_limit=2); losses:",
              [round(e["loss"], 4) for e in trainer.state.log_history if "loss" in e])
        for step in ckpt.steps():
            figures = ckpt.checkpoint(step).metrics
            print(f"  step {step}: epoch {figures.get('epoch')}")
    for future in callback.futures:
        s = future.stats
        print(f"save of step {s.step}: the Trainer waited {s.blocked_ms:.1f} ms; written in the background "
              f"in {s.persist_ms:.0f} ms ({s.bytes / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
