"""The control plane's fan-out (``cluster.fanout(N)``) fixed in a process, whatever the job's
size, for scenarios of real processes that show with a small one what 64 does at pod scale.
Every process of a job must set the same value, before its restore. The knobs are the cluster
package's own (``cluster/_relays.py``: the fan-out's floor and cap): tests of other packages set
them through here."""

import contextlib
from collections.abc import Iterator

from tpu_ckpt.cluster import _relays


def set_fanout(fanout: str) -> None:
    """``fanout`` as a scenario's argument: "" keeps the default."""
    if fanout:
        _relays.SMALLEST_FANOUT = _relays.MAX_SERVERS = int(fanout)


@contextlib.contextmanager
def fixed_fanout(fanout: int) -> Iterator[None]:
    """``fanout`` whatever the job's size, within the block (plans made in this process)."""
    previous = _relays.SMALLEST_FANOUT, _relays.MAX_SERVERS
    set_fanout(str(fanout))
    try:
        yield
    finally:
        _relays.SMALLEST_FANOUT, _relays.MAX_SERVERS = previous
