"""Where the checkpoint roots are, when the folder a user named holds no checkpoint.

A root is a folder that holds committed checkpoints: folders under the names mpckpt writes
(``format.names.step_of``) with a ``manifest.json`` in them (the manifest is written last, so
its presence is what makes a checkpoint exist, as for ``catalog.scan``). ``roots_below``
looks one and two levels below a local folder (not below a root it finds), and
``no_checkpoint`` and ``missing`` turn what it finds into the message the commands print:
the roots with how many checkpoints each holds and its newest step, and the command to run
next. Manifests are only looked for, never read: ``mpckpt ls`` of a root says whether they
verify. ``written_by_mpckpt`` tells a root (with no checkpoint yet, perhaps) from a folder
that never was one, which ``mpckpt gc`` leaves alone.

INVARIANT: looking is bounded and harmless. Links are not followed (a link loop or a link to
``/`` costs nothing), nothing is opened (a FIFO named ``manifest.json`` never blocks), at most
``_MAX_ENTRIES`` names are looked at in each folder, and nothing is ever written.
"""

from __future__ import annotations

import os
import shlex
import stat
from dataclasses import dataclass

from mpckpt.format.names import MANIFEST_NAME, step_of
from mpckpt.storage.local import LOCK_NAME, STAGING_PREFIX

_DEPTH = 2           # the folder's children and grandchildren
_MAX_ENTRIES = 2000  # names looked at in one folder (a folder of millions is not a run's folder)
_SHOWN = 8           # roots named in one message


@dataclass(frozen=True)
class Root:
    """A folder holding committed checkpoints: its path, how many, and the newest step."""

    path: str
    checkpoints: int
    newest: int

    def describe(self) -> str:
        shown = shown_path(self.path)
        if self.checkpoints == 1:
            return f"{shown} (1 checkpoint, step {self.newest})"
        return f"{shown} ({self.checkpoints} checkpoints, newest step {self.newest})"


def committed_steps(folder: str) -> list[int]:
    """The steps of the checkpoint folders directly in ``folder`` that have a manifest."""
    steps = []
    for entry in _entries(folder):
        step = step_of(entry.name)
        if step is not None and _is_folder(entry) and _is_file(os.path.join(entry.path, MANIFEST_NAME)):
            steps.append(step)
    return steps


def written_by_mpckpt(folder: str) -> bool:
    """Whether a Checkpointer has used ``folder`` as its root: it holds a writer lock file, a
    checkpoint folder (committed or not) or a staging folder. ``mpckpt gc`` cleans only such."""
    return any(entry.name == LOCK_NAME or entry.name.startswith(STAGING_PREFIX) or step_of(entry.name) is not None
               for entry in _entries(folder))


def roots_below(folder: str, depth: int = _DEPTH) -> list[Root]:
    """The roots one to ``depth`` levels below ``folder``, by path; none is looked into."""
    found: list[Root] = []
    for entry in sorted(_entries(folder), key=lambda e: e.name):
        if entry.name.startswith(".") or step_of(entry.name) is not None or not _is_folder(entry):
            continue
        steps = committed_steps(entry.path)
        if steps:
            found.append(Root(entry.path, len(steps), max(steps)))
        elif depth > 1:
            found.extend(roots_below(entry.path, depth - 1))
    return found


def no_checkpoint(folder: str) -> str:
    """What to say of an existing local ``folder`` with no checkpoint in it."""
    head = f"no checkpoint in {folder}"
    parent, name = os.path.split(folder.rstrip(os.sep))
    step = step_of(name)
    if step is not None and _is_file(os.path.join(folder, MANIFEST_NAME)):
        root = shlex.quote(shown_path(parent))
        return (f"{head}: it is the folder of the checkpoint of step {step} in {shown_path(parent)}; give the root "
                f"and the step (mpckpt info {root} {step})")
    roots = roots_below(folder)
    if not roots:
        return (f"{head}, nor in the folders one or two levels below it; give the folder a Checkpointer was given "
                "(it holds step_* folders)")
    return f"{head}; checkpoint roots below it: {_listed(roots)}"


def missing(folder: str) -> str:
    """What to say of a local ``folder`` that does not exist, naming the roots beside it."""
    head = f"{folder} does not exist"
    parent = os.path.dirname(folder.rstrip(os.sep))
    if os.path.isdir(parent):
        roots = [r for r in roots_below(parent) if r.path != folder]
        if roots:
            return f"{head}; checkpoint roots beside it: {_listed(roots)}"
    return f"{head}; give the folder a Checkpointer wrote to"


def shown_path(path: str) -> str:
    """``path`` as a user would type it here: relative below the working folder, else absolute."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if relative == ".." or relative.startswith(".." + os.sep) else relative


def _listed(roots: list[Root]) -> str:
    described = ", ".join(r.describe() for r in roots[:_SHOWN])
    more = f" and {len(roots) - _SHOWN} more" if len(roots) > _SHOWN else ""
    return f"{described}{more}; give one of them as ROOT (mpckpt ls {shlex.quote(shown_path(roots[0].path))})"


def _entries(folder: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            entries = []
            for entry in it:
                entries.append(entry)
                if len(entries) >= _MAX_ENTRIES:
                    break
            return entries
    except OSError:  # unreadable, gone meanwhile, not a folder: nothing below it
        return []


def _is_folder(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _is_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
