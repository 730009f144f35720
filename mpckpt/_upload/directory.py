"""How ``report(checkpoint=...)`` commits a folder of files the user wrote.

The files go under ``files/`` in the checkpoint (no name of the user's can collide with the
manifest or the skeleton). ``ASYNC`` and ``SYNC`` queue one upload job per file in the
uploader pool, and the local folder is deleted after the commit when asked; ``NO_UPLOAD``
(local roots only) moves the folder into the checkpoint's staging folder through the
backend, hashing each file first, so the commit is a rename and nothing is copied.

Which files are taken (regular files only, never through a link that leaves the folder) is
decided by ``checkpoint.local_files`` before the record is opened. The caller (the runtime)
makes the save's ``SaveStats`` and gets the ledger's record back, whose future it returns.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from mpckpt._commit.ledger import Ledger, Pending
from mpckpt._upload.pool import Job, UploaderPool
from mpckpt._upload.worker import UploadJob, file_digest
from mpckpt.config import Config
from mpckpt.format.manifest import FileEntry
from mpckpt.format.names import USER_FILES
from mpckpt.storage import Backend


class DirectoryUploads:
    """Commits folders the user wrote, for one checkpointer."""

    def __init__(self, config: Config, ledger: Ledger, pool: UploaderPool, backend: Backend) -> None:
        self.config = config
        self.ledger = ledger
        self.pool = pool
        self.backend = backend

    def report(self, step: int, folder: str, files: list[str], metrics: dict[str, object], stats: Any, *,
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
