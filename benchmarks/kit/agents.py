"""torchrun elastic agents on this machine standing for nodes: start them, lose them, and watch their workers.

A :class:`Cluster` keeps ``n`` agents (``torch.distributed.run --nnodes 1:MAX --rdzv-backend c10d``) of one
job. Node 0 hosts the c10d rendezvous store, so a shrink loses the newest nodes first and node 0 only when
the allocation goes to zero (the job then pauses; the next grow starts a fresh rendezvous on a new port and
the workers resume from the newest checkpoint). A lost node is SIGKILLed with its workers (no notice: the
survivors detect the failure themselves). :meth:`Cluster.poll` records when every worker process was first
seen and when it was gone, for the change breakdown.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import psutil

from benchmarks.kit.launch import env

# last_call_timeout: how long the rendezvous waits for more nodes after MIN joined; keep-alives detect lost agents
# (an agent whose heartbeat is older than interval x attempts seconds is taken for lost)
KEEP_ALIVE_ATTEMPTS = 3


def rdzv_conf(keep_alive_attempts: int = KEEP_ALIVE_ATTEMPTS, join_timeout: int = 600) -> str:
    """torchrun's ``--rdzv-conf`` for the benchmarks' (and the elastic tests') agents. On oversubscribed cores an
    agent's heartbeat thread can stall for seconds: taken for lost, the node that hosts the job is dropped from the
    rendezvous and a node that joins then forms a world of its own beside it; more attempts trade that away for
    slower detection of a lost agent."""
    return (f"last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt={keep_alive_attempts},"
            f"join_timeout={join_timeout}")


RDZV_CONF = rdzv_conf()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"no torchrun agent listens on port {port} after {timeout:.0f} s")


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers (torchrun starts workers in sessions of their own: kill them too)."""
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=60)


@dataclass
class WorkerSpan:
    """One worker process: the node (agent) it ran under, when it was first seen and when it was gone."""

    pid: int
    node: int
    seen: float
    gone: float | None = None


@dataclass
class Cluster:
    """The agents of one job: ``nodes`` of ``nproc`` workers each running ``script args``."""

    name: str
    script: str
    args: list[str]
    max_nodes: int
    nproc: int
    log_dir: str
    agents: dict[int, subprocess.Popen] = field(default_factory=dict)
    workers: dict[int, WorkerSpan] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    port: int = 0
    round: int = 0
    rdzv_conf: str = RDZV_CONF

    def _start(self, node: int) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"1:{self.max_nodes}",
               "--nproc-per-node", str(self.nproc), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", f"{self.name}-{self.round}",
               "--rdzv-conf", self.rdzv_conf, "--max-restarts", "100", "--monitor-interval", "0.5",
               self.script, *self.args]
        # a separate rendezvous store per round (torch 2.13's shared store hung re-rendezvous when a node joined)
        e = dict(env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        log = open(os.path.join(self.log_dir, f"{self.name}.node{node}.log"), "a")
        self.agents[node] = subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)

    def set_nodes(self, n: int) -> None:
        """Grow to or shrink to ``n`` agents (0: the job pauses)."""
        alive = sorted(self.agents)
        if n < len(alive):
            for node in (alive if n == 0 else alive[n:])[::-1]:
                kill_tree(self.agents.pop(node))
            return
        if not self.agents:  # a fresh rendezvous: node 0 hosts its store
            self.port, self.round = free_port(), self.round + 1
            self._start(0)
            wait_listening(self.port)
        for node in range(n):
            if node not in self.agents:
                self._start(node)

    def poll(self) -> None:
        """Record new and finished workers; note agents that ended with a failure."""
        now = time.time()
        live = set()
        for node, agent in list(self.agents.items()):
            rc = agent.poll()
            if rc is not None:
                if rc != 0:
                    self.failures.append(f"{self.name} node {node}: agent exited with status {rc}")
                del self.agents[node]
                continue
            try:
                children = psutil.Process(agent.pid).children(recursive=False)
            except psutil.NoSuchProcess:
                continue
            for c in children:
                live.add(c.pid)
                if c.pid not in self.workers:
                    self.workers[c.pid] = WorkerSpan(c.pid, node, now)
        for span in self.workers.values():
            if span.gone is None and span.pid not in live:
                span.gone = now

    @property
    def done(self) -> bool:
        """Every agent has exited (the job finished, or failed: see ``failures``)."""
        return not self.agents

    def stop(self) -> None:
        for node in list(self.agents):
            kill_tree(self.agents.pop(node))
