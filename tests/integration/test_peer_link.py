"""mpckpt's own link between the ranks of one open (``_peer.link``), over a real gloo group on
127.0.0.1 and an in-memory store.

What a heal relies on: the ranks of one open meet on the link whatever links each process opened
before it (a survivor of ``mpckpt.heal`` reopens its root, its second link, beside a replacement
that opens it for the first time; were the prefix of the link's keys to count a process's links,
the two would wait for each other under different keys until the group's timeout); and a link
shut because the job's group failed ends the transfers in flight on it, instead of their waiting
for a lost rank until ``PROGRESS_S``.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from mpckpt._dist.group import RankGroup
from mpckpt._peer.link import Link, ints

BOUND_S = 60.0


@pytest.fixture
def pair(monkeypatch) -> list[Link]:
    """Ranks 0 and 1 of one open, in two threads; rank 0's process opened a link before."""
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
    return [links[0], links[1]]


def test_a_process_that_opened_a_link_before_meets_one_that_did_not(pair):
    got = ints(0, 0)
    sender = threading.Thread(target=pair[0].send, args=(ints(7, 11), 1, 3), daemon=True)
    sender.start()
    pair[1].recv(got, 0, 3)
    sender.join(BOUND_S)
    assert torch.equal(got, ints(7, 11))


def test_a_link_shut_ends_the_transfer_waiting_on_it(pair):
    ended: list[BaseException | None] = []

    def wait_for_what_never_comes() -> None:
        try:
            pair[1].recv(ints(0), 0, 5, timeout_s=10 * BOUND_S)
            ended.append(None)
        except BaseException as e:
            ended.append(e)

    waiting = threading.Thread(target=wait_for_what_never_comes, daemon=True)
    waiting.start()
    assert pair[1].shut() > 0
    waiting.join(BOUND_S)
    assert not waiting.is_alive(), f"a receive on a shut link still waited after {BOUND_S:.0f} s"
    assert isinstance(ended[0], RuntimeError), ended
