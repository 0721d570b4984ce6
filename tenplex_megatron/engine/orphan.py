"""Workers die with their torchrun agent: a SIGKILLed agent (a lost or drained node) otherwise leaves its workers
running, holding GPUs and perhaps still writing into the checkpoint directory.

Under torchrun (``TORCHELASTIC_RUN_ID`` set) a worker's parent is its agent. Linux's parent-death signal
(``prctl(PR_SET_PDEATHSIG, SIGKILL)``) kills the worker the moment the agent dies: no handler runs, so nothing is
saved or committed after that. Where ``prctl`` is missing, a daemon thread polls the parent's pid instead. Outside
torchrun nothing is armed (a job started from a shell must survive that shell, under ``nohup`` say).
``TENPLEX_ORPHAN_EXIT=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

from tenplex_megatron import log as tlog

log = tlog.get("orphan")

OFF_ENV = "TENPLEX_ORPHAN_EXIT"
AGENT_IGNORES_SIGTERM = "TENPLEX_AGENT_IGNORES_SIGTERM"  # frontdoor/slurm.py's SIGTERM_ENV (engine imports no frontdoor)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PR_GET_PDEATHSIG = 2
POLL_SECONDS = 0.5  # the watchdog's period where prctl is missing
WATCH_THREAD = "tenplex-orphan-watch"


def _watch(parent: int) -> None:
    """The fallback: SIGKILL this process once its parent is no longer ``parent`` (it died; we were re-parented)."""
    while os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)


def armed() -> str:
    """How this process is armed already ("prctl", "watchdog"), else "": the kernel's parent-death signal and the
    watchdog thread are the record, and neither survives a fork (a forked child has a parent of its own to watch)."""
    sig = ctypes.c_int(0)
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0) == 0 and \
                sig.value == signal.SIGKILL:
            return "prctl"
    except (OSError, AttributeError):  # not Linux: only the watchdog arms here
        pass
    return "watchdog" if any(t.name == WATCH_THREAD and t.is_alive() for t in threading.enumerate()) else ""


def die_with_agent() -> str:
    """Arm the parent-death kill in a torchrun worker; returns how ("prctl", "watchdog") or "" where not armed."""
    if os.environ.pop(AGENT_IGNORES_SIGTERM, None) == "1":  # frontdoor/slurm.py: the agent alone ignores SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    how = armed()
    if how:
        return how
    if not os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get(OFF_ENV) == "0":
        return ""
    parent = os.getppid()
    if parent == 1:  # already re-parented to init: the agent is gone
        os.kill(os.getpid(), signal.SIGKILL)
    how = "prctl"
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    except (OSError, AttributeError) as e:  # not Linux, or refused: poll instead
        log.debug("parent-death signal unavailable (%s): polling the parent's pid", e)
        how = "watchdog"
        threading.Thread(target=_watch, args=(parent,), name=WATCH_THREAD, daemon=True).start()
    if os.getppid() != parent:  # the agent died between reading its pid and arming the signal
        os.kill(os.getpid(), signal.SIGKILL)
    return how
