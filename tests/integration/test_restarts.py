"""Restarts as users write them: ``mpckpt.init_process_group`` across torchrun's restarts, and every
snippet of the README and the user guide (``docs/guide/*.md``) that restarts, run twice with a
step-0 checkpoint between.

- A 2-rank job under ``torchrun --max-restarts 4`` whose rank 1 exits after each attempt's save:
  five attempts, each over a store private to it, each resuming from the step the one before saved
  (step 0 first: the README's idiom goes on from 1, never saves 0 again).
- ``init_process_group`` does torch's plain call outside torchrun, with ``store=`` / ``init_method=``,
  and where torchrun's workers do not share the agent's store.
- Each ```python block that restores then loops (``restore(state)`` and ``range(``), from
  README.md and then docs/guide/*.md in sorted order (``_*.md`` there are notes, not pages): run
  in a fresh process with only step 0 to save, then again with three steps. The second run
  restores step 0 and saves 1 and 2 (no ``StepOrderError``, no ``None`` dereferenced on a first
  run). Five today: the README's main example; jobs-and-nodes.md's multi-rank job and peer
  copies; restoring.md's read-ahead loop and restart from memory.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mpckpt
from mpckpt.process_group import attempt_store_wanted
from tests.launch import torchrun, worker_env

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("restart_worker.py"))


def test_init_process_group_survives_four_torchrun_restarts(tmp_path):
    root, out, log = tmp_path / "root", tmp_path / "out", tmp_path / "log.txt"
    out.mkdir()
    torchrun(2, root, out, 4, log=log, launcher=("--max-restarts=4",), worker=WORKER, timeout_s=400)
    for attempt in range(5):
        seen = [json.loads((out / f"a{attempt}-r{rank}.json").read_text()) for rank in range(2)]
        expect = {"restored": None if attempt == 0 else attempt - 1, "saved": attempt,
                  "restored_attempt": attempt, "prefix": f"mpckpt-attempt-{attempt}/"}
        for view in seen:
            assert {k: view[k] for k in expect} == expect, (attempt, seen)
            assert (view["source"] is None) == (attempt == 0), view
    assert mpckpt.load(root)["attempt"] == 4
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_{s:010d}" for s in range(5)]


def test_init_process_group_is_torchs_own_call_where_no_attempt_store_is_needed():
    agent = {"TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert attempt_store_wanted({}, agent)
    assert not attempt_store_wanted({}, {})  # not under torchrun
    assert not attempt_store_wanted({}, {**agent, "TORCHELASTIC_USE_AGENT_STORE": "False"})  # rank 0's own store
    assert not attempt_store_wanted({"init_method": "tcp://127.0.0.1:1"}, agent)  # the caller chose
    assert not attempt_store_wanted({"store": object()}, agent)


_PRELUDE = """
import sys, torch, mpckpt
torch.manual_seed(0)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x, y=None):  # model(x), or model(x, y): the loss
        out = self.lin(x)
        return out if y is None else ((out - y) ** 2).mean()

model = fsdp_model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = {"model": model, "optim": opt}
total = n_steps = max_iters = int(sys.argv[2])
epoch = 0

def train_step():
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return 1.0

def get_batch(split):
    return torch.randn(3, 4), torch.randn(3, 2)
"""


def _restart_blocks() -> list[str]:
    guide = sorted(p for p in (REPO / "docs" / "guide").glob("*.md") if not p.name.startswith("_"))
    pages = [REPO / "README.md", *guide]
    blocks = [b for page in pages for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]
    return [b for b in blocks if "restore(state)" in b and "range(" in b]


def _runnable(block: str) -> str:
    """The block with its root (the first string given to ``mpckpt.Checkpointer`` or ``mpckpt.load``)
    replaced by ``sys.argv[1]``; a block that uses a ``ckpt`` it does not open runs inside one."""
    block = textwrap.dedent(block)
    roots = set(re.findall(r'mpckpt\.(?:Checkpointer|load)\("([^"]+)"', block))
    for root in roots:
        block = block.replace(f'"{root}"', "sys.argv[1]")
    if not roots:
        assert "ckpt." in block, block
        block = "with mpckpt.Checkpointer(sys.argv[1]) as ckpt:\n" + textwrap.indent(block, "    ")
    return _PRELUDE + block + '\nprint("RESTORED", last)\n'


@pytest.mark.parametrize("index", range(5))
def test_each_doc_snippet_that_restarts_goes_on_after_a_step_0_checkpoint(tmp_path, index):
    blocks = _restart_blocks()
    assert len(blocks) == 5, [b.splitlines()[0] for b in blocks]  # a new snippet: add it to the range above
    script = tmp_path / "snippet.py"
    script.write_text(_runnable(blocks[index]))
    root = tmp_path / "root"
    for total, restored in ((1, "None"), (3, "0")):  # step 0 only, then a restart that goes on from it
        done = subprocess.run([sys.executable, str(script), str(root), str(total)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=180, env=worker_env())
        assert done.returncode == 0, (blocks[index], done.stderr[-3000:])
        assert done.stdout.splitlines()[-1] == f"RESTORED {restored}", (blocks[index], done.stdout[-2000:])
