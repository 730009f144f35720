"""``Checkpoint``: a folder of files, either one the user wrote or one that is committed.

``Checkpoint.from_directory(path)`` wraps files a framework wrote itself (Hugging Face
``save_pretrained``, a Lightning ``.ckpt``) so ``Checkpointer.report`` can upload and commit
them. ``Checkpointer.checkpoint(step)`` returns the committed version; ``as_directory()``
gives a local folder to read (the folder itself on local disk, a verified download
elsewhere) and ``to_directory(path)`` copies it out. A copy streams each file in chunks while
hashing it, into a hidden partial name that is renamed into place only once the checksum
matches: a damaged file never appears under its real name, and no file is held whole.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
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

    def files(self) -> list[str]:
        """Relative paths of the checkpoint's files."""
        if self._stored is not None:
            return sorted(r for r in self._stored[2].files if r != "manifest.json")
        return local_files(self.path)

    def to_directory(self, path: str | os.PathLike[str] | None = None) -> str:
        """Copy the files into ``path`` (a new temporary folder by default); return it."""
        dest = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="mpckpt-")
        os.makedirs(dest, exist_ok=True)
        if self._stored is None:
            shutil.copytree(self.path, dest, dirs_exist_ok=True)
            return dest
        from mpckpt.restore import stream_verified

        backend, name, manifest = self._stored
        for rel in manifest.files:
            target = os.path.join(dest, rel)
            folder, base = os.path.split(target)
            os.makedirs(folder, exist_ok=True)
            # INVARIANT: a file appears under its own name only after its checksum matched
            partial = os.path.join(folder, f".{base}.{secrets.token_hex(4)}.partial")
            try:
                with open(partial, "wb") as f:
                    stream_verified(backend, name, manifest, rel, f.write)
                os.replace(partial, target)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
                raise
        return dest

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """A local folder holding the files, valid inside the ``with`` block."""
        if self._stored is None:
            yield self.path
            return
        backend, name, _ = self._stored
        local_root = getattr(backend, "root", None)
        if local_root and os.path.isdir(os.path.join(local_root, name)):  # local disk: no copy
            yield os.path.join(local_root, name)
            return
        dest = tempfile.mkdtemp(prefix="mpckpt-")
        try:
            yield self.to_directory(dest)
        finally:
            shutil.rmtree(dest, ignore_errors=True)

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r})"


def local_files(root: str) -> list[str]:
    """Relative paths of the regular files under ``root``; refuses links that leave it."""
    out = []
    real_root = os.path.realpath(root)
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            full = os.path.join(dirpath, f)
            if os.path.islink(full) and not os.path.realpath(full).startswith(real_root + os.sep):
                raise ConfigError(f"{full} is a link that points outside {root}; copy the file in instead")
            out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(out)
