"""The control plane's fan-out (``cluster.fanout()``) set in a process, for scenarios of real
processes that show with a small one what 64 does at pod scale. Every process of a job must
set the same value, before its restore. The knob is the cluster package's own
(``cluster/_relays.py`` ``MAX_SERVERS``): tests of other packages set it through here."""

from tpu_ckpt.cluster import _relays


def set_fanout(fanout: str) -> None:
    """``fanout`` as a scenario's argument: "" keeps the default."""
    if fanout:
        _relays.MAX_SERVERS = int(fanout)
