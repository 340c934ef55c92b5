"""CheckpointOptions: TensorFlow's ``tf.train.CheckpointOptions``, brought to JAX.

One immutable object, validated at construction. Each TF spelling (``experimental_*``) is an
alias of exactly one field, accepted as a keyword and readable as an attribute; giving both
spellings with different values is an error rather than a silent precedence rule.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tpu_ckpt.sharding import ShardByDevicePolicy, ShardingCallback

PlainCallback = Callable[[], object]
"""A write callback taking no argument."""
PathCallback = Callable[[str], object]
"""A write callback taking the saved path: the one shape a save calls (``path_callbacks``)."""
WriteCallback = PlainCallback | PathCallback

_TF_ALIASES = {
    "experimental_io_device": "io_device",
    "experimental_write_callbacks": "write_callbacks",
    "experimental_skip_slot_variables": "skip_slot_variables",
    "experimental_sharding_callback": "sharding_callback",
}


class _Default:
    """The default of a field that has a TF alias: it must be told apart from the same value
    passed explicitly (so that ``io_device=None, experimental_io_device=2`` is a conflict),
    yet ``help(CheckpointOptions)`` should show the value it stands for."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


_NONE: Any = _Default(None)
_FALSE: Any = _Default(False)
_LOCALHOST = re.compile(r"^/job:localhost(/replica:0)?(/task:0)?(/device:[A-Za-z_]+:\d+)?$")
_WORKER = re.compile(r"^/job:worker(/replica:\d+)?/task:(\d+)(/device:[A-Za-z_]+:\d+)?$")


_FIELDS = (
    "io_device", "enable_async", "write_callbacks", "skip_slot_variables",
    "sharding_callback", "coordination_timeout", "load_and_broadcast", "host_memory_limit",
)


class CheckpointOptions:
    """Options for :func:`tpu_ckpt.save` and :func:`tpu_ckpt.restore`.

    Args:
      io_device: ``None`` (every process writes its own pieces), or the one process that does
        all file IO: a process index, a ``jax.Device``, or a TF device string
        (``/job:localhost`` = process 0, ``/job:worker/task:N[/device:CPU:0]`` = process N).
      enable_async: return from ``save`` once the data is on the host; write in background.
      write_callbacks: callables run in order after each save is committed; one that accepts
        a positional argument gets the saved path.
      skip_slot_variables: on restore, do not read optimizer slot variables.
      sharding_callback: a :class:`ShardingCallback` deciding which pieces go to which data
        file; ``None`` means :class:`ShardByDevicePolicy`.
      coordination_timeout: seconds any cross-process wait may take before raising an error
        that names the processes which did not arrive (a wait on a process that reports
        progress goes on, for at most 10 x ``coordination_timeout`` in all).
      load_and_broadcast: on a multi-process restore, read each piece several processes need
        once: a leaf replicated over a mesh axis across processes is read in parts, one per
        replica, and completed by one XLA collective (``restoring/_fanout.py``); the rest is read
        by one process and sent to the others over TCP (``restoring/_shared_reads.py``).
        Refused together with ``io_device``, where one process already reads everything once.
      host_memory_limit: ``None`` (the default: unbounded, as fast as memory allows), or the most
        bytes of host memory a save or restore holds beyond the live arrays and the restored
        result (our extension; not in TF): data files in flight, an async save's snapshot (``save``
        then blocks until the last of it fits), read batches and the pieces ``load_and_broadcast``
        keeps for peers. README "Memory" says what each operation holds.

    TF spellings are accepted as keywords and readable as attributes: ``experimental_io_device``,
    ``experimental_write_callbacks``, ``experimental_skip_slot_variables``,
    ``experimental_sharding_callback`` and the deprecated ``experimental_enable_async_checkpoint``.

    Raises:
      TypeError: a flag is not a ``bool`` (a numpy bool is one; ``enable_async="no"`` is
        refused, not taken as ``True``), or another field has the wrong type.
      ValueError: a value is out of range, or a field is given under both its names.

    Options compare equal when their fields do (sharding callbacks: the same object, or the same class,
    description and attributes), hash accordingly (so they are unhashable when a write callback is),
    and survive ``copy``, ``deepcopy`` and serialisation by ``__reduce__`` (when their callbacks do).
    """

    __slots__ = (*_FIELDS, "_path_callbacks")

    io_device: int | None
    enable_async: bool
    write_callbacks: tuple[WriteCallback, ...]
    skip_slot_variables: bool
    sharding_callback: ShardingCallback
    coordination_timeout: float
    load_and_broadcast: bool
    host_memory_limit: int | None
    _path_callbacks: tuple[PathCallback, ...]

    def __init__(
        self,
        io_device: int | jax.Device | str | None = _NONE,
        enable_async: bool = False,
        write_callbacks: Sequence[WriteCallback] | None = _NONE,
        skip_slot_variables: bool = _FALSE,
        sharding_callback: ShardingCallback | None = _NONE,
        coordination_timeout: float = 300.0,
        load_and_broadcast: bool = False,
        host_memory_limit: int | None = None,
        *,
        experimental_io_device: int | jax.Device | str | None = _NONE,
        experimental_enable_async_checkpoint: bool = _FALSE,
        experimental_write_callbacks: Sequence[WriteCallback] | None = _NONE,
        experimental_skip_slot_variables: bool = _FALSE,
        experimental_sharding_callback: ShardingCallback | None = _NONE,
    ):
        skip_slots = _merge(
            "skip_slot_variables",
            _check_flag("skip_slot_variables", skip_slot_variables),
            _check_flag("experimental_skip_slot_variables", experimental_skip_slot_variables),
        )
        io = parse_io_device(_merge("io_device", io_device, experimental_io_device))
        share = _check_flag("load_and_broadcast", load_and_broadcast)
        if share and io is not None:
            raise ValueError(
                f"CheckpointOptions got load_and_broadcast=True with io_device={io}: with io_device, "
                f"process {io} already reads every piece once and sends it on; drop load_and_broadcast."
            )
        deprecated_async = _check_flag("experimental_enable_async_checkpoint", experimental_enable_async_checkpoint)
        if not isinstance(deprecated_async, _Default):
            warnings.warn(
                "experimental_enable_async_checkpoint is deprecated; use enable_async instead.",
                DeprecationWarning,
                stacklevel=2,
            )
        # TF's rule: the deprecated flag OR enable_async.
        async_flag = _check_flag("enable_async", enable_async) or deprecated_async is True
        callbacks = _merge("write_callbacks", write_callbacks, experimental_write_callbacks)
        policy = _merge("sharding_callback", sharding_callback, experimental_sharding_callback)
        set_ = object.__setattr__
        set_(self, "io_device", io)
        set_(self, "enable_async", async_flag)
        set_(self, "write_callbacks", _check_callbacks(callbacks))
        set_(self, "_path_callbacks", tuple(map(_with_path, self.write_callbacks)))
        set_(self, "skip_slot_variables", skip_slots)
        set_(self, "sharding_callback", _check_sharding_callback(policy))
        set_(self, "coordination_timeout", _check_timeout(coordination_timeout))
        set_(self, "load_and_broadcast", share)
        set_(self, "host_memory_limit", _check_memory_limit(host_memory_limit))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"CheckpointOptions is immutable; build a new one (tried to set {name!r})")

    def __getattr__(self, name: str) -> Any:
        if name in _TF_ALIASES:
            return getattr(self, _TF_ALIASES[name])
        if name == "experimental_enable_async_checkpoint":
            return self.enable_async
        raise AttributeError(f"CheckpointOptions has no attribute {name!r}")

    def replace(self, **changes: Any) -> CheckpointOptions:
        """A copy with the fields ``**changes`` names changed (options are immutable)."""
        fields = {name: getattr(self, name) for name in _FIELDS}
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"CheckpointOptions has no field(s) {sorted(unknown)}")
        return CheckpointOptions(**{**fields, **changes})

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in _FIELDS)
        return f"CheckpointOptions({fields})"

    def __reduce__(self) -> tuple[type[CheckpointOptions], tuple[Any, ...]]:
        # The immutable __setattr__ forbids the default slot-by-slot restore, so copies and
        # unpickling go through the constructor (and its validation) instead.
        return CheckpointOptions, tuple(getattr(self, name) for name in _FIELDS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CheckpointOptions):
            return NotImplemented
        return self._plain_fields() == other._plain_fields() and _same_policy(
            self.sharding_callback, other.sharding_callback
        )

    def __hash__(self) -> int:
        policy = self.sharding_callback
        return hash((self._plain_fields(), type(policy), policy.description))

    def _plain_fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in _FIELDS if name != "sharding_callback")


def checked_options(options: Any, call: str) -> CheckpointOptions:
    """``options`` as ``call`` got it (None: the defaults); a dict of fields, say, is a TypeError here."""
    if options is not None and not isinstance(options, CheckpointOptions):
        raise TypeError(f"{call}(options=...) takes a tpu_ckpt.CheckpointOptions or None, not a "
                        f"{type(options).__name__}: e.g. options=tc.CheckpointOptions(enable_async=True)")
    return CheckpointOptions() if options is None else options


def io_process(options: CheckpointOptions, process_count: int) -> int | None:
    """The process doing all storage IO, checked against the job's size (unknown when the
    options were built); ``None`` when every process does its own."""
    io = options.io_device
    if io is not None and io >= process_count:
        raise ValueError(
            f"io_device names process {io}, but this job has {process_count} process(es) "
            f"(indices 0..{process_count - 1})."
        )
    return io


def path_callbacks(options: CheckpointOptions) -> tuple[PathCallback, ...]:
    """The write callbacks as a save runs them, in order: each called with the saved path."""
    return options._path_callbacks


def _with_path(callback: Callable[..., object]) -> PathCallback:
    """``callback`` called with the saved path; one that accepts no positional argument is
    called without it. Told once, from its signature, when the options are built: the
    documented contract (TF's) is that a callback taking an argument gets the path."""
    if _positional_capacity(callback)[1] >= 1:
        return callback
    return lambda path: callback()


def _merge(name: str, new: Any, old: Any) -> Any:
    """One field from its two spellings; a default (``_Default``) counts as not given."""
    if isinstance(new, _Default):
        return old.value if isinstance(old, _Default) else old
    if not isinstance(old, _Default) and new is not old and new != old:
        raise ValueError(
            f"CheckpointOptions got both {name}={new!r} and experimental_{name}={old!r}; pass only one."
        )
    return new


def _check_flag(name: str, value: Any) -> Any:
    """A flag as ``bool``, since truthiness would turn ``"false"`` into ``True``; a default
    passes through unchanged, for :func:`_merge` to tell it from an explicit ``False``."""
    if isinstance(value, _Default):
        return value
    if not isinstance(value, (bool, np.bool_)):
        kind = type(value).__name__
        raise TypeError(f"CheckpointOptions {name} must be True or False, got {value!r} of type {kind}.")
    return bool(value)


def _same_policy(a: ShardingCallback, b: ShardingCallback) -> bool:
    """Built-in policies are plain configuration, so a copy or an equally built one is the
    same policy; one keeping its configuration outside ``__dict__`` is left to its own ``==``."""
    if a is b or a == b:
        return True
    config = getattr(a, "__dict__", None)
    same_kind = type(a) is type(b) and a.description == b.description
    return same_kind and config is not None and config == getattr(b, "__dict__", None)


def parse_io_device(value: Any) -> int | None:
    """Resolves every accepted io_device form to a process index (ValueError otherwise)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"io_device must be a process index, jax.Device or TF device string, not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"io_device process index must be >= 0, got {value}")
        return value
    if isinstance(value, jax.Device):
        return int(value.process_index)
    if isinstance(value, str):
        text = value.strip()
        if _LOCALHOST.match(text):
            return 0
        match = _WORKER.match(text)
        if match:
            return int(match.group(2))
    raise ValueError(
        f"io_device {value!r} is not understood: use a process index, a jax.Device, "
        "'/job:localhost' or '/job:worker/task:N[/device:CPU:0]'."
    )


def _positional_capacity(callback: Callable[..., Any]) -> tuple[int, float]:
    """(required positional parameters, maximum positional arguments accepted)."""
    try:
        params = inspect.signature(callback).parameters.values()
    except (TypeError, ValueError):
        return 0, 1  # builtins without a signature: treat like print(*args)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in positional if p.default is p.empty)
    most = float("inf") if any(p.kind == p.VAR_POSITIONAL for p in params) else len(positional)
    return required, most


def _check_callbacks(callbacks: Sequence[WriteCallback] | None) -> tuple[WriteCallback, ...]:
    if callbacks is None:
        return ()
    if callable(callbacks) or isinstance(callbacks, (str, bytes)):
        raise TypeError("write_callbacks must be a sequence of callables, e.g. [callback]")
    out = tuple(callbacks)
    for cb in out:
        if not callable(cb):
            raise TypeError(f"write callback {cb!r} is not callable")
        required, _ = _positional_capacity(cb)
        if required > 1:
            raise ValueError(f"write callback {getattr(cb, '__name__', cb)!r} requires {required} positional "
                             "arguments; a write callback takes none or one (the saved path).")
    return out


def _check_sharding_callback(callback: Any) -> ShardingCallback:
    if callback is None:
        return ShardByDevicePolicy()
    if not isinstance(callback, ShardingCallback):
        raise ValueError("sharding_callback must be an instance of tpu_ckpt.ShardingCallback (e.g. "
                         f"tc.MaxShardSizePolicy(2**30)); got {callback!r} of type {type(callback).__name__}.")
    return callback


def _check_timeout(timeout: Any) -> float:
    if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"coordination_timeout must be a number of seconds, got {timeout!r} of type "
                        f"{type(timeout).__name__}")
    seconds = float(timeout)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"coordination_timeout must be a positive, finite number of seconds, got {timeout!r}")
    return seconds


MIN_HOST_MEMORY_LIMIT = 16 << 20
"""Below this, per-file and per-batch overheads dominate: a smaller limit is a mistake."""


def _check_memory_limit(limit: Any) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, (bool, np.bool_)) or not isinstance(limit, numbers.Integral):
        kind = type(limit).__name__
        raise TypeError(f"host_memory_limit must be None or a number of bytes (int), got {limit!r} of type {kind}")
    if limit < MIN_HOST_MEMORY_LIMIT:
        raise ValueError(f"host_memory_limit must be at least {MIN_HOST_MEMORY_LIMIT} bytes (16 MiB), got {limit}")
    return int(limit)
