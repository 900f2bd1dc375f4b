"""Which nodes hold snapshot replicas: a pure function of the membership."""

from __future__ import annotations

from elastic_ddp.snapshot.replication import Member, choose_replica_targets


def member(rank: int, group_rank: int, store_id: str, receiver: bool = True, local_rank: int = 0) -> Member:
    return Member(rank=rank, group_rank=group_rank, local_rank=local_rank, store_id=store_id, can_receive=receiver)


def test_targets_are_the_next_nodes_after_rank_0s_one_per_directory():
    members = [member(0, 2, "c"), member(1, 2, "c", receiver=False, local_rank=1), member(2, 0, "a"),
               member(3, 0, "a", receiver=False, local_rank=1), member(4, 1, "b"), member(5, 3, "d")]
    assert [m.group_rank for m in choose_replica_targets(members, 1)] == [3]
    assert [m.group_rank for m in choose_replica_targets(members, 2)] == [3, 0]
    assert [m.group_rank for m in choose_replica_targets(members, 9)] == [3, 0, 1]


def test_a_shared_directory_gets_no_replicas():
    members = [member(0, 0, "shared"), member(1, 1, "shared"), member(2, 2, "shared")]
    assert choose_replica_targets(members, 2) == []


def test_two_nodes_sharing_a_directory_get_one_replica_between_them():
    members = [member(0, 0, "a"), member(1, 1, "nfs"), member(2, 2, "nfs"), member(3, 3, "d")]
    assert [m.group_rank for m in choose_replica_targets(members, 3)] == [1, 3]
