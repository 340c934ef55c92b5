"""The collective listing: one process lists a run's directory and tells the others.

Here, not in ``catalog``, because it needs the coordinator (and so JAX), which ``tpu-ckpt
ls`` and ``gc`` must not import."""

from __future__ import annotations

from collections.abc import Callable

from tpu_ckpt import cluster
from tpu_ckpt.catalog import Listing, list_run
from tpu_ckpt.storage import Location


def list_on_leader(
    loc: Location, leader: int, timeout: float, lister: Callable[[Location], Listing] = list_run
) -> Listing:
    """What ``loc`` holds, as process ``leader`` sees it (collective).

    The leader lists and tells the others, which never list storage: one listing per call
    for the whole job, and with ``io_device`` the directory may be that process's local
    disk, which only it sees. Every process must therefore make the same manager calls.
    ``lister`` lists on the leader (``list_run``, or a run directory's index)."""

    if cluster.process_count() == 1:
        return lister(loc)
    with cluster.Coordinator(f"list {loc.url}", timeout) as coord:
        if coord.me != leader:
            return Listing.from_json(coord.receive("listing", leader))
        try:
            listing = lister(loc)
        except BaseException as error:
            coord.report_failure(error)
            raise
        coord.publish("listing", listing.to_json())
        return listing
