"""Every coordinator wait has an overall deadline, MAX_WAIT_TIMEOUTS x coordination_timeout,
however long the process it waits on goes on reporting progress (issue #39): before, a
sender's changing progress notes extended a wait without bound."""

import pytest

from tests.support import process_group
from tpu_ckpt.cluster._coordinator import MAX_WAIT_TIMEOUTS

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_a_leader_reporting_progress_past_the_deadline_is_a_timeout_saying_so():
    timeout = 1.5  # the leader reports progress each 0.6 s, for 5 beats longer than the waiter's deadline
    steps = int(MAX_WAIT_TIMEOUTS * 2.5) + 5
    runs = process_group.run(
        "cluster.cluster_scenarios.busy_leader", 2, str(steps), "0", str(timeout), devices_per_process=1, timeout=180
    )
    assert all(r.returncode == 0 and r.result is not None for r in runs), [r.output for r in runs]
    leader, waiter = (r.result for r in runs)
    assert leader["error"] is None
    assert waiter["error"] == "CoordinationTimeoutError", waiter
    assert MAX_WAIT_TIMEOUTS * timeout <= waiter["waited"] < (MAX_WAIT_TIMEOUTS + 2) * timeout, waiter
    assert "processes [0] did not reach stage 'committed'" in waiter["message"]
    assert "it was last merging indexes (" in waiter["message"]
    assert f"no wait lasts more than {MAX_WAIT_TIMEOUTS} x coordination_timeout, progress or not" in waiter["message"]
