"""Tier restores that fail part-way, run by every process (see tests/support/process_group.py): each
ends, on every process, in the newest persistent step, with a warning naming the failure.

Local steps 1-3 on 4 processes, step 1 also persistent (save_interval_steps=4); then the
restore of local step 3 fails on one process in one of these ways (``case``):

- ``timeout``: process 2 stalls past coordination_timeout in the middle of its restore, so the
  others time out waiting for it (a ``CoordinationTimeoutError``), and it hears of it late;
- ``holder``: process 3, which serves its own part, vanishes from the network after its first
  answer (its relay server closes: a host gone mid-restore, as its peers see it);
- ``error``: process 1 fails with an error of no checkpoint type (an ``OSError``), which the
  others learn of as a ``RemoteProcessError``.
"""

from __future__ import annotations

import logging
import threading
import time

import jax

import tpu_ckpt as tc
from tests.support.mp_scenarios import GLOBAL, _job_mesh, _mismatches, _reversed_mesh, _targets
from tests.tiers.tier_scenarios import _enter_host, _manager, _state
from tpu_ckpt import relay
from tpu_ckpt.tiers import _restore as tier_restore

TIMEOUT = 6.0  # the restore's coordination_timeout (the saves keep 30 s)
_ORIGINAL = tier_restore.restore_from
_SERVER = relay.RelayServer


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _VanishingServer(relay.RelayServer):
    """A relay server whose host is gone after its first answer: every connection and the
    listener close (from another thread: ``close`` joins the handlers)."""

    def _serve_one(self, conn):  # type: ignore[no-untyped-def]
        super()._serve_one(conn)
        threading.Thread(target=self.close, daemon=True).start()
        return False


def _fail_on(me: int, case: str) -> None:
    """Makes this process fail its part of the tier restore as ``case`` says (``_undo`` ends it)."""
    original = _ORIGINAL
    if case == "timeout" and me == 2:
        def stalled(*args, **kwargs):
            time.sleep(TIMEOUT * 1.5)
            return original(*args, **kwargs)
        tier_restore.restore_from = stalled
    elif case == "holder" and me == 3:
        relay.RelayServer = _VanishingServer  # every relay this process serves from now on: the host is gone
    elif case == "error" and me == 1:
        def broken(*args, **kwargs):
            raise OSError("the disk went away")
        tier_restore.restore_from = broken


def _undo() -> None:
    relay.RelayServer, tier_restore.restore_from = _SERVER, _ORIGINAL


def restore_fails(directory: str, case: str) -> dict:
    me = jax.process_index()
    persistent = _enter_host(directory)
    with _manager(persistent, enable_async=False, every=4) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    warnings = _Warnings()
    logging.getLogger("tpu_ckpt").addHandler(warnings)
    _fail_on(me, case)
    options = tc.CheckpointOptions(coordination_timeout=TIMEOUT)
    with _manager(persistent, enable_async=False, every=4) as manager:
        restored = manager.restore(None, _targets(_state(0), _reversed_mesh()), options=options)
        _undo()
        again = manager.restore(None, _targets(_state(0), _job_mesh()))  # the job goes on: nothing left behind
    fell_back = [m for m in warnings.messages if "restores the persistent step" in m]
    return {"step": int(restored["step"]), "mismatches": _mismatches(restored, {"w": GLOBAL + 1, "step": 1}),
            "warnings": fell_back,
            "again": int(again["step"]), "again_mismatches": _mismatches(again, {"w": GLOBAL + 3, "step": 3})}
