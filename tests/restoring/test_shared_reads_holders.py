"""load_and_broadcast's holders capped (#37 item 3): a piece several processes need over the
relay is read by one of at most ``cluster.fanout()`` of them, so each process fetches from
O(K) peers, however many processes the job has. Planned for a pod's process counts, no files."""

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


def test_the_readers_of_pieces_the_whole_job_needs_are_at_most_max_servers_whatever_the_job():
    peers = {}
    for processes in (16, 128, 1536):
        plan = shared_reads.plan(_host_leaves(1000), processes)
        assert all(needers == frozenset(range(processes)) for needers in plan.needers.values())
        peers[processes] = len(set(plan.readers.values()))  # each process connects to these (but itself)
    assert peers == {16: 16, 128: cluster.fanout(), 1536: cluster.fanout()}


def test_the_readers_share_the_bytes_evenly():
    plan = shared_reads.plan(_host_leaves(6400), 1536)
    per_reader: dict[int, int] = {}
    for reader in plan.readers.values():
        per_reader[reader] = per_reader.get(reader, 0) + 1
    assert len(per_reader) == cluster.fanout() and set(per_reader.values()) == {100}


def test_beyond_the_fanout_each_process_fetches_from_its_group_and_each_reader_serves_a_relayer_a_group():
    """1,536 processes needing every piece: a process fetches each reader's pieces from one
    member of its own group (or the reader, in the reader's group), and a reader is taken
    from by its group and one relayer per other group: O(K + N / K) peers, 87 at most here,
    where every needer fetching from its reader would make a reader serve 1,535."""
    processes, fanout = 1536, cluster.fanout()
    plan = shared_reads.plan(_host_leaves(1000), processes)
    readers = set(plan.readers.values())
    tree = shared_reads._RelayTree(processes, fanout, tuple(sorted(readers)))
    for group in (1, processes // fanout - 1):  # each reader's pieces reach a group through its own relayer
        assert len({tree.relayer(reader, group) for reader in readers}) == len(readers), group
    for me in (0, 700, 1535):
        sources = {tree.source(me, reader) for reader in readers} - {me}
        assert len(sources) <= fanout and all(s // fanout == me // fanout or s in readers for s in sources), me
    for reader in readers:
        takers = tree.takers(reader, frozenset(range(processes))) - {reader}
        assert len(takers) <= (fanout - 1) + (processes // fanout - 1), (reader, len(takers))
    relayed = {me: tree.relayed(me, plan) for me in range(0, processes, 97)}
    for me, pieces in relayed.items():  # a relayer passes each piece on to its own group's needers alone
        assert all(needers == frozenset(range(me // fanout * fanout, me // fanout * fanout + fanout))
                   for needers in pieces.values()), me


def test_within_the_fanout_every_piece_comes_from_its_reader():
    tree = shared_reads._RelayTree(16, cluster.fanout(), tuple(range(16)))
    assert tree.source(3, 9) == 9 and tree.takers(9, frozenset(range(16))) == frozenset(range(16))
    assert tree.relayed(3, shared_reads.plan(_host_leaves(10), 16)) == {}
