"""Cluster faults with real torchrun agents: a worker dies with its agent (``engine/orphan.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tenplex_megatron.storage import directory
from tests.harness import CHILD_PYTHONPATH, PRETRAIN, TINY_GPT, metrics

pytestmark = pytest.mark.dist
FLAGS = [*TINY_GPT, "--vocab-size", "96", "--train-iters", "100000", "--save-interval", "3"]


def _wait_for(log: str, n: int, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(log) and len(metrics(log)) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"{log}: fewer than {n} iterations after {timeout} s")


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_worker_exits_when_its_agent_is_killed(tmp_path) -> None:
    """SIGKILL of the agent alone: its worker exits within seconds and commits nothing after."""
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=CHILD_PYTHONPATH, PYTHONUNBUFFERED="1")
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                              PRETRAIN, *FLAGS, "--save", ckpt, "--tenplex-metrics", log], env=env,
                             stdout=open(tmp_path / "agent.log", "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        _wait_for(log, 7)  # past two commits
        (worker,) = psutil.Process(agent.pid).children()
        t0 = time.time()
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=30)
        while not _gone(worker) and time.time() - t0 < 30:
            time.sleep(0.05)
        seconds = time.time() - t0
        committed = directory.committed_iterations(ckpt)
        ran = len(metrics(log))
        time.sleep(2)
        assert _gone(worker), "the worker outlived its agent by 30 s"
    finally:
        for p in psutil.Process(agent.pid).children(recursive=True) if agent.poll() is None else []:
            p.kill()
        if agent.poll() is None:
            agent.kill()
    print(f"worker exited {seconds:.2f} s after its agent was SIGKILLed")
    assert seconds < 5, seconds
    assert directory.committed_iterations(ckpt) == committed and len(metrics(log)) == ran  # nothing after
    assert not directory.partial_dirs(ckpt) or committed  # at most a save cut short, never committed
