"""What an Orbax checkpoint must be before its files are handed to Orbax, and Orbax's
errors turned into ours.

Orbax and tensorstore trust their files: a FIFO chunk or ``_METADATA`` makes them wait
forever, ``/dev/zero`` as ``_METADATA`` fills memory, a ``.zarray`` nested 200,000 deep
crashes tensorstore's parser, and an array declared at 4 TiB is allocated before any of its
data is read, which kills the process (``std::bad_alloc``) with the staging directory of
the import left behind. So an import first walks the Orbax checkpoint (:func:`check_files`:
regular files inside it only, its zarr metadata small JSON objects, in files or in its
OCDBT database, which is read here through tensorstore as Orbax reads it), then checks what
Orbax's metadata declares against the memory the process can have (:func:`check_memory`),
and reads only then, through :func:`orbax_errors`, which turns whatever Orbax raises on a
damaged file into a :class:`CorruptCheckpointError` naming the checkpoint and the leaves
being read.

Step directories are named as Orbax names them (:func:`step_directories`): ``10`` (or
``00000010``), or ``<prefix>_10`` for a manager given a ``step_prefix``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
from collections.abc import Iterator, Sequence
from typing import Any

import tensorstore as ts

from tpu_ckpt import storage
from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError
from tpu_ckpt.format import PER_PROCESS, LeafEntry, Manifest

ZARR_JSON_FILES = frozenset({".zarray", ".zattrs", ".zgroup", "zarr.json"})
"""The metadata tensorstore parses; Orbax writes each in a few hundred bytes."""
MAX_ZARR_JSON_BYTES = 1 << 20

_PLAIN_STEP = re.compile(r"\d+")
_PREFIXED_STEP = re.compile(r"(.+)_(\d+)")
_ORBAX_TMP = "orbax-checkpoint-tmp"


def check_files(root: str) -> None:
    """Refuses an Orbax checkpoint holding anything but regular files and directories
    inside it: a FIFO, a device, a socket, or a link leading out (see module docstring),
    and zarr metadata that is not a small JSON object. A checkpoint in an object store
    (``gs://``) is no local directory, and holds none of these: nothing is walked."""
    for directory, dirs, names in os.walk(root):
        for name in dirs:
            _check_directory_link(root, os.path.join(directory, name))
        for name in names:
            relative = os.path.relpath(os.path.join(directory, name), root)
            os.close(storage.open_confined(root, relative))  # refuses links out, FIFOs, devices
            if name in ZARR_JSON_FILES:
                data = storage.read_whole(root, relative, MAX_ZARR_JSON_BYTES)
                _check_zarr_json(root, data, os.path.join(root, relative))
    if os.path.isfile(os.path.join(root, "manifest.ocdbt")):
        _check_ocdbt(root)


def _check_ocdbt(root: str) -> None:
    """The zarr metadata stored in the OCDBT database, which no walk sees."""
    with orbax_errors(root):
        base = {"driver": "file", "path": root.rstrip(os.sep) + os.sep}
        kv = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
        names = [
            key for key in kv.list().result() if key.rsplit(b"/", 1)[-1].decode(errors="replace") in ZARR_JSON_FILES
        ]
        reads = [kv.read(key) for key in names]
        for key, read in zip(names, reads):
            _check_zarr_json(root, read.result().value, f"{key.decode(errors='replace')!r} in {root}/manifest.ocdbt")


def _check_zarr_json(root: str, data: bytes | None, where: str) -> None:
    """Zarr metadata must be a small JSON object: nested deep enough, it would crash
    tensorstore's parser, where Python's stops at a thousand levels (RecursionError)."""
    problem = _zarr_json_problem(data) if data is not None else None  # None: gone meanwhile, Orbax will say so
    if problem:
        raise CorruptCheckpointError(f"Zarr metadata {where} {problem}. {_restore_hint(root)}", file=root)


def _zarr_json_problem(data: bytes) -> str | None:
    if len(data) > MAX_ZARR_JSON_BYTES:
        return f"is longer than the {MAX_ZARR_JSON_BYTES} bytes zarr metadata may be"
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        return f"is not valid JSON ({str(e)[:200]})"
    return None if isinstance(doc, dict) else "is not a JSON object"


def _check_directory_link(root: str, path: str) -> None:
    """os.walk does not follow a directory link, but Orbax would: it must stay inside."""
    if not os.path.islink(path):
        return
    resolved, inside = os.path.realpath(path), os.path.realpath(root)
    if not resolved.startswith(inside.rstrip(os.sep) + os.sep):
        raise CorruptCheckpointError(
            f"{path} leads, through a symbolic link, to {resolved}, outside Orbax checkpoint {root}. "
            f"{_restore_hint(root)}",
            file=path,
        )


def check_memory(root: str, batches: Sequence[Sequence[LeafEntry]]) -> None:
    """Refuses, before anything is read, a batch of array leaves larger than
    the memory this process can still have: Orbax allocates a leaf whole before reading it,
    and an allocation that fails inside tensorstore ends the process."""
    headroom = memory_headroom()
    for batch in batches:
        need = sum(entry.nbytes for entry in batch)
        if need > headroom:
            big = max(batch, key=lambda entry: entry.nbytes)
            raise CorruptCheckpointError(
                f"Orbax checkpoint {root} declares array {big.key!r} as {big.dtype}{list(big.shape)}: reading it "
                f"needs {need / 1e9:.1f} GB of memory, more than the {headroom / 1e9:.1f} GB this process can have. "
                "A damaged .zarray declares such shapes; if the checkpoint is sound, import it where more memory "
                "is free (a batch holds one such leaf alone, whatever --max-batch-bytes says).",
                key=big.key, file=root,
            )


def memory_headroom() -> int:
    """The bytes this process can still allocate: the host's free memory (MemAvailable),
    less where ``ulimit -v`` or ``ulimit -d`` leaves less; no bound where none is known."""
    bounds = [_proc_bytes("/proc/meminfo", "MemAvailable:")]
    for limit, used in ((resource.RLIMIT_AS, "VmSize:"), (resource.RLIMIT_DATA, "VmData:")):
        soft, _ = resource.getrlimit(limit)
        if soft != resource.RLIM_INFINITY:
            bounds.append(soft - (_proc_bytes("/proc/self/status", used) or 0))
    known = [bound for bound in bounds if bound is not None]
    return max(min(known), 0) if known else 1 << 62


def _proc_bytes(path: str, field: str) -> int | None:
    try:
        with open(path, "rb") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field.encode()))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


@contextlib.contextmanager
def orbax_errors(root: str, keys: Sequence[str] = ()) -> Iterator[None]:
    """Runs an Orbax call on checkpoint ``root`` (reading leaves ``keys``, or its metadata
    when none): what Orbax and tensorstore raise on a damaged file (ValueError, TypeError,
    KeyError, RecursionError on JSON nested too deep, ...) becomes a CorruptCheckpointError,
    a MemoryError a CheckpointError saying so."""
    what = f"array {keys[0]!r}" if len(keys) == 1 else f"leaves {list(keys)[:5]}" if keys else "the metadata"
    try:
        yield
    except CheckpointError:
        raise
    except MemoryError as e:
        raise CheckpointError(
            f"Ran out of memory reading {what} of Orbax checkpoint {root}; lower max_batch_bytes (--max-batch-bytes) "
            "or import where more memory is free.",
            key=keys[0] if len(keys) == 1 else None, file=root,
        ) from e
    except Exception as e:  # a damaged file surfaces as any of Orbax's error types
        raise CorruptCheckpointError(
            f"Orbax checkpoint {root} is damaged: {what} cannot be read ({_reason(e)}). {_restore_hint(root)}",
            key=keys[0] if len(keys) == 1 else None, file=root,
        ) from e


def _reason(error: Exception) -> str:
    """Orbax's message, one line: tensorstore appends its whole JSON spec, Orbax tree
    mismatches span many lines."""
    text = str(error).split(" [tensorstore_spec=")[0].strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first[:400]}"


def _restore_hint(root: str) -> str:
    return f"Copy {root} again from where it was saved, or import another checkpoint."


def step_directories(path: Any) -> dict[int, Any]:
    """A manager directory's steps, by number, as Orbax names them: plain numbers, or, where
    there are none, ``<prefix>_<n>`` with the one prefix a manager's ``step_prefix`` gives.
    Other directories (``x_5`` beside ``5``, Orbax's ``*.orbax-checkpoint-tmp-*``) are not
    steps; two names for one step, or several prefixes, are refused rather than guessed."""
    names = [c.name for c in path.iterdir() if _ORBAX_TMP not in c.name and c.is_dir()] if path.is_dir() else []
    plain = {name: int(name) for name in names if _PLAIN_STEP.fullmatch(name)}
    prefixed = {name: match for name in names if (match := _PREFIXED_STEP.fullmatch(name))}
    prefixes = sorted({match[1] for match in prefixed.values()})
    if not plain and len(prefixes) > 1:
        raise CheckpointError(
            f"{path} holds steps under several prefixes ({', '.join(p + '_' for p in prefixes)}), as no one Orbax "
            "CheckpointManager writes them: import each step directory on its own.",
            file=str(path),
        )
    steps = plain or {name: int(match[2]) for name, match in prefixed.items()}
    found: dict[int, Any] = {}
    for name, step in sorted(steps.items(), key=lambda item: item[1]):
        if step in found:
            raise CheckpointError(f"{path}: both {found[step].name} and {name} name step {step}; remove one.",
                                  file=str(path))
        found[step] = path / name
    return found


def check_exportable(manifest: Manifest, where: str) -> None:
    """Raises ValueError, naming the key, for a leaf of ``manifest`` that an Orbax checkpoint
    cannot hold, before the export writes anything: a ``tc.PerProcess`` leaf (Orbax would keep
    the exporting process's value and lose the others') and a bytes leaf (Orbax's
    StandardCheckpointer saves arrays and numbers only). Typed PRNG keys Orbax holds as keys."""
    for leaf in manifest.leaves:
        if leaf.kind == PER_PROCESS:
            kind = f"a tc.PerProcess leaf, one value per process ({len(leaf.pieces)} saved it)"
            lost = "an Orbax checkpoint holds one value, and the others would be lost"
        elif leaf.logical == "bytes":
            kind, lost = "a bytes leaf", "Orbax's StandardCheckpointer saves arrays and numbers only"
        else:
            continue
        raise ValueError(
            f"Leaf {leaf.key!r} of {where} is {kind}, which Orbax cannot hold: {lost}. Nothing was exported. "
            "Restore the checkpoint, leave that leaf out, and tc.save the rest to export it (or save it with "
            "Orbax yourself)."
        )
