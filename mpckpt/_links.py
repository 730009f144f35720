"""The connections a process group opened, so that a rank leaving a failed group can close them.

gloo fails a collective on a peer's closed connection at once, but a rank that waits on a live
peer (a ring's next rank) waits for the group's whole timeout when that peer has left the failed
collective: destroying the group does not close its connections while a wrapper (DDP's reducer)
still holds it. ``mpckpt.heal`` therefore shuts down the sockets the group opened when it formed
(``opened_by``: the process's TCP sockets before and after ``init_process_group``), and every rank
still waiting on this one fails its collective at once and heals too.

A socket is shut down only while its descriptor still names the same socket (its inode), so a
number the process reused meanwhile is never touched; and only a connection, never a listening
socket (gloo's listener thread ends the process when its socket fails). Linux only (``/proc/self/fd``); elsewhere
nothing is recorded and the group's timeout bounds the wait.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_FDS = "/proc/self/fd"


def sockets() -> dict[int, str]:
    """This process's socket descriptors and what each names (``socket:[<inode>]``)."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(_FDS)
    except OSError:
        return found
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            target = os.readlink(f"{_FDS}/{name}")
            if target.startswith("socket:"):
                found[int(name)] = target
    return found


def opened_by(call: Callable[[], T]) -> tuple[T, dict[int, str]]:
    """``call()``'s result and the TCP sockets it opened (and kept open): gloo's connections are TCP,
    so a Unix socket another thread opened meanwhile (a fork server's, a logger's) is never one."""
    before = sockets()
    result = call()
    after = sockets()
    return result, {fd: name for fd, name in after.items() if before.get(fd) != name and _is_tcp(fd, name)}


def _is_tcp(fd: int, name: str) -> bool:
    try:
        if os.readlink(f"{_FDS}/{fd}") != name:
            return False
        with socket.socket(fileno=os.dup(fd)) as s:  # (closing the duplicate leaves ``fd`` open)
            return s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM
    except OSError:
        return False


def shut(links: dict[int, str]) -> int:
    """Shut down (both ways) each of ``links`` that still names the same socket; how many."""
    done = 0
    for fd, name in links.items():
        try:
            if os.readlink(f"{_FDS}/{fd}") != name:
                continue
            with socket.socket(fileno=os.dup(fd)) as s:  # (closing the duplicate leaves ``fd`` open)
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue  # a listener: gloo's accept thread aborts the process on a shut one
                s.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            continue
    return done
