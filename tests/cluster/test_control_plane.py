"""The restores' control plane does not grow with the job (#37 item 3): counted per process
with real processes at 2 and 4 processes (tests/cluster/control_plane_scenarios.py)."""

import pytest

from tests.support import process_group
from tpu_ckpt import cluster


def _counts(tmp_path, scenario: str, processes: int, *args: str, **options) -> list[dict]:
    """Each process's counts from ``scenario``, every restore in it bit-exact."""
    results = process_group.run(f"cluster.control_plane_scenarios.{scenario}", processes, str(tmp_path), *args,
                                **options)
    for r in results:
        assert r.returncode == 0 and r.result is not None, r.output[-4000:]
        assert all(not wrong for key, wrong in r.result.items() if key.endswith("mismatches")), r.result
    return [r.result for r in results]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kv_calls_and_connections_per_process_do_not_grow_with_the_process_count(tmp_path):
    two, four = (_counts(tmp_path / str(p), "control_plane_counts", p) for p in (2, 4))
    print({"P=2": two, "P=4": four})
    for kind in ("tier", "shared"):  # one collect of every contact, not a receive per peer
        assert max(res[kind]["kv_calls"] for res in four) <= max(res[kind]["kv_calls"] for res in two) + 8, (two, four)
    # load_and_broadcast: each process connects to the one reader of the replicated piece, whatever P
    assert max(res["shared"]["opened"] for res in four) <= max(res["shared"]["opened"] for res in two), (two, four)
    # The tier: at most 1 connection per range server (3 leaves: 2 ranges at P=2, 3 at P=4) and 2 per
    # holder read from; within cluster.fanout(P) processes a merger still reads its range's rows from every holder.
    for res in four:
        assert res["tier"]["opened"] <= (4 - 1) + 2 * (4 - 1), res
    # Onto numpy targets too big for the collective (the relay's path) every process needs every piece,
    # each read by one of at most cluster.fanout(P) readers: 2 connections to each other reader, all made
    # before the reads, and the KV calls of one collect of contacts whatever P; the bytes arrive bit for bit.
    for count, results in ((2, two), (4, four)):
        assert all(
            res["shared_host_mismatches"] == [] and res["shared_host"]["opened"] <= 2 * (count - 1) for res in results
        ), results
    assert all(res["shared_host"]["opened"] > 0 for res in two + four), (two, four)  # the relay did serve
    most = max(res["shared_host"]["kv_calls"] for res in two)
    assert max(res["shared_host"]["kv_calls"] for res in four) <= most + 8, (two, four)


def _fanout_counts(tmp_path, processes: int, fanout: int | None) -> list[dict]:
    return _counts(tmp_path, "fanout_counts", processes, "" if fanout is None else str(fanout), devices_per_process=2)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_beyond_the_fanout_each_process_talks_to_its_group_and_a_few_more(tmp_path):
    """K = 3 at 4 processes, and the default K = cluster.fanout(8) = 4 at 8: beyond K, the tier's
    merge goes through gatherers and relayers (tiers/_merge_tree.py) and load_and_broadcast's
    pieces reach each group of K through one relayer (restoring/_shared_reads.py), bit for bit.
    Flat at 8, a range server would open 2 connections to each of 7 holders and 1 to each of 7
    other servers (21) and accept as many, and a reader of pieces everyone needs would accept 2
    from each of 7 needers (14); through the trees each process stays within 4K."""
    assert cluster.fanout(8) == 4  # at the default, 8 processes are beyond K: 2 groups
    four, eight = _fanout_counts(tmp_path / "four", 4, 3), _fanout_counts(tmp_path / "eight", 8, None)
    print({"P=4": four, "P=8": eight})
    for kind in ("tier", "shared_host"):
        for count in ("opened", "accepted"):
            assert max(res[kind][count] for res in four) <= 4 * 3, (kind, count, four)
            assert max(res[kind][count] for res in eight) <= 4 * cluster.fanout(8), (kind, count, eight)
    assert any(res["shared_host"]["accepted"] > 0 for res in eight), eight  # the relay tree did serve


@pytest.mark.multiprocess
def test_a_fanout_of_one_restores_bit_exactly_through_both_trees(tmp_path):
    """K = 1, 2 processes: every process is its own group, so each range's rows come through a
    gatherer, its manifest through a relayer, and each replicated piece through the other
    process's relayer (itself)."""
    for res in _fanout_counts(tmp_path, 2, 1):
        assert res["tier"]["opened"] <= 4 and res["shared_host"]["opened"] <= 2, res


def test_the_readers_are_capped_whatever_the_job():
    chosen = cluster.spread(list(range(1536)), cluster.fanout(1536))
    assert len(chosen) == 64 and chosen[:2] == [0, 24] and chosen[-1] == 1536 - 1536 // 64
    assert cluster.spread([3, 5], 4) == [3, 5]

