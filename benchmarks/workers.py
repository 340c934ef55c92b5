"""What the multi-process benchmark scripts share: a free port, and N worker processes of a
script, each printing one JSON line last, run to completion (killed on the way out)."""

from __future__ import annotations

import json
import pathlib
import resource
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: list[str], processes: int, extra: list[str], env: dict, timeout: float = 900) -> list[dict]:
    """Runs ``command --worker PORT INDEX *extra`` for INDEX in 0..processes-1, against one
    coordinator port; returns each worker's last line, parsed. A failed worker ends the run,
    as does one still running ``timeout`` seconds after the start."""
    return launch_jobs([command], processes, extra, env, timeout)[0]


def launch_jobs(
    commands: list[list[str]], processes: int, extra: list[str], env: dict, timeout: float = 900
) -> list[list[dict]]:
    """:func:`launch` of several independent jobs at once, one per command, each with its own
    coordinator port: the workers of every job run side by side, so that jobs of one process
    each share the machine's cores as the processes of one larger job would."""
    jobs, ports = [], set()
    for command in commands:
        port = free_port()
        while port in ports:  # a port just released may come back
            port = free_port()
        ports.add(port)
        jobs.append([
            subprocess.Popen([*command, "--worker", str(port), str(i), *extra], stdout=subprocess.PIPE, text=True,
                             env=env)
            for i in range(processes)
        ])
    procs = [p for job in jobs for p in job]
    try:
        deadline = time.monotonic() + timeout
        outputs = {p: p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: exit codes {[p.returncode for p in procs]}")
    return [[json.loads(outputs[p].strip().splitlines()[-1]) for p in job] for job in jobs]


if __name__ == "__main__":
    sys.exit("a module of the benchmark scripts, not a script")


MB = 1e6


def measured(call) -> tuple:
    """``call()``'s result; its wall time, CPU time (user + system, every thread of this
    process) and peak RSS growth (VmHWM after over VmRSS before, the peak reset first)."""
    rss_before = status_kib("VmRSS") * 1024 / MB
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    cpu_before, start = cpu_seconds(), time.perf_counter()
    result = call()
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu_before
    peak = status_kib("VmHWM") * 1024 / MB
    return result, {"wall_s": wall, "cpu_s": cpu, "rss_growth_mb": peak - rss_before, "rss_before_mb": rss_before,
                    "peak_rss_mb": peak}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def status_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)
