"""What every trainer under torchrun's elastic agent needs around ``--tenplex-layout``: the world it was given,
the device's memory, and a refusal that stops the agent instead of letting it restart a job no restart can fix.

Used by the reference trainer (``training/layout_choice.py``) and the Megatron-LM hook, before any process group.
"""

from __future__ import annotations

import os
import signal
import time
from typing import NoReturn

import torch

from tenplex_megatron import log

_log = log.get("elastic")


def world() -> tuple[int, int]:
    """(world size, processes per node) from torchrun's environment (TP stays within a node)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return size, int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))


def memory_gb(budget: float | None) -> float | None:
    """Per-rank memory for the layout choice: the given budget, else the GPU's, else None (the CPU: no limit)."""
    if budget is not None:
        return float(budget)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return None


def refuse(prog: str, spec: str, world_size: int, error: Exception) -> NoReturn:
    """Log why no layout can run at ``world_size`` and exit 2; under torchrun's elastic agent with restarts
    left, with the agent stopped (which ends the job with a failure rather than restart it forever)."""
    # the message first (every rank: whichever survives the agent's shutdown says it), then stop the agent
    _log.error("%s: --tenplex-layout %s at world size %d: %s", prog, spec, world_size, error)
    stop_agent_and_exit(2)


def stop_agent_and_exit(code: int, wait_seconds: float = 60.0) -> NoReturn:
    """Exit ``code``; under torchrun's elastic agent with restarts left, this node's agent stopped instead of
    restarting a job no restart can fix. Local rank 0 SIGTERMs it (its parent); the other local ranks wait for the
    agent to stop them (up to ``wait_seconds``): exiting first, they could let it restart the group before the
    signal lands."""
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":
        agent = os.getppid()
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            os.kill(agent, signal.SIGTERM)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the agent's SIGTERM ends this process, saving nothing
            deadline = time.monotonic() + wait_seconds
            while os.getppid() == agent and time.monotonic() < deadline:
                time.sleep(0.1)
    raise SystemExit(code)
