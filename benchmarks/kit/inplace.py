"""In-process launchers on this machine standing for nodes (the elastic benchmark's ``inprocess`` policy).

An :class:`InplaceCluster` is a :class:`~benchmarks.kit.agents.Cluster` whose nodes are ``python -m
tenplex_megatron.frontdoor.launch`` processes (``--nnodes N --node-rank R``, a memory directory each) running the
trainer with ``--tenplex-inprocess``. Node 0 serves the job's stores, so a shrink loses the newest nodes first: each
lost node's process group (launcher, ranks, helper) is SIGKILLed at once and its memory removed, and the survivors
continue in their own processes. NVRx's in-process restart only shrinks, so a grow is a planned stop (SIGTERM to
every launcher: every rank saves and exits) and a new launch on all nodes, which resumes from host memory.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

from benchmarks.kit.agents import Cluster, free_port, kill_tree, wait_listening
from benchmarks.kit.launch import env

STOP_TIMEOUT = 300.0  # seconds a planned stop may take (the ranks finish an iteration and save)


@dataclass
class InplaceCluster(Cluster):
    """The in-process launchers of one job: ``nodes`` of ``nproc`` ranks each running ``script args``."""

    launch_timeout: float = 3600.0  # each launcher's --timeout: no rank outlives the benchmark

    def memory(self, node: int) -> str:
        """Node ``node``'s memory directory (its ``--tenplex-memory``)."""
        return os.path.join(self.log_dir, f"{self.name}.mem{node}")

    def _launch(self, node: int, nnodes: int) -> None:
        cmd = [sys.executable, "-m", "tenplex_megatron.frontdoor.launch", "--nnodes", str(nnodes), "--node-rank",
               str(node), "--nproc-per-node", str(self.nproc), "--master-port", str(self.port), "--timeout",
               str(self.launch_timeout), self.script, *self.args, "--tenplex-memory", self.memory(node)]
        log = open(os.path.join(self.log_dir, f"{self.name}.node{node}.log"), "a")
        self.agents[node] = subprocess.Popen(cmd, env=env(), stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)

    def set_nodes(self, n: int) -> None:
        """Shrink to ``n`` nodes in place (the newest lost), or stop every node and launch ``n`` (a grow)."""
        alive = sorted(self.agents)
        if n < len(alive):
            for node in (alive if n == 0 else alive[n:])[::-1]:
                p = self.agents.pop(node)
                os.killpg(p.pid, signal.SIGKILL)  # the node: launcher, ranks, helper at once
                p.wait()
                shutil.rmtree(self.memory(node), ignore_errors=True)  # its memory goes with it
            return
        if n == len(alive):
            return
        for p in self.agents.values():  # a planned stop: every rank saves at the same iteration and exits
            p.send_signal(signal.SIGTERM)
        for node, p in sorted(self.agents.items()):
            try:
                rc = p.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                kill_tree(p)
                rc = None
            if rc != 0:
                self.failures.append(f"{self.name} node {node}: launcher ended with {rc} at a planned stop")
        self.poll()  # the stopped ranks' end, for the change's breakdown
        self.agents.clear()
        self.port, self.round = free_port(), self.round + 1
        self._launch(0, n)
        wait_listening(self.port)
        for node in range(1, n):
            self._launch(node, n)

    def stop(self) -> None:
        for node in list(self.agents):
            p = self.agents.pop(node)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
