"""The tier restore's merge tree (tiers/_merge_tree.py): each process talks to O(K) peers
whatever the job's size, K = cluster.fanout(N) (#37 item 3). The plan is checked at pod
sizes as data here; real processes run it with a small K in tests/cluster/test_control_plane.py."""

import pytest

from tpu_ckpt import cluster
from tpu_ckpt.tiers._merge_tree import MergeTree


def _tree(members: int, holders: int, fanout: int) -> MergeTree:
    return MergeTree(tuple(range(members)), min(members, fanout), tuple(range(holders)), fanout)


def _peers(tree: MergeTree) -> tuple[dict[int, set], dict[int, set]]:
    """Per process, the processes it connects to and those that connect to it, as the tree's
    steps do: gatherers to holders, servers to gatherers (or holders), relayers to servers,
    members to each range's relayer (or server)."""
    opened: dict[int, set] = {p: set() for p in tree.members}
    accepted: dict[int, set] = {p: set() for p in tree.members}

    def link(client: int, server: int) -> None:
        if client != server:
            opened[client].add(server)
            accepted.setdefault(server, set()).add(client)

    for r in range(tree.ranges):
        server = tree.members[r]
        for holder in tree.holders:
            gatherer = tree.gatherer(r, tree.chunk_of(holder))
            link(gatherer, holder)
            link(server, gatherer)
    for p in tree.members:
        for r in range(tree.ranges):
            relayer = tree.relayer(r, p)
            link(relayer, tree.members[r])
            link(p, relayer)
    return opened, accepted


@pytest.mark.parametrize(("members", "fanout"), [(1536, 64), (4096, 64), (16, 4), (100, 8)])
def test_every_range_has_one_gatherer_per_chunk_and_one_relayer_per_group(members, fanout):
    tree = _tree(members, members, fanout)
    for r in range(tree.ranges):
        assert tree.relayer(r, tree.members[r]) == tree.members[r]  # a server relays to its own group itself
        for p in (0, members // 2, members - 1):
            assert tree.relayer(r, p) in tree.group(p), (r, p)
    gathered = [(r, c) for p in tree.members for r, c in tree.gathers(p)]
    assert len(gathered) == len(set(gathered))
    direct = {(r, c) for r in range(tree.ranges) for c in range(tree.chunks) if tree.gatherer(r, c) == tree.members[r]}
    assert set(gathered) | direct == {(r, c) for r in range(tree.ranges) for c in range(tree.chunks)}


@pytest.mark.parametrize(("members", "fanout"), [(1536, 64), (4096, 64), (64, 8), (16, 4), (12, 4)])
def test_each_process_talks_to_a_few_times_the_fanout_up_to_its_square(members, fanout):
    opened, accepted = _peers(_tree(members, members, fanout))
    most = max(max(len(v) for v in opened.values()), max(len(v) for v in accepted.values()))
    assert most <= 3 * fanout, most  # flat, the range servers would each take `members` - 1
    assert sum(len(v) for v in opened.values()) <= 4 * fanout * members


def test_within_the_fanout_the_tree_is_the_flat_merge():
    tree = _tree(8, 8, 64)
    assert tree.chunks == tree.groups == 1
    assert all(tree.gathers(p) == [] and tree.relays(p) == [] for p in tree.members)
    assert all(tree.gatherer(r, 0) == r and tree.relayer(r, p) == r for r in range(8) for p in range(8))


def test_the_default_fanout_costs_no_process_more_than_a_constant_64():
    """K = cluster.fanout(N), the smallest power of two with K² >= N: each process's peers (the
    most it opens or accepts) stay within 3K, and below those of K = 64 at every size short of
    the cap (at 1,536 processes K is 64)."""
    for members, expected in ((16, (4, 6, 15)), (128, (16, 22, 64)), (256, (16, 30, 66)), (1024, (32, 62, 78))):
        fanout = cluster.fanout(members)
        most, flat = (max(map(len, [*opened.values(), *accepted.values()]))
                      for opened, accepted in (_peers(_tree(members, members, k)) for k in (fanout, 64)))
        assert (fanout, most, flat) == expected, members
        assert most <= 3 * fanout
    assert cluster.fanout(1536) == 64
