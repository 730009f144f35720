"""mpckpt's own link between the ranks of one open (``_peer.link``), over a real gloo group on
127.0.0.1 and an in-memory store.

What a heal relies on: the ranks of one open meet on the link whatever links each process opened
before it. A survivor of ``mpckpt.heal`` reopens its root (its second link) beside a replacement
that opens it for the first time; were the prefix of the link's keys to count a process's links,
the two would wait for each other under different keys until the group's timeout.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from mpckpt._dist.group import RankGroup
from mpckpt._peer.link import Link, ints

BOUND_S = 60.0


def test_a_process_that_opened_a_link_before_meets_one_that_did_not(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = dist.HashStore()
    Link(RankGroup(0, 1, None, dist.PrefixStore("earlier-job/", store)), "an-earlier-open", timeout_s=BOUND_S)

    links: dict[int, Link] = {}
    failures: list[BaseException] = []

    def open_rank(rank: int) -> None:
        try:
            links[rank] = Link(RankGroup(rank, 2, None, store), "this-open", timeout_s=BOUND_S)
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=open_rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    assert not failures, failures
    if any(t.is_alive() for t in threads):
        pytest.fail(f"the ranks of one open did not meet on the link within {BOUND_S:.0f} s")

    got = ints(0, 0)
    sender = threading.Thread(target=links[0].send, args=(ints(7, 11), 1, 3), daemon=True)
    sender.start()
    links[1].recv(got, 0, 3)
    sender.join(BOUND_S)
    assert torch.equal(got, ints(7, 11))
