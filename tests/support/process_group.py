"""Runs a scenario in N real JAX processes (CPU, 4 devices each unless told, gloo collectives).

Each process runs ``tests/support/mp_worker.py``, which calls ``jax.distributed.initialize`` against
a coordinator on a free loopback port and then the named function of
``tests/support/mp_scenarios.py``. Processes are always killed at the end, whatever happens.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

WORKER = os.path.join(os.path.dirname(__file__), "mp_worker.py")


@dataclasses.dataclass
class ProcessResult:
    returncode: int
    output: str
    result: dict | None  # the scenario's JSON result, when it returned normally


def results_of(results: list[ProcessResult]) -> list[dict]:
    """Every process's scenario result, in process order, each process having exited cleanly
    (else the assertion shows the end of what it printed)."""
    for r in results:
        assert r.returncode == 0 and r.result is not None, r.output[-4000:]
    return [r.result for r in results]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    scenario: str, num_processes: int, *args: str, timeout: float = 240, devices_per_process: int = 4
) -> list[ProcessResult]:
    """Runs ``mp_scenarios.<scenario>`` in every process."""
    return run_script(WORKER, num_processes, scenario, *args, timeout=timeout, devices_per_process=devices_per_process)


def run_script(
    script: str, num_processes: int, *args: str, timeout: float = 240, devices_per_process: int = 4
) -> list[ProcessResult]:
    """Runs ``script PORT NUM_PROCESSES PROCESS_ID *args`` in every process, each with
    ``devices_per_process`` CPU devices (a pod host has 1 to 8 chips)."""
    port = free_port()
    env = {
        **os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}",
    }
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(port), str(num_processes), str(i), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        for i in range(num_processes)
    ]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # hung: kill it, keep what it printed for the report
                p.kill()
                out, _ = p.communicate()
                out += f"\n[killed after the {timeout:g}s test timeout]"
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [ProcessResult(p.returncode, out, _result(out)) for p, out in zip(procs, outputs)]


def _result(output: str) -> dict | None:
    for line in reversed(output.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return None
