"""A dead writer's staging area is garbage at once on its own host (issue #38, item 5): a
staging marker records host (hostname, boot id, PID namespace), process id and start time;
``tpu-ckpt gc`` and a CheckpointManager's next save remove a leftover whose writer is
provably gone, and keep the grace period for any other (another host, a live process, a
marker without those fields). ``tpu-ckpt gc --grace SECONDS`` shortens the grace period."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.manager.test_deleters_race import run_url  # noqa: F401 - the fixture: local, gs, s3
from tpu_ckpt import catalog, cli, storage
from tpu_ckpt.format import STAGING_MARKER

# A process that starts a save's staging area of step_3 (its marker, as a save writes it), then exits.
STAGE = """
import sys
from tpu_ckpt import storage
run = storage.location(sys.argv[1])
final = storage.Location(run.child("step_3"))
staging = storage.Location(run.child("step_3.tmp-abc")) if final.is_local else final
storage.open_staging(staging, final, "abc").close()
"""


def staged_by_a_dead_process(url: str) -> str:
    subprocess.run([sys.executable, "-c", STAGE, url], check=True, timeout=120)
    return "step_3.tmp-abc" if storage.location(url).is_local else "step_3"


def marker_of(url: str, name: str) -> tuple[storage.Location, str]:
    where = storage.Location(storage.location(url).child(name))
    with storage.Store(where, threads=1) as store:
        return where, storage.markers(store.list())[0]


def rewrite_marker(url: str, name: str, **fields) -> None:
    where, marker = marker_of(url, name)
    with storage.Store(where, threads=1) as store:
        doc = json.loads(store.read_file(marker))
        doc.update(fields)
        for key in [k for k, v in fields.items() if v is None]:
            del doc[key]
        store.write(marker, [json.dumps(doc).encode()]).result()


def leftovers(url: str) -> list[str]:
    return [e.name for e in catalog.scan(url) if not e.committed]


def test_a_marker_records_its_writer(tmp_path):
    name = staged_by_a_dead_process(str(tmp_path))
    doc = json.loads((tmp_path / name / STAGING_MARKER).read_text())
    assert doc["host"]["name"] == os.uname().nodename
    assert doc["host"]["boot_id"] == open("/proc/sys/kernel/random/boot_id").read().strip()
    assert isinstance(doc["pid"], int) and doc["pid"] != os.getpid() and isinstance(doc["pid_start"], int)


def test_gc_removes_a_dead_writers_leftover_at_once(run_url, capsys):  # noqa: F811
    name = staged_by_a_dead_process(run_url)
    assert leftovers(run_url) == [name]
    assert cli.main(["gc", run_url]) == 0
    assert f"removed {name}" in capsys.readouterr().out
    assert leftovers(run_url) == []


@pytest.mark.parametrize("change", ["another_host", "old_marker", "live_process"])
def test_gc_keeps_a_leftover_whose_writer_may_live(run_url, change, capsys):  # noqa: F811
    name = staged_by_a_dead_process(run_url)
    if change == "another_host":
        rewrite_marker(run_url, name, host={"name": "elsewhere", "boot_id": "b", "pid_ns": "pid:[1]"})
    elif change == "old_marker":  # written before markers recorded their writer
        rewrite_marker(run_url, name, host=None, pid=None, pid_start=None)
    else:  # this very process, as it started
        started = int(open(f"/proc/{os.getpid()}/stat").read().rpartition(")")[2].split()[19])
        rewrite_marker(run_url, name, pid=os.getpid(), pid_start=started)
    assert cli.main(["gc", run_url]) == 0
    assert f"kept {name} (a save that may still be running" in capsys.readouterr().out
    assert leftovers(run_url) == [name]


def test_a_reused_process_id_is_a_dead_writer(tmp_path, capsys):
    name = staged_by_a_dead_process(str(tmp_path))
    rewrite_marker(str(tmp_path), name, pid=os.getpid(), pid_start=1)  # this process's id, another start
    assert cli.main(["gc", str(tmp_path)]) == 0
    assert leftovers(str(tmp_path)) == []


def test_gc_grace_shortens_the_grace_period_of_another_hosts_save(run_url, capsys):  # noqa: F811
    name = staged_by_a_dead_process(run_url)
    rewrite_marker(
        run_url, name, host={"name": "elsewhere", "boot_id": "b", "pid_ns": "pid:[1]"}, started=time.time() - 100
    )
    assert cli.main(["gc", "--grace", "600", run_url]) == 0
    assert leftovers(run_url) == [name]
    assert cli.main(["gc", "--grace", "60", "--dry-run", run_url]) == 0
    assert f"would remove {name}" in capsys.readouterr().out and leftovers(run_url) == [name]
    assert cli.main(["gc", "--grace", "60", run_url]) == 0
    assert leftovers(run_url) == []
    for wrong in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            cli.main(["gc", "--grace", wrong, run_url])
        assert "--grace takes a number of seconds" in capsys.readouterr().err


def test_a_managers_next_save_removes_a_dead_writers_leftover(run_url):  # noqa: F811
    name = staged_by_a_dead_process(run_url)
    with tc.CheckpointManager(run_url, max_to_keep=None) as manager:
        manager.save(4, {"w": np.arange(8, dtype=np.float32)})
        assert leftovers(run_url) == []
        manager.save(3, {"w": np.zeros(8, dtype=np.float32)}, force=True)  # the dead save's step, saved again
        assert manager.all_steps() == [3, 4]
    assert leftovers(run_url) == [] and name not in catalog.list_run(storage.location(run_url)).leftovers
