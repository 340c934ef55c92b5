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
