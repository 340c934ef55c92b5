"""A leader that works longer than coordination_timeout is waited for while it reports
progress; one that stops reporting is a timeout naming what it was last doing."""

import pytest

from tests.support import process_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _results(*args: str) -> list[dict]:
    runs = process_group.run("cluster.cluster_scenarios.busy_leader", 3, *args, devices_per_process=1, timeout=120)
    assert all(r.returncode == 0 and r.result is not None for r in runs), [r.output for r in runs]
    return [r.result for r in runs]


def test_a_leader_working_three_timeouts_long_is_waited_for_while_it_reports_progress():
    leader, *waiters = _results("8", "0")
    assert leader["error"] is None
    for waiter in waiters:
        assert waiter["error"] is None, waiter
        assert waiter["waited"] > 5  # twice the 2.5 s timeout: it waited on


def test_a_leader_that_stops_reporting_is_a_timeout_saying_what_it_was_doing():
    leader, *waiters = _results("2", "12")
    for waiter in waiters:
        assert waiter["error"] == "CoordinationTimeoutError", waiter
        assert "processes [0] did not reach stage 'committed'" in waiter["message"]
        assert "it was last merging indexes (2 of 2)" in waiter["message"]
        assert waiter["waited"] < 11  # gave up within two timeouts of the last progress, not at the leader's end
