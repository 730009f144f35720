"""How ``report(checkpoint=...)`` commits a folder of files the user wrote.

The files go under ``files/`` in the checkpoint (no name of the user's can collide with the
manifest or the skeleton). ``ASYNC`` and ``SYNC`` queue one upload job per file in the
uploader pool, and the local folder is deleted after the commit when asked; ``NO_UPLOAD``
(local roots only) moves the folder into the checkpoint's staging folder through the
backend, hashing each file first, so the commit is a rename and nothing is copied.

It owns the rules of such a report: what ``checkpoint=`` must be (``Checkpoint.from_directory``
of a folder, never in a multi-rank job), ``NO_UPLOAD`` only to a local root, a folder deleted
after an ``ASYNC`` upload and kept after a ``SYNC`` one unless told. Which files are taken
(regular files only, never through a link that leaves the folder) is decided by
``checkpoint.local_files`` before the record is opened. The caller (the runtime) gets the
ledger's record back, whose future it returns.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

from mpckpt._futures import SaveStats
from mpckpt._ledger import Ledger, Pending
from mpckpt._upload.pool import Job, UploaderPool
from mpckpt._upload.worker import UploadJob
from mpckpt.checkpoint import Checkpoint, local_files
from mpckpt.config import Config, UploadMode
from mpckpt.errors import ConfigError
from mpckpt.format.checksums import file_digest
from mpckpt.format.manifest import FileEntry
from mpckpt.format.names import USER_FILES
from mpckpt.storage import Backend


class DirectoryUploads:
    """Commits folders the user wrote, for one checkpointer."""

    def __init__(self, config: Config, ledger: Ledger, pool: UploaderPool, backend: Backend, *, local: bool) -> None:
        self.local = local  # the root is a local folder (``file``): NO_UPLOAD can move a folder into it
        self.config = config
        self.ledger = ledger
        self.pool = pool
        self.backend = backend

    def report_folder(self, step: int, metrics: dict[str, Any], checkpoint: Any, *, mode: UploadMode,
                      delete_local: bool | None, multi_rank: bool, check_step: Callable[[Any], int]) -> Pending:
        """``report(step, metrics, checkpoint=...)``: refuse what cannot be committed so (naming
        what to do instead), then commit the folder's files (``check_step``: the caller's check of
        ``step``, run after the refusals of the folder)."""
        if multi_rank:
            raise ConfigError("report(checkpoint=...) uploads files one process wrote; in a multi-rank job save the "
                              "state with save(step, state) on every rank, or upload the folder from a single process")
        if not isinstance(checkpoint, Checkpoint) or checkpoint._stored is not None:
            raise ConfigError("report(checkpoint=...) takes Checkpoint.from_directory(path) of files you wrote")
        step = check_step(step)
        files = local_files(checkpoint.path, links=mode is not UploadMode.NO_UPLOAD)
        if delete_local is None:  # deleted after an ASYNC upload, kept after a SYNC one
            delete_local = mode is UploadMode.ASYNC
        if mode is UploadMode.NO_UPLOAD and not self.local:
            raise ConfigError(f"mode=NO_UPLOAD moves a local folder into {self.backend.url}; with a remote root use "
                              "ASYNC or SYNC")
        stats = SaveStats(step, bytes=sum(os.path.getsize(os.path.join(checkpoint.path, f)) for f in files))
        return self._commit_files(step, checkpoint.path, files, metrics, stats, upload=mode is not UploadMode.NO_UPLOAD,
                           delete_local=delete_local)

    def _commit_files(self, step: int, folder: str, files: list[str], metrics: dict[str, object], stats: Any, *,
                      upload: bool, delete_local: bool) -> Pending:
        """Commit ``files`` of ``folder`` as checkpoint ``step``, its figures in ``stats`` (a
        ``SaveStats``): uploaded, or moved (``upload=False``). Returns the ledger's record."""
        with self.ledger.recording(step, "directory", stats, dict(metrics)) as record:
            if upload:
                self.ledger.add_jobs(record, len(files))
                done = self.ledger.job_done(record, "uploading")
                jobs = []
                for rel in files:
                    payload = UploadJob(f"{record.staging}/{USER_FILES}{rel}", os.path.join(folder, rel))
                    size = os.path.getsize(payload.local_path)
                    jobs.append(Job("upload", payload, done, tag=record.seq, step=record.step,
                                    timeout_s=self.config.job_deadline_s(size)))
                self.pool.submit(*jobs, before=lambda: self.backend.prepare_staging(record.staging))
                if delete_local:
                    self.ledger.after_commit(record, lambda: shutil.rmtree(folder))
            else:
                self.ledger.add_files(record, {USER_FILES + rel: FileEntry(*file_digest(os.path.join(folder, rel)))
                                               for rel in files})
                self.backend.adopt_folder(folder, f"{record.staging}/{USER_FILES.rstrip('/')}")
            record.stats.written_bytes = record.stats.bytes
            self.ledger.all_submitted(record)
        return record
