"""load_and_broadcast's holders capped (#37 item 3): a piece several processes need over the
relay is read by one of at most K = ``cluster.fanout(N)`` of them (the smallest power of two
with K² >= N, at least 4, at most 64), so each process fetches from O(K) peers, however many processes the
job has. Planned for a pod's process counts, no files."""

import pytest

from tests.cluster.fanout import fixed_fanout
from tpu_ckpt import cluster
from tpu_ckpt.format import LeafEntry, PieceEntry
from tpu_ckpt.restoring import _shared_reads as shared_reads


def _host_leaves(count: int) -> list[tuple[LeafEntry, None]]:
    """Leaves every process wants whole, on the host (numpy targets: the relay's path)."""
    leaves = [
        LeafEntry(f"l{i}", [f"l{i}"], "array", (16,), "float32", pieces=(PieceEntry(((0, 16),), f"f{i}", 0, 64, 0),))
        for i in range(count)
    ]
    return [(leaf, None) for leaf in leaves]


def test_the_readers_of_pieces_the_whole_job_needs_are_at_most_the_fanout_whatever_the_job():
    peers = {}
    for processes in (16, 128, 1536, 10_000):
        plan = shared_reads.plan(_host_leaves(1000), processes)
        assert all(needers == frozenset(range(processes)) for needers in plan.needers.values())
        peers[processes] = len(set(plan.readers.values()))  # each process connects to these (but itself)
    assert peers == {16: 4, 128: 16, 1536: 64, 10_000: 64}
    fanouts = {p: cluster.fanout(p) for p in (1, 4, 5, 16, 17, 64, 65, 1024, 1025, 4097)}
    assert fanouts == {1: 4, 4: 4, 5: 4, 16: 4, 17: 8, 64: 8, 65: 16, 1024: 32, 1025: 64, 4097: 64}


def test_the_readers_share_the_bytes_evenly():
    plan = shared_reads.plan(_host_leaves(6400), 1536)
    per_reader: dict[int, int] = {}
    for reader in plan.readers.values():
        per_reader[reader] = per_reader.get(reader, 0) + 1
    assert len(per_reader) == cluster.fanout(1536) == 64 and set(per_reader.values()) == {100}


def _peers(processes: int, fanout: int, leaves: int) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    """Every process's peers through the relay tree, each piece needed by every process: whom
    it fetches from, and who fetches from it (what its server accepts), as SharedReads asks."""
    with fixed_fanout(fanout):  # the readers' cap, as every process of such a job sets it
        plan = shared_reads.plan(_host_leaves(leaves), processes)
    tree = shared_reads._RelayTree(processes, fanout, tuple(sorted(set(plan.readers.values()))))
    fetches: dict[int, set[int]] = {p: set() for p in range(processes)}
    for me in range(processes):
        relayed = tree.relayed(me, plan)
        for pid, reader in plan.readers.items():
            if pid in relayed:
                fetches[me].add(tree.upstream(me, reader))
                for taker in relayed[pid] - {me}:  # each taker fetches it from here
                    assert me in (tree.source(taker, reader), tree.upstream(taker, reader)), (me, taker)
            elif me != reader:
                fetches[me].add(tree.source(me, reader))
    takes: dict[int, set[int]] = {p: set() for p in range(processes)}
    for me, sources in fetches.items():
        sources.discard(me)
        for source in sources:
            takes[source].add(me)
    return fetches, takes


@pytest.mark.slow  # every process's plan at 4,096 processes: a few seconds
def test_beyond_the_fanout_each_process_fetches_from_its_group_and_about_two_others():
    """Every process needing every piece, K = 64 at 1,536 and 4,096 processes and K = 4 at 16 and
    32: each fetches from at most K peers (its group's readers and relayers, and as a relayer
    one sender) and is fetched from by at most K + 2 (its group, and as a sender about one
    other group's relayer), where a reader serving one relayer per group took 86 at 1,536
    processes and 126 at 4,096; and a relayer's pieces reach its group's needers alone."""
    for processes, fanout in ((1536, 64), (4096, 64), (16, 4), (32, 4)):
        fetches, takes = _peers(processes, fanout, 2 * fanout)
        assert max(len(s) for s in fetches.values()) <= fanout, (processes, fanout)
        assert max(len(s) for s in takes.values()) <= fanout + 2, (processes, fanout)
        outside = {me: {p for p in s if p // fanout != me // fanout} for me, s in fetches.items()}
        assert max(len(s) for s in outside.values()) <= 2, (processes, fanout)
    processes, fanout = 1536, cluster.fanout(1536)
    plan = shared_reads.plan(_host_leaves(1000), processes)
    readers = set(plan.readers.values())
    tree = shared_reads._RelayTree(processes, fanout, tuple(sorted(readers)))
    for group in (1, processes // fanout - 1):  # each reader's pieces reach a group through its own relayer
        assert len({tree.relayer(reader, group) for reader in readers}) == len(readers), group
    for me in range(0, processes, 97):
        for pid, takers in tree.relayed(me, plan).items():
            if plan.readers[pid] // fanout != me // fanout:  # a relayer: its own group's needers alone
                assert takers == frozenset(range(me // fanout * fanout, me // fanout * fanout + fanout)), me
            else:  # a sender: other groups' relayers, and itself
                assert me in takers and all(t // fanout != me // fanout for t in takers - {me}), me


def test_within_the_fanout_every_piece_comes_from_its_reader():
    tree = shared_reads._RelayTree(16, 16, tuple(range(16)))
    assert tree.source(3, 9) == 9 and tree.takers(9, frozenset(range(16))) == frozenset(range(16))
    with fixed_fanout(16):
        assert tree.relayed(3, shared_reads.plan(_host_leaves(10), 16)) == {}
