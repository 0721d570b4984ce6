"""Running the GPU check's processes: the time budget and each step's limit, the environment every process gets,
launches side by side in process groups of their own stopped on the clock, and how each ended."""

from __future__ import annotations

import itertools
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: each step's own limit in seconds (the bench gets what is left; mlm, after it, at most 180 s of what the bench left);
#: a step also never runs past the budget
STEP_LIMIT = {"env": 60, "pytest": 180, "identity": 150, "snapshot": 100, "resume": 200, "mlm": 180}
REPORT_RESERVE = 10.0  # seconds kept for writing the report


@dataclass
class Clock:
    """The check's time budget: seconds left, and each step's limit within it."""

    budget: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start) - REPORT_RESERVE

    def limit(self, step: str) -> float:
        return max(0.0, min(STEP_LIMIT.get(step, math.inf), self.left()))


def child_env(site: str | None, hide_cuda: bool) -> dict[str, str]:
    """The environment of every process a step starts: the carried packages and the checkout first on the path,
    one thread per process, no index for pip, and ``CUDA_VISIBLE_DEVICES=""`` where CUDA must be hidden."""
    env = dict(os.environ)
    path = [p for p in (site, ROOT, env.get("PYTHONPATH")) if p]
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PIP_NO_INDEX="1")
    if hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@dataclass
class Launch:
    """One process (group) of a step: its command, environment and log file, and how it ended."""

    cmd: list[str]
    env: dict[str, str]
    log: str
    rc: int | None = None
    seconds: float = 0.0


def run_all(launches: list[Launch], timeout: float) -> None:
    """Run the launches side by side, each in its own session (torchrun's workers included), until they end or
    ``timeout`` seconds pass: then each one still running gets SIGTERM, then SIGKILL, and rc 124."""
    procs = []
    t0 = time.monotonic()
    for launch in launches:
        os.makedirs(os.path.dirname(launch.log), exist_ok=True)
        log = open(launch.log, "w")
        log.write(f"$ {shlex.join(launch.cmd)}\n")
        log.flush()
        procs.append((launch, log, subprocess.Popen(launch.cmd, stdout=log, stderr=subprocess.STDOUT, env=launch.env,
                                                    cwd=ROOT, start_new_session=True)))
    for launch, log, p in procs:
        try:
            launch.rc = p.wait(max(0.1, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            stop(p)
            launch.rc = 124
            log.write(f"\n[gpu_check: stopped after {timeout:.0f} s]\n")
        launch.seconds = time.monotonic() - t0
        log.close()


def stop(p: subprocess.Popen) -> None:
    """End the process group this check started for ``p`` (SIGTERM, 10 s, then SIGKILL)."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


_LOG_SEQ = itertools.count(1)


def log_path(work: str, name: str) -> str:
    """``work/logs/NN-name.log``: numbered in the order the launches are made, the order ``gpu_check.log`` keeps."""
    return os.path.join(work, "logs", f"{next(_LOG_SEQ):02d}-{name}.log")


def python_step(args: list[str], work: str, name: str, site: str | None, hide_cuda: bool,
                timeout: float) -> Launch:
    """Run this Python with ``args`` as step ``name`` (its log in ``work/logs``) and wait for it."""
    launch = Launch([sys.executable, *args], child_env(site, hide_cuda), log_path(work, name))
    run_all([launch], timeout)
    return launch


def status_of(rc: int | None) -> str:
    """A launch's exit status as a step's result (124: stopped on the clock)."""
    return "pass" if rc == 0 else "timeout" if rc == 124 else "fail"


def outcome(launch: Launch) -> dict[str, Any]:
    """A launch's status and seconds, and on failure its output's last line (usually the error) as the why."""
    out: dict[str, Any] = {"status": status_of(launch.rc), "seconds": launch.seconds}
    if launch.rc != 0:
        with open(launch.log, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
        out["why"] = f"exit status {launch.rc}: {lines[-1][:300] if lines else 'no output'}"
    return out


def visible_device(device: str, visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` that shows only ``device`` (``cuda:N``), within what ``visible`` already shows."""
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    shown = [d.strip() for d in visible.split(",")] if visible else None
    if shown is None:
        return str(index)
    if index >= len(shown):
        raise ValueError(f"{device}: CUDA_VISIBLE_DEVICES={visible!r} shows {len(shown)} device(s)")
    return shown[index]
