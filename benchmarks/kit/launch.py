"""Launching workers (torchrun or one process) with the benchmarks' environment, and collecting their JSON.

Every worker runs with ``OMP_NUM_THREADS=1`` and the repository on ``PYTHONPATH``; its output goes to a log file,
and a failure or a timeout stops the benchmark with the log's tail (the command and the log are named).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOG_TAIL_CHARS = 6000


def env() -> dict[str, str]:
    """The workers' environment: one thread per process (the machine's cores are the ranks'), unbuffered output."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")


def run(cmd: list[str], log: str, timeout: float) -> None:
    """Run ``cmd`` with its output in ``log``; on failure or timeout exit with the log's tail."""
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, env=env(), stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    if rc != 0:
        with open(log) as f:
            tail = f.read()[-LOG_TAIL_CHARS:]
        why = f"timed out after {timeout:.0f} s" if rc is None else f"failed (exit {rc})"
        sys.exit(f"bench: {' '.join(cmd[:8])} ... {why}; log {log}:\n{tail}")


def program(target: str) -> list[str]:
    """How an interpreter runs ``target``: a script's path (``*.py``) as itself, a module name (a benchmark's own
    workers: ``__spec__.name``) with ``-m``, as the benchmarks themselves are run."""
    return [os.path.abspath(target)] if target.endswith(".py") else ["-m", target]


def torchrun(nproc: int, target: str, args: list[str], log: str, timeout: float) -> None:
    """``nproc`` ranks of ``target args`` (see :func:`program`) on this machine (torchrun --standalone), as
    :func:`run`."""
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
         *program(target), *args], log, timeout)


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def write_json(path: str, obj: Any, indent: int | None = None) -> None:
    """Write ``obj`` as JSON (a worker's result: rank 0 only; the report), creating the directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)
