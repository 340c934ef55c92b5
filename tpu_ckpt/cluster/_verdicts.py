"""One question put to every process of a job, one answer for all: each brings what it
sees, one process judges, and every process gets the same verdict. The proofs of what the
processes see of a path (a directory every process shares, a local directory that is each
process's own) are such questions, asked once per path: ``Proved`` remembers the answers."""

from __future__ import annotations

import threading
from collections.abc import Callable

from tpu_ckpt.cluster._coordinator import Coordinator


def agreed_verdict(
    coord: Coordinator, stage: str, view: str, judge: Callable[[dict[int, str]], str], leader: int = 0
) -> str:
    """``judge`` (on ``leader``) of every process's ``view`` at ``stage``, on every process; ''
    when all is well. The others hear it from the leader, so a process that arrives after the
    leader gave up waiting still hears why, rather than judging alone."""
    views = coord.collect(stage, view, at=leader)
    if coord.me != leader:
        return coord.receive(f"{stage}-verdict", leader)
    verdict = judge(views)
    coord.publish(f"{stage}-verdict", verdict)
    return verdict


class Proved:
    """The paths this process proved something of: a proof costs a coordination round, and
    what a directory is does not change while the job runs."""

    def __init__(self) -> None:
        self._paths: set[str] = set()
        self._lock = threading.Lock()

    def __contains__(self, path: object) -> bool:
        with self._lock:
            return path in self._paths

    def add(self, path: str) -> None:
        with self._lock:
            self._paths.add(path)
