"""A ranged read's bytes, cut back into the lengths asked for, from the requests it was issued as."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tpu_ckpt.storage import _safe_reads as safe_reads


def request_chunks(
    start: int, lengths: Sequence[int], ranges: Sequence[tuple[int, int]], data: Sequence[np.ndarray]
) -> list[np.ndarray]:
    """One array per length, from the requests' bytes: a view where the length lies in one
    request, else a fresh aligned array it is copied into.

    The one copy of a range that is unavoidable is tensorstore's, out of the Cord it received
    into the ``bytes`` its Python API returns; views add none. They are read-only (``bytes``
    are immutable, so the file's later fate cannot change them either) and 16-byte aligned
    (CPython's allocators), not 64: JAX's CPU backend copies them where it would adopt an
    aligned array, and what the restore hands to the user is copied (``restore_exec``).
    """
    out, at, r = [], start, 0
    for n in lengths:
        while at >= ranges[r][1] and r + 1 < len(ranges):
            r += 1
        if at + n <= ranges[r][1]:
            out.append(data[r][at - ranges[r][0] : at - ranges[r][0] + n])
        else:
            chunk = safe_reads.aligned_empty(n)
            for (first, last), received in zip(ranges[r:], data[r:]):
                a, b = max(first, at), min(last, at + n)
                chunk[a - at : b - at] = received[a - first : b - first]
                if b == at + n:
                    break
            out.append(chunk)
        at += n
    return out
