"""The single-writer lease that object-store backends keep in ``<root>/.mpckpt.lock``.

Object stores have no ``flock``, so the lock is a small JSON object
``{"owner", "token", "expires_unix"}`` that its holder rewrites (``renew``) before it expires.
A holder that dies stops renewing, and once ``expires_unix`` has passed the next writer takes
the lease over; until then ``acquire`` raises ``LockedError`` naming the holder. A held lease
renews itself from a daemon thread every ``lease_s / 3`` seconds, so a live holder keeps it
whatever its main thread is doing, and a dead one (thread and all) loses it; a takeover the
thread notices is logged and raised by the next ``renew()``. Expiry times are wall-clock
seconds: hosts sharing a root need clocks in sync to well within ``lease_s``.

Writes are compare-and-swap where the store can do it: create-only when no lease exists, and
"replace only if unchanged since I read it" (an ETag condition) when taking over or renewing.
A store that cannot compare versions gets write-then-read-back, which detects a lost race
after the fact; two takers racing within one round trip on such a store is the known gap.
The clock is a parameter so tests never wait for a real expiry.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from mpckpt._threads import Thread
from mpckpt.errors import ConfigError, LockedError

log = logging.getLogger(__name__)

LOCK_NAME = ".mpckpt.lock"
DEFAULT_LEASE_S = 60.0


class LeaseLost(Exception):
    """A conditional write found the lease object changed (someone else won a race)."""


@dataclass(frozen=True)
class LeaseObject:
    """The lease object as stored, with the store's version tag (an ETag) when it has one."""

    data: bytes
    tag: str | None


class LeaseStore(Protocol):
    """The few conditional operations a backend offers on its lease object."""

    compare_and_swap: bool  # whether replace/remove honour ``tag`` atomically

    def load(self) -> LeaseObject | None: ...

    def create(self, data: bytes) -> None:
        """Write ``data`` only if no lease object exists; ``LeaseLost`` otherwise."""

    def replace(self, data: bytes, tag: str | None) -> None:
        """Overwrite the lease object if its version is still ``tag``; ``LeaseLost`` otherwise."""

    def remove(self, tag: str | None) -> None:
        """Delete the lease object if its version is still ``tag`` (best effort)."""


def parse_lease_s(value: object) -> float:
    """Validate a ``lease_s`` storage option."""
    try:
        lease_s = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"storage option lease_s={value!r} is not a number of seconds") from e
    if not lease_s > 0:
        raise ConfigError(f"storage option lease_s={value!r} must be positive (seconds)")
    return lease_s


def _decode(obj: LeaseObject) -> dict:
    try:
        record = json.loads(obj.data)
        float(record["expires_unix"])
        return record if isinstance(record, dict) else {}
    except (ValueError, KeyError, TypeError):
        return {"owner": "unreadable lease", "expires_unix": 0.0}  # garbage never blocks forever


class LeaseLock:
    """A held lease; ``renew`` pushes the expiry forward, ``release`` deletes it (idempotent)."""

    def __init__(self, store: LeaseStore, *, owner: str, where: str, lease_s: float = DEFAULT_LEASE_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self.owner = owner
        self.where = where
        self.lease_s = lease_s
        self._clock = clock
        self._token = secrets.token_hex(8)
        self._tag: str | None = None
        self._held = False
        self.expires_unix = 0.0
        self._mutex = threading.Lock()  # the keep-alive thread and callers renew one at a time
        self._stop = threading.Event()
        self._keepalive: threading.Thread | None = None
        self.lost: LockedError | None = None  # set when a renewal found the lease taken over

    def _record(self) -> bytes:
        self.expires_unix = self._clock() + self.lease_s
        return json.dumps({"owner": self.owner, "token": self._token, "expires_unix": self.expires_unix}).encode()

    def _locked(self, record: dict) -> LockedError:
        left_s = max(0.0, float(record.get("expires_unix", 0)) - self._clock())
        return LockedError(
            f"{self.where} is being written by another live process ({record.get('owner', 'unknown')}, "
            f"lease valid for {left_s:.0f} s more); use a different root or stop the other writer "
            "(a dead writer's lease expires by itself)"
        )

    def _confirm(self) -> None:
        """On stores without compare-and-swap: read back, and give up if someone else won."""
        current = self._store.load()
        record = _decode(current) if current else {}
        if record.get("token") != self._token:
            raise LeaseLost
        self._tag = current.tag if current else None

    def acquire(self) -> LeaseLock:
        current = self._store.load()
        try:
            if current is None:
                self._store.create(self._record())
            else:
                record = _decode(current)
                live = float(record["expires_unix"]) > self._clock()
                if live and record.get("owner") != self.owner:
                    raise self._locked(record)
                self._store.replace(self._record(), current.tag)  # stale, or our own earlier lease
            self._confirm()
        except LeaseLost as e:
            latest = self._store.load()
            raise self._locked(_decode(latest) if latest else {}) from e
        self._held = True
        self._keepalive = Thread(target=self._keep_alive, name=f"mpckpt-lease {self.where}", daemon=True)
        self._keepalive.start()
        return self

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.renew()
            except LockedError as e:
                log.error("%s", e)
                return
            except Exception as e:  # noqa: BLE001 - a failed renewal is retried at the next tick
                log.warning("renewing the writer lease on %s failed (%s); retrying in %.0f s",
                            self.where, e, self.lease_s / 3)

    def renew(self) -> None:
        """Push the expiry ``lease_s`` ahead; ``LockedError`` if the lease is no longer ours."""
        with self._mutex:
            if self.lost is not None:
                raise self.lost
            if not self._held:
                raise LockedError(f"the writer lease on {self.where} was released; open the checkpointer again")
            try:
                self._renew_now()
            except LockedError as e:
                self.lost = e
                raise

    def _renew_now(self) -> None:
        try:
            if not self._store.compare_and_swap:
                self._confirm()  # never overwrite a lease someone took over after ours expired
            self._store.replace(self._record(), self._tag)
            self._confirm()
        except LeaseLost as e:
            self._held = False
            latest = self._store.load()
            raise LockedError(
                f"the writer lease on {self.where} was taken over by "
                f"{_decode(latest).get('owner', 'unknown') if latest else 'nobody'} after it expired "
                "(it could not be renewed for lease_s seconds: storage unreachable, or the process stalled); "
                "stop writing here and open the checkpointer again"
            ) from e

    def release(self) -> None:
        self._stop.set()
        if self._keepalive is not None and self._keepalive is not threading.current_thread():
            self._keepalive.join()
        with self._mutex:
            if not self._held:
                return
            self._held = False
        current = self._store.load()
        if current is not None and _decode(current).get("token") == self._token:
            self._store.remove(current.tag)
