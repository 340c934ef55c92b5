"""Which processes keep copies of a process's local-tier part, worked out for one process.

A part's holders are the next processes by index (a pod runs one process per host, so
each is another host), those in another slice first where JAX tells slices apart (a slice
can fail whole). Every process must agree on the rule, but each needs only its own two
answers: whom it sends its part to, and whose parts it keeps. Listing every process's
holders costs O(N^2 log N) (0.65-0.9 s per local save at 1,536 hosts); this costs
O(N log N) once per job shape (cached).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence


@functools.lru_cache(maxsize=16)
def replica_roles(me: int, replicas: int, slices: tuple[int | None, ...]) -> tuple[tuple[int, ...], frozenset[int]]:
    """(the processes ``me`` sends its part to, in order; the processes whose parts ``me``
    keeps), for ``replicas`` copies among ``len(slices)`` processes, ``slices[p]`` being
    process ``p``'s slice (None where unknown)."""
    count = len(slices)
    kept = min(replicas, count - 1)
    members: dict[int, list[int]] = {}
    for process, slice_index in enumerate(slices):
        if slice_index is not None:
            members.setdefault(slice_index, []).append(process)
    order = _Order(slices, members)
    sends = tuple(sorted((p for p in range(count) if p != me), key=lambda p: order.rank(me, p))[:kept])
    keeps = frozenset(owner for owner in range(count) if owner != me and order.rank(owner, me) < kept)
    return sends, keeps


class _Order:
    """Where each process stands in an owner's list of candidate holders: processes in
    another slice (or of unknown slice) first, then those in the owner's own slice, each
    group in index order starting after the owner."""

    def __init__(self, slices: Sequence[int | None], members: dict[int, list[int]]):
        self.slices, self.members = slices, members

    def rank(self, owner: int, other: int) -> int:
        count = len(self.slices)
        slice_index = self.slices[owner]
        own_slice = self.members.get(slice_index, []) if slice_index is not None else []
        before = (other - owner) % count - 1  # processes between them, counting up from the owner
        same_before = _between(own_slice, owner, other)
        if slice_index is not None and self.slices[other] == slice_index:
            return (count - len(own_slice)) + same_before  # after every process of another slice
        return before - same_before


def _between(sorted_processes: list[int], owner: int, other: int) -> int:
    """How many of ``sorted_processes`` lie strictly between ``owner`` and ``other``, going
    up from ``owner`` and wrapping around."""
    if owner < other:
        return bisect.bisect_left(sorted_processes, other) - bisect.bisect_right(sorted_processes, owner)
    return len(sorted_processes) - bisect.bisect_right(sorted_processes, owner) + bisect.bisect_left(sorted_processes, other)
