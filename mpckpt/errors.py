"""The whole exception tree of mpckpt.

    MpckptError
    ├── ConfigError(ValueError)          bad argument, setting or MPCKPT_* variable; nothing written
    ├── StateError(ValueError)           a value in the state cannot be stored (names the key)
    ├── StepOrderError(ValueError)       a step that repeats or goes backwards
    ├── StorageError                     the backend failed
    │   ├── TransientStorageError        worth a retry (5xx, throttling, resets, timeouts)
    │   ├── CheckpointNotFoundError      no such checkpoint / file (also LookupError)
    │   ├── CommitConflictError          someone else committed this step first
    │   └── StorageFullError             ENOSPC / quota; earlier checkpoints are intact
    ├── CorruptCheckpointError           a checksum, size, header or manifest does not verify
    │   └── UnsupportedFormatError       written by a newer mpckpt format version
    ├── UploadError                      a background upload failed (carries step and shard)
    ├── ValidationError                  validate= failed for a committed checkpoint (carries the
    │                                    step); logged and kept in stats, never raised: the
    │                                    checkpoint stays committed
    ├── BudgetError                      the memory budget cannot be honoured (also TimeoutError
    │                                    subclasses below for bounded waits)
    ├── WaitTimeoutError(TimeoutError)   a bounded wait ran out
    ├── LockedError                      another live writer holds the checkpoint folder
    └── HealError                        a job cannot heal in place after a lost rank (mpckpt.heal
                                         says which part of the state, or the launcher's reason)

Every error raised from a lower-level cause is chained with ``raise ... from e``. Every
``UploadError`` is made by ``upload_error``, so all of them read "step N: what failed: cause". A failure in
an uploader process comes back as the original exception type where it can be rebuilt, with
the remote traceback attached as a note.
"""

from __future__ import annotations


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (where tracebacks will not print it)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]


class MpckptError(Exception):
    """Base class of every error mpckpt raises on purpose."""


class ConfigError(MpckptError, ValueError):
    """An argument, setting or environment variable has a bad value."""


class StateError(MpckptError, ValueError):
    """A value in the state passed to ``save`` cannot be stored."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class StepOrderError(MpckptError, ValueError):
    """A step repeats or goes backwards."""


class StorageError(MpckptError):
    """The storage backend failed."""


class TransientStorageError(StorageError):
    """A storage failure that a retry may cure."""


class CheckpointNotFoundError(StorageError, LookupError):
    """The requested checkpoint or file does not exist."""


class CommitConflictError(StorageError):
    """The checkpoint was already committed by another writer."""


class StorageFullError(StorageError):
    """The storage ran out of space (ENOSPC) or quota."""


class CorruptCheckpointError(MpckptError):
    """A checkpoint does not verify: checksum, size, header or manifest."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class UnsupportedFormatError(CorruptCheckpointError):
    """The checkpoint was written in a format version this mpckpt does not read."""


class UploadError(MpckptError):
    """A background upload of one checkpoint failed."""

    def __init__(self, message: str, *, step: int | None = None, shard: str | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.shard = shard


def upload_error(step: int | None, what: str, cause: BaseException | None = None, *,
                 shard: str | None = None) -> UploadError:
    """The one shape of every upload failure: ``step N: <what>[: <Type>: <cause>]``, chained to ``cause``."""
    message = what if step is None else f"step {step}: {what}"
    if cause is not None:
        message += f": {type(cause).__name__}: {cause}"
    error = UploadError(message, step=step, shard=shard)
    error.__cause__ = cause
    return error


class RankError(UploadError):
    """A multi-rank checkpoint was not committed because of other ranks (``ranks``: which ones;
    empty when the job's store itself failed): one died, failed its part, or was too slow."""

    def __init__(self, message: str, *, step: int | None = None, ranks: list[int] | None = None) -> None:
        super().__init__(message, step=step)
        self.ranks = list(ranks or [])


class ValidationError(MpckptError):
    """``validate=`` failed for a committed checkpoint (the checkpoint stays; see ``stats.validations``)."""

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


class BudgetError(MpckptError):
    """The memory budget cannot be honoured for this request."""


class WaitTimeoutError(MpckptError, TimeoutError):
    """A bounded wait ran out of time."""


class LockedError(MpckptError):
    """Another live process writes to this checkpoint folder."""


class HealError(MpckptError):
    """``mpckpt.heal`` cannot heal the job in place: the message says why (a part of the state bound
    to the failed process group, a job not started by ``python -m mpckpt.run``, more failures than
    ``--max-restarts``) and what to do; the failure that started it is the ``__cause__``."""
