#!/usr/bin/env python
"""Run a training job through a schedule of faults and report, per fault, what it cost.

    python -m benchmarks.faults [--iters 60] [--save-interval 10] [--faults NAME,...] [--out r.json]
    python -m benchmarks.faults --quick          # fewer iterations (the smoke test runs it with --faults)
    python -m benchmarks.faults --megatron-lm DIR --faults mlm-restart@rank3   # Megatron-LM's rows alone

Every fault hits a fresh run of ``scripts/pretrain_gpt.py --tenplex`` (a tiny GPT, CPU and gloo, or the GPUs where
present) under real torchrun agents on this machine, and the job must carry on by itself:

* ``kill@<phase>``: a worker SIGKILLed at a phase of the save of iteration 2 x S (``TENPLEX_FAULT``, once): its agent
  restarts the group, which resumes from the newest complete checkpoint;
* ``enospc@save.tensors``: a rank's shard write fails with ENOSPC: the save fails on every rank, the agent restarts;
* ``agent``: two agents (nodes, c10d rendezvous); the one not hosting the rendezvous store is SIGKILLed alone: its
  worker exits with it (``engine/orphan.py``), the other re-forms the rendezvous and trains on alone;
* ``etcd-host``: the same with ``--rdzv-backend etcd-v2`` (a real etcd server) and the agent started first killed;
* ``flip@snapshot`` / ``flip@replica``: two nodes with host-memory snapshots (K=2, persisted every snapshot) stop at
  iteration 3 x S; a byte of rank 0's file of the newest snapshot is flipped in every node's copy (snapshot) or in
  the other node's copy only (replica); the restart falls back (``memory/fallback.py``);
* ``second-job``: a second job started on the running job's ``--save``, both plain torchrun launches without
  ``--rdzv-id`` (run id ``none``): refused at start (the lease);
* ``restart@rank1``: the in-place rows' fault under torchrun's agent (2 ranks, ``--tenplex-memory``, rank 1
  SIGKILLed while it writes its snapshot of iteration 2 x S): the agent restarts both workers (new processes,
  imports), which load from host memory; the process restart the in-place rows are compared with;
* ``inprocess@rank1`` / ``inprocess@rank0``: ``--tenplex-inprocess`` with ``--tenplex-memory`` under the in-process
  launcher (``python -m tenplex_megatron.frontdoor.launch``, NVRx), 2 ranks at DP2; the rank SIGKILLed while it
  writes its snapshot of iteration 2 x S; the survivor continues in its own process at DP1 from host memory;
* ``inprocess@node1``: two in-process launchers of 2 ranks each (``--nnodes 2``, a memory directory each) at DP4,
  8 x --iters; once node 1's part of a snapshot from iteration 2 x S on is in node 0's memory, node 1's process
  group (launcher, ranks, helper) is SIGKILLed and its memory removed; node 0's ranks continue in place at DP2;
* ``inprocess-stop@rank1``: as ``inprocess@rank1`` but the rank SIGSTOPped (hung): NVRx's progress timeouts end it;
* ``reform-join``, ``restart-join``, ``reform-leave``, ``restart-leave``: planned changes, a node joining or
  leaving on notice in place (the launcher's ``--reform``) beside torchrun's agents restarting every process for the
  same change (``benchmarks/kit/faults_reform.py``; ``RATIO reform_over_restart ...``, targets 3 s and 0.25);
* with ``--megatron-lm DIR``, Megatron-LM's own ``pretrain_gpt.py`` (``benchmarks/kit/faults_mlm.py``): its process
  restart and its in-place rows (``mlm-restart@rank3``, ``mlm-inprocess@rank3``, ``mlm-inprocess@rank0``).

The in-place rows' note says whether the survivors' process ids stayed the same and the timeouts used; their
seconds run to the first iteration at the new layout, and each is divided by the ``restart@rank1`` row's when that
ran too (``RATIO in_place_over_restart ...``; the issue's target: at most 0.25).

Per fault: checkpoints lost (durable checkpoints the job reported committed that are missing or fail their
checksums at the end), iterations lost (the newest iteration done before the fault minus the one resumed from) and
those beyond the save interval (less S), megabytes rank 0 read from durable storage at the recovery, and the seconds from
the fault to the first iteration after it (a restart row: from the relaunch, imports included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import psutil

from benchmarks.kit import faults_mlm, faults_reform
from benchmarks.kit.agents import RDZV_CONF, free_port, kill_tree, wait_listening
from benchmarks.kit.etcd import EtcdError, start_etcd
from benchmarks.kit.fault_rows import Row, inplace_timeouts, survivors
from benchmarks.kit.launch import ROOT, env, write_json
from benchmarks.kit.report import Column, Table, machine, num, ratio_line
from tenplex_megatron.storage import directory
from tenplex_megatron.storage.verify_ckpt import verify_checkpoint

PRETRAIN = os.path.join(ROOT, "scripts", "pretrain_gpt.py")
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--vocab-size", "96", "--make-vocab-size-divisible-by", "16",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
         "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--mock-data", "--tenplex", "--log-interval", "1"]
TIMEOUT = 600.0
SAVED_RE = re.compile(r"> tenplex: saved iteration (\d+) to ")
PERSISTED_RE = re.compile(r"> tenplex: persisted \S*iter_(\d+)")
LOADED_RE = re.compile(r"> tenplex: loaded iteration (\d+) from (host memory)?.*?(?:([\d.]+) MB read on rank 0|"
                       r"(\d+) bytes read from durable storage)")


@dataclass
class Run:
    """One fault's working directory: the durable checkpoint, the metrics, the agents' logs."""

    root: str
    iters: int
    every: int

    @property
    def ckpt(self) -> str:
        return os.path.join(self.root, "ckpt")

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.root, "metrics.jsonl")

    def flags(self, extra: list[str] = ()) -> list[str]:
        return [*MODEL, "--train-iters", str(self.iters), "--save-interval", str(self.every), "--save", self.ckpt,
                "--load", self.ckpt, "--tenplex-metrics", self.metrics_path, *extra]

    def metrics(self) -> list[dict]:
        if not os.path.exists(self.metrics_path):
            return []
        with open(self.metrics_path) as f:
            return [json.loads(x) for x in f if x.strip()]

    def logs(self) -> str:
        return "".join(open(os.path.join(self.root, n)).read() for n in sorted(os.listdir(self.root))
                       if n.endswith(".log"))

    def agent(self, name: str, nnodes: str, nproc: int, rdzv: list[str], extra: list[str] = (),
              more_env: dict[str, str] | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
               *rdzv, "--max-restarts", "3", "--monitor-interval", "0.5", PRETRAIN, *self.flags(extra)]
        e = dict(env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **(more_env or {}))
        return subprocess.Popen(cmd, env=e, stdout=open(os.path.join(self.root, f"{name}.log"), "a"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    def wait_iters(self, n: int, dp: int | None = None, timeout: float = TIMEOUT) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            got = self.metrics()
            if len(got) >= n and (dp is None or got[-1]["layout"]["dp"] == dp):
                return
            time.sleep(0.2)
        raise SystemExit(f"bench_faults: {self.root}: fewer than {n} iterations after {timeout:.0f} s\n"
                         f"{self.logs()[-4000:]}")

    def finish(self, fault: str, t_fault: float | None, done_before: int | None, note: str = "",
               new_layout: bool = False) -> Row:
        """Measure the run once every agent has exited: ``done_before``: the newest iteration done at the fault;
        ``new_layout``: time to the first iteration at a layout other than the one trained at the fault."""
        logs = self.logs()
        reported = {int(m) for m in SAVED_RE.findall(logs)} | {int(m) for m in PERSISTED_RE.findall(logs)}
        whole = {it for it in directory.committed_iterations(self.ckpt)
                 if verify_checkpoint(os.path.join(self.ckpt, directory.iter_dir_name(it)), workers=1).ok}
        lost = len(reported - whole)
        got = self.metrics()
        if {m["iteration"] for m in got} != set(range(1, self.iters + 1)):
            note = (note + "; " if note else "") + "training did not reach its last iteration"
        if t_fault is None or done_before is None:
            return Row(fault, lost, None, None, None, note)
        after = [m for m in got if m["time"] > t_fault]
        if new_layout:
            before = [m["layout"] for m in got if m["time"] <= t_fault][-1:]
            after = [m for m in after if [m["layout"]] != before]
        if not after:
            return Row(fault, lost, None, None, None, note + "; nothing ran after the fault")
        resumed = after[0]["iteration"] - 1
        loads = LOADED_RE.findall(logs)
        mb = None
        if loads:
            _, memory, durable_mb, durable_bytes = loads[-1]
            mb = float(durable_bytes) / 1e6 if memory else float(durable_mb)
        return Row(fault, lost, max(0, done_before - resumed - self.every), mb, after[0]["time"] - t_fault, note,
                   iterations_lost=max(0, done_before - resumed))


def _wait_all(procs: list[subprocess.Popen], what: str, run: Run) -> None:
    for p in procs:
        try:
            rc = p.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0:
            for q in procs:
                if q.poll() is None:
                    kill_tree(q)
            raise SystemExit(f"bench_faults: {what}: an agent ended with {rc}\n{run.logs()[-4000:]}")


def _standalone(run: Run, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    return run.agent("job", "1", 2, ["--standalone"], more_env=extra_env)


def worker_fault(point: str, rank: int, kind: str) -> Callable[[Run], Row]:
    """A worker (``rank``) fails at ``point`` of the save of iteration 2 x S (once)."""
    def go(run: Run) -> Row:
        at = 2 * run.every
        once = os.path.join(run.root, "fault-fired")
        job = _standalone(run, {"TENPLEX_FAULT": f"{point}@{rank}#{at}:{kind}", "TENPLEX_FAULT_ONCE": once})
        _wait_all([job], point, run)
        fired = os.path.getmtime(once) if os.path.exists(once) else None
        return run.finish(f"{'ENOSPC' if kind == 'enospc' else 'SIGKILL worker'} @ {point}", fired, at,
                          "" if fired else "the fault never fired")
    return go


def _two_nodes(run: Run, rdzv: list[str], names: tuple[str, str] = ("node0", "node1"), nnodes: str = "1:2",
               extra: tuple[list[str], list[str]] = ([], [])) -> list[subprocess.Popen]:
    """Two agents of one node each; the first hosts the c10d store (or, with etcd, simply starts first)."""
    a = run.agent(names[0], nnodes, 1, rdzv, extra[0])
    if "c10d" in rdzv:
        wait_listening(int(rdzv[rdzv.index("--rdzv-endpoint") + 1].rsplit(":", 1)[1]))
    else:
        time.sleep(2)
    return [a, run.agent(names[1], nnodes, 1, rdzv, extra[1])]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_agent_alone(agents: list[subprocess.Popen], victim: int) -> str:
    """SIGKILL one agent (not its worker); returns how long its worker outlived it."""
    workers = psutil.Process(agents[victim].pid).children()
    t0 = time.time()
    agents[victim].send_signal(signal.SIGKILL)
    agents[victim].wait(timeout=60)
    while any(_alive(w) for w in workers) and time.time() - t0 < 30:
        time.sleep(0.05)
    return f"its worker exited {time.time() - t0:.2f} s after it"


def agent_loss(backend: str) -> Callable[[Run], Row]:
    """Two nodes; c10d: the agent not hosting the store is lost; etcd-v2: the agent started first."""
    def go(run: Run) -> Row:
        etcd = None
        if backend == "c10d":
            rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        else:
            try:
                etcd, port = start_etcd(os.path.join(run.root, "etcd"))
            except EtcdError as e:
                raise SystemExit(f"bench_faults: {e}") from None
            rdzv = ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        rdzv += ["--rdzv-id", "bench-faults", "--rdzv-conf", RDZV_CONF]
        agents = _two_nodes(run, rdzv)
        try:
            run.wait_iters(2 * run.every + 2, dp=2)
            done = run.metrics()[-1]["iteration"]
            t = time.time()
            note = _kill_agent_alone(agents, 1 if backend == "c10d" else 0)
            survivor = agents[0 if backend == "c10d" else 1]
            _wait_all([survivor], f"{backend} agent loss", run)
        finally:
            for p in agents:
                if p.poll() is None:
                    kill_tree(p)
            if etcd is not None:
                etcd.kill()
                etcd.wait()
        return run.finish("SIGKILL agent (c10d)" if backend == "c10d" else "SIGKILL rendezvous host (etcd)",
                          t, done, note)
    return go


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b ^ 0x40]))


def flip(where: str) -> Callable[[Run], Row]:
    """Two nodes with host-memory snapshots stop at 3 x S; a byte of the newest snapshot is flipped; restart."""
    def go(run: Run) -> Row:
        stop = 3 * run.every
        mems = [os.path.join(run.root, f"mem{n}") for n in (0, 1)]
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "bench-flip",
                "--rdzv-conf", RDZV_CONF]
        memory = ["--tenplex-replicas", "2", "--tenplex-persist-interval", "1"]
        first = _two_nodes(run, rdzv, ("first0", "first1"), "2",
                           ([*memory, "--tenplex-memory", mems[0], "--exit-interval", str(stop)],
                            [*memory, "--tenplex-memory", mems[1], "--exit-interval", str(stop)]))
        _wait_all(first, "the run before the flip", run)
        rank0 = 0 if "> tenplex-megatron: layout" in open(os.path.join(run.root, "first0.log")).read() else 1
        name = directory.rank_file_name(0)
        targets = [mems[0], mems[1]] if where == "snapshot" else [mems[1 - rank0]]
        for m in targets:
            _flip(os.path.join(m, directory.iter_dir_name(stop), name))
        t = time.time()
        rdzv[3] = f"127.0.0.1:{free_port()}"
        second = _two_nodes(run, rdzv, ("second0", "second1"), "2",
                            ([*memory, "--tenplex-memory", mems[0]], [*memory, "--tenplex-memory", mems[1]]))
        _wait_all(second, "the restart after the flip", run)
        copies = "every node's copy" if where == "snapshot" else "the other node's copy (a replica)"
        return run.finish(f"flipped byte in a {where}", t, stop, f"{name} of iteration {stop}: {copies}")
    return go


#: a torchrun agent with the trainer's modules imported, held until a line on stdin, then torchrun's own main: its
#: worker is forked from it (``--run-path --start-method fork``) with its imports done
_HELD_TORCHRUN = ("import runpy, sys, torch.distributed.run as r; a = r.parse_args(sys.argv[1:]); "
                  "runpy.run_path(a.training_script, run_name='__preload__'); print('ready', flush=True); "
                  "sys.stdin.readline(); r.main(sys.argv[1:])")


def second_job(run: Run) -> Row:
    """A second job on the running job's ``--save``, both plain torchrun launches without --rdzv-id (run id
    ``none``, each its static rendezvous on its own --master-port): the second is refused at start, the first runs
    on untouched. The second is started first and held, its imports done, until the first job is past its first
    checkpoint (a tiny job would otherwise be over before the second's imports are)."""
    second = subprocess.Popen([sys.executable, "-c", _HELD_TORCHRUN, "--run-path", "--start-method", "fork",
                               "--nproc-per-node", "1", "--master-port", str(free_port()), PRETRAIN, *run.flags()],
                              env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    head = []  # what the second printed before its imports were done (warnings)
    while (line := second.stdout.readline()) and line.strip() != "ready":
        head.append(line)
    if not line:
        raise SystemExit(f"bench_faults: the second job exited before its imports were done:\n{''.join(head)[-3000:]}")
    job = run.agent("job", "1", 2, ["--master-port", str(free_port())])
    try:
        run.wait_iters(run.every + 2)
        t0 = time.time()
        out, _ = second.communicate("go\n", timeout=TIMEOUT)
        refused = time.time() - t0
        ok = second.returncode != 0 and f"{run.ckpt} is held by job 'torchrun-" in out
        _wait_all([job], "the first job", run)
    finally:
        for p in (job, second):
            if p.poll() is None:
                kill_tree(p)
    return run.finish("second job on the same --save", None, None,
                      f"refused at start in {refused:.2f} s (imports done beforehand), naming the holder" if ok else
                      f"NOT refused: exit {second.returncode}: {out[-300:]}")


INPROCESS_TIMEOUT = 30  # --tenplex-inprocess-timeout of the in-process rows that kill (s)
STOP_TIMEOUT = 8  # the SIGSTOP row's: a hung rank is caught only by NVRx's progress timeouts (1.5x, 2x this)
RESTART = "restart@rank1"  # the process restart the in-place rows are compared with (same fault, same run)


def _launcher(run: Run, name: str, nproc: int, port: int, extra: list[str], more_env: dict[str, str] | None = None,
              nodes: tuple[int, int] | None = None) -> subprocess.Popen:
    """``python -m tenplex_megatron.frontdoor.launch`` (the stores served outside the ranks) running the trainer in
    place; ``nodes``: (this launcher's node rank, the number of nodes)."""
    where = ["--nnodes", str(nodes[1]), "--node-rank", str(nodes[0])] if nodes else []
    cmd = [sys.executable, "-m", "tenplex_megatron.frontdoor.launch", *where, "--nproc-per-node", str(nproc),
           "--master-port", str(port), "--timeout", str(TIMEOUT), PRETRAIN, *run.flags(["--tenplex-inprocess", *extra])]
    return subprocess.Popen(cmd, env=dict(env(), **(more_env or {})), stdout=open(os.path.join(run.root, f"{name}.log"),
                            "a"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_launcher(job: subprocess.Popen, what: str, run: Run) -> None:
    try:
        job.wait(timeout=TIMEOUT + 30)
    finally:
        if job.poll() is None:
            kill_tree(job)
    if job.returncode != 0:
        raise SystemExit(f"bench_faults: in place, {what}: the launcher ended with {job.returncode}\n"
                         f"{run.logs()[-4000:]}")


def _in_place_row(run: Run, fault: str, t_fault: float | None, done_before: int, seconds: float, lost: set[int],
                  what: str = "") -> Row:
    if t_fault is None:
        return run.finish(fault, None, done_before, "the fault never fired")
    kept, ended = survivors(run.logs(), lost)
    note = (f"{what}survivors' processes {'kept' if kept else 'NOT kept'}"
            f"{'; also ended by NVRx (stuck in a collective): rank ' + ', '.join(map(str, ended)) if ended else ''}; "
            f"{inplace_timeouts(seconds)}")
    return replace(run.finish(fault, t_fault, done_before, note, new_layout=True), in_place=True, survivors_kept=kept,
                   survivors_ended=ended)


def inprocess_fault(victim: int, kind: str = "kill") -> Callable[[Run], Row]:
    """2 ranks in place (NVRx) at DP2; ``victim`` SIGKILLed (``kill``) or SIGSTOPped (``stop``: a hung rank, ended
    by NVRx's hard timeout) while it writes its snapshot of iteration 2 x S (once)."""
    def go(run: Run) -> Row:
        at = 2 * run.every
        once = os.path.join(run.root, "fault-fired")
        seconds = STOP_TIMEOUT if kind == "stop" else INPROCESS_TIMEOUT
        extra = ["--tenplex-memory", os.path.join(run.root, "mem"), "--tenplex-inprocess-timeout", str(seconds)]
        job = _launcher(run, "job", 2, free_port(), extra,
                        {"TENPLEX_FAULT": f"memory.write@{victim}#{at}:{kind}", "TENPLEX_FAULT_ONCE": once})
        _wait_launcher(job, f"rank {victim} {'stopped' if kind == 'stop' else 'lost'}", run)
        fired = os.path.getmtime(once) if os.path.exists(once) else None
        fault = f"{'SIGSTOP' if kind == 'stop' else 'SIGKILL'} rank {victim}, in place (NVRx)"
        return _in_place_row(run, fault, fired, at, seconds, {victim})
    return go


NODE_ITERS = 8  # the node row trains this many times --iters: the helpers that replicate need seconds to start


def _replicated(mem: str, ranks: range, since: int) -> int | None:
    """The newest iteration from ``since`` on whose snapshot in ``mem`` (a node's memory directory) holds the files
    of ``ranks`` (another node's: replicas), or None."""
    names = {directory.rank_file_name(r) for r in ranks}
    found = []
    for it in directory.committed_iterations(mem) if os.path.isdir(mem) else []:
        try:
            if it >= since and names <= set(os.listdir(os.path.join(mem, directory.iter_dir_name(it)))):
                found.append(it)
        except FileNotFoundError:  # removed by retention meanwhile
            pass
    return max(found, default=None)


def inprocess_node(run: Run) -> Row:
    """Two in-process launchers of 2 ranks each (nodes on localhost, a memory directory each) at DP4, training
    ``NODE_ITERS`` x --iters; once node 1's part of a snapshot from iteration 2 x S on is replicated into node 0's
    memory, node 1 is lost: its launcher, ranks and helper SIGKILLed at once (its process group), its memory removed.
    Node 0's ranks continue in place at DP2."""
    run = Run(run.root, run.iters * NODE_ITERS, run.every)
    port, mems = free_port(), [os.path.join(run.root, f"mem-{n}") for n in (0, 1)]
    extra = ["--tenplex-inprocess-timeout", str(INPROCESS_TIMEOUT)]
    nodes = [_launcher(run, f"node{n}", 2, port, [*extra, "--tenplex-memory", mems[n]], nodes=(n, 2)) for n in (0, 1)]
    try:
        deadline = time.time() + TIMEOUT
        while _replicated(mems[0], range(2, 4), 2 * run.every) is None or run.metrics()[-1]["layout"]["dp"] != 4:
            if time.time() > deadline or any(p.poll() is not None for p in nodes):
                raise SystemExit(f"bench_faults: in place, node lost: no snapshot of node 1 from iteration "
                                 f"{2 * run.every} on replicated to node 0 while the job ran\n{run.logs()[-4000:]}")
            time.sleep(0.05)
        done = run.metrics()[-1]["iteration"]
        t = time.time()
        os.killpg(nodes[1].pid, signal.SIGKILL)  # node 1: launcher, ranks, helper
        nodes[1].wait()
        shutil.rmtree(mems[1], ignore_errors=True)  # its memory goes with it
        _wait_launcher(nodes[0], "node 1 lost", run)
    finally:
        for p in nodes:
            if p.poll() is None:
                kill_tree(p)
    return _in_place_row(run, "SIGKILL node of 2 ranks, in place (NVRx)", t, done, INPROCESS_TIMEOUT, {2, 3},
                         "2 of 4 ranks left; ")


def process_restart(run: Run) -> Row:
    """The in-place rows' fault under torchrun's agent: 2 ranks with ``--tenplex-memory``, rank 1 SIGKILLed while it
    writes its snapshot of iteration 2 x S (once); the agent restarts both workers (new processes, imports), which
    load from host memory at the same layout."""
    at = 2 * run.every
    once = os.path.join(run.root, "fault-fired")
    job = run.agent("job", "1", 2, ["--standalone"], ["--tenplex-memory", os.path.join(run.root, "mem")],
                    {"TENPLEX_FAULT": f"memory.write@1#{at}", "TENPLEX_FAULT_ONCE": once})
    _wait_all([job], "process restart", run)
    fired = os.path.getmtime(once) if os.path.exists(once) else None
    return run.finish("SIGKILL rank 1, process restart", fired, at, "" if fired else "the fault never fired")


def with_ratios(rows: list[Row]) -> tuple[list[Row], list[str]]:
    """Each in-place row's seconds to its first iteration over the process restart's of the same trainer in the same
    run (the reference trainer's, or Megatron-LM's; the issue's target: at most 0.25); the RATIO lines."""
    restarts = {mlm: next((r for r in rows if r.fault == name and r.seconds_to_first_iteration), None)
                for mlm, name in ((False, "SIGKILL rank 1, process restart"), (True, faults_mlm.RESTART))}
    out, lines = [], []
    for r in rows:
        restart = restarts["Megatron-LM" in r.fault]
        if r.in_place and r.fault not in faults_reform.RESTART_OF and r.seconds_to_first_iteration is not None and restart is not None:
            x = r.seconds_to_first_iteration / restart.seconds_to_first_iteration
            r = replace(r, ratio_to_restart=x)
            who = "mlm_" if "Megatron-LM" in r.fault else ""
            lines.append(ratio_line(f"in_place_over_restart {who}{r.fault.split(',')[0].replace(' ', '_')}", x) +
                         " (target <= 0.25)")
        out.append(r)
    return out, lines


FAULTS: dict[str, Callable[[Run], Row]] = {
    "kill@save.gather": worker_fault("save.gather", 1, "kill"),
    "kill@save.tensors": worker_fault("save.tensors", 1, "kill"),
    "kill@save.metadata": worker_fault("save.metadata", 0, "kill"),
    "kill@save.commit": worker_fault("save.commit", 0, "kill"),
    "enospc@save.tensors": worker_fault("save.tensors", 1, "enospc"),
    "agent": agent_loss("c10d"),
    "etcd-host": agent_loss("etcd"),
    "flip@snapshot": flip("snapshot"),
    "flip@replica": flip("replica"),
    "second-job": second_job,
    RESTART: process_restart,
    "inprocess@rank1": inprocess_fault(1),
    "inprocess@rank0": inprocess_fault(0),
    "inprocess@node1": inprocess_node,
    "inprocess-stop@rank1": inprocess_fault(1, "stop"),
    **faults_reform.FAULTS,
}


def commit_id() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=60, help="training iterations of each run (default 60)")
    p.add_argument("--save-interval", type=int, default=10, help="S: iterations between checkpoints (default 10)")
    p.add_argument("--quick", action="store_true", help="30 iterations, S=5")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of: {', '.join(FAULTS)}")
    p.add_argument("--out", default=None, help="write the rows and the machine as JSON here")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep each run's directory under DIR")
    p.add_argument("--megatron-lm", default=None, metavar="DIR",
                   help=f"a Megatron-LM checkout (core_v0.15-0.17): also its own pretrain_gpt.py's rows "
                        f"({', '.join(faults_mlm.NAMES)}); alone with --faults naming only those")
    a = p.parse_args(argv)
    iters, every = (30, 5) if a.quick else (a.iters, a.save_interval)
    names = [x for x in a.faults.split(",") if x]
    if a.megatron_lm:
        names += [n for n in faults_mlm.NAMES if n not in names]
    known = {**FAULTS, **dict.fromkeys(faults_mlm.NAMES)} if a.megatron_lm else FAULTS
    unknown = [x for x in names if x not in known]
    if unknown:
        p.error(f"unknown fault(s) {', '.join(unknown)}: choose from {', '.join(known)}"
                + ("" if a.megatron_lm else f" ({', '.join(faults_mlm.NAMES)} with --megatron-lm DIR)"))
    if iters < 4 * every:
        p.error(f"--iters {iters} must be at least 4 x --save-interval ({4 * every}): faults strike at 2 x and 3 x S")
    base = a.keep or tempfile.mkdtemp(prefix="bench_faults.")
    table = dict(FAULTS)
    if a.megatron_lm:
        table.update(faults_mlm.faults(faults_mlm.setup(a.megatron_lm, base)))
    rows, load_start = [], os.getloadavg()
    for name in names:
        root = os.path.join(base, name.replace("@", "_"))
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        t0 = time.time()
        row = table[name](Run(root, iters, every))
        rows.append(row)
        print(f"> bench_faults: {name}: {time.time() - t0:.0f} s", flush=True)
    if a.keep is None:
        shutil.rmtree(base, ignore_errors=True)
    rows, ratios = with_ratios(rows)
    rows, planned = faults_reform.with_ratios(rows)
    ratios += planned
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    info = {**machine(), "commit": commit_id(), "date": when, "iters": iters, "save_interval": every,
            "load_average_start": load_start}
    print(f"fault benchmark: {iters} iterations, a checkpoint every {every}; {info['cpus']} CPUs, torch "
          f"{info['torch']}, gpu {info['gpu']}; commit {info['commit']}; {when}; load average (1/5/15 min) at the "
          f"start {' '.join(f'{x:.1f}' for x in load_start)}, at the end "
          f"{' '.join(f'{x:.1f}' for x in info['load_average'])}")
    t = Table([Column("fault", 40, "<"), Column("ckpts lost", 10), Column("iters lost", 10), Column("> S", 4),
               Column("durable MB (rank 0)", 19), Column("s to 1st iter", 13), Column("/ restart", 9),
               Column("note", 0, "<", "  ")])
    print(t.header())
    for r in rows:
        print(t.row(r.fault, str(r.checkpoints_lost), num(r.iterations_lost, "d"), num(r.iterations_lost_beyond_interval, "d"),
                    num(r.durable_mb_rank0, ".2f"), num(r.seconds_to_first_iteration, ".1f"),
                    num(r.ratio_to_restart, ".2f"), r.note))
    for line in ratios:
        print(line)
    if a.out:
        write_json(a.out, {"machine": info, "rows": [asdict(r) for r in rows], "ratios": ratios}, indent=1)
    bad = [r.fault for r in rows if r.checkpoints_lost or (r.iterations_lost_beyond_interval or 0)]
    if bad:
        print(f"bench_faults: target missed (checkpoints or iterations lost) in: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
