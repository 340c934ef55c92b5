"""Shared test helpers (no fixtures: plain functions)."""

from __future__ import annotations

import json
import os

import numpy as np


def bits(x) -> np.ndarray:
    """The raw bytes of an array, for bit-exact comparisons (NaN payloads included)."""
    a = np.ascontiguousarray(np.asarray(x))
    return a.reshape(-1).view(np.uint8)


def manifest(path: str) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def files(path: str) -> dict[str, int]:
    """The manifest's data files, name -> size."""
    return dict(manifest(path)["files"])


def leaf(path: str, key: str) -> dict:
    """One leaf's manifest entry, its pieces decoded into dicts (see FORMAT.md)."""
    doc = manifest(path)
    names = [name for name, _ in doc["files"]]
    entry = next(e for e in doc["leaves"] if e["key"] == key)
    entry["pieces"] = [
        {"slice": spec, "file": names[f], "offset": offset, "length": length, "crc32c": crc}
        for spec, f, offset, length, crc in entry.get("pieces", [])
    ]
    return entry


def read_chars() -> int:
    """Bytes this process has read through read(2)-like calls so far (/proc/self/io rchar).

    Local restores map data files rather than read them, and mapped pages are not counted
    here: tests that count bytes read set ``TPU_CKPT_MMAP=0`` (the read plan, which decides
    what is fetched, is the same either way)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def sealed(doc: dict) -> bytes:
    """A manifest document as tpu_ckpt writes it: compact JSON ending in its own crc32c.

    Tests that hand-edit a manifest re-seal it, so that what they test is the edit, not the
    checksum (which would refuse any edit)."""
    from tpu_ckpt.format import seal

    body = {k: v for k, v in doc.items() if k != "manifest_crc32c"}
    return seal(json.dumps(body, separators=(",", ":")).encode())


def write_manifest(path: str, doc: dict) -> None:
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(sealed(doc))
