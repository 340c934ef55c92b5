"""Local-tier replicas placed by host, not by process index (#37 item 4): no copy of a part
lands on a process of its owner's host (tiers/_replicas.py, tiers/_hosts.py)."""

import numpy as np
import pytest

from tpu_ckpt.settings import Settings
from tpu_ckpt.tiers._replicas import replica_roles


def _holders_of_every_process(replicas, slices, hosts):
    """The rule, worked out for every process at once: the next processes of other hosts,
    those of another slice first."""
    count = len(slices)
    holders = {}
    for owner in range(count):
        others = [p for p in range(count) if hosts[p] != hosts[owner]]
        start = owner + count - len(others) - 1  # after the owner's host's other processes
        others.sort(key=lambda p: (slices[p] is not None and slices[p] == slices[owner], (p - start - 1) % count))
        holders[owner] = others[:replicas]
    return holders


def test_two_processes_per_host_never_keep_each_others_parts():
    hosts = (0, 0, 1, 1)
    assert replica_roles(0, 1, (None,) * 4, hosts) == ((2,), frozenset({2}))  # host 0's k-th to host 1's k-th
    assert replica_roles(1, 1, (None,) * 4, hosts) == ((3,), frozenset({3}))
    assert replica_roles(0, 3, (None,) * 4, hosts) == ((2, 3), frozenset({2, 3}))  # 2 other processes only
    assert replica_roles(0, 1, (None,) * 4) == ((1,), frozenset({3}))  # by process index: 1 shares 0's host


@pytest.mark.parametrize("seed", range(8))
def test_each_process_works_out_its_replicas_as_the_rule_says_with_several_processes_per_host(seed):
    rng = np.random.default_rng(seed)
    count = int(rng.integers(2, 24))
    per_host = int(rng.integers(1, 4))
    hosts = tuple(p // per_host for p in range(count))
    host_slice = rng.integers(0, 3, count)  # a host lies in one slice
    if seed % 4 == 1:  # hosts' processes not contiguous by index
        hosts = tuple(int(h) for h in rng.permutation(hosts))
    slices = tuple(None if seed % 3 == 0 else int(host_slice[h]) for h in hosts)
    replicas = int(rng.integers(1, 4))
    holders = _holders_of_every_process(replicas, slices, hosts)
    for me in range(count):
        sends, keeps = replica_roles(me, replicas, slices, hosts)
        assert list(sends) == holders[me], (me, slices, hosts)
        assert keeps == {owner for owner, held_by in holders.items() if me in held_by}, (me, slices, hosts)
        assert all(hosts[p] != hosts[me] for p in sends)


def test_the_hosts_come_from_the_environment():
    assert Settings.from_environment({"TPU_CKPT_HOSTS": "0,0,1,1"}).hosts == (0, 0, 1, 1)
    with pytest.raises(ValueError, match="TPU_CKPT_HOSTS"):
        Settings.from_environment({"TPU_CKPT_HOSTS": "a"})
