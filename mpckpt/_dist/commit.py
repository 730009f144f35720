"""The two-phase commit of a multi-rank checkpoint, through the job's store.

Every rank's committer thread, in save order, for each checkpoint:

1. once its own files are durable (its record settled, its skeleton written), posts its
   *part* under ``<step>/p<rank>``: ``ok`` with its files' sizes and checksums, or ``failed``
   (with why) or ``dropped``;
2. rank 0 (the coordinator) waits for every part, bounded by ``timeout_s``. All ``ok``: it
   merges the files into one global manifest and writes it last (``Backend.commit``), then
   posts the *outcome* ``<step>/outcome`` = committed, with the manifest. Anything else
   (a part missing in time: the rank is named; a failed part: its rank and cause; the
   manifest write failed) and it aborts the checkpoint and posts the outcome ``failed``, with
   the reason; a checkpoint every rank dropped is ``dropped``;
3. every other rank waits for the outcome, bounded by ``timeout_s`` (a coordinator that
   never answers is named too), and records the commit or the failure.

So a step commits only when every rank's files are durable and its part recorded, the
previous checkpoint stays the latest until then, and every rank agrees on the outcome.
Nothing here is a collective: store requests only, safe from a background thread.

Store requests per rank and checkpoint: a non-coordinator posts its part, waits for the
outcome, reads it and deletes its part (4, whatever the world size); the coordinator posts
its part, waits for all parts (one request the store answers when they are all there),
reads them (one ``multi_get``), posts the outcome and deletes the previous outcome (5).
Keys live under a prefix private to one open of the root (a restarted job never reads an
earlier attempt's keys); a part is deleted by its rank after the outcome, the outcome by
the coordinator once every rank has posted the next part (so all have read it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from mpckpt._dist.group import store_timeout
from mpckpt.errors import RankError, UploadError
from mpckpt.format.manifest import MANIFEST_NAME, FileEntry, Manifest, format_version_for
from mpckpt.storage import Backend

log = logging.getLogger("mpckpt")

_STORE_ERRORS = (RuntimeError, ValueError, OSError)  # DistStoreError, DistNetworkError are RuntimeErrors


class StoreCoordinator:
    """One rank's side of the commit protocol (rank 0 coordinates)."""

    def __init__(self, backend: Backend, store: Any, *, rank: int, world_size: int, timeout_s: float) -> None:
        self.backend = backend
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._last_outcome: str | None = None  # the coordinator's previous outcome key, deleted later

    # -- the committer's calls ---------------------------------------------------------------
    def commit(self, staging: str, name: str, manifest: Manifest) -> Manifest:
        """Post this rank's files; return the global manifest once committed, or raise."""
        part = {"status": "ok", "files": {rel: _entry_json(e) for rel, e in manifest.files.items()},
                "written_bytes": (manifest.figures or {}).get("written_bytes") or 0}
        self._post(manifest.step, part)
        if self.rank == 0:
            committed = self._decide(manifest.step, staging, name, manifest)
            assert committed is not None
            return committed
        return self._outcome(manifest.step)

    def abandon(self, step: int, staging: str, status: str, reason: str) -> None:
        """This rank has no files for ``step`` (its save ``failed`` or was ``dropped``): say so,
        so that the step fails (or is dropped) on every rank instead of being waited for."""
        try:
            self._post(step, {"status": status, "error": reason})
            if self.rank == 0:
                self._decide(step, staging, None, None)
        except UploadError as e:
            if status != "dropped":
                log.debug("mpckpt: step %d: %s", step, e)

    def abort(self, staging: str) -> None:
        """Remove a failed checkpoint's files (the coordinator's job: they are every rank's)."""
        if self.rank == 0:
            self.backend.abort(staging)

    # -- the protocol --------------------------------------------------------------------------
    def _post(self, step: int, part: dict[str, Any]) -> None:
        try:
            self.store.set(f"{step}/p{self.rank}", json.dumps(part, separators=(",", ":")))
        except _STORE_ERRORS as e:
            raise self._store_failed(step, "posting its part", e) from e

    def _decide(self, step: int, staging: str, name: str | None, manifest: Manifest | None) -> Manifest | None:
        """The coordinator: wait for every part, then commit or fail the step for everyone."""
        keys = [f"{step}/p{r}" for r in range(self.world_size)]
        try:
            self.store.wait(keys, store_timeout(self.timeout_s))
            raw = self.store.multi_get(keys)
        except _STORE_ERRORS as e:
            missing = self._missing(keys)
            if missing is None:
                error: UploadError = self._store_failed(step, "waiting for the parts of the other ranks", e)
            else:
                error = RankError(
                    f"step {step}: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not "
                    f"finish {'their' if len(missing) > 1 else 'its'} part within timeout_s={self.timeout_s:g}s "
                    "(died, or its uploads were too slow); the checkpoint is not committed and the previous one "
                    "stays the latest", step=step, ranks=missing)
            self._fail(step, staging, error)
            raise error from e
        self._forget_previous(step)
        parts = [json.loads(b) for b in raw]
        statuses = [p.get("status") for p in parts]
        if all(s == "dropped" for s in statuses):
            self._tell(step, {"status": "dropped"})
            return None
        bad = [(r, p) for r, p in enumerate(parts) if p.get("status") != "ok"]
        if bad or manifest is None or name is None:
            culprits = [r for r, _ in bad] or [self.rank]
            why = "; ".join(f"rank {r}: {p.get('error') or p.get('status')}" for r, p in bad)
            error = RankError(f"step {step} is not committed: {why}", step=step, ranks=culprits)
            self._fail(step, staging, error)
            raise error
        files: dict[str, FileEntry] = {}
        written = 0
        for part in parts:
            for rel, doc in part["files"].items():
                files[rel] = FileEntry(int(doc["size"]), str(doc["checksum"]))
            written += int(part.get("written_bytes") or 0)
        figures = dict(manifest.figures or {})
        if figures:
            figures["written_bytes"] = written
        merged = dataclasses.replace(manifest, files=files, world_size=self.world_size,
                                     format_version=format_version_for(manifest.kind, files, ranked=True),
                                     figures=figures or None)
        data = merged.to_bytes()
        try:
            self.backend.commit(staging, name, data)
        except BaseException as e:
            self._fail(step, staging, UploadError(f"step {step}: writing the manifest failed: {type(e).__name__}: {e}",
                                                  step=step))
            raise
        self._tell(step, {"status": "committed", "manifest": data.decode()})
        self._drop_own_part(step)
        return Manifest.from_bytes(data, path=f"{name}/{MANIFEST_NAME}")

    def _outcome(self, step: int) -> Manifest:
        key = f"{step}/outcome"
        try:
            self.store.wait([key], store_timeout(self.timeout_s))
            doc = json.loads(self.store.get(key))
        except _STORE_ERRORS as e:
            if self._missing([key]) is None:
                raise self._store_failed(step, "waiting for the coordinator's outcome", e) from e
            raise RankError(f"step {step}: the coordinator (rank 0) did not commit it within timeout_s="
                            f"{self.timeout_s:g}s (died, or its uploads or another rank's were too slow); the "
                            "previous checkpoint stays the latest", step=step, ranks=[0]) from e
        self._drop_own_part(step)
        if doc.get("status") == "committed":
            return Manifest.from_bytes(doc["manifest"].encode(), path=f"step {step}/{MANIFEST_NAME} (from rank 0)")
        raise RankError(str(doc.get("error") or f"step {step} was {doc.get('status')} on another rank"), step=step,
                        ranks=list(doc.get("ranks") or []))

    # -- helpers ---------------------------------------------------------------------------
    def _fail(self, step: int, staging: str, error: UploadError) -> None:
        ranks = error.ranks if isinstance(error, RankError) else []
        try:
            self.backend.abort(staging)
        except Exception as e:  # what is left is debris the next open removes
            log.warning("mpckpt: step %d: removing the files of the failed checkpoint: %s", step, e)
        try:
            self._tell(step, {"status": "failed", "error": str(error), "ranks": ranks})
        except UploadError as e:
            log.warning("mpckpt: %s", e)

    def _tell(self, step: int, outcome: dict[str, Any]) -> None:
        key = f"{step}/outcome"
        try:
            self.store.set(key, json.dumps(outcome, separators=(",", ":")))
        except _STORE_ERRORS as e:
            raise self._store_failed(step, "posting the outcome", e) from e
        self._last_outcome = key

    def _forget_previous(self, step: int) -> None:
        """Every rank posted its part of ``step``, so each has read the previous outcome."""
        if self._last_outcome is not None:
            try:
                self.store.delete_key(self._last_outcome)
            except _STORE_ERRORS:
                pass
            self._last_outcome = None

    def _drop_own_part(self, step: int) -> None:
        try:
            self.store.delete_key(f"{step}/p{self.rank}")
        except _STORE_ERRORS:
            pass

    def _missing(self, keys: list[str]) -> list[int] | None:
        """Ranks whose key is missing (parsed from ``<step>/p<rank>`` or 0 for the outcome);
        None when the store cannot even be asked."""
        try:
            missing = [k for k in keys if not self.store.check([k])]
        except _STORE_ERRORS:
            return None
        return [int(k.rsplit("/p", 1)[1]) if "/p" in k else 0 for k in missing]

    def _store_failed(self, step: int, doing: str, e: BaseException) -> UploadError:
        return RankError(f"step {step}: the torch.distributed store failed while {doing} ({type(e).__name__}: "
                         f"{str(e)[:300]}); the process hosting it (the torchrun agent, or rank 0) may have died",
                         step=step)


def _entry_json(entry: FileEntry) -> dict[str, Any]:
    return {"size": entry.size, "checksum": entry.checksum}
