"""Preble's local wait queue (§4.3): P = 10 priority groups by cached-token fraction, batches filled
in proportion to the group weights (g + 1), FCFS within a group."""

import pytest

from elastune_gateway.routing.priority import (
    PRIORITY_GROUPS,
    PriorityGroups,
    group_counts,
    priority_group,
    select_batch,
)


def test_group_of_a_cached_fraction():
    assert PRIORITY_GROUPS == 10
    assert priority_group(63, 100) == 6  # the paper's example
    assert priority_group(60, 100) == 6  # integer arithmetic: no 5.999…
    assert priority_group(0, 100) == 0
    assert priority_group(99, 100) == 9
    assert priority_group(100, 100) == 9  # a full hit joins the top group
    assert priority_group(5, 0) == 9
    assert priority_group(150, 100) == 9
    assert priority_group(1, 3, groups=3) == 1
    with pytest.raises(ValueError):
        priority_group(1, 2, groups=0)


def filled(per_group: int = 20) -> PriorityGroups[str]:
    """Ten groups, ``per_group`` requests each, named g<group>-<arrival>; queued interleaved."""
    q: PriorityGroups[str] = PriorityGroups()
    for i in range(per_group):
        for g in range(10):
            q.push(f"g{g}-{i}", g * 10, 100)
    return q


def test_a_batch_takes_from_every_group_in_proportion_top_first():
    q = filled()
    batch = [q.pop() for _ in range(55)]
    assert group_counts(batch, lambda s: int(s[1])) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert batch[0] == "g9-0"  # the top group goes first
    # FCFS within a group.
    assert [s for s in batch if s.startswith("g9-")] == [f"g9-{i}" for i in range(10)]


def test_proportions_hold_across_batches_and_lone_picks():
    q = filled()
    picks = [q.pop() for _ in range(5)] + [q.pop() for _ in range(50)]
    assert group_counts(picks, lambda s: int(s[1])) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_empty_groups_leave_their_share_and_nobody_starves():
    q: PriorityGroups[str] = PriorityGroups()
    for i in range(30):
        q.push(f"hit{i}", 100, 100)  # group 9, weight 10
    q.push("miss", 0, 100)  # group 0, weight 1
    batch = [q.pop() for _ in range(11)]
    assert "miss" in batch  # within one cycle of 11 picks, interleaved (smooth weighted round-robin)
    assert batch.index("miss") == 5


def test_peek_push_front_update_remove_and_iteration():
    q: PriorityGroups[str] = PriorityGroups()
    q.push("a", 0, 100)
    q.push("b", 95, 100)
    q.push("c", 95, 100)
    assert len(q) == 3 and "a" in q and q.group_of("b") == 9
    order = list(q)
    assert order == [q.peek(), *order[1:]]
    assert list(q) == order  # iterating pops nothing
    first = q.pop()
    assert first == "b"
    q.push_front(first, 95, 100)  # preempted: ahead of c again
    assert q.pop() == "b"
    assert q.update("a", 100, 100) == 9  # its prefix got cached meanwhile
    assert q.group_of("a") == 9
    q.remove("c")
    assert list(q) == ["a"]
    with pytest.raises(ValueError):
        q.push("a", 0, 1)
    q.pop()
    with pytest.raises(IndexError):
        q.pop()


def test_select_batch_is_stateless():
    items = [("x", 0.05), ("y", 0.95), ("z", 0.5), ("w", 0.95)]
    picked = select_batch(items, 3, lambda it: it[1])
    assert [name for name, _ in picked] == ["y", "z", "w"]  # groups 9, 5, 9: interleaved by weight
    assert select_batch(items, 10, lambda it: it[1])[-1] == ("x", 0.05)
