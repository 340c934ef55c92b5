"""Cross-process coordination over JAX's distributed runtime (the only user of its client).

Checkpointing must never hang silently, and must never issue device collectives (they can
deadlock with a training step running on another thread). So every cross-process wait here
blocks inside the coordination service's key-value store, with the operation's timeout, on
one key: the stage's *release*. A stage every process reaches is released by whichever
arrives last (an atomic counter says which); a value one process sends is its release. A
process that fails sets its failure report, then releases, marked failed, every stage
someone waits at, so the others raise at once instead of at the timeout. On a timeout the
error names the processes that never arrived and the stage, which ``wait_at_barrier``
cannot do. Per stage that is O(1) calls for each process and O(N) on the service, never a
poll (docs/scaling.md counts them).

Operation ids come from a per-process counter: like ``jax.jit``, checkpoint calls are SPMD,
made by every process in the same order, so the n-th call has the same id everywhere. An
operation's keys live under ``tpu_ckpt/<id>/`` only while it runs: each process, once it has
read the last key it will read there, counts itself out on an atomic counter, and the one
that counts last deletes the directory. So a job's key-value store holds the keys of the
operations in progress, never a history of every save (see :meth:`Coordinator.close`).
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import time
from typing import Any, Protocol

import jax

from tpu_ckpt.errors import CoordinationTimeoutError, RemoteProcessError
from tpu_ckpt.settings import settings

logger = logging.getLogger(__name__)

_ERROR = "error"  # <op>/error/<process>: a failure report
_FINISHED = "finished"  # the counter of processes done with the operation
_ARRIVED = "arrived"  # <op>/arrived/<stage>: the counter of processes that reached it
_VALUES = "values"  # <op>/values/<stage>/<process>: what each process brought to a stage
_RELEASED = "released"  # <op>/released/<stage>: "v<value>" once it is over, "x" if a failure ended it
_WAITING = "waiting"  # <op>/waiting/<stage>: present once some process blocks there
_PROGRESS = "progress"  # <op>/progress/<process>: what a process others wait on is doing, and a count
_PROGRESS_EVERY_S = 1.0  # at most one progress call a second
# The longest one wait lasts, in coordination timeouts, however long the process it waits on
# goes on reporting progress: a process that reports but never arrives is not waited on forever.
MAX_WAIT_TIMEOUTS = 10
_op_counter = itertools.count()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def preemption_sync_available() -> bool:
    """Whether JAX's preemption sync manager runs (jax.distributed.initialize() sets it up
    when the preemption service is enabled)."""
    from jax._src.distributed import global_state

    return global_state.preemption_sync_manager is not None


def reached_preemption_sync_point(step: int) -> bool:
    """JAX's agreement, across processes, on the step at which a preempted job stops."""
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(step))


def relay_host() -> str:
    """An address of this host that the job's other processes can reach: the local end of
    the route to the coordinator, which every process reaches already. ``TPU_CKPT_RELAY_HOST``
    overrides it for networks where that route is not the one hosts talk to each other on."""
    override = settings().relay_host
    if override:
        return override
    from jax._src.distributed import global_state

    if global_state.coordinator_address is None:
        return "127.0.0.1"
    host, port = global_state.coordinator_address.rsplit(":", 1)
    family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


class _KeyValues(Protocol):
    """The parts of JAX's distributed runtime client (the coordination service's key-value
    store) a coordinator uses."""

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...

    def key_value_increment(self, key: str, increment: int) -> int: ...

    def key_value_delete(self, key: str) -> None: ...

    def key_value_try_get(self, key: str) -> str: ...

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]: ...


def _client() -> _KeyValues | None:
    from jax._src.distributed import global_state

    return global_state.client


class Coordinator:
    """Named, time-bounded rendezvous points for one checkpoint operation. Each stage name
    is used once per operation.

    Every process must :meth:`close` it (or use it as a context manager) when it has done
    its part, failed or not, so that the operation's keys are deleted."""

    def __init__(self, what: str, timeout: float):
        self.count = process_count()
        self.me = process_index()
        self.timeout = timeout
        self.what = what
        self.prefix = f"tpu_ckpt/{next(_op_counter)}"
        self._client = _client() if self.count > 1 else None
        if self.count > 1 and self._client is None:
            raise RuntimeError(
                "jax.process_count() > 1 but the JAX distributed runtime client is missing; "
                "call jax.distributed.initialize() first."
            )
        self._closed = False
        self._progress_count = 0
        self._last_note = ""  # what the process this one waited on last said it was doing
        self._progress_at = time.monotonic()  # a step shorter than a second costs no call

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Ends this process's part: it reads and writes none of the operation's keys any more.

        The process that ends it last deletes them all. Only then has every process read what
        it will read, failure reports included, so no key goes from under a waiter, whatever
        order the processes finish in (an async save ends on a background thread while the
        next operations run). Of an operation some process never ends (it died, so the job
        is failing anyway), the keys stay."""
        if self._client is None or self._closed:
            return
        self._closed = True
        try:
            if self._client.key_value_increment(self._key(_FINISHED), 1) == self.count:
                self._client.key_value_delete(self.prefix)  # the directory: every key under it
        except Exception as error:  # noqa: BLE001 - the operation's outcome stands; only the tidying failed
            logger.warning("tpu_ckpt: could not delete the coordination keys of %s: %s", self.what, error)

    def barrier(self, stage: str) -> None:
        """Waits until every process reached ``stage``."""
        if self._client is not None:
            self._arrive(stage, "")
            self._block(stage, None)

    def collect(self, stage: str, value: str, at: int) -> dict[int, str]:
        """Brings ``value`` to ``stage``; process ``at`` waits for everyone's and gets them
        all, the others go on at once and get nothing (an empty dict). ``at=me`` on every
        process: each gets everyone's, in O(1) calls (not a :meth:`receive` per peer)."""
        if self._client is None:
            return {self.me: value}
        self._arrive(stage, value)
        if self.me != at:
            return {}
        self._block(stage, None)
        return self._values(stage)

    def publish(self, stage: str, value: str = "") -> None:
        """Sends a value others may :meth:`receive` (e.g. process 0's decision)."""
        if self._client is not None:
            self._release(stage, "v" + value)

    def receive(self, stage: str, sender: int) -> str:
        """Waits for ``sender``'s value for ``stage``."""
        if self._client is None:
            raise RuntimeError("receive() needs more than one process")
        return self._block(stage, sender)

    def progress(self, note: str) -> None:
        """Tells the processes waiting on this one what it is doing (``note``: the step and how
        far it got), so that a long step is not taken for a dead process: a waiter whose
        timeout passes reads the note and waits on while it changes (:meth:`_blocking_get`).
        The leader's commit calls it between batches; at most one call a second is made."""
        now = time.monotonic()
        if self._client is None or now - self._progress_at < _PROGRESS_EVERY_S:
            return
        self._progress_at, self._progress_count = now, self._progress_count + 1
        self._kv.key_value_set(self._key(_PROGRESS, self.me), f"{self._progress_count} {note}", allow_overwrite=True)

    def report_failure(self, error: BaseException, abandoned: bool = False) -> None:
        """Tells the other processes this one failed, and wakes those that wait, so they
        stop waiting for it at once. ``abandoned``: it gave the operation up before any
        commit (see :meth:`abandoned`)."""
        if self._client is None:
            return
        kind = type(error).__name__
        report: dict[str, Any] = {"message": f"{kind}: {error}", "abandoned": abandoned, "type": kind}
        if isinstance(error, CoordinationTimeoutError):  # others waiting there learn who is late
            report.update(stage=error.stage, missing=error.missing)
        try:
            self._client.key_value_set(self._key(_ERROR, self.me), json.dumps(report), allow_overwrite=True)
            # The report first, then the waiters: one that registers after this listing
            # finds the report before it blocks (see _block).
            for key, _ in self._client.key_value_dir_get(self._key(_WAITING) + "/"):
                self._release(key.rsplit("/", 1)[1], "x")
        except Exception:  # noqa: BLE001 - the coordinator may itself be gone
            pass

    def abandoned(self, process: int) -> bool:
        """Whether ``process`` reported that it gave the operation up before committing it."""
        if self._client is None:
            return False
        try:
            report = self._try_get(self._key(_ERROR, process))
        except Exception as error:  # noqa: BLE001 - on a failure's path, with the coordinator perhaps gone
            logger.warning("tpu_ckpt: %s: could not read process %d's failure report: %s", self.what, process, error)
            return False  # not known to be abandoned: delete nothing
        return report is not None and bool(json.loads(report).get("abandoned"))

    def raise_if_another_failed(self, stage: str, grace: float = 0.0) -> None:
        """Raises if another process reported a failure: :class:`RemoteProcessError`, or, when
        it timed out waiting for some processes, the same :class:`CoordinationTimeoutError`
        (so every waiting process names the late ones, whichever gave up first).

        ``grace``: seconds to wait for a report, for a caller that saw a peer vanish (its
        connection closed) a moment before the peer could say why."""
        deadline = time.monotonic() + grace
        while True:
            failures = self._failures()
            if failures or time.monotonic() >= deadline:
                break
            time.sleep(0.05)  # only on a failure's path, at most ``grace`` long
        if not failures:
            return
        who, text = sorted(failures.items())[0]
        report = json.loads(text)
        if "missing" in report:
            raise self._timeout_error(report["stage"], report["missing"], f"as process {who} found; ")
        raise RemoteProcessError(
            f"{self.what}: process {who} failed while this process ({self.me}) was at "
            f"stage '{stage}': {report['message']}",
            remote_type=report.get("type"),
        )

    @property
    def _kv(self) -> _KeyValues:
        """The client, on the paths that only several processes reach (the public methods
        return early when there is none)."""
        if self._client is None:
            raise RuntimeError(f"{self.what}: a single process has no coordination service to use")
        return self._client

    def _arrive(self, stage: str, value: str) -> None:
        self._kv.key_value_set(self._key(_VALUES, stage, self.me), value)
        if self._kv.key_value_increment(self._key(_ARRIVED, stage), 1) == self.count:
            self._release(stage, "v")

    def _release(self, stage: str, mark: str) -> None:
        """Ends the wait at ``stage``, once: a value sent after a failure ended it is dropped."""
        try:
            self._kv.key_value_set(self._key(_RELEASED, stage), mark)
        except Exception as error:  # noqa: BLE001 - the service's error type is not public
            if "ALREADY_EXISTS" not in str(error):
                raise

    def _block(self, stage: str, sender: int | None) -> str:
        """Waits for the release of ``stage`` (``sender``'s value, or everyone's arrival when
        None) and returns its value; raises if a failure ended it or the timeout passed."""
        released_key = self._key(_RELEASED, stage)
        self._kv.key_value_set(self._key(_WAITING, stage), "", allow_overwrite=True)
        if self._failures():  # checked after registering: see report_failure
            released = self._try_get(released_key)
        else:
            released = self._blocking_get(released_key, stage, sender)
        if released is None or released.startswith("x"):
            # A value published before its sender failed still counts; anything else raises.
            self.raise_if_another_failed(stage)
            raise RemoteProcessError(f"{self.what}: a failure report ended the wait at stage '{stage}'")
        return released[1:]

    def _blocking_get(self, key: str, stage: str, sender: int | None) -> str:
        """Waits up to the timeout, again and again while ``sender`` reports progress (so a
        sender working on gives up at most two timeouts after its last progress), and never
        longer than MAX_WAIT_TIMEOUTS timeouts in all."""
        note, deadline = None, time.monotonic() + MAX_WAIT_TIMEOUTS * self.timeout
        while True:
            started = time.monotonic()
            wait = min(self.timeout, deadline - started)
            try:
                return self._kv.blocking_key_value_get(key, max(1, int(wait * 1000)))
            except Exception as error:  # noqa: BLE001 - the service's error type is not public
                if "DEADLINE_EXCEEDED" not in str(error) and time.monotonic() - started < wait:
                    raise
            latest = None if sender is None else self._try_get(self._key(_PROGRESS, sender))
            if latest is None or latest == note:
                break
            note = latest
            if time.monotonic() >= deadline:
                break
            doing = latest.split(" ", 1)[1]
            logger.info("tpu_ckpt: %s: process %s is still working (%s); waiting on", self.what, sender, doing)
        self._last_note = "" if note is None else f"; it was last {note.split(' ', 1)[1]}"
        if time.monotonic() >= deadline:
            self._last_note += f"; no wait lasts more than {MAX_WAIT_TIMEOUTS} x coordination_timeout, progress or not"
        if sender is not None:
            # Waiting on a sender that may itself wait on a straggler: its report names
            # the straggler, where this process could only name the sender.
            self.raise_if_another_failed(stage, grace=min(5.0, self.timeout / 4))
            missing = [sender]
        else:
            self.raise_if_another_failed(stage)
            missing = sorted(set(range(self.count)) - self._values(stage).keys())
        raise self._timeout_error(stage, missing, "")

    def _timeout_error(self, stage: str, missing: list[int], finder: str) -> CoordinationTimeoutError:
        return CoordinationTimeoutError(
            f"{self.what}: processes {missing} did not reach stage '{stage}' within "
            f"coordination_timeout={self.timeout:g}s ({finder}this is process {self.me} of "
            f"{self.count}{self._last_note}). "
            "Check those hosts' logs; raise coordination_timeout if they are merely slow.",
            stage=stage,
            missing=missing,
        )

    def _values(self, stage: str) -> dict[int, str]:
        entries = self._kv.key_value_dir_get(self._key(_VALUES, stage) + "/")
        return {int(key.rsplit("/", 1)[1]): value for key, value in entries}

    def _failures(self) -> dict[int, str]:
        entries = self._kv.key_value_dir_get(self._key(_ERROR) + "/")
        failures = {int(key.rsplit("/", 1)[1]): value for key, value in entries}
        failures.pop(self.me, None)
        return failures

    def _try_get(self, key: str) -> str | None:
        try:
            return self._kv.key_value_try_get(key)
        except Exception as error:  # noqa: BLE001 - the service's error type is not public
            if "NOT_FOUND" not in str(error):
                raise
            return None

    def _key(self, *parts: object) -> str:
        return "/".join((self.prefix, *map(str, parts)))
