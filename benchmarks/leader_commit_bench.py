"""The leader's commit at many processes, on synthetic indexes: reading them to the manifest.

    python benchmarks/leader_commit_bench.py [--processes 64] [--devices-per-process 4]
        [--leaves 2200] [--dir /tmp] [--json OUT]

Issue 21's pod-scale target is ``--processes 1536 --devices-per-process 4 --leaves 2200``
(13.5 M pieces); the default (563 k pieces) runs here in under two minutes.

Every leaf is float32 of shape (processes * devices * 4,), one 16-byte piece per device, the
devices of process p holding its p-th stretch: what a pod's fully sharded state looks like to
the commit. Process p's index is written into a local staging directory exactly as a save
writes it (binary rows, ``format.encode_index(commit.index(...), plan)`` as ``index-<p>.bin``),
beside a sparse data file of the size it claims; process 0 (the leader) keeps its own in
memory, as a save does. Then, each in a fresh interpreter (nothing of the setup in its heap):

- ``commit``: the real ``commit.commit`` end to end (read, check and delete every index,
  merge, check the tiling, write the piece tables and the manifest, rename), under
  ``gc_paused`` as a save runs it: wall and CPU time (getrusage), peak RSS growth (VmHWM over
  VmRSS before it).
- ``stages``: the same work stage by stage on the same files: decode (read + ``decode_index``
  of every index), merge + tiling (``merge_rows``), encode (``encode_manifest``: the format 2
  manifest and its tables); µs per piece each.

The indexes are copied aside before the commit (which deletes them) and put back for the
stages. CPU time is this process's (all threads): on a shared machine it is the steadier number.

``--tier`` measures a local-tier restore's merge instead, on the same synthetic parts laid
out as a local step (``plan.json`` and every part's ``index-<p>.bin``): ``tier`` reads them
and runs ``merge_range`` (tiers/_range_merge.py) over all the leaves (decode and check every index,
``merge_rows``, the format 2 manifest and its tables), then decodes that manifest (one entry
per leaf; the tables are read lazily). A job spreads this merge over its processes, a range
of leaves each (``tiers/_range_merge.py``), so each does about 1/N of it: the figure is the
whole merge, the most any one host would do at N = 1.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import tier_phases  # benchmarks/tier_phases.py
import workers  # benchmarks/workers.py

MB = 1e6
PIECE_BYTES = 16  # float32 x 4
PHASES = ("setup", "commit", "stages")
TIER_PHASES = ("tier_setup", "tier")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=64)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--leaves", type=int, default=2200)
    parser.add_argument("--dir", default=None, help="where the scratch directory goes (default: the system's temp dir)")
    parser.add_argument("--json", default=None, help="also write the results here, as JSON")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds each phase may take")
    parser.add_argument("--tier", action="store_true",
                        help="time a local-tier restore's merge of every leaf (what a job spreads over its processes)")
    parser.add_argument("--phase", choices=(*PHASES, *TIER_PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(_run_phase(args)))
        return 0
    scratch = tempfile.mkdtemp(prefix="tpu_ckpt_leader_commit_", dir=args.dir)
    try:
        phases = TIER_PHASES if args.tier else PHASES
        results = {phase: _child(args, phase, scratch) for phase in phases}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = _tier_summary(args, results) if args.tier else _summary(args, results)
    (_tier_report if args.tier else _report)(summary)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


def _child(args: argparse.Namespace, phase: str, scratch: str) -> dict:
    command = [
        sys.executable, __file__, "--phase", phase, "--path", scratch, "--processes", str(args.processes),
        "--devices-per-process", str(args.devices_per_process), "--leaves", str(args.leaves),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"phase {phase} failed with exit status {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_phase(args: argparse.Namespace) -> dict:
    staging, saved = os.path.join(args.path, "ckpt.tmp-bench"), os.path.join(args.path, "indexes")
    if args.phase in TIER_PHASES:
        return tier_phases.run(args, os.path.join(args.path, "step_1"), _planned, _index, _pieces)
    if args.phase == "setup":
        return _setup(args, staging, saved)
    if args.phase == "commit":
        return _commit(args, staging, os.path.join(args.path, "ckpt"))
    final = os.path.join(args.path, "ckpt")  # the commit renamed the staging directory, and deleted the indexes
    for name in os.listdir(saved):
        shutil.copy(os.path.join(saved, name), os.path.join(final, name))
    return _stages(args, final)


def _layout(args: argparse.Namespace) -> tuple[int, int]:
    """Devices in all, elements per leaf."""
    devices = args.processes * args.devices_per_process
    return devices, devices * PIECE_BYTES // 4


def _name(leaf: int) -> str:
    return f"leaf{leaf:05d}"


def _pieces(args: argparse.Namespace, process: int, leaf: int) -> list:
    """Process ``process``'s pieces of leaf number ``leaf``: one per device, side by side in
    its one data file, leaf after leaf."""
    from tpu_ckpt.format import PieceEntry, data_file_name

    d = args.devices_per_process
    file = data_file_name(process, 0)
    offset = leaf * d * PIECE_BYTES
    own = []
    for device in range(process * d, (process + 1) * d):
        start = device * (PIECE_BYTES // 4)
        crc = (leaf * 7919 + device) & 0xFFFFFFFF
        own.append(PieceEntry(((start, start + PIECE_BYTES // 4),), file, offset, PIECE_BYTES, crc))
        offset += PIECE_BYTES
    return own


def _index(args: argparse.Namespace, process: int):
    """Process ``process``'s index as a save makes it (``commit.index``): its devices' pieces
    of every leaf, one data file."""
    from tpu_ckpt.format import data_file_name
    from tpu_ckpt.saving._commit import index

    pieces = {_name(leaf): _pieces(args, process, leaf) for leaf in range(args.leaves)}
    return index(pieces, {data_file_name(process, 0): args.leaves * args.devices_per_process * PIECE_BYTES})


def _planned(args: argparse.Namespace):
    """The plan's manifest: the tree, no piece locations yet."""
    from tpu_ckpt.format import LeafEntry, Manifest

    _, elements = _layout(args)
    leaves = tuple(
        LeafEntry(_name(i), [("dict", _name(i))], "array", (elements,), "float32") for i in range(args.leaves)
    )
    return Manifest(leaves, {}, args.processes, "bench")


def _setup(args: argparse.Namespace, staging: str, saved: str) -> dict:
    """Every other process's index file and (sparse) data file in the staging directory; the
    leader's data file too. Copies of the indexes go to ``saved``."""
    from tpu_ckpt.format import IndexPlan, data_file_name, encode_index, staged_index_file

    os.makedirs(staging)
    os.makedirs(saved)
    plan = IndexPlan.of(_planned(args))
    sizes = []
    for process in range(args.processes):
        own = _index(args, process)
        with open(os.path.join(staging, data_file_name(process, 0)), "wb") as f:
            f.truncate(own.files[data_file_name(process, 0)])
        body = encode_index(own, plan)
        sizes.append(len(body))
        if process:
            name = staged_index_file(process)
            pathlib.Path(staging, name).write_bytes(body)
            shutil.copy(os.path.join(staging, name), os.path.join(saved, name))
    return {"index_bytes_per_process": sizes[-1], "index_bytes_total": sum(sizes[1:])}


def _commit(args: argparse.Namespace, staging: str, final: str) -> dict:
    """The real commit, end to end; then a check that the manifest it wrote reads back whole."""
    from tpu_ckpt import storage
    from tpu_ckpt.runtime import gc_paused
    from tpu_ckpt.saving._commit import commit

    planned, own = _planned(args), _index(args, 0)
    store = storage.Store(storage.location(staging))
    with store, gc_paused():
        _, measured = workers.measured(
            lambda: commit(store, storage.location(final), planned, own, range(1, args.processes))
        )
    files = [p for p in pathlib.Path(final).iterdir() if not p.name.endswith(".safetensors")]
    measured["manifest_and_table_bytes"] = sum(p.stat().st_size for p in files)
    measured["checked_pieces"] = _check(args, final)
    return measured


def _check(args: argparse.Namespace, final: str) -> int:
    """Reads the committed checkpoint's manifest and the first and last leaves' pieces back;
    raises unless each is where the synthetic index put it. Returns the pieces checked."""
    from tpu_ckpt import catalog, storage

    manifest = catalog.read_manifest(storage.location(final))
    checked = 0
    for leaf in (0, args.leaves - 1):
        entry = manifest.leaves[leaf]
        expected = sorted(p for q in range(args.processes) for p in _pieces(args, q, leaf))
        if list(entry.pieces) != expected:
            raise SystemExit(f"leaf {entry.key}: the committed pieces differ from the indexes'")
        checked += len(expected)
    return checked


def _stages(args: argparse.Namespace, where: str) -> dict:
    """The commit's CPU stages one by one, on the same indexes."""
    from tpu_ckpt import saving, storage
    from tpu_ckpt.format import IndexPlan, decode_index, encode_index, encode_manifest, grids_shared, staged_index_file
    from tpu_ckpt.runtime import gc_paused

    planned = _planned(args)
    plan = IndexPlan.of(planned)
    own = decode_index(encode_index(_index(args, 0), plan), where="the leader's own index", plan=plan)
    store = storage.Store(storage.location(where))

    def decode() -> list:
        names = [staged_index_file(p) for p in range(1, args.processes)]
        return [own, *(decode_index(store.read_file(n), where=n, plan=plan) for n in names)]

    with store, gc_paused(), grids_shared():
        indexes, decoded = workers.measured(decode)
        (merged, grids), merge = workers.measured(lambda: saving.merge_rows(planned, plan, indexes))
        _, encode = workers.measured(lambda: encode_manifest(merged, grids))
    return {"decode": decoded, "merge_and_tiling": merge, "encode": encode}


def _summary(args: argparse.Namespace, results: dict) -> dict:
    pieces = args.processes * args.devices_per_process * args.leaves
    stages = results["stages"]
    return {
        "processes": args.processes, "devices_per_process": args.devices_per_process, "leaves": args.leaves,
        "pieces": pieces, **results["setup"], "commit": results["commit"],
        "stages": {name: {**s, "us_per_piece_cpu": s["cpu_s"] / pieces * 1e6,
                          "us_per_piece_wall": s["wall_s"] / pieces * 1e6}
                   for name, s in stages.items()},
    }


def _report(summary: dict) -> None:
    c = summary["commit"]
    print(f"{summary['processes']} processes x {summary['devices_per_process']} devices x {summary['leaves']} leaves"
          f" = {summary['pieces']:,} pieces")
    print(f"binary indexes: {summary['index_bytes_per_process']:,} bytes a process, "
          f"{summary['index_bytes_total']:,} in all;"
          f" manifest + tables {c['manifest_and_table_bytes']:,} bytes")
    print(f"commit.commit: wall {c['wall_s']:.2f} s, CPU {c['cpu_s']:.2f} s, "
          f"peak RSS growth {c['rss_growth_mb']:.0f} MB"
          f" ({c['cpu_s'] / summary['pieces'] * 1e6:.2f} us CPU a piece); "
          f"{c['checked_pieces']:,} pieces read back and checked")
    print(f"{'stage':<18}{'wall s':>8}{'CPU s':>8}{'us/piece':>10}{'RSS MB':>8}")
    for name, s in summary["stages"].items():
        print(f"{name:<18}{s['wall_s']:>8.2f}{s['cpu_s']:>8.2f}{s['us_per_piece_cpu']:>10.2f}{s['rss_growth_mb']:>8.0f}")


def _tier_summary(args: argparse.Namespace, results: dict) -> dict:
    pieces = args.processes * args.devices_per_process * args.leaves
    timed = {phase: stages for phase, stages in results.items() if phase != "tier_setup"}
    return {
        "processes": args.processes, "devices_per_process": args.devices_per_process, "leaves": args.leaves,
        "pieces": pieces, **results["tier_setup"],
        **{phase: {name: {**s, "us_per_piece_cpu": s["cpu_s"] / pieces * 1e6} for name, s in stages.items()}
           for phase, stages in timed.items()},
    }


def _tier_report(summary: dict) -> None:
    print(f"local-tier restore, the merge of every leaf (spread over the processes in a job): "
          f"{summary['processes']} processes x {summary['devices_per_process']}"
          f" devices x {summary['leaves']} leaves = {summary['pieces']:,} pieces")
    print(f"{'path':<12}{'stage':<10}{'wall s':>8}{'CPU s':>8}{'us/piece':>10}{'RSS MB':>8}")
    for name, s in summary.get("tier", {}).items():
        print(f"{'tier':<12}{name:<10}{s['wall_s']:>8.2f}{s['cpu_s']:>8.2f}{s['us_per_piece_cpu']:>10.2f}{s['rss_growth_mb']:>8.0f}")


if __name__ == "__main__":
    sys.exit(main())
