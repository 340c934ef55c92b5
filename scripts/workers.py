"""What the multi-process benchmark scripts share: a free port, and N worker processes of a
script, each printing one JSON line last, run to completion (killed on the way out)."""

from __future__ import annotations

import json
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
    port = free_port()
    procs = [
        subprocess.Popen([*command, "--worker", str(port), str(i), *extra], stdout=subprocess.PIPE, text=True, env=env)
        for i in range(processes)
    ]
    try:
        deadline = time.monotonic() + timeout
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: exit codes {[p.returncode for p in procs]}")
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


if __name__ == "__main__":
    sys.exit("a module of the benchmark scripts, not a script")
