"""Who uses which file outside its own folder, and what may therefore be deleted.

A checkpoint lists files outside its folder in two ways (``format.manifest``): shared files
in ``shared/`` (format version 3; frozen shards written once and listed by every checkpoint
whose tensors did not change), and, as an mpckpt before version 3 wrote them, files in an
earlier checkpoint's folder (``ref``). The rules, counted over manifests only, never over a
table of their own that a crash could leave wrong:

* a shared file lives while any committed or pending checkpoint lists it (the writer asks
  its ledger, ``Ledger.referenced_shared``, which also knows the files pending saves are
  writing); once none does it is deleted right after the deletion that made it so, and
  ``collect_orphans`` (every open of a writer, ``mpckpt gc``, ``mpckpt rm``, all with the
  writer lock held, so nothing is pending) deletes those a crash left behind;
* a folder another checkpoint references (``ref``) is never deleted while that checkpoint
  stays (``deletion_blockers``), by retention, ``ckpt.delete`` or ``mpckpt rm``.

A damaged checkpoint (a manifest that does not verify) may still be recovered, so the shared
files whose names its manifest's bytes contain are kept, and so are those a damaged checkpoint
set aside (``damaged.step_*``, see ``format.names``) lists; when those bytes cannot be read at
all, no shared file is deleted (the message says which step to look at).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from mpckpt.errors import MpckptError
from mpckpt.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest
from mpckpt.format.names import SHARED_FOLDER, checkpoint_name, is_aside_name, is_our_shared_file, step_of
from mpckpt.storage import Backend

log = logging.getLogger("mpckpt")


def shared_users(committed: Mapping[int, Manifest]) -> dict[str, list[int]]:
    """Each shared file any of ``committed`` lists -> the steps that list it."""
    users: dict[str, list[int]] = {}
    for step in sorted(committed):
        for path in committed[step].shared_files():
            users.setdefault(path, []).append(step)
    return users


def deletion_blockers(committed: Mapping[int, Manifest], steps: Iterable[int]) -> dict[int, list[int]]:
    """Steps of ``steps`` whose folder a checkpoint that stays references (``ref``) -> those.

    Only roots written before format version 3 have such references: pending saves list
    shared files, never another checkpoint's folder.
    """
    going = set(steps)
    blockers: dict[int, list[int]] = {}
    for user, manifest in sorted(committed.items()):
        if user in going:
            continue
        for name in manifest.referenced_folders():
            step = step_of(name)
            if step is not None and step in going:
                blockers.setdefault(step, []).append(user)
    return blockers


def collect_orphans(backend: Backend, committed: Mapping[int, Manifest],
                    damaged: Mapping[int, Exception] | None = None) -> list[str]:
    """Delete the files in ``shared/`` that no manifest lists; return their paths.

    Call with the writer lock held (nothing may be pending). Files a damaged checkpoint may
    list are kept (see the module docstring); a backend without ``list_files`` keeps all.
    """
    lister = getattr(backend, "list_files", None)
    if lister is None or getattr(backend, "delete_file", None) is None:
        return []
    try:
        found = [p for p in lister(SHARED_FOLDER) if is_our_shared_file(p)]  # never a file mpckpt did not name
    except MpckptError as e:
        log.warning("mpckpt: cannot list %s/%s, shared files no checkpoint uses are kept: %s", backend.url,
                    SHARED_FOLDER, e)
        return []
    used = set(shared_users(committed))
    orphans = [p for p in found if p not in used]
    if not orphans:
        return []
    protected = _named_by_damaged(backend, damaged or {})
    if protected is None:
        return []
    removed = []
    for path in orphans:
        if path.rpartition("/")[2].encode() in protected:
            continue
        log.info("mpckpt: removing shared file %s: no checkpoint uses it", path)
        backend.delete_file(path)
        removed.append(path)
    return removed


class _Names:
    """The raw bytes of damaged manifests, asked whether a name occurs in any of them."""

    def __init__(self, texts: list[bytes]) -> None:
        self.texts = texts

    def __contains__(self, name: object) -> bool:
        return isinstance(name, bytes) and any(name in t for t in self.texts)


def _named_by_damaged(backend: Backend, damaged: Mapping[int, Exception]) -> _Names | None:
    """What the manifests of damaged checkpoints contain; None when one cannot be read at all."""
    texts = []
    for name in backend.list_names():  # damaged checkpoints set aside (format.names.aside_name) may list some too
        if is_aside_name(name):
            try:
                texts.append(backend.read_bytes(f"{name}/{MANIFEST_NAME}", max_bytes=MAX_MANIFEST_BYTES))
            except MpckptError as e:
                log.warning("mpckpt: the manifest of %s cannot be read (%s); shared files no checkpoint uses are "
                            "kept, since it may list them: remove that folder if it cannot be recovered", name, e)
                return None
    for step in sorted(damaged):
        try:
            texts.append(backend.read_bytes(f"{checkpoint_name(step)}/{MANIFEST_NAME}", max_bytes=MAX_MANIFEST_BYTES))
        except MpckptError as e:
            log.warning("mpckpt: the manifest of damaged step %d cannot be read (%s); shared files no other "
                        "checkpoint uses are kept, since it may list them: look at it (mpckpt verify) and "
                        "remove it (mpckpt rm --damaged) if it cannot be recovered", step, e)
            return None
    return _Names(texts)
