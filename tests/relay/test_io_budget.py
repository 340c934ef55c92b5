"""io_device at scale (#37 item 5): a save or restore whose bytes the io process would not move
within coordination_timeout, or not fit on its disk, is warned of once, with the numbers and the
alternative; in one process (the estimate) and in two real ones (a relayed save and restore)."""

import logging

import pytest

from tests.support import process_group
from tpu_ckpt.relay import _io_budget as io_budget
from tpu_ckpt.settings import Settings, configure

GB = 10**9


@pytest.fixture
def fresh(monkeypatch, caplog):
    """No rate measured and no warning given yet in this process; the settings' default rate."""
    monkeypatch.setattr(io_budget, "_measured", [])
    monkeypatch.setattr(io_budget, "_warned", [])
    previous = configure(Settings())
    caplog.set_level(logging.WARNING, logger="tpu_ckpt")
    yield caplog
    configure(previous)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == io_budget.__name__]


def test_a_job_within_the_timeout_is_not_warned_of(fresh):
    # 200 GB at the configured 1 GB/s: 200 s, within the default 300 s
    assert io_budget.warn_if_beyond("save", "/ckpt/7", 200 * GB, 300.0) is None
    assert _warnings(fresh) == []


def test_a_job_beyond_the_timeout_is_warned_of_once_with_its_numbers(fresh):
    text = io_budget.warn_if_beyond("save", "/ckpt/7", 1100 * GB, 300.0)
    assert _warnings(fresh) == [text]
    for part in ("save /ckpt/7", "1,100.0 GB", "~1,100 s at 1,000 MB/s", "Settings.io_device_bytes_per_second",
                 "coordination_timeout=300s", "Leave io_device unset", "every process reads and writes its own share"):
        assert part in text, (part, text)
    # the next operation beyond it says the same: not logged again
    assert "restore /ckpt/8" in io_budget.warn_if_beyond("restore", "/ckpt/8", 2000 * GB, 300.0)
    assert _warnings(fresh) == [text]


def test_a_measured_rate_replaces_the_configured_one(fresh):
    io_budget.note_rate(10 * GB, 100.0)  # 100 MB/s measured
    text = io_budget.warn_if_beyond("restore", "gs://b/ckpt", 40 * GB, 300.0)
    assert text is not None and "~400 s at 100 MB/s (measured over this process's last io_device operation)" in text
    io_budget.note_rate(1 << 20, 0.001)  # too few bytes to be a rate: the last one stands
    assert io_budget._rate()[0] == pytest.approx(1e8)


def test_a_save_beyond_the_io_process_disk_is_warned_of(fresh, tmp_path):
    text = io_budget.warn_if_beyond("save", str(tmp_path / "ckpt"), 10**18, 10.0**12, local_dir=str(tmp_path))
    assert text is not None and f"GB free in {tmp_path}" in text and "beyond coordination_timeout" not in text
    assert io_budget.warn_if_beyond("save", "x", 1, 10.0**12, local_dir=str(tmp_path / "absent")) is None


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_relayed_save_and_restore_beyond_the_timeout_warn_once_on_the_io_process(tmp_path):
    results = process_group.run("relay.io_budget_scenarios.slow_io_device", 2, str(tmp_path), "1")
    assert all(r.returncode == 0 and r.result is not None for r in results), [r.output[-3000:] for r in results]
    io, other = results[1].result, results[0].result
    assert other["warnings"] == [] and other["mismatches"] == []
    assert io["mismatches"] == [] and len(io["warnings"]) == 1, io
    (text,) = io["warnings"]
    assert text.startswith("tpu_ckpt: save ") and "coordination_timeout=60s" in text and "Leave io_device unset" in text
    assert f"{io['job_bytes'] / 1e9:,.1f} GB" in text
