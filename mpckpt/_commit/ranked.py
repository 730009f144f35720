"""The two-phase commit of a multi-rank checkpoint, through the job's store.

Every rank's committer thread, in save order, for each checkpoint:

1. once its own files are durable (its record settled, its skeleton written), posts its
   *part* under ``<step>/p<rank>``: ``ok`` with its files' sizes and checksums, or ``failed``
   (with why) or ``dropped``;
2. rank 0 (the coordinator) waits for every part, bounded by ``timeout_s``. All ``ok``: it
   merges the files into one global manifest and writes it last (``Backend.commit``), then
   posts the *outcome* ``<step>/outcome`` = committed, with the manifest's summary (all but
   the file list, which grows with the ranks: the others read the manifest from storage when
   they read the checkpoint). Anything else
   (a part missing in time: the rank is named; a failed part: its rank and cause; the
   manifest write failed) and it aborts the checkpoint and posts the outcome ``failed``, with
   the reason; a checkpoint any rank dropped (and none failed) is ``dropped`` everywhere, as
   a skipped save is (``StepDropped``: no checkpoint, not an error);
3. every other rank waits for the outcome, bounded by ``timeout_s``, and records the
   commit or the failure. A rank whose wait runs out decides the step failed itself, naming
   the ranks whose part is missing (or the coordinator, if none is).

The outcome is decided once, by compare-and-set on ``<step>/claim``: the coordinator claims
it (``committing``) before it writes the manifest, and a rank that gave up waiting claims it
(``failed``); whichever comes first holds for every rank, and the claim's holder posts the
outcome everyone waits for. So a slow coordinator can cost a
checkpoint but never make the ranks disagree about whether it committed.

So a step commits only when every rank's files are durable and its part recorded, the
previous checkpoint stays the latest until then, and every rank agrees on the outcome.
Nothing here is a collective: store requests only, safe from a background thread.

Store requests per rank and checkpoint: a non-coordinator posts its part, waits for the
outcome, reads it and deletes its part (4, whatever the world size); the coordinator posts
its part, waits for all parts (one request the store answers when they are all there),
reads them (one ``multi_get``), claims and posts the outcome, deletes the previous claim
and outcome and its own part (8). Only a wait that runs out asks after each rank's part.
Keys live under a prefix private to one open of the root (a restarted job never reads an
earlier attempt's keys); a part is deleted by its rank after the outcome, the outcome by
the coordinator once every rank has posted the next part (so all have read it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from mpckpt._commit.coordinator import StepDropped
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
            error = self._late(step, keys, e)
            self._fail(step, staging, error)
            raise error from e
        self._forget_previous(step)
        parts = [json.loads(b) for b in raw]
        failed = [(r, p) for r, p in enumerate(parts) if p.get("status") not in ("ok", "dropped")]
        if failed:
            why = "; ".join(f"rank {r}: {p.get('error') or p.get('status')}" for r, p in failed)
            error = RankError(f"step {step} is not committed: {why}", step=step, ranks=[r for r, _ in failed])
            self._fail(step, staging, error)
            raise error
        dropped = [r for r, p in enumerate(parts) if p.get("status") == "dropped"]
        if dropped or manifest is None or name is None:  # a step dropped anywhere is dropped everywhere
            outcome = {"status": "dropped", "ranks": dropped}
            if self._decide_first(step, outcome) is None:
                self._tell(step, outcome)
            self._abort_quietly(step, staging)
            if manifest is not None:
                raise StepDropped(f"step {step} was dropped on rank{'s' if len(dropped) > 1 else ''} "
                                  f"{', '.join(map(str, dropped))} (memory budget full, policy skip or coalesce)")
            return None
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
        # INVARIANT: the outcome is decided once. A rank that gave up waiting decided "failed"
        # first: then nothing is committed, whatever every part said.
        other = self._decide_first(step, {"status": "committing"})
        if other is not None:
            error = RankError(str(other.get("error") or f"step {step} was failed by another rank"), step=step,
                              ranks=list(other.get("ranks") or []))
            self._fail(step, staging, error, decided=True)  # (the outcome the other rank claimed)
            raise error
        try:
            self.backend.commit(staging, name, data)
        except BaseException as e:
            self._fail(step, staging, UploadError(f"step {step}: writing the manifest failed: {type(e).__name__}: {e}",
                                                  step=step), decided=True)
            raise
        committed = Manifest.from_bytes(data, path=f"{name}/{MANIFEST_NAME}")
        # the others get the summary, not the file list: the store sends it to every rank, and
        # a list that grows with the ranks would make that traffic grow with their square
        self._tell(step, {"status": "committed", "summary": committed.summary()})
        self._drop_own_part(step)
        return committed

    def _outcome(self, step: int) -> Manifest:
        key = f"{step}/outcome"
        keys = [f"{step}/p{r}" for r in range(self.world_size)]
        try:
            try:
                self.store.wait([key], store_timeout(self.timeout_s))
            except _STORE_ERRORS as e:  # nobody decided in time: this rank decides "failed", unless one did
                error = self._late(step, keys, e)
                failed = {"status": "failed", "error": str(error), "ranks": error.ranks}
                other = self._decide_first(step, failed)
                if other is None:
                    self._tell(step, failed)
                    raise error from e
                # the coordinator claimed it first and is writing the manifest: its outcome follows
                self.store.wait([key], store_timeout(self.timeout_s))
            doc = json.loads(self.store.get(key))
        except _STORE_ERRORS as e:
            raise (self._late(step, keys, e) if self._missing([key]) else
                   self._store_failed(step, "reading the outcome", e)) from e
        self._drop_own_part(step)
        if doc.get("status") == "committed":
            return Manifest.from_summary(doc["summary"])  # a reader reads the whole manifest when it needs it
        if doc.get("status") == "dropped":
            ranks = list(doc.get("ranks") or [])
            raise StepDropped(f"step {step} was dropped on rank{'s' if len(ranks) > 1 else ''} "
                              f"{', '.join(map(str, ranks))} (memory budget full, policy skip or coalesce)")
        raise RankError(str(doc.get("error") or f"step {step} was {doc.get('status')} on another rank"), step=step,
                        ranks=list(doc.get("ranks") or []))

    def _late(self, step: int, keys: list[str], e: BaseException) -> RankError:
        """The error of a wait that ran out: the ranks whose part is missing, or the coordinator."""
        missing = self._missing(keys)
        if missing is None:
            return self._store_failed(step, "waiting for the other ranks", e)
        if not missing:
            return RankError(f"step {step}: every rank posted its part, and the coordinator (rank 0) did not commit "
                             f"it within timeout_s={self.timeout_s:g}s (died, or stalled); the previous checkpoint "
                             "stays the latest", step=step, ranks=[0])
        many = len(missing) > 1
        return RankError(
            f"step {step}: rank{'s' if many else ''} {', '.join(map(str, missing))} did not finish "
            f"{'their' if many else 'its'} part within timeout_s={self.timeout_s:g}s (died, or its uploads were too "
            "slow); the checkpoint is not committed and the previous one stays the latest", step=step, ranks=missing)

    # -- helpers ---------------------------------------------------------------------------
    def _fail(self, step: int, staging: str, error: UploadError, *, decided: bool = False) -> None:
        """Fail ``step`` for everyone (``decided``: this rank already holds the outcome)."""
        ranks = error.ranks if isinstance(error, RankError) else []
        outcome = {"status": "failed", "error": str(error), "ranks": ranks}
        try:
            if decided or self._decide_first(step, outcome) is None:
                self._tell(step, outcome)
        except UploadError as e:
            log.warning("mpckpt: %s", e)
        self._abort_quietly(step, staging)

    def _abort_quietly(self, step: int, staging: str) -> None:
        try:
            self.backend.abort(staging)
        except Exception as e:  # what is left is debris the next open removes
            log.warning("mpckpt: step %d: removing the files of the failed checkpoint: %s", step, e)

    def _decide_first(self, step: int, outcome: dict[str, Any]) -> dict[str, Any] | None:
        """Claim the decision on ``step`` unless a rank did already: None if this claim holds,
        else the claim another rank made first (compare-and-set in the store: one decision).
        The claim's holder then posts the outcome (``_tell``) that the other ranks wait for."""
        key = f"{step}/claim"
        mine = json.dumps(outcome, separators=(",", ":"))
        try:
            current = self.store.compare_set(key, "", mine)
        except _STORE_ERRORS as e:
            raise self._store_failed(step, "deciding its outcome", e) from e
        current = current.decode() if isinstance(current, bytes) else str(current)
        return None if current == mine else json.loads(current)

    def _tell(self, step: int, outcome: dict[str, Any]) -> None:
        key = f"{step}/outcome"
        try:
            self.store.set(key, json.dumps(outcome, separators=(",", ":")))
        except _STORE_ERRORS as e:
            raise self._store_failed(step, "posting the outcome", e) from e
        if self.rank == 0:
            self._last_outcome = key

    def _forget_previous(self, step: int) -> None:
        """Every rank posted its part of ``step``, so each has read the previous outcome."""
        if self._last_outcome is not None:
            previous = self._last_outcome.rsplit("/", 1)[0]
            for key in (f"{previous}/outcome", f"{previous}/claim"):
                try:
                    self.store.delete_key(key)
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

    def _store_failed(self, step: int, doing: str, e: BaseException) -> RankError:
        return RankError(f"step {step}: the torch.distributed store failed while {doing} ({type(e).__name__}: "
                         f"{str(e)[:300]}); the process hosting it (the torchrun agent, or rank 0) may have died",
                         step=step)


def _entry_json(entry: FileEntry) -> dict[str, Any]:
    return {"size": entry.size, "checksum": entry.checksum}
