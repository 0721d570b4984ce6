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


def test_armed_once_per_process_and_again_in_a_forked_child() -> None:
    """A second call finds the process armed (the kernel's record, nothing kept in the module); a forked child
    starts unarmed (the kernel clears the signal at fork) and arms against its own parent."""
    script = """
import os
from tenplex_megatron.engine.orphan import armed, die_with_agent
first, again = die_with_agent(), die_with_agent()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, f"{armed()!r} {die_with_agent()!r} {armed()!r}".encode())
    os._exit(0)
os.waitpid(pid, 0)
print(first, again, os.read(r, 100).decode())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT, TORCHELASTIC_RUN_ID="t"))
    assert out.stdout.split() == ["prctl", "prctl", "''", "'prctl'", "'prctl'"], out.stderr


def test_the_watchdog_is_started_once() -> None:
    """Where prctl is missing: the watchdog thread arms the process, and is its record (one thread for two calls)."""
    script = """
import threading
from tenplex_megatron.engine import orphan
def missing(*a, **k):
    raise OSError("no prctl here")
orphan.ctypes.CDLL = missing
print(orphan.die_with_agent(), orphan.die_with_agent(), orphan.armed(),
      sum(t.name == orphan.WATCH_THREAD for t in threading.enumerate()))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT, TORCHELASTIC_RUN_ID="t"))
    assert out.stdout.split() == ["watchdog", "watchdog", "watchdog", "1"], out.stderr


HOOK_WORKER = """
import sys, argparse
from tenplex_megatron.engine import orphan
from tenplex_megatron.frontdoor import megatron_lm
print(repr(megatron_lm.arm_with_tenplex(argparse.Namespace())), repr(orphan.armed()), flush=True)
print(repr(megatron_lm.arm_with_tenplex(argparse.Namespace(tenplex=True))), repr(orphan.armed()), flush=True)
"""


def test_the_megatron_lm_hook_arms_the_worker_only_with_tenplex() -> None:
    """Without ``--tenplex`` the patched pretrain_gpt.py behaves as the stock one: no parent-death signal armed in the
    torchrun worker (checked in the kernel); with it, armed."""
    out = subprocess.run([sys.executable, "-c", HOOK_WORKER], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT, TORCHELASTIC_RUN_ID="t"))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")
    assert lines[0] == "'' ''" and lines[1] == "'prctl' 'prctl'", out.stdout
