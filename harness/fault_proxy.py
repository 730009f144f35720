"""A small fault-injecting HTTP/1.1 proxy on 127.0.0.1 for the storage-fault tests.

``FaultProxy(target_port)`` listens on a free port and forwards each client connection to
``127.0.0.1:target_port``. It reads request heads (and bodies, by ``Content-Length`` or
chunked encoding) so that it can decide *per request* what to do; responses are relayed as
raw bytes, so ``Expect: 100-continue`` and keep-alive work as they do without it. A plan of
rules picks, for every request, one of:

* ``pass``      forward the request and relay the response;
* ``reset``     read the request, then close the client socket with ``SO_LINGER 0`` (an RST);
* ``stall``     read the request and hold the connection ``stall_s`` seconds without answering;
* ``http_503``  answer ``503 Service Unavailable`` (``Content-Length: 0``, ``Connection: close``)
  without forwarding;
* ``truncate``  forward the request, relay only the first ``truncate_bytes`` bytes of the
  response, then close;
* ``delay``     wait ``delay_s`` seconds, then forward as ``pass`` does (a slow link or server).

Rules are consulted in the order they were added; the first that fires decides. A rule fires
for the next ``times`` matching requests, with probability ``probability`` (a seeded RNG), or
in turn from a ``sequence`` of kinds (one per matching request, ``pass`` included). With
``scope="connection"`` a rule looks only at the first request of each new connection. A
``match(method, path)`` predicate narrows a rule to some requests (``PUT`` only, one key).

Bounded: every socket has a timeout or is shut down by ``stop()``, a stall ends after
``stall_s`` or at ``stop()``, and the threads are daemons joined with a deadline. Threads, not
asyncio, because the tests drive it from plain synchronous code.
"""

from __future__ import annotations

import collections
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

KINDS = ("pass", "reset", "stall", "http_503", "truncate", "delay")
_HEAD_LIMIT = 64 << 10
_IO_TIMEOUT_S = 30.0  # no socket of the proxy ever waits longer than this for one read
_RESPONSE_503 = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                 b"Connection: close\r\nRetry-After: 0\r\n\r\n")

Match = Callable[[str, str], bool]


@dataclass
class _Rule:
    kind: str | None
    times: int | None = None              # None: unlimited (until clear())
    probability: float | None = None
    sequence: collections.deque[str] | None = None
    scope: str = "request"
    match: Match | None = None
    rng: random.Random = field(default_factory=random.Random)

    def decide(self, first_on_connection: bool, method: str, path: str) -> str | None:
        if self.scope == "connection" and not first_on_connection:
            return None
        if self.match is not None and not self.match(method, path):
            return None
        if self.sequence is not None:
            return self.sequence.popleft() if self.sequence else None
        if self.times is not None and self.times <= 0:
            return None
        if self.probability is not None and self.rng.random() >= self.probability:
            return None
        if self.times is not None:
            self.times -= 1
        return self.kind

    @property
    def spent(self) -> bool:
        return (self.sequence is not None and not self.sequence) or (self.times is not None and self.times <= 0)


class _Reader:
    """Buffered reads from a socket: request heads, exact byte counts, lines."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> bool:
        data = self.sock.recv(1 << 16)
        if not data:
            return False
        self.buf += data
        return True

    def until(self, marker: bytes, limit: int = _HEAD_LIMIT) -> bytes | None:
        while True:
            i = self.buf.find(marker)
            if i >= 0:
                out = bytes(self.buf[:i + len(marker)])
                del self.buf[:i + len(marker)]
                return out
            if len(self.buf) > limit or not self._fill():
                return None

    def exactly(self, n: int, sink: Callable[[bytes], None]) -> bool:
        while n > 0:
            if not self.buf and not self._fill():
                return False
            take = bytes(self.buf[:n])
            del self.buf[:len(take)]
            n -= len(take)
            sink(take)
        return True


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    method, path = (parts[0], parts[1]) if len(parts) >= 2 else ("?", "?")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return method, path, headers


def _relay_body(reader: _Reader, method: str, headers: dict[str, str], sink: Callable[[bytes], None]) -> bool:
    """Move the request body from ``reader`` to ``sink``; False if the client went away."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            line = reader.until(b"\r\n")
            if line is None:
                return False
            sink(line)
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:  # trailers, then the empty line
                while True:
                    trailer = reader.until(b"\r\n")
                    if trailer is None:
                        return False
                    sink(trailer)
                    if trailer == b"\r\n":
                        return True
            if not reader.exactly(size + 2, sink):
                return False
    length = int(headers.get("content-length", "0") or 0)
    return reader.exactly(length, sink)


def _shut(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets an RST, not a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        _shut(sock)


class _Upstream:
    """One connection to the target and the thread that relays its bytes back to the client."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.sock = socket.create_connection((proxy.target_host, proxy.target_port), timeout=_IO_TIMEOUT_S)
        self.limit: int | None = None  # set by a truncate fault: bytes of the response still to relay
        self.lock = threading.Lock()
        proxy._track(self.sock)
        proxy._spawn(self._pump, "fault-proxy-pump")

    def _pump(self) -> None:
        try:
            while not self.proxy._stopping.is_set():
                try:
                    data = self.sock.recv(1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    break
                with self.lock:
                    limit = self.limit
                    if limit is not None:
                        data = data[:limit]
                        self.limit = limit - len(data)
                if data:
                    self.client.sendall(data)
                if limit is not None and self.limit == 0:
                    break
        except OSError:
            pass
        finally:
            _shut(self.sock)
            _shut(self.client)  # a truncated or ended upstream ends the client connection too


class FaultProxy:
    """A fault-injecting TCP/HTTP proxy from ``127.0.0.1:port`` to ``target_host:target_port``."""

    def __init__(self, target_port: int, *, target_host: str = "127.0.0.1", seed: int = 0,
                 stall_s: float = 10.0, truncate_bytes: int = 12, delay_s: float = 0.5) -> None:
        self.target_host = target_host
        self.delay_s = delay_s
        self.target_port = target_port
        self.stall_s = stall_s
        self.truncate_bytes = truncate_bytes
        self._seed = seed
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._release = threading.Event()  # set by release_stalls(): ongoing stalls end now
        self._threads: list[threading.Thread] = []
        self._socks: set[socket.socket] = set()
        self.injected: collections.Counter[str] = collections.Counter()  # faults applied, by kind
        self.requests = 0
        self.connections = 0
        self.log: list[tuple[str, str, str]] = []  # (kind, method, path) of every fault applied
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]

    # -- the plan ---------------------------------------------------------------------------------
    def inject(self, kind: str, *, times: int | None = 1, probability: float | None = None,
               scope: str = "request", match: Match | None = None, seed: int | None = None) -> None:
        """Apply ``kind`` to the next ``times`` matching requests (None: every one until ``clear``),
        each with ``probability`` if given (drawn from an RNG seeded with ``seed``)."""
        _check_kind(kind)
        if scope not in ("request", "connection"):
            raise ValueError(f"scope={scope!r}: use 'request' or 'connection'")
        rng = random.Random(self._seed if seed is None else seed)
        with self._lock:
            self._rules.append(_Rule(kind, times=times, probability=probability, scope=scope, match=match, rng=rng))

    def sequence(self, kinds: Iterable[str], *, scope: str = "request", match: Match | None = None) -> None:
        """Apply ``kinds`` in turn, one per matching request (``"pass"`` lets one through)."""
        kinds = list(kinds)
        for kind in kinds:
            _check_kind(kind)
        with self._lock:
            self._rules.append(_Rule(None, sequence=collections.deque(kinds), scope=scope, match=match))

    def clear(self) -> None:
        """Drop every rule: from now on every request passes."""
        with self._lock:
            self._rules.clear()

    def release_stalls(self) -> None:
        """End every stall in progress now (its connection is closed); later stalls hold again."""
        self._release.set()
        time.sleep(0.3)  # every stalled connection polls at 0.1 s
        self._release.clear()

    def pending(self) -> bool:
        """Whether a rule with a finite count or sequence still has faults to give."""
        with self._lock:
            return any(not r.spent for r in self._rules if r.times is not None or r.sequence is not None)

    @property
    def total_injected(self) -> int:
        return sum(v for k, v in self.injected.items() if k != "pass")

    def _decide(self, first_on_connection: bool, method: str, path: str) -> str:
        with self._lock:
            self.requests += 1
            kind = "pass"
            for rule in self._rules:
                chosen = rule.decide(first_on_connection, method, path)
                if chosen is not None:
                    kind = chosen
                    break
            self._rules = [r for r in self._rules if not r.spent]
            if kind != "pass":
                self.injected[kind] += 1
                self.log.append((kind, method, path))
            return kind

    # -- running ----------------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._spawn(self._accept_loop, "fault-proxy-accept")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        _shut(self._listener)
        with self._lock:
            socks = list(self._socks)
        for sock in socks:
            _shut(sock)
        deadline = time.monotonic() + timeout_s
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.add(sock)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(_IO_TIMEOUT_S)
            with self._lock:
                self.connections += 1
            self._track(client)
            self._spawn(self._serve, "fault-proxy-conn", client)

    def _serve(self, client: socket.socket) -> None:
        reader = _Reader(client)
        upstream: _Upstream | None = None
        first = True
        try:
            while not self._stopping.is_set():
                head = reader.until(b"\r\n\r\n")
                if head is None:
                    return
                method, path, headers = _parse_head(head)
                kind = self._decide(first, method, path)
                first = False
                if kind == "delay":
                    self._drain_wait(self.delay_s)
                    kind = "pass"
                expects_continue = headers.get("expect", "").lower() == "100-continue"
                if kind in ("pass", "truncate"):
                    if upstream is None:
                        upstream = _Upstream(self, client)
                    if kind == "truncate":
                        with upstream.lock:
                            upstream.limit = self.truncate_bytes
                    upstream.sock.sendall(head)
                    if not _relay_body(reader, method, headers, upstream.sock.sendall):
                        return
                    continue
                if not expects_continue:  # read the whole request first, as a real server would
                    if not _relay_body(reader, method, headers, lambda _b: None):
                        return
                if kind == "reset":
                    _reset(client)
                elif kind == "http_503":
                    client.sendall(_RESPONSE_503)
                    client.shutdown(socket.SHUT_WR)
                    self._drain(client, 1.0)
                elif kind == "stall":
                    self._drain(client, self.stall_s)
                return
        except (OSError, ValueError):
            return
        finally:
            if upstream is not None:
                _shut(upstream.sock)
            _shut(client)
            with self._lock:
                self._socks.discard(client)
                if upstream is not None:
                    self._socks.discard(upstream.sock)

    def _drain_wait(self, seconds: float) -> None:
        """Wait ``seconds`` (or until stop() / release_stalls())."""
        deadline = time.monotonic() + seconds
        while not (self._stopping.is_set() or self._release.is_set()) and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _drain(self, sock: socket.socket, seconds: float) -> None:
        """Read and discard what the client sends for ``seconds`` (or until it closes / stop())."""
        deadline = time.monotonic() + seconds
        sock.settimeout(0.1)
        while not (self._stopping.is_set() or self._release.is_set()) and time.monotonic() < deadline:
            try:
                if not sock.recv(1 << 16):
                    return
            except TimeoutError:
                continue
            except OSError:
                return


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"fault kind {kind!r} is not one of {KINDS}")
