"""What every process does when a local-tier restore failed somewhere: the same thing.

A tier restore can fail in many ways (a coordination timeout, a relay connection cut, a
holder gone mid-restore, a missing, damaged or inconsistent part, a failure on another
process of any type), and not on every process alike: one process may have its tree while
another timed out. So after every tier restore, failed or not, the processes hold one more
coordination round, a fresh operation (the restore's own may be what broke): each brings
its outcome, process 0 tells everyone the verdict. Any failure → every process restores
the newest persistent step not newer than the chosen local one, which each works out alone
from what all share (the persistent steps, agreed by the manager's listing, and the step
asked for), so no further round can split them; with no such step, each raises.

The manager holds the same round after a persistent restore with ``fallback`` (``agree``,
``manager/_intact.py``): a step whose data one process found damaged is skipped by all.

If the round itself fails on a process, that process reports the failure (waking the
others' waits, so they fall back too) and falls back: the verdict is "restored" only when
process 0 saw every process restore, and a process that then cannot read it means the
coordination service itself is failing, when the job cannot go on either way.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable
from typing import Any

from tpu_ckpt import cluster
from tpu_ckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidShardsError,
    ProcessCountMismatchError,
    RemoteProcessError,
    TargetMismatchError,
)

logger = logging.getLogger(__name__)

# The caller's mistake (the target's, or a per-process leaf without reshard): no other tier helps.
_CALLERS = (TargetMismatchError, InvalidShardsError, ProcessCountMismatchError, TypeError)
_CALLER_TYPES = {t.__name__ for t in _CALLERS}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The processes' common outcome: ``cause`` is None when every process restored;
    ``fall_back`` whether the cause is one another tier may get round; ``damaged`` whether a
    process found a local file damaged or of another save (a ``CorruptCheckpointError``)."""

    cause: str | None
    fall_back: bool = True
    damaged: bool = False


def recoverable(error: BaseException) -> bool:
    """Whether the persistent tier may serve where the local one failed with ``error``."""
    if isinstance(error, _CALLERS):
        return False
    if isinstance(error, RemoteProcessError):
        return error.remote_type not in _CALLER_TYPES
    return isinstance(error, (CheckpointError, OSError, ValueError))


def agree(root: str, failure: BaseException | None, timeout: float) -> Verdict:
    """The verdict on the tier restore from ``root`` (collective): ``failure`` is this
    process's own error, None if it restored."""
    mine: dict[str, Any] = {"cause": None} if failure is None else {
        "cause": f"{type(failure).__name__}: {failure}", "fall_back": recoverable(failure),
        "damaged": isinstance(failure, CorruptCheckpointError),
    }
    with cluster.Coordinator(f"agree on the restore from {root}", timeout) as coord:
        try:
            reports = coord.collect("outcome", json.dumps(mine), at=0)
            if coord.me == 0:
                verdict = _verdict({p: json.loads(text) for p, text in reports.items()})
                coord.publish("verdict", json.dumps(dataclasses.asdict(verdict)))
                return verdict
            return Verdict(**json.loads(coord.receive("verdict", 0)))
        except Exception as error:  # noqa: BLE001 - any failure of the round: fall back, and say so
            coord.report_failure(error)
            cause = mine["cause"] or f"the agreement on the outcome failed ({type(error).__name__}: {error})"
            return Verdict(cause, bool(mine.get("fall_back", True)), bool(mine.get("damaged")))


def _verdict(reports: dict[int, dict[str, Any]]) -> Verdict:
    """Process 0's verdict: the first cause that is not merely another process's report
    (``RemoteProcessError``), naming its process; a caller's mistake anywhere wins."""
    failed = {p: r for p, r in sorted(reports.items()) if r["cause"] is not None}
    if not failed:
        return Verdict(None)
    fall_back = all(r.get("fall_back", True) for r in failed.values())
    own = [p for p, r in failed.items() if not r["cause"].startswith(RemoteProcessError.__name__)]
    first = own[0] if own else min(failed)
    damaged = any(r.get("damaged", False) for r in failed.values())
    return Verdict(f"process {first}: {failed[first]['cause']}", fall_back, damaged)


def persistent_step(persistent: Iterable[int], step: int | None) -> int | None:
    """The persistent step to restore instead: ``step`` if it is persistent, else (None)
    the newest. A local step is chosen only when no persistent step is newer, so this is
    never newer than it, and every process gets it without knowing the local choice."""
    steps = set(persistent)
    if step is not None:
        return step if step in steps else None
    return max(steps, default=None)


def fall_back(
    root: str, local: int | None, verdict: Verdict, own: BaseException | None, persistent: Iterable[int],
    step: int | None,
) -> int:
    """The persistent step every process restores after ``verdict``'s failure, with a
    warning naming it; raises when there is none (or no other tier can help): this
    process's own error, or one naming the process that failed."""
    what = (
        f"the restore from the local tier {root}" if local is None
        else f"the restore of the local step {local} from {root}"
    )
    target = persistent_step(persistent, step) if verdict.fall_back else None
    if target is None:
        if own is not None:
            raise own
        remedy = (
            "the persistent directory has no step to fall back to" if verdict.fall_back else "no other tier can help"
        )
        raise RemoteProcessError(f"{what[0].upper()}{what[1:]} failed ({verdict.cause}), and {remedy}.")
    logger.warning(
        "tpu_ckpt: %s failed (%s); every process restores the persistent step %d instead", what, verdict.cause, target,
    )
    return target
