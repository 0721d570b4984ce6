"""Planned changes in the fault benchmark (``python -m benchmarks.faults --faults reform-join,...``): a node that
joins and a node that leaves on notice, in place (the launcher's ``--reform``/``--join``, no NVRx) beside torchrun's
agents restarting every process for the same change.

Each job trains until the change has been measured, then node 0 is stopped on notice (SIGTERM: every rank saves and
exits 0); 2 ranks per node, ``--tenplex-memory`` (a directory per node), the faults benchmark's tiny GPT.

* ``reform-join``: node 0's launcher (``--reform``, 2 ranks at DP2); after 2 x S iterations a second launcher
  ``--join``s with 2 ranks. Seconds from the newcomer ready (both its ranks registered: their interpreter and
  imports done, reported apart as ``imports``) to the first iteration at DP4;
* ``restart-join``: the same under torchrun's agents (``--nnodes 1:2``, c10d): the newcomer's agent ready (its
  rendezvous begins: ``LOGLEVEL=INFO``'s line, its own imports reported apart), both agents restart every worker
  (new processes, imports), which load from host memory at DP4;
* ``reform-leave``: node 0 and a node joined as above, at DP4 for S iterations; SIGTERM to the joined node's launcher (a leave notice). Seconds
  from the notice to the first iteration at DP2;
* ``restart-leave``: two agents at DP4 (grown as above) for S iterations; torchrun has no leave on notice for one node (SIGTERM to an agent closes the
  rendezvous: the job ends), so the node's agent is SIGKILLed (its workers exit with it) and the other agent
  restarts its workers at DP2. Seconds from the kill to the first iteration at DP2.

Each in-place row is divided by its restart's (``RATIO reform_over_restart ...``, the target at most 0.25) and
its seconds are checked against 3 s (``TARGET ...``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from benchmarks.kit.agents import free_port, kill_tree, rdzv_conf, wait_listening
from benchmarks.kit.fault_rows import Row
from benchmarks.kit.launch import ROOT, env
from benchmarks.kit.report import ratio_line
from tenplex_megatron.storage import directory
from tenplex_megatron.storage.verify_ckpt import verify_checkpoint

NAMES = ("restart-join", "reform-join", "restart-leave", "reform-leave")
JOIN, LEAVE = "a node of 2 ranks joins", "a node of 2 ranks leaves"
RESTART_OF = {f"{JOIN}, in place (--reform)": f"{JOIN}, process restart",
              f"{LEAVE} on notice, in place (--reform)": f"{LEAVE} (agent SIGKILLed), process restart"}
TARGET_S, TARGET_RATIO = 3.0, 0.25
LONG = 100000  # --train-iters: each job runs until it is stopped on notice
TIMEOUT = 600.0
# the elastic tests' keep-alives: on two busy cores a live agent taken for lost (3 missed 1 s heartbeats) had the
# newcomer form a world of its own beside the job; a lost agent is then detected 10 s after its last heartbeat
RDZV = rdzv_conf(keep_alive_attempts=10)
REGISTERED = "registered, waiting for the next re-form"
GENERATION_RE = re.compile(r"re-form: generation \d+: rank \d+ of \d+ \(pid (\d+)\)")
PIDS_RE = re.compile(r"ranks started, pids ((?:\d+:\d+ ?)+)")
LOADED_RE = re.compile(r"> tenplex: loaded iteration (\d+) from (host memory)?.*?(?:([\d.]+) MB read on rank 0|"
                       r"(\d+) bytes read from durable storage)")
SAVED_RE = re.compile(r"> tenplex: (?:saved iteration (\d+) to |persisted \S*iter_(\d+))")
PRETRAIN = os.path.join(ROOT, "scripts", "pretrain_gpt.py")


class RunDir(Protocol):
    """What a row needs of the fault benchmark's run (``benchmarks.faults.Run``)."""

    root: str
    every: int

    @property
    def ckpt(self) -> str: ...

    def flags(self, extra: list[str] = ...) -> list[str]: ...

    def metrics(self) -> list[dict]: ...

    def logs(self) -> str: ...


class Job:
    """One planned change's job: ``run`` is the fault benchmark's run directory (flags, metrics, logs)."""

    def __init__(self, run: RunDir) -> None:
        self.run, self.port = run, free_port()
        self.procs: dict[str, subprocess.Popen] = {}

    def mem(self, node: int) -> list[str]:
        """Node ``node``'s own flags: its memory directory, and training that runs until stopped."""
        return ["--tenplex-memory", os.path.join(self.run.root, f"mem-{node}"), "--train-iters", str(LONG)]

    def _start(self, name: str, cmd: list[str], more: dict[str, str] | None = None) -> subprocess.Popen:
        out = open(os.path.join(self.run.root, f"{name}.log"), "a")
        p = subprocess.Popen(cmd, env=dict(env(), **(more or {})), stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs[name] = p
        return p

    def launcher(self, node: int, join: bool = False) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "tenplex_megatron.frontdoor.launch", "--reform", *(["--join"] if join else []),
               "--node-rank", str(node), "--nproc-per-node", "2", "--master-port", str(self.port), "--timeout",
               str(TIMEOUT), PRETRAIN, *self.run.flags(self.mem(node))]
        p = self._start(f"node{node}", cmd)
        if node == 0:
            wait_listening(self.port)
        return p

    def agent(self, node: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "bench-reform",
               "--rdzv-conf", RDZV, "--max-restarts", "3", "--monitor-interval", "0.5", PRETRAIN,
               *self.run.flags(self.mem(node))]
        p = self._start(f"node{node}", cmd, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"})
        if node == 0:
            wait_listening(self.port)
        return p

    def log(self, name: str) -> str:
        with open(os.path.join(self.run.root, f"{name}.log")) as f:
            return f.read()

    def wait(self, what: str, ready: Callable[[], object], timeout: float = TIMEOUT) -> object:
        """Poll ``ready`` until it is truthy (its value returned); node 0 ending first or the timeout: SystemExit."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            got = ready()
            if got:
                return got
            if self.procs["node0"].poll() is not None:  # another node may end by design (a leave, a kill)
                break
            time.sleep(0.02)
        for p in self.procs.values():  # nothing of a failed row outlives the benchmark
            if p.poll() is None:
                kill_tree(p)
        raise SystemExit(f"bench_faults: {self.run.root}: {what} did not happen\n{self.run.logs()[-4000:]}")

    def iterations(self, dp: int, after: float = 0.0) -> list[dict]:
        return [m for m in self.run.metrics() if m["layout"]["dp"] == dp and m["time"] > after]

    def stop(self, in_place: bool) -> str:
        """SIGTERM to node 0's launcher (in place: the job stops on notice, every rank saves and exits 0; SIGTERM to
        another launcher would be its leave notice) or to every agent; what went wrong, if anything."""
        for name, p in self.procs.items():
            if p.poll() is None and (name == "node0" or not in_place):
                p.send_signal(signal.SIGTERM)
        bad = []
        for name, p in self.procs.items():
            try:
                rc = p.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                rc = None
            if rc not in (0, -signal.SIGKILL) or (rc != 0 and name == "node0"):
                bad.append(f"{name} ended with {rc}")
        for p in self.procs.values():
            if p.poll() is None:
                kill_tree(p)
        return "; ".join(bad)

    def row(self, fault: str, first: dict, seconds: float, done: int, note: str, in_place: bool) -> Row:
        """The change's row once every process has ended: ``first``, the first iteration at the new layout;
        ``done``, the newest iteration before the change."""
        problem = self.stop(in_place)
        logs = self.run.logs()
        reported = {int(a or b) for a, b in SAVED_RE.findall(logs)}
        ckpt = self.run.ckpt
        whole = {it for it in directory.committed_iterations(ckpt)
                 if verify_checkpoint(os.path.join(ckpt, directory.iter_dir_name(it)), workers=1).ok}
        lost = max(0, done - (first["iteration"] - 1))
        loads = [x for x in LOADED_RE.findall(logs)]
        mb = None
        if loads:
            _, memory, durable_mb, durable_bytes = loads[-1]
            mb = float(durable_bytes) / 1e6 if memory else float(durable_mb)
        kept = None
        if in_place:
            started = {int(p) for m in PIDS_RE.finditer(self.log("node0")) for p in
                       (x.split(":")[1] for x in m.group(1).split())}
            kept = {int(p) for p in GENERATION_RE.findall(self.log("node0"))} == started
            note += f"; node 0's processes {'kept' if kept else 'NOT kept'}"
        if problem:
            note += f"; at the stop: {problem}"
        return Row(fault, len(reported - whole), max(0, lost - self.run.every),
                   mb, seconds, note, in_place=in_place, survivors_kept=kept, iterations_lost=lost)


def _grown(job: Job, first: Callable[[int], subprocess.Popen], ready: Callable[[], bool]) -> tuple[float, float,
                                                                                                     dict, int]:
    """Node 0 trains 2 x S iterations at DP2, then node 1 starts: (its start, its ready time, the first iteration at
    DP4, the newest iteration before the change)."""
    first(0)
    job.wait("2 x S iterations at DP2", lambda: len(job.iterations(2)) >= 2 * job.run.every)
    t_start = time.time()
    first(1)
    job.wait("the newcomer ready", ready)
    t_ready = time.time()
    grown = job.wait("an iteration at DP4", lambda: job.iterations(4))
    done = max(m["iteration"] for m in job.run.metrics() if m["time"] <= grown[0]["time"] and
               m["layout"]["dp"] == 2)
    return t_start, t_ready, grown[0], done


def reform_join(run: RunDir) -> Row:
    job = Job(run)
    t_start, t_ready, t_first, done = _grown(job, lambda n: job.launcher(n, join=n == 1),
                                             lambda: job.log("node1").count(REGISTERED) >= 2)
    return job.row(f"{JOIN}, in place (--reform)", t_first, t_first["time"] - t_ready, done,
                   f"from the newcomer's ranks registered; their own start (interpreter, imports) "
                   f"{t_ready - t_start:.1f} s before it", True)


def restart_join(run: RunDir) -> Row:
    job = Job(run)
    t_start, t_ready, t_first, done = _grown(job, job.agent,
                                             lambda: "Rendezvous'ing worker group" in job.log("node1"))
    return job.row(f"{JOIN}, process restart", t_first, t_first["time"] - t_ready, done,
                   f"from the newcomer's agent ready (its rendezvous); its own start {t_ready - t_start:.1f} s "
                   "before it", False)


def _at_four(job: Job, start: Callable[[int], subprocess.Popen], ready: Callable[[], bool]) -> int:
    """Node 0 grows with node 1 (as in the join rows: two agents started together may each form a world of their
    own on two busy cores), then trains S iterations at DP4: the newest iteration."""
    _grown(job, start, ready)
    got = job.wait("S iterations at DP4", lambda: len(job.iterations(4)) >= job.run.every and job.iterations(4))
    return got[-1]["iteration"]


def reform_leave(run: RunDir) -> Row:
    job = Job(run)
    _at_four(job, lambda n: job.launcher(n, join=n == 1), lambda: job.log("node1").count(REGISTERED) >= 2)
    done = job.run.metrics()[-1]["iteration"]
    t = time.time()
    job.procs["node1"].send_signal(signal.SIGTERM)
    first = job.wait("an iteration at DP2 after the notice", lambda: job.iterations(2, t))
    return job.row(f"{LEAVE} on notice, in place (--reform)", first[0], first[0]["time"] - t, done,
                   "from SIGTERM to the node's launcher", True)


def restart_leave(run: RunDir) -> Row:
    job = Job(run)
    _at_four(job, job.agent, lambda: "Rendezvous'ing worker group" in job.log("node1"))
    done = job.run.metrics()[-1]["iteration"]
    t = time.time()
    job.procs["node1"].send_signal(signal.SIGKILL)  # the agent alone: its workers exit with it (engine/orphan.py)
    first = job.wait("an iteration at DP2 after the kill", lambda: job.iterations(2, t))
    return job.row(f"{LEAVE} (agent SIGKILLed), process restart", first[0], first[0]["time"] - t, done,
                   "from SIGKILL to the node's agent (torchrun has no leave on notice)", False)


FAULTS: dict[str, Callable[[RunDir], Row]] = {"restart-join": restart_join, "reform-join": reform_join,
                                               "restart-leave": restart_leave, "reform-leave": reform_leave}


def with_ratios(rows: list[Row]) -> tuple[list[Row], list[str]]:
    """Each in-place planned change over its process restart (same run); the RATIO and TARGET lines."""
    by = {r.fault: r for r in rows}
    out, lines = [], []
    for r in rows:
        base = by.get(RESTART_OF.get(r.fault, ""))
        if r.seconds_to_first_iteration is not None and r.fault in RESTART_OF:
            name = "join" if r.fault.startswith(JOIN) else "leave"
            ok = r.seconds_to_first_iteration <= TARGET_S
            lines.append(f"TARGET reform_{name}_seconds = {r.seconds_to_first_iteration:.2f} (target <= "
                         f"{TARGET_S:g} s: {'met' if ok else 'MISSED'})")
            if base is not None and base.seconds_to_first_iteration:
                x = r.seconds_to_first_iteration / base.seconds_to_first_iteration
                r = replace(r, ratio_to_restart=x)
                lines.append(ratio_line(f"reform_over_restart {name}", x) + f" (target <= {TARGET_RATIO:g})")
        out.append(r)
    return out, lines
