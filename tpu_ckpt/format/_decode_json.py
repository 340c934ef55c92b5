"""A manifest's JSON, parsed only where the host can hold what parsing it takes.

Apart from the field checks of ``format/_decode.py`` because it comes before them, and guards the host rather than the
checkpoint: a few hundred MB of hostile or damaged JSON take gigabytes decoded, so that cost is estimated from the bytes
and refused with a CorruptCheckpointError, where ``json.loads`` alone would get the process killed.
"""

from __future__ import annotations

import json
from typing import Any

from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format._manifest import FORMAT_NAME, MAX_INT


def parse_json(body: bytes, where: str) -> dict[str, Any]:
    need = _decoded_bytes(body)
    if need > _available_memory():
        raise _too_big(where, need)
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep to be ours
        raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({str(e)[:200]})", file=where) from None
    except MemoryError:  # a memory limit (ulimit -v) below what the host has free
        raise _too_big(where, need) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a tpu_ckpt manifest", file=where)
    return doc


def _decoded_bytes(body: bytes) -> int:
    """What json.loads holds for ``body``, at least (measured, CPython 3.11): a list and its
    place in its parent 64 bytes, a small object 200, each further value (a comma) a place
    and, unless a small int, its object, 44, and a string ~56 (two quotes). So what a
    manifest will take is known before it is parsed: 200 MB of ``[],`` take over 4 GB, of
    ``{"a":1},`` 5 GB, of ``"ab",`` 2.6 GB, whatever its brackets."""
    return 64 * body.count(b"[") + 200 * body.count(b"{") + 44 * body.count(b",") + 28 * body.count(b'"')


def _available_memory() -> int:
    """The host's free memory (MemAvailable), or no bound where it cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(b"MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return MAX_INT


def _too_big(where: str, need: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: decoding this manifest would take about {need / 1e9:.1f} GB of memory or more, more than "
        "this process can have: it is not a manifest tpu_ckpt wrote, or it is one for a far larger host. "
        "Restore another checkpoint, or restore it where more memory is free.",
        file=where,
    )
