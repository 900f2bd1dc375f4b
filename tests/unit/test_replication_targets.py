"""Which nodes hold snapshot replicas: a pure function of the membership."""

from __future__ import annotations

from elastic_ddp.snapshot.exchange.replication import Member, choose_replica_targets


def member(rank: int, group_rank: int, directory: int, receiver: bool = True, local_rank: int = 0) -> Member:
    return Member(rank=rank, group_rank=group_rank, local_rank=local_rank, directory=directory, can_receive=receiver)


def test_targets_are_the_next_nodes_after_rank_0s_one_per_directory():
    members = [member(0, 2, 0), member(1, 2, 0, receiver=False, local_rank=1), member(2, 0, 2),
               member(3, 0, 2, receiver=False, local_rank=1), member(4, 1, 4), member(5, 3, 5)]
    assert [m.group_rank for m in choose_replica_targets(members, 1)] == [3]
    assert [m.group_rank for m in choose_replica_targets(members, 2)] == [3, 0]
    assert [m.group_rank for m in choose_replica_targets(members, 9)] == [3, 0, 1]


def test_a_shared_directory_gets_no_replicas():
    members = [member(0, 0, 0), member(1, 1, 0), member(2, 2, 0)]
    assert choose_replica_targets(members, 2) == []


def test_two_nodes_sharing_a_directory_get_one_replica_between_them():
    members = [member(0, 0, 0), member(1, 1, 1), member(2, 2, 1), member(3, 3, 3)]
    assert [m.group_rank for m in choose_replica_targets(members, 3)] == [1, 3]
