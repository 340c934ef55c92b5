"""The exceptions tpu_ckpt raises.

Every error names what is wrong and where (checkpoint key, file, process) so a user can act on
it without reading our source. Where a builtin describes the problem well (``ValueError`` for a
bad option or sharding-callback result, ``FileNotFoundError`` for a missing checkpoint), the
error also derives from it, so existing ``except`` clauses keep working.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every tpu_ckpt error; carries the offending key and file when known.

    Args:
      message: what is wrong and what to do, naming the checkpoint key or file.
      key: the checkpoint key (a leaf's path joined by ``/``) at fault, readable as ``.key``.
      file: the checkpoint, manifest or data file at fault, readable as ``.file``.
    """

    def __init__(self, message: str, *, key: str | None = None, file: str | None = None):
        super().__init__(message)
        self.key = key
        self.file = file


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists at the path."""


class UncommittedCheckpointError(CheckpointNotFoundError):
    """Only a partial (never committed) checkpoint exists at the path."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """The destination already holds data; tpu_ckpt never overwrites silently."""


class CorruptCheckpointError(CheckpointError):
    """A data file is missing, truncated, or fails its crc32c check."""


class FormatVersionError(CheckpointError):
    """The checkpoint was written by a newer, incompatible format version."""


class TargetMismatchError(CheckpointError, ValueError):
    """The restore target's structure, shape or dtype does not match the checkpoint."""


class InvalidShardsError(CheckpointError, ValueError):
    """A sharding callback returned shards that do not cover the pieces exactly once."""


class CoordinationTimeoutError(CheckpointError, TimeoutError):
    """Some processes did not reach a cross-process stage within ``coordination_timeout``.

    Args:
      message: the stage, the processes that did not arrive, and what to do.
      stage: the name of the stage waited on, as ``.stage``.
      missing: the indices of the processes that did not arrive, as ``.missing``.
    """

    def __init__(self, message: str, *, stage: str, missing: list[int]):
        super().__init__(message)
        self.stage = stage
        self.missing = missing


class RemoteProcessError(CheckpointError):
    """Another process of the job failed at a stage this process was waiting on.

    Args:
      message: the failing process and its error's message.
      remote_type: the class name of its error (e.g. ``"CorruptCheckpointError"``), as
        ``.remote_type``; ``None`` when unknown.
    """

    def __init__(self, message: str, *, remote_type: str | None = None):
        super().__init__(message)
        self.remote_type = remote_type


class ProcessValueMismatchError(CheckpointError):
    """A plain Python leaf has different values on different processes (save it as ``tc.PerProcess``)."""


class ProcessCountMismatchError(CheckpointError):
    """A ``tc.PerProcess`` leaf was saved by another number of processes than restore it, and
    the target gives no ``reshard`` function for it.

    Args:
      message: the key, both process counts, and what to do.
      key: the leaf's checkpoint key.
      saved_count: the processes that saved it, as ``.saved_count``.
      process_count: the processes restoring it, as ``.process_count``.
      file: the checkpoint, as ``.file``.
    """

    def __init__(self, message: str, *, key: str, saved_count: int, process_count: int, file: str | None = None):
        super().__init__(message, key=key, file=file)
        self.saved_count = saved_count
        self.process_count = process_count
