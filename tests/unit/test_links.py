"""``mpckpt._links``: the connections a call opened are recorded, and shut down later only while
their descriptor still names the same socket; listeners and Unix sockets are never touched. Real
sockets on 127.0.0.1."""

from __future__ import annotations

import os
import socket

from mpckpt import _links


def _connect(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname(), timeout=10)
    accepted, _ = listener.accept()
    accepted.settimeout(10)
    return client, accepted


def test_a_calls_tcp_connections_are_recorded_and_shut_its_unix_sockets_and_listener_are_not():
    outside = socket.create_server(("127.0.0.1", 0))  # opened before the call: never recorded
    opened: dict[str, socket.socket] = {}

    def call() -> str:
        opened["listener"] = socket.create_server(("127.0.0.1", 0))
        opened["client"], opened["accepted"] = _connect(opened["listener"])
        opened["unix_a"], opened["unix_b"] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return "formed"

    result, links = _links.opened_by(call)
    try:
        assert result == "formed"
        fds = {name: s.fileno() for name, s in opened.items()}
        assert set(links) == {fds["listener"], fds["client"], fds["accepted"]}, (links, fds)
        assert outside.fileno() not in links

        assert _links.shut(links) == 2  # the two ends of the connection; the listener is skipped
        assert opened["client"].recv(1) == b""  # shut down both ways: the peer sees the end at once
        assert opened["accepted"].recv(1) == b""
        late, late_accepted = _connect(opened["listener"])  # the listener still accepts
        late.close()
        late_accepted.close()
        opened["unix_a"].sendall(b"x")  # the Unix pair works as before
        assert opened["unix_b"].recv(1) == b"x"
    finally:
        outside.close()
        for s in opened.values():
            s.close()


def test_a_descriptor_reused_for_another_socket_is_never_shut():
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        held: list[socket.socket] = []
        _, links = _links.opened_by(lambda: held.extend(_connect(listener)))
        client, accepted = held
        number = client.fileno()
        assert number in links
        client.close()
        reused = socket.create_connection(listener.getsockname(), timeout=10)  # the lowest free number: the same
        reused_peer, _ = listener.accept()
        reused_peer.settimeout(10)
        try:
            if reused.fileno() == number:  # (the kernel gave the number back, as it does)
                assert os.readlink(f"/proc/self/fd/{number}") != links[number]
            assert _links.shut({number: links[number]}) == 0
            reused.sendall(b"y")  # untouched
            assert reused_peer.recv(1) == b"y"
        finally:
            reused.close()
            reused_peer.close()
            accepted.close()
    finally:
        listener.close()
