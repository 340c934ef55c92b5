"""Which committed steps a CheckpointManager names and restores: those whose manifest is intact,
and, with ``fallback``, whose data restores.

A ``step_<n>`` with a manifest is committed, but that manifest can still be unusable: damaged
(it fails its seal, its crc32c), of a format this tpu_ckpt does not read, or a stray step put
there by other means that is no checkpoint of ours. ``restore()`` of the newest step would fail
on it, ``latest_step()`` would name a step no restore returns, and retention, keeping it as the
newest, would let the intact steps below it go. So the leader reads the newest step's manifest
(``catalog.read_manifest``: one read, its seal and fields checked, no piece table read) and,
while that one fails, the next older one's, and tells the others (collective): the damaged
steps above the newest intact one. An intact verdict is kept while the step stays listed, so
a manager reads each manifest once; a damaged one is read again at each call (it may be
replaced). Damaged steps below the newest intact one are not looked for: no call takes them
but ``restore(step)``, which names what is wrong.

A step's data can fail too, found only by reading it: a piece that fails its crc32c, a data
file truncated or gone. With ``fallback``, a restore of the newest step that fails so on any
process is followed by one more coordination round (``tiers.agree``, the tier restore's own),
and every process alike then restores the newest intact step below it, with a warning
(:meth:`Checks.restored`); any other failure is raised, as without ``fallback``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from tpu_ckpt import cluster, storage, tiers
from tpu_ckpt.catalog import read_manifest
from tpu_ckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, RemoteProcessError

logger = logging.getLogger(__name__)


class Checks:
    """The manifest checks of one manager's run directory; ``leader`` checks for all."""

    def __init__(self, loc: storage.Location, leader: int):
        self._loc, self._leader = loc, leader
        self._intact: set[str] = set()  # step names whose manifest was read and found intact

    def damaged(self, committed: dict[int, str], timeout: float) -> dict[int, str]:
        """The steps of ``committed`` newer than its newest intact one, each with what is
        wrong with it (collective: the leader reads, the others are told)."""
        self._intact &= set(committed.values())  # a step removed and saved again is read again
        if cluster.process_count() == 1:
            return self._above_intact(committed)
        with cluster.Coordinator(f"check the newest steps of {self._loc.url}", timeout) as coord:
            if coord.me != self._leader:
                return {int(s): problem for s, problem in json.loads(coord.receive("damaged", self._leader)).items()}
            try:
                found = self._above_intact(committed)
            except BaseException as error:
                coord.report_failure(error)
                raise
            coord.publish("damaged", json.dumps(found))
            return found

    def intact(self, committed: dict[int, str], timeout: float) -> list[int]:
        """The steps of ``committed`` but the damaged ones above the newest intact one (collective)."""
        return sorted(set(committed) - set(self.damaged(committed, timeout)))

    def latest(
        self, committed: dict[int, str], timeout: float, tier: Callable[[dict[int, str]], int | None] | None
    ) -> int | None:
        """The step a restore of the newest takes (collective): of ``committed``, or of the
        tier's choice (``tier``: the step it would take from a listing), whose persistent
        steps are checked only when it would take one of them."""
        newest = tier(committed) if tier is not None else max(committed, default=None)
        if newest is None or newest not in committed:
            return newest  # a local step, no older than any persistent one
        damaged = self.damaged({s: name for s, name in committed.items() if s <= newest}, timeout)
        if not damaged:
            return newest
        listed = {s: name for s, name in committed.items() if s not in damaged}
        return tier(listed) if tier is not None else max(listed, default=None)

    def restorable(
        self, directory: str, committed: dict[int, str], step: int | None, fallback: bool, timeout: float,
        tier: Callable[[dict[int, str]], tiers.FromLocal | int | None] | None,
    ) -> tiers.FromLocal | int:
        """What ``restore(step, fallback=fallback)`` restores (collective): the tier's local
        step (``tier`` restores from a listing, or returns the persistent step to restore), or
        a persistent step of ``committed``, checked as :func:`chosen` says when it is the newest."""
        found = tier(committed) if tier is not None else None
        if isinstance(found, tiers.FromLocal):
            return found
        found = found if found is not None else step
        if step is not None:  # asked for by number: restored, or refused, as it is
            return chosen(directory, committed, {}, found)
        damaged = self.damaged({s: name for s, name in committed.items() if found is None or s <= found}, timeout)
        if not damaged or not fallback:
            return chosen(directory, committed, damaged, found)
        listed = {s: name for s, name in committed.items() if s not in damaged}
        found = tier(listed) if tier is not None else None
        if isinstance(found, tiers.FromLocal):  # a local step newer than the newest intact persistent one
            skipped(directory, damaged, found.step)
            return found
        return chosen(directory, listed, damaged, found)

    def restored(
        self, directory: str, committed: dict[int, str], step: int, fallback: bool, timeout: float,
        restore: Callable[[int], Any],
    ) -> tuple[int, Any]:
        """``restore(step)``; with ``fallback``, where its data fails its checks on some process,
        the newest step below it whose manifest is intact, and so on, every process alike
        (collective: see the module docstring). Returns the step restored and its tree."""
        if not fallback:
            return step, restore(step)
        failed: dict[int, str] = {}
        while True:
            tree, failure = None, None
            try:
                tree = restore(step)
            except Exception as error:  # noqa: BLE001 - every failure goes to the agreement, then falls back or raises
                failure = error
            verdict = tiers.agree(f"{directory} (step {step})", failure, timeout)
            if verdict.cause is None:
                skipped(directory, failed, step)
                return step, tree
            if not (verdict.damaged and verdict.fall_back):
                if failure is not None:
                    raise failure
                raise RemoteProcessError(f"The restore of step {step} from {directory} failed ({verdict.cause}).")
            failed[step] = verdict.cause
            older = {s: name for s, name in committed.items() if s < step}
            failed.update(self.damaged(older, timeout))
            intact = [s for s in older if s not in failed]
            if not intact:
                raise CorruptCheckpointError(f"No step of {directory} restores: {_named(failed)}",
                                             file=f"{directory.rstrip('/')}/{committed[step]}")
            step = max(intact)

    def spare(self, committed: dict[int, str], step: int, expired: list[int]) -> list[int]:
        """``expired`` (retention's choice after committing ``step``) less the newest intact
        step of ``committed``: ``step``, or a newer one if one is intact (the leader's)."""
        newer = {s: name for s, name in committed.items() if s > step}
        damaged = self._above_intact(newer)
        newest = max((s for s in newer if s not in damaged), default=step)
        return [s for s in expired if s != newest]

    def _above_intact(self, committed: dict[int, str]) -> dict[int, str]:
        found = {}
        for step in sorted(committed, reverse=True):
            problem = self._problem(committed[step])
            if problem is None:
                break
            found[step] = problem
        return found

    def _problem(self, name: str) -> str | None:
        """What is wrong with the manifest of step ``name``, or None."""
        if name in self._intact:
            return None
        try:
            read_manifest(storage.Location(self._loc.child(name)))
        except CheckpointError as error:  # an IO error is not a damaged step: it is raised
            return f"{type(error).__name__}: {error}"
        self._intact.add(name)
        return None


def chosen(directory: str, listed: dict[int, str], damaged: dict[int, str], step: int | None) -> int:
    """The persistent step a restore takes: ``step``, or (None) the newest of ``listed``; a
    typed error if it is not listed, or is ``damaged`` (``listed`` then holds it: no fallback)."""
    if step is None:
        if not listed:
            found = f" but damaged ones ({_named(damaged)})" if damaged else ""
            raise CheckpointNotFoundError(f"No committed checkpoint in {directory}{found}", file=directory)
        step = max(listed)
    elif step not in listed:
        raise CheckpointNotFoundError(
            f"No committed checkpoint for step {step} in {directory}; the committed steps are {sorted(listed)}",
            file=directory,
        )
    if step in damaged:
        older = max((s for s in listed if s not in damaged), default=None)
        instead = f"the newest intact step, {older}" if older is not None else "nothing: no older step is intact"
        raise CorruptCheckpointError(
            f"The newest step of {directory}, {step}, cannot be restored ({damaged[step]}). Delete it, restore a "
            f"step by number, or pass restore(..., fallback=True), which skips damaged steps and restores {instead}.",
            file=f"{directory.rstrip('/')}/{listed[step]}",
        )
    skipped(directory, damaged, step)
    return step


def skipped(directory: str, damaged: dict[int, str], restored: int) -> None:
    """Warns of each damaged step newer than the step ``restored`` (which ``fallback`` skipped)."""
    for step in sorted((s for s in damaged if s > restored), reverse=True):
        logger.warning("tpu_ckpt: skipping step %d of %s, which fails its checks (%s); restoring step %d",
                       step, directory, damaged[step], restored)


def _named(damaged: dict[int, str]) -> str:
    return "; ".join(f"step {step}: {problem}" for step, problem in sorted(damaged.items(), reverse=True))
