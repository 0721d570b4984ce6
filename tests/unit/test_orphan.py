"""A worker started under torchrun dies with its parent (the agent): real processes, no torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the "agent": starts a "worker" that arms the parent-death kill, says its pid, then both wait
AGENT = """
import subprocess, sys, time
w = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=dict(__import__("os").environ, TORCHELASTIC_RUN_ID="t"))
print(w.pid, flush=True)
time.sleep(600)
"""
WORKER = """
import sys, time
from tenplex_megatron.engine.orphan import die_with_agent
sys.stdout.write(die_with_agent() + "\\n"); sys.stdout.flush()
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _run(worker: str, env: dict[str, str], wait: float = 10) -> tuple[int, float]:
    """Start agent and worker, SIGKILL the agent; returns the worker's pid and the seconds it outlived the agent."""
    agent = subprocess.Popen([sys.executable, "-c", AGENT, worker], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=ROOT, **env))
    pid = int(agent.stdout.readline())
    time.sleep(0.5)  # the worker has armed by now (its interpreter starts in ~50 ms)
    t0 = time.time()
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    while not _gone(pid) and time.time() - t0 < wait:
        time.sleep(0.02)
    alive = not _gone(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    return pid, (float("inf") if alive else time.time() - t0)


def test_worker_dies_with_its_agent() -> None:
    _, seconds = _run(WORKER, {})
    assert seconds < 2, seconds


def test_off_switch_leaves_the_worker_running() -> None:
    _, seconds = _run(WORKER, {"TENPLEX_ORPHAN_EXIT": "0"}, wait=2)
    assert seconds == float("inf")


def test_not_armed_outside_torchrun() -> None:
    out = subprocess.run([sys.executable, "-c", "from tenplex_megatron.engine.orphan import die_with_agent; "
                          "print(repr(die_with_agent()))"], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"} | {"PYTHONPATH": ROOT})
    assert out.stdout.strip() == "''", out.stderr
