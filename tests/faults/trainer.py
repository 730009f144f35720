"""A training process for the crash tests: saves ASYNC checkpoints until it is killed.

Run as ``python -m tests.faults.trainer ROOT MARKER_DIR``. The state of step s is a pure
function of s (``state_for``), so a test can check a restored checkpoint bit for bit. The
upload of every step from 2 on is slowed down so the kill lands while uploads are in flight;
it prints "committed <step>" lines as commits happen.
"""

from __future__ import annotations

import sys
import time

import torch

import mpckpt
from tests.backends import ctl_url
from tests.states import random_state


def state_for(step: int) -> dict[str, object]:
    return random_state(step, {"w": (256, 256), "b": (256,)}, dtypes={"b": torch.bfloat16}, step=step)


def main() -> None:
    root, markers = sys.argv[1], sys.argv[2]
    opts = {"delay": {r"step_00000000(0[2-9]|[1-9]\d)\.": 0.3}, "marker_dir": markers}
    with mpckpt.Checkpointer(ctl_url(root), workers=2, storage_options=opts) as ckpt:
        start = 0 if ckpt.latest_step is None else ckpt.latest_step + 1
        for step in range(start, start + 1000):
            fut = ckpt.save(step, state_for(step))
            fut.add_done_callback(lambda f: print(f"committed {f.step}", flush=True))
            time.sleep(0.05)  # the scenario: a training step (uploads run meanwhile)


if __name__ == "__main__":
    main()
