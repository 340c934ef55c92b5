"""Which step a multi-tier restore takes, and who serves each part: the processes' agreement.

Each host knows only its own disk, so the processes agree through the coordination service:
each reports the local steps it holds and whose parts (``local_steps.held_steps``: the parts
it holds of another save apart, ``_part_checks``); process 0 picks the newest local step
whose parts, on the hosts alive now, cover every process of the job that saved it (a
replaced host with an empty disk simply reports nothing; a step saved as slice copies,
``_slice_copies``, needs only one slice's parts), compares it with the newest step of the
persistent directory, and tells everyone, with the process that serves each part: O(N), all
process 0 publishes. ``_restore`` then restores the chosen local step.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Container, Iterable

from tpu_ckpt import cluster
from tpu_ckpt.tiers import _local_steps as local_steps


@dataclasses.dataclass(frozen=True)
class Choice:
    """What the processes restore: ``step`` (None: nothing in any tier), from the local tier
    or from the persistent directory; for a local step, who serves each process's part."""

    step: int | None
    local: bool = False
    holders: dict[int, int] = dataclasses.field(default_factory=dict)  # owner -> serving process
    token: str = dataclasses.field(default="", compare=False)  # a local step's save (``tier.json``)
    # Of a step saved as slice copies, the whole copies (each slice's owners); () otherwise.
    copies: tuple[tuple[int, ...], ...] = dataclasses.field(default=(), compare=False)

    @property
    def local_step(self) -> int | None:
        """The step to restore from the local tier; None: restore from the persistent one."""
        return self.step if self.local else None

    def to_json(self) -> str:
        return json.dumps([self.step, self.local, sorted(self.holders.items()), self.token, self.copies])

    @classmethod
    def from_json(cls, text: str) -> Choice:
        step, local, holders, token, copies = json.loads(text)
        return cls(step, local, {int(o): int(h) for o, h in holders}, token, tuple(tuple(c) for c in copies))

    def reads(self, process: int, count: int) -> tuple[list[int], list[int]]:
        """(the owners whose parts ``process`` reads, the processes that read those same parts):
        every part, by every process; of slice copies, a slice's own copy when it is whole
        (its disks hold the slice's share: nothing crosses hosts), else a whole copy picked
        by process number, so the slices that lost theirs spread over the whole ones."""
        if not self.copies:
            return sorted(self.holders), list(range(count))

        def copy_of(p: int) -> tuple[int, ...]:
            return next((c for c in self.copies if p in c), self.copies[p % len(self.copies)])

        mine = copy_of(process)
        return list(mine), [p for p in range(count) if copy_of(p) == mine]


def choose(
    coord: cluster.Coordinator, root: str, persistent: Iterable[int], step: int | None,
    failed: Container[tuple[int, str]] = (),
) -> Choice:
    """The processes' common choice (collective): ``step``, or the newest when None; never a
    local save of ``failed`` (step, token): one whose restore failed before."""
    held = [[s.step, s.token, s.count, list(s.owners), s.copy, list(s.others)]
            for s in local_steps.held_steps(root) if (s.step, s.token) not in failed]
    reports = coord.collect("held", json.dumps(held), at=0)
    if coord.me != 0:
        return Choice.from_json(coord.receive("choice", 0))
    try:
        choice = decide(reports, set(persistent), step)
    except BaseException as error:
        coord.report_failure(error)
        raise
    coord.publish("choice", choice.to_json())
    return choice


def decide(reports: dict[int, str], persistent: set[int], step: int | None) -> Choice:
    """Process 0's choice from every process's report: the newest whole local step unless the
    persistent tier has a newer one (a pure function, tested alone). Of two whole saves of
    one step, the newer: the larger token (``local_steps._LocalSave._agreed_token``). A part
    a host holds of another save (``_part_checks``) is taken only when no step is left
    without it: the restore then fails naming the file."""
    choice = _decided(reports, persistent, step, others=False)
    return choice if choice.step is not None else _decided(reports, persistent, step, others=True)


def _decided(reports: dict[int, str], persistent: set[int], step: int | None, others: bool) -> Choice:
    parts, copies = _held(reports, others)
    served = {key: _served(held, key[2], copies.get(key)) for key, held in parts.items() if step in (None, key[0])}
    local = max((key for key, owners in served.items() if owners is not None), default=None)
    newest = max(persistent, default=None) if step is None else (step if step in persistent else None)
    if local is not None and (newest is None or local[0] >= newest):
        holders = _assign({o: parts[local][o] for o in served[local] or ()})
        return Choice(local[0], True, holders, local[1], _whole(parts[local], copies.get(local)))
    return Choice(newest)


_Key = tuple[int, str, int]  # a local save: its step, token and process count


def _held(
    reports: dict[int, str], others: bool
) -> tuple[dict[_Key, dict[int, list[int]]], dict[_Key, set[tuple[int, ...]]]]:
    """Each local save's holders of each part (with ``others``, those of another save's
    files too), and its slices' copies."""
    parts: dict[_Key, dict[int, list[int]]] = collections.defaultdict(dict)
    copies: dict[_Key, set[tuple[int, ...]]] = collections.defaultdict(set)
    for process, text in sorted(reports.items()):
        for saved, token, count, owners, *rest in json.loads(text):
            for owner in [*owners, *(rest[1] if others and len(rest) > 1 else ())]:
                parts[(saved, token, count)].setdefault(owner, []).append(process)
            if rest and rest[0] is not None:
                copies[(saved, token, count)].add(tuple(rest[0]))
    return parts, copies


def _served(held: dict[int, list[int]], count: int, copies: set[tuple[int, ...]] | None) -> list[int] | None:
    """The parts a restore reads, if the held ones make the step whole: every process's part;
    of a save where each slice wrote a copy, the parts of every slice whose parts are all
    held (each slice reads one copy: ``Choice.reads``)."""
    if copies is None:
        return sorted(held) if _covers(held, count) else None
    whole = _whole(held, copies)
    return sorted(owner for copy in whole for owner in copy) if whole else None


def _whole(held: dict[int, list[int]], copies: set[tuple[int, ...]] | None) -> tuple[tuple[int, ...], ...]:
    """The slice copies whose parts are all held, in order (none where the step has none)."""
    return tuple(copy for copy in sorted(copies or ()) if copy and all(owner in held for owner in copy))


def _covers(held: dict[int, list[int]], count: int) -> bool:
    """Whether ``held`` has a part of every process of ``count`` (a count from a damaged
    tier.json may be huge: never a set of that many)."""
    return 0 < count <= len(held) and all(owner in held for owner in range(count))


def _assign(held: dict[int, list[int]]) -> dict[int, int]:
    """A server for each part: its owner when alive, else the least loaded holder."""
    load: collections.Counter[int] = collections.Counter()
    holders = {}
    for owner, processes in sorted(held.items()):
        holders[owner] = owner if owner in processes else min(processes, key=lambda p: (load[p], p))
        load[holders[owner]] += 1
    return holders
