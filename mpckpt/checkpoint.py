"""``Checkpoint``: a folder of files, either one the user wrote or one that is committed.

``Checkpoint.from_directory(path)`` wraps files a framework wrote itself (Hugging Face
``save_pretrained``, a Lightning ``.ckpt``) so ``Checkpointer.report`` can upload and commit
them. ``Checkpointer.checkpoint(step)`` returns the committed version; ``as_directory()``
gives a local folder to read (the folder itself on local disk, a verified download
elsewhere) and ``to_directory(path)`` copies it out. A copy streams each file in chunks while
hashing it, into a hidden partial name that is renamed into place only once the checksum
matches: a damaged file never appears under its real name, and no file is held whole.
``load()`` gives a committed state as ``mpckpt.load`` does (what a ``validate=`` function
is handed: one of these).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mpckpt.errors import ConfigError

if TYPE_CHECKING:
    from mpckpt.format.manifest import Manifest
    from mpckpt.storage import Backend


class Checkpoint:
    """A checkpoint as a set of files."""

    def __init__(self, path: str, *, _stored: tuple[Backend, str, Manifest] | None = None) -> None:
        self.path = path
        self._stored = _stored

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> Checkpoint:
        path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(path):
            raise ConfigError(f"Checkpoint.from_directory: {path} is not a folder")
        return cls(path)

    @property
    def metrics(self) -> dict[str, Any]:
        return dict(self._stored[2].metrics) if self._stored else {}

    @property
    def step(self) -> int | None:
        return self._stored[2].step if self._stored else None

    def load(self, *, allow_pickle: bool = False, classes: bool = True) -> Any:
        """The plain nested state of a committed state checkpoint, every file verified (as ``mpckpt.load``).

        What a ``validate=`` function calls to evaluate the checkpoint it is given.
        """
        if self._stored is None:
            raise ConfigError(f"{self!r} is a folder of your files, not a committed state; read its files")
        backend, name, manifest = self._stored
        if manifest.kind != "state":
            raise ConfigError(f"the checkpoint of step {manifest.step} is a directory checkpoint (files given to "
                              "report()), not a state: read its files with as_directory() or to_directory(path)")
        from mpckpt._read.load import load_checkpoint

        return load_checkpoint(backend, name, manifest, allow_pickle=allow_pickle, classes=classes)

    def files(self) -> list[str]:
        """Relative paths of the checkpoint's files (as the user wrote them)."""
        if self._stored is not None:
            return sorted(self._stored[2].user_files())
        return local_files(self.path)

    def to_directory(self, path: str | os.PathLike[str] | None = None) -> str:
        """Copy the files into ``path`` (a new temporary folder by default); return it."""
        dest = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="mpckpt-")
        os.makedirs(dest, exist_ok=True)
        if self._stored is None:
            shutil.copytree(self.path, dest, dirs_exist_ok=True)
            return dest
        from mpckpt._read.sources import StorageSource
        from mpckpt._read.verified import stream_verified

        backend, name, manifest = self._stored
        source = StorageSource(backend, name, manifest)
        for rel, entry_name in manifest.user_files().items():
            target = os.path.join(dest, rel)
            folder, base = os.path.split(target)
            os.makedirs(folder, exist_ok=True)
            # INVARIANT: a file appears under its own name only after its checksum matched
            partial = os.path.join(folder, f".{base}.{secrets.token_hex(4)}.partial")
            try:
                with open(partial, "wb") as f:
                    stream_verified(source, entry_name, f.write)
                os.replace(partial, target)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
                raise
        return dest

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """A local folder holding the files, valid inside the ``with`` block.

        On local disk it is the checkpoint's own folder, handed out only after every file was
        checked against the manifest and nothing else (no link, no stray file) is in it;
        elsewhere a verified copy in a temporary folder.
        """
        if self._stored is None:
            yield self.path
            return
        backend, name, manifest = self._stored
        local_root = getattr(backend, "root", None)
        if local_root and not any(e.ref or e.shared for e in manifest.files.values()) and \
                os.path.isdir(os.path.join(local_root, name)):  # local disk: no copy
            yield _verified_in_place(backend, local_root, name, manifest)
            return
        dest = tempfile.mkdtemp(prefix="mpckpt-")
        try:
            yield self.to_directory(dest)
        finally:
            shutil.rmtree(dest, ignore_errors=True)

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r})"


def _verified_in_place(backend: Backend, local_root: str, name: str, manifest: Manifest) -> str:
    """The folder of a local directory checkpoint, once it holds exactly what its manifest lists."""
    from mpckpt._read.sources import StorageSource
    from mpckpt._read.verified import stream_verified
    from mpckpt.errors import CorruptCheckpointError
    from mpckpt.format.validation import VALIDATION_NAME
    from mpckpt.storage import MANIFEST_NAME

    source = StorageSource(backend, name, manifest)
    for rel in manifest.files:
        stream_verified(source, rel)
    folder = os.path.join(local_root, name)
    listed = set(manifest.files) | {MANIFEST_NAME, VALIDATION_NAME}  # validation.json: validate='s metrics
    parents = {rel.rsplit("/", i)[0] for rel in listed for i in range(1, rel.count("/") + 1)}
    for dirpath, dirs, files in os.walk(folder):  # never follows links: they are reported below
        for entry in [*dirs, *files]:
            full = os.path.join(dirpath, entry)
            rel = os.path.relpath(full, folder).replace(os.sep, "/")
            kind = os.lstat(full).st_mode
            if stat.S_ISDIR(kind) and rel in parents or stat.S_ISREG(kind) and rel in listed:
                continue
            raise CorruptCheckpointError(f"{full}: not listed in the manifest (a link, a stray file or folder); "
                                         "the checkpoint folder was changed after its commit", path=full)
    return os.path.join(folder, manifest.user_prefix.rstrip("/")) if manifest.user_prefix else folder


def local_files(root: str, *, links: bool = True) -> list[str]:
    """Relative paths of the files under ``root``, for ``report``.

    A link to a file inside ``root`` counts as that file (its bytes are uploaded), unless
    ``links`` is False (NO_UPLOAD moves the folder as it is, and readers never follow links
    inside a checkpoint root). Links that leave ``root``, links to folders, FIFOs, sockets and
    devices are refused: a FIFO would block the upload, a linked folder would be skipped.
    """
    out = []
    real_root = os.path.realpath(root)
    for dirpath, dirs, files in os.walk(root):
        for entry in [*dirs, *files]:
            full = os.path.join(dirpath, entry)
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                target = os.path.realpath(full)
                if os.path.isdir(target):
                    raise ConfigError(f"{full} is a link to a folder; copy the folder in instead")
                if not target.startswith(real_root + os.sep):
                    raise ConfigError(f"{full} is a link to {target}, outside {root}; copy the file in instead")
                if not links:
                    raise ConfigError(f"{full} is a link; mode=NO_UPLOAD moves the folder as it is and checkpoints "
                                      "never hold links: use ASYNC or SYNC, which copy its bytes")
            elif not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise ConfigError(f"{full} is not a regular file (a FIFO, socket or device); "
                                  "a checkpoint holds regular files only")
            if entry in files:
                out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(out)
