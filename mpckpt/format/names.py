"""The names of a checkpoint on storage, and the rule every relative path obeys.

A root holds one folder per checkpoint, ``step_<step, 10+ digits>`` (``checkpoint_name``;
``step_of`` accepts exactly those names and nothing else, so a stray ``step_2`` or
``step_²`` is never read as, or instead of, a checkpoint). In a folder: ``manifest.json``,
written last, whose presence makes the checkpoint exist; ``skeleton.json`` and the shards of
a state; the user's files of a directory checkpoint under ``files/``. Files that several
checkpoints use (frozen shards) live in ``shared/``, each under a name no other file ever had
(``shared_path``: the step that wrote it, a random token, the shard's file name), so a shared
file is never overwritten and deleting any one checkpoint folder never takes it away. A
damaged checkpoint that ``restore(fallback=True)`` went back past is moved, whole, to
``damaged.step_<step>.<UTC time>`` (``aside_name``): kept for a look, no longer in the way; an
intact one that a run going on from an older step went back past (``discard_newer(step,
keep=True)``), to ``superseded.step_<step>.<UTC time>``. Every
path below the root is relative, uses ``/`` and never escapes it (``check_relpath``). Storage
backends and the format both use these names: they live here, below both.

A checkpoint several ranks of a torch.distributed job saved (format version 4) has no
``skeleton.json``: each rank writes its own files under its prefix, ``r<rank, 5 digits>-``
(``rank_prefix``), its skeleton as ``r00003-skeleton.json`` (``rank_skeleton_name``).
"""

from __future__ import annotations

import posixpath
import re
import secrets

from mpckpt.errors import ConfigError

MANIFEST_NAME = "manifest.json"
SKELETON_NAME = "skeleton.json"
USER_FILES = "files/"  # where a directory checkpoint keeps the user's files (format version 2)
STEP_PREFIX = "step_"
SHARED_FOLDER = "shared"  # files several checkpoints use (format version 3)
ASIDE_PREFIX = "damaged."  # damaged checkpoints a run went back past: kept, no longer checkpoints
SUPERSEDED_PREFIX = "superseded."  # intact checkpoints a run going on from an older step went back past
_STEP_NAME_RE = re.compile(r"step_([0-9]{10,})")
_SHARED_PATH_RE = re.compile(r"shared/[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_OUR_SHARED_RE = re.compile(r"shared/step_[0-9]{10,}\.[0-9a-f]+\..+")


def rank_prefix(rank: int) -> str:
    """What the names of the files rank ``rank`` writes into a multi-rank checkpoint start with."""
    return f"r{rank:05d}-"


def rank_skeleton_name(rank: int) -> str:
    """The skeleton rank ``rank`` writes into a multi-rank checkpoint."""
    return f"{rank_prefix(rank)}{SKELETON_NAME}"


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint of ``step`` (sorts by step up to 10**10)."""
    return f"{STEP_PREFIX}{step:010d}"


def step_of(name: str) -> int | None:
    """The step a folder name stands for, or None for folders that are not checkpoints.

    Only the names ``checkpoint_name`` writes count (ASCII digits, zero-padded to ten): a stray
    ``step_2`` or ``step_²`` is someone else's folder, never read as, or instead of, a checkpoint.
    """
    m = _STEP_NAME_RE.fullmatch(name)
    if m is None or len(m.group(1)) > 30:
        return None
    step = int(m.group(1))
    return step if checkpoint_name(step) == name else None


def aside_name(step: int, when: str, *, prefix: str = ASIDE_PREFIX) -> str:
    """The folder a checkpoint of ``step`` is moved to when a run goes back past it: a damaged
    one (``ASIDE_PREFIX``), or an intact one a run went on from an older step (``SUPERSEDED_PREFIX``).

    ``when`` is a UTC time (``20261124T173000Z``) plus whatever makes it unique. Never a
    checkpoint name: nothing reads it as one, and the step can be saved again.
    """
    return f"{prefix}{checkpoint_name(step)}.{when}"


def is_aside_name(name: str) -> bool:
    """Whether a top-level folder is a checkpoint a run set aside (``aside_name``, either kind)."""
    return name.startswith((ASIDE_PREFIX, SUPERSEDED_PREFIX)) and "/" not in name


def shared_path(step: int, filename: str) -> str:
    """A new, never used path in ``shared/`` for file ``filename`` written by the save of ``step``.

    No I/O (``save`` calls it on the training thread): 96 random bits make it unique, so a
    file there is written once and never replaced (object stores have no rename to publish it).
    """
    return f"{SHARED_FOLDER}/{checkpoint_name(step)}.{secrets.token_hex(12)}.{filename}"


def is_our_shared_file(path: str) -> bool:
    """Whether ``path`` has the form only ``shared_path`` gives (``shared/step_<step>.<hex token>.<file>``):
    what may be deleted as an orphan. A file of another form in ``shared/`` is someone else's."""
    return is_shared_path(path) and _OUR_SHARED_RE.fullmatch(path) is not None


def is_shared_path(path: str) -> bool:
    """Whether ``path`` names a file directly in ``shared/`` (one component, no link tricks)."""
    return isinstance(path, str) and _SHARED_PATH_RE.fullmatch(path) is not None and ".." not in path


def check_relpath(relpath: str) -> str:
    """Return ``relpath`` normalised, or raise ``ConfigError`` if it could escape the root."""
    if not isinstance(relpath, str) or not relpath:
        raise ConfigError(f"storage path {relpath!r} is empty or not a string")
    if "\\" in relpath or "\x00" in relpath:
        raise ConfigError(f"storage path {relpath!r} contains a backslash or NUL byte")
    if relpath.startswith("/"):
        raise ConfigError(f"storage path {relpath!r} is absolute; paths must be relative to the root")
    norm = posixpath.normpath(relpath)
    if norm == ".." or norm.startswith("../") or norm == ".":
        raise ConfigError(f"storage path {relpath!r} escapes the checkpoint root")
    return norm
