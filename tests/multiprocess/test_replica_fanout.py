"""load_and_broadcast's data path over an XLA collective (issue 37 item 1), with real processes:
each process reads about 1/R of the bytes it restores, the restore is bit-exact, no relay
connection is opened where the replica axis is clean, and a process that never reaches the
collective is named by the barrier before it."""

import pytest

from tests.support import process_group
from tests.support.process_group import results_of

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.mark.parametrize("processes", [2, 4])
def test_each_replica_reads_its_part_and_the_collective_completes_them(tmp_path, processes):
    results = results_of(process_group.run("multiprocess.fanout_scenarios.replica_fanout", processes, str(tmp_path),
                                    devices_per_process=2))
    for r in results:
        assert r["plain_mismatches"] == r["shared_mismatches"] == r["mixed_mismatches"] == [], r
        # Every process holds the whole state (R = processes replicas): it reads 1/R of it.
        assert 0 < r["shared_read"] <= 1.1 * r["plain_read"] / processes, (r["shared_read"], r["plain_read"])
        assert r["shared_counts"]["opened"] == r["shared_counts"]["accepted"] == 0, r["shared_counts"]
    print("data bytes read per process, plain / load_and_broadcast:",
          [(r["plain_read"], r["shared_read"]) for r in results])


def test_a_corrupt_piece_and_a_process_that_never_reaches_the_collective_are_named(tmp_path):
    timeout = 3
    results = results_of(process_group.run("multiprocess.fanout_scenarios.fanout_failures", 2, str(tmp_path),
                                    str(timeout), devices_per_process=2))
    # The reader of the flipped piece names it; the other hears of it before any collective.
    kinds = sorted(r["corrupt"]["type"] for r in results)
    assert kinds == ["CorruptCheckpointError", "RemoteProcessError"], results
    assert all("'w'" in r["corrupt"]["message"] for r in results), results
    waiting = [r for r in results if not r["stalled"]]
    for r in waiting:
        assert r["error"]["type"] == "CoordinationTimeoutError", r
        assert r["error"]["missing"] == [1] and "'fan-out 0'" in r["error"]["message"], r
        assert r["seconds"] < 4 * timeout, r
    (stalled,) = [r for r in results if r["stalled"]]
    assert stalled["error"] is not None  # it hears of the others' verdict, not left in a collective


@pytest.mark.parametrize("processes", [2, 4])
def test_small_host_targets_travel_packed_in_the_collective(tmp_path, processes):
    """Numpy and Python targets every process wants whole (a step, a loss, a data iterator's
    arrays): each process reads a part, the collective brings the rest, no relay connection;
    a host leaf bigger than a device's part of the read batch, or of a dtype JAX cannot carry,
    still comes through the relay. All bit for bit, -0.0 and NaN payloads included."""
    results = results_of(process_group.run("multiprocess.fanout_scenarios.host_targets", processes, str(tmp_path),
                                    devices_per_process=2))
    for r in results:
        assert r["small_mismatches"] == r["everything_mismatches"] == [], r
        assert r["small_counts"]["opened"] == r["small_counts"]["accepted"] == 0, r["small_counts"]
        assert r["everything_counts"]["opened"] > 0, r["everything_counts"]
    # Each process reads a part of the small leaves, and the job about each byte once (reads of
    # neighbouring pieces are coalesced, so a few bytes between them too), not once per process.
    assert sum(r["small_read"] for r in results) <= 1.25 * results[0]["small_bytes"], results
    assert all(0 < r["small_read"] < r["small_bytes"] for r in results), results
