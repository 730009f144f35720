"""A single process is a group of one: its collectives return what it gives, its store is its own."""

from __future__ import annotations

from mpckpt._dist.group import RankGroup


def test_a_process_without_a_job_is_a_group_of_one() -> None:
    for group in (RankGroup.detect(), RankGroup.detect(False)):
        assert (group.rank, group.world_size, group.alone, group.coordinator) == (0, 1, True, True)
        assert group.broadcast({"a": 1}) == {"a": 1}
        assert group.all_gather(("due", False)) == [("due", False)]


def test_a_group_of_ones_store_lives_in_the_process() -> None:
    group = RankGroup.of_one()
    store = group.scoped("mpckpt/x/")
    store.set("k", "v")
    assert group.scoped("mpckpt/x/").get("k") == b"v"
    assert RankGroup.of_one().scoped("mpckpt/x/").check(["k"]) is False  # another group of one: another store
