"""The ``--tier`` phases of ``benchmarks/leader_commit_bench.py``: the merge of every leaf at a local-tier restore
(which a job spreads over its processes), on synthetic parts laid out as a local step (see that script's docstring).

Each phase runs in a fresh interpreter; ``planned``, ``index`` and ``pieces`` are the bench's
synthetic plan, per-process index and per-leaf pieces, so the parts are exactly the commit's.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from collections.abc import Callable
from typing import Any

import workers  # benchmarks/workers.py

PLAN = "plan.json"


def run(args: argparse.Namespace, step: str, planned: Callable, index: Callable, pieces: Callable) -> dict:
    if args.phase == "tier_setup":
        return _setup(args, step, planned, index)
    return _after(args, step, pieces)


def _setup(args: argparse.Namespace, step: str, planned: Callable, index: Callable) -> dict:
    """``plan.json`` and every part's binary index, as a local save writes them."""
    from tpu_ckpt.format import IndexPlan, encode_index, staged_index_file

    os.makedirs(step)
    plan = planned(args)
    pathlib.Path(step, PLAN).write_bytes(plan.to_json())
    rows_plan = IndexPlan.of(plan)
    sizes = []
    for process in range(args.processes):
        own = index(args, process)
        sizes.append(pathlib.Path(step, staged_index_file(process)).write_bytes(encode_index(own, rows_plan)))
    return {"index_bytes_per_process": sizes[-1], "index_bytes_total": sum(sizes)}


def _read(step: str, names: list[str]) -> tuple[bytes, list[tuple[str, bytes]]]:
    return pathlib.Path(step, PLAN).read_bytes(), [(name, pathlib.Path(step, name).read_bytes()) for name in names]


def _after(args: argparse.Namespace, step: str, pieces: Callable) -> dict:
    """Read, ``merge_range`` (tiers/_range_merge.py), then the decode of the manifest it makes; the
    first and last leaves' pieces are then loaded from the tables and checked."""
    from tpu_ckpt import storage
    from tpu_ckpt.format import TableSource, decode_manifest, staged_index_file
    from tpu_ckpt.tiers._range_merge import merge_range

    (plan, indexes), read = workers.measured(lambda: _read(step, [staged_index_file(p) for p in range(args.processes)]))
    (body, tables), merge = workers.measured(lambda: merge_range(plan, indexes, storage.location(step)))
    source = TableSource(lambda name, start, length: tables[name][start : start + length], lambda name: name)
    manifest, decode = workers.measured(lambda: decode_manifest(body, where="the merged manifest", tables=source))
    _check(args, manifest, pieces)
    return {"read": read, "merge": merge, "decode": decode}


def _check(args: argparse.Namespace, manifest: Any, pieces: Callable) -> None:
    """The first and last leaves' pieces, loaded from the tables, are the synthetic ones."""
    for leaf in (0, args.leaves - 1):
        expected = sorted(p for q in range(args.processes) for p in pieces(args, q, leaf))
        if sorted(manifest.leaves[leaf].pieces) != expected:
            raise SystemExit(f"leaf {manifest.leaves[leaf].key}: the merged pieces differ from the parts'")
