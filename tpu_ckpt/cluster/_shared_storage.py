"""Proof that the processes of a job see the same local directory, before relying on it.

A local path is one directory for the whole job only on a shared file system; on a pod each
host's disk is its own. A multi-process save there would write part of the checkpoint on
every host and then fail obscurely (the leader finds no other process's index), and a
restore would find the checkpoint on some hosts only. So processes about to depend on
sharing first prove it: each looks (a stat) for a path that one of them made or found, and
one value per process says what it saw; if anyone is blind, every process raises the same
error, naming one blind process and the ways out, before any data is written.

A save's leader proves each directory once per process lifetime (``unproved``), so a
training loop pays one round for its first save into a directory, not one per save. The
leader alone decides, and tells the others with the staging name, so all take part or none.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TypeVar

from tpu_ckpt import storage
from tpu_ckpt.cluster import _coordinator as distributed
from tpu_ckpt.cluster._verdicts import Proved, agreed_verdict
from tpu_ckpt.errors import CheckpointError, CheckpointNotFoundError

_STAGE, _VERDICT = "shared", "shared-verdict"
_SEEN, _UNSEEN = "seen", "unseen"
T = TypeVar("T")
_proved = Proved()  # parent directories (on the leader) whose sharing a save proved

WAYS_OUT = (
    "Use storage that every process shares: a gs:// or s3:// URL, or a shared file system "
    "(NFS, Filestore, gcsfuse) mounted at the same path on every host; or keep the local path "
    "and set CheckpointOptions(io_device=...) so that one process does all the storage I/O."
)


def unproved(final: storage.Location, count: int) -> bool:
    """Whether a save's leader must still prove that every process sees ``final``'s directory."""
    return final.is_local and count > 1 and _parent(final) not in _proved


def prove_staging(
    coord: distributed.Coordinator, final: storage.Location, staging: storage.Location, leader: int
) -> None:
    """Every process of a save, after the leader created ``staging`` and before anyone
    writes: raises on every process if one cannot see it.

    The leader alone gathers what everyone saw and publishes the verdict: a process that
    arrives after the leader gave up waiting (and removed ``staging``) then hears why,
    rather than concluding that it cannot see the directory."""
    def judge(views: dict[int, str]) -> str:
        blind = sorted(process for process, view in views.items() if view != _SEEN)
        return "" if not blind else (
            f"save {final.url}: {_who(blind[0], len(blind), coord.count)} cannot see the staging directory "
            f"{staging.url} that process {leader} created: this path is not one directory shared by "
            f"every process (on a pod each host's local disk is its own). Nothing was written. {WAYS_OUT}"
        )

    verdict = agreed_verdict(coord, _STAGE, _SEEN if os.path.isdir(staging.local_path) else _UNSEEN, judge, leader)
    if verdict:
        raise CheckpointError(verdict, file=final.url)
    if coord.me == leader:
        _proved.add(_parent(final))


def read_manifest_everywhere(
    coord: distributed.Coordinator, loc: storage.Location, read: Callable[[storage.Location], T]
) -> T:
    """Every process of a coordinated restore reading the manifest itself (``read``: opening
    the checkpoint): on a local path,
    if some processes find the checkpoint and others do not (which a missing checkpoint
    alone cannot cause), every process raises the same error naming one that does not.
    Process 0 counts the views and tells everyone one blind process, one seeing process
    and how many are blind: O(1) for each process."""
    if not loc.is_local:
        return read(loc)
    found: T | CheckpointNotFoundError
    try:
        found = read(loc)
    except CheckpointNotFoundError as error:
        found = error
    views = coord.collect(_STAGE, _UNSEEN if isinstance(found, CheckpointNotFoundError) else _SEEN, at=0)
    if coord.me == 0:
        blind = sorted(process for process, view in views.items() if view != _SEEN)
        seers = sorted(set(views) - set(blind))
        coord.publish(_VERDICT, json.dumps([len(blind), blind[:1], seers[:1]]))
        blind_count, first_blind, first_seer = len(blind), blind[:1], seers[:1]
    else:
        blind_count, first_blind, first_seer = json.loads(coord.receive(_VERDICT, 0))
    if first_blind and first_seer:
        raise CheckpointError(
            f"restore {loc.url}: {_who(first_blind[0], blind_count, coord.count)} cannot see the checkpoint that "
            f"process {first_seer[0]} reads there: this path is not one directory shared by every process (on a "
            f"pod each host's local disk is its own). {WAYS_OUT}",
            file=loc.url,
        )
    if isinstance(found, CheckpointNotFoundError):
        raise found
    return found


def _who(first: int, blind: int, count: int) -> str:
    if blind == 1:
        return f"process {first}"
    return f"process {first} (and {blind - 1} more of the {count} processes)"


def _parent(loc: storage.Location) -> str:
    return os.path.dirname(os.path.abspath(loc.local_path.rstrip("/")))
