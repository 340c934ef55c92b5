"""What ties a local step's files to its save, so that no restore mixes two saves.

A local step's ``tier.json`` names its save (``token``, the same on every host) and, since
parts were tied to their save, the ``step`` and the crc32c of this host's ``plan.json`` and of
each part's index as this host committed them (``parts``; :func:`record`). A part's data files
are tied through its index, which holds the crc32c of every piece. So a part, an index or a
plan of another save (a disk image restored, a hand copy, a step directory renamed) is never
taken for this save's:

- when listing (:func:`others`, each host for the steps it holds): a plan or an index that is
  not the one ``tier.json`` records (of another save, damaged, missing, unreadable) marks
  that part, or for the plan or the step every part, apart in what the host reports, with a
  warning naming the file; the restore then takes the part from another holder, or another
  step, and only when no step is left does it take such a part: the restore then fails
  naming the file (and falls back, or raises);
- when restoring (:func:`check_step`, each holder): ``tier.json`` against the agreed token and
  the step, and the plan and each index read against ``tier.json`` again.

Each check costs the crc32c of files the host holds (its plan, its parts' indexes: O(its own
pieces)), with no decoding and no data file read. A step saved before parts were
tied (its ``tier.json`` without ``plan``) is checked by its token and count, as then.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tpu_ckpt import storage
from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError
from tpu_ckpt.format import PLAN_FILE, TIER_FILE, crc32c, staged_index_file, written_by

logger = logging.getLogger(__name__)

_warned: set[str] = set()  # files of another save this process has warned of (once each)


def record(staging: str, step: int) -> dict[str, Any]:
    """What ``tier.json`` records of the staged step at ``staging``: the step, and the crc32c
    of its plan and of each part's index."""
    parts = {str(owner): _crc(staging, n) for n in os.listdir(staging)
             if (owner := written_by(n)) is not None and n == staged_index_file(owner)}
    return {"step": step, "plan": _crc(staging, PLAN_FILE), "parts": parts}


def _crc(root: str, name: str) -> int:
    data = storage.read_whole(root, name)
    if data is None:
        raise CheckpointError(f"{os.path.join(root, name)} vanished before the local step was committed", file=root)
    return crc32c(data)


def others(path: str, step: int, info: dict[str, Any], owners: set[int]) -> set[int]:
    """The parts of ``owners`` the step at ``path`` does not hold as its save wrote them
    (``info``: its ``tier.json``): those whose index is not the one recorded (damaged, or of
    another save), and all of them when its plan or its step is not."""
    if "plan" not in info:
        return set()  # saved before parts were tied: nothing recorded to check against
    if info.get("step") != step:
        _warn(os.path.join(path, TIER_FILE), f"names step {info.get('step')!r}, not {step}")
        return owners
    plan = _readable(path, PLAN_FILE)
    if plan is None or crc32c(plan) != info["plan"]:
        _warn(os.path.join(path, PLAN_FILE), "is not the one its tier.json records")
        return owners
    parts = info.get("parts")
    recorded = parts if isinstance(parts, dict) else {}
    return {owner for owner in owners if not _as_recorded(path, staged_index_file(owner), recorded.get(str(owner)))}


def _as_recorded(path: str, name: str, crc: Any) -> bool:
    data = _readable(path, name)
    if data is not None and crc32c(data) == crc:
        return True
    _warn(os.path.join(path, name), "is not the one its tier.json records")
    return False


def _readable(path: str, name: str) -> bytes | None:
    try:
        return storage.read_whole(path, name)
    except (OSError, CheckpointError):
        return None  # missing, or no regular file of ours: the restore reads it again, and names what is wrong


def _warn(where: str, problem: str) -> None:
    if where not in _warned:
        _warned.add(where)
        logger.warning(
            "tpu_ckpt: %s %s (it is damaged, or of another save): this host's part of the local step is "
            "taken only if no other holder's, and no other step, can be restored", where, problem,
        )


def check_step(path: str, step: int, token: str | None, plan: bytes) -> dict[str, Any] | None:
    """Checks, on a holder about to serve the local step at ``path``, that its ``tier.json``
    is of step ``step`` and the save ``token`` (None: any) and that ``plan`` is the plan it
    records; returns its crc32c of each part's index (None for a step saved before parts
    were tied). Raises :class:`CorruptCheckpointError` naming the file otherwise."""
    where = os.path.join(path, TIER_FILE)
    info = storage.read_json(path, TIER_FILE, 1 << 16)
    if not isinstance(info, dict) or (token is not None and info.get("token") != token):
        raise CorruptCheckpointError(f"{where} is not of the save being restored (token {token})", file=where)
    if "plan" not in info:
        return None
    if info.get("step") != step:
        raise CorruptCheckpointError(f"{where} is of step {info.get('step')!r}, not of {step}", file=where)
    if crc32c(plan) != info["plan"]:
        raise _another_save(os.path.join(path, PLAN_FILE), path, step)
    parts = info.get("parts")
    return parts if isinstance(parts, dict) else {}


def check_index(path: str, data: bytes, owner: int, parts: dict[str, Any] | None, step: int) -> None:
    """Checks the index of ``owner``'s part of the local step at ``path`` (``data``) against
    the crc32c its ``tier.json`` records (:func:`check_step`; None: nothing recorded)."""
    if parts is not None and crc32c(data) != parts.get(str(owner)):
        raise _another_save(os.path.join(path, staged_index_file(owner)), path, step)


def _another_save(where: str, path: str, step: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where} is not of one save with its local step {step}'s tier.json, which records another crc32c of "
        "it: the file is damaged or of another save. Remove that step_<n> on this host.",
        file=path,
    )
