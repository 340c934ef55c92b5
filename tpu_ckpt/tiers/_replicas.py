"""Which processes keep copies of a process's local-tier part, worked out for one process.

A part's holders are the next processes by index on other hosts (``_hosts``: a host may run several processes, and a
copy on the owner's host dies with it), counted from as many places after the owner as its host has other processes (a
host's k-th process sends to the next host's k-th, so each keeps as many parts as it sends), those in another slice
first where JAX tells slices apart (a slice can fail whole). Every process must agree on the rule, but each needs only
its own two answers: whom it sends its part to, and whose parts it keeps. Listing every process's holders costs
O(N^2 log N) (0.65-0.9 s per local save at 1,536 hosts); this costs O(N log N) once per job shape (cached).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence


@functools.lru_cache(maxsize=16)
def replica_roles(
    me: int, replicas: int, slices: tuple[int | None, ...], hosts: tuple[int, ...] | None = None,
) -> tuple[tuple[int, ...], frozenset[int]]:
    """(the processes ``me`` sends its part to, in order; the processes whose parts ``me``
    keeps), for ``replicas`` copies among ``len(slices)`` processes, ``slices[p]`` being
    process ``p``'s slice (None where unknown) and ``hosts[p]`` its host (None: one process
    per host). No copy goes to a process of its owner's host."""
    count = len(slices)
    members: dict[int, list[int]] = {}
    for process, slice_index in enumerate(slices):
        if slice_index is not None:
            members.setdefault(slice_index, []).append(process)
    order = _Order(slices, members, hosts)
    candidates = (p for p in range(count) if order.candidate(me, p))
    sends = tuple(sorted(candidates, key=lambda p: order.rank(me, p))[: order.kept(me, replicas)])
    keeps = frozenset(o for o in range(count) if order.candidate(o, me) and order.rank(o, me) < order.kept(o, replicas))
    return sends, keeps


class _Order:
    """Where each process stands in an owner's list of candidate holders (the processes of
    other hosts): processes in another slice (or of unknown slice) first, then those in the
    owner's own slice, each group in index order starting after the owner."""

    def __init__(self, slices: Sequence[int | None], members: dict[int, list[int]], hosts: Sequence[int] | None):
        self.slices, self.members, self.hosts = slices, members, hosts
        self.in_slice = {s: set(m) for s, m in members.items()}
        self.on_host: dict[int, list[int]] = {}
        for process, host in enumerate(hosts or ()):
            self.on_host.setdefault(host, []).append(process)

    def candidate(self, owner: int, other: int) -> bool:
        return other != owner and (self.hosts is None or self.hosts[other] != self.hosts[owner])

    def kept(self, owner: int, replicas: int) -> int:
        """How many copies of ``owner``'s part are kept: ``replicas``, at most one per process of another host."""
        return min(replicas, len(self.slices) - len(self._mates(owner)) - 1)

    def rank(self, owner: int, other: int) -> int:
        count = len(self.slices)
        slice_index = self.slices[owner]
        own_slice = self.members.get(slice_index, []) if slice_index is not None else []
        in_slice = self.in_slice.get(slice_index, set()) if slice_index is not None else set()
        mates = self._mates(owner)
        start = (owner + len(mates)) % count  # counted from the process after it: a host's k-th process the k-th's
        excluded = sorted([owner, *mates])
        out_of_slice = [p for p in excluded if p not in in_slice]
        before = (other - start - 1) % count  # processes between them, counting up from ``start``
        same_before = _between(own_slice, start, other)
        if slice_index is not None and self.slices[other] == slice_index:  # after every candidate of another slice
            first = count - len(own_slice) - len(out_of_slice)
            return first + same_before - _between([p for p in excluded if p in in_slice], start, other)
        return before - same_before - _between(out_of_slice, start, other)

    def _mates(self, owner: int) -> list[int]:
        """The other processes of ``owner``'s host, in index order."""
        if self.hosts is None:
            return []
        return [p for p in self.on_host[self.hosts[owner]] if p != owner]


def _between(sorted_processes: list[int], owner: int, other: int) -> int:
    """How many of ``sorted_processes`` lie strictly between ``owner`` and ``other``, going
    up from ``owner`` and wrapping around."""
    if owner < other:
        return bisect.bisect_left(sorted_processes, other) - bisect.bisect_right(sorted_processes, owner)
    after = len(sorted_processes) - bisect.bisect_right(sorted_processes, owner)
    return after + bisect.bisect_left(sorted_processes, other)
