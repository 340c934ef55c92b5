"""A save's staging area: where every process writes until the leader commits.

The leader checks the destination, names the staging area and, for ``io_device``, serves
it to the others over the relay (accepting only their own files); the others learn its name
or where to connect. A local staging directory is proved shared before anyone writes (see
``cluster/_shared_storage.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os

from tpu_ckpt import cluster, relay, storage
from tpu_ckpt.errors import CheckpointExistsError
from tpu_ckpt.format import is_marker, left_by_a_save, token_of, written_by

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Staging:
    """Where this process writes: the staging area, its store (the backend itself, or, for a
    process writing through the io_device leader, the leader's relay), on that leader the
    relay serving the staging area to the others, and the token the save's object names
    carry (``spread``): on an object store, where the staging area is the final prefix that
    another save of the same checkpoint may share; empty for a local staging directory,
    the save's own."""

    location: storage.Location
    store: storage.Backend | relay.RelayStore
    server: relay.RelayServer | None = None
    token: str = ""

    @property
    def backend(self) -> storage.Backend:
        """The store the leader commits through, and that a process writing directly removes
        its own files from: the staging area's backend, which a relay's writer cannot reach."""
        if isinstance(self.store, relay.RelayStore):
            raise TypeError(f"{self.location.url} is written through a relay here, which cannot list or delete")
        return self.store

    def close(self) -> None:
        """Stops serving the others (first: no late write may land after this), closes the store."""
        if self.server is not None:
            self.server.close()
        self.store.close()


def prepare(
    final: storage.Location, coord: cluster.Coordinator, leader: int, timeout: float, relayed: bool
) -> Staging:
    """The leader checks the destination and names the staging area (serving it to the
    others when they write through it); the others learn its name, or where to connect.
    Before anyone writes, the processes prove they all see a local staging directory
    (see ``cluster/_shared_storage.py``): the leader decides when, so every process takes part."""
    if coord.me != leader:
        return _join(final, coord, leader, timeout)
    if final.is_local:
        warn_if_gcsfuse(final.local_path)
    _check_free(final)
    token = storage.new_token()
    location = final.staging(token)
    staging = Staging(location, storage.open_staging(location, final, token), token=_names_token(final, token))
    prove = not relayed and cluster.unproved(final, coord.count)
    try:
        contact = ""
        if relayed and coord.count > 1:
            accepts = functools.partial(_sent_by_another, leader=leader, count=coord.count)
            server = relay.RelayServer(
                staging.backend, cluster.relay_host(), timeout, peers=coord.count - 1, accepts=accepts
            )
            staging = dataclasses.replace(staging, server=server)
            contact = server.contact()
        coord.publish("start", json.dumps({"token": token, "contact": contact, "prove_shared": prove}))
        if prove:
            cluster.prove_staging(coord, final, location, leader)
    except BaseException:
        staging.close()
        remove_staging(location, staging.token)  # nobody else knows its name: nobody else would remove it
        raise
    return staging


def _join(final: storage.Location, coord: cluster.Coordinator, leader: int, timeout: float) -> Staging:
    """A process other than the leader: the staging area the leader named, written directly
    or through the leader's relay."""
    start = json.loads(coord.receive("start", leader))
    location, token = final.staging(start["token"]), _names_token(final, start["token"])
    if start["prove_shared"]:
        cluster.prove_staging(coord, final, location, leader)
    if start["contact"]:
        return Staging(location, relay.RelayStore(location, start["contact"], timeout, leader), token=token)
    return Staging(location, storage.Store(location), token=token)


def _names_token(final: storage.Location, token: str) -> str:
    return "" if final.is_local else token


def _check_free(final: storage.Location) -> None:
    """Refuses a destination that holds a checkpoint, or anything but what saves leave
    while they run: on an object store, where a save writes into the final prefix, the
    objects of a save that crashed or stalled there (no manifest) do not block a new one,
    whose names carry its own token (``spread``) and whose manifest is created only if
    absent (``write_manifest``). A local destination must be empty (its save renames onto it),
    and a directory if it exists."""
    taken = final.is_local and os.path.lexists(final.local_path) and not os.path.isdir(final.local_path)
    with storage.Store(final, threads=1) as store:
        names = [] if taken else store.list()
    if taken or any(final.is_local or not left_by_a_save(name) for name in names):
        raise CheckpointExistsError(
            f"{final.url} already exists and is not empty; tpu_ckpt never overwrites a checkpoint. "
            "Save to a new path, or delete the old one first.",
            file=final.url,
        )


def remove_staging(location: storage.Location, token: str) -> None:
    """Deletes an abandoned save's staging area: a local directory whole (``storage.remove``);
    in an object store's prefix, which another save of the same checkpoint may share
    (committed, or still writing), only the objects named with this save's ``token``, its
    staging marker among them (``format.marker_name``), and that last: what remains of an
    interrupted cleanup stays marked as the save's."""
    if not token:
        storage.remove(location)
        return
    with storage.Store(location) as store:
        names = [name for name in store.list() if token_of(name) == token]
        storage.remove_files(store, sorted(names, key=is_marker))


def _sent_by_another(name: str, leader: int, count: int) -> bool:
    """What the io_device leader's relay accepts: the data files and index of another
    process of this job, nothing else."""
    process = written_by(name)
    return process is not None and process != leader and process < count


_WARNED: set[str] = set()  # gcsfuse mount points warned about in this process


def warn_if_gcsfuse(path: str, mounts: str = "/proc/mounts") -> None:
    """Warns, once per mount, that ``path`` is on a gcsfuse mount: a local save commits by
    renaming its staging directory, which gcsfuse refuses, or carries out as a copy and a
    delete that a crash can leave half-done, unless the bucket has a hierarchical namespace."""
    mount = gcsfuse_mount(path, mounts)
    if mount is None or mount in _WARNED:
        return
    _WARNED.add(mount)
    logger.warning(
        "tpu_ckpt: %s is on a gcsfuse mount (%s). Its commit, a directory rename, is atomic only on a bucket "
        "with hierarchical namespace; save to gs://<bucket>/<path> instead (docs/object_stores.md).",
        path, mount,
    )


def gcsfuse_mount(path: str, mounts: str = "/proc/mounts") -> str | None:
    """The gcsfuse mount point ``path`` lies under (the longest mount point that holds it,
    as ``mounts`` lists them), or None."""
    try:
        with open(mounts, encoding="utf-8", errors="replace") as listing:
            entries = [line.split()[1:3] for line in listing if len(line.split()) >= 3]
    except OSError:
        return None
    where = os.path.realpath(os.path.abspath(path))
    found, kind = "", ""
    for point, fstype in entries:
        point = point.replace("\\040", " ")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(found):
            found, kind = point, fstype
    return found if kind == "fuse.gcsfuse" else None
