"""Cluster faults with real torchrun agents: a worker dies with its agent (``engine/orphan.py``); one writer per
checkpoint directory (``storage/lease.py``): a second job is refused at start even when both are plain torchrun
launches without --rdzv-id (``storage/job_identity.py``) while an elastic restart of one takes the next generation at
once, a split rendezvous leaves the newest generation alone writing, a dead holder's lease is taken over at once; a damaged checkpoint is skipped
(``memory/fallback.py``); with torchrun's etcd rendezvous (a real etcd server) losing the first agent's node does
not end the job."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from benchmarks.kit.agents import rdzv_conf
from benchmarks.kit.etcd import start_etcd
from tenplex_megatron.storage import directory, lease
from tenplex_megatron.storage.verify_ckpt import verify_checkpoint
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


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=CHILD_PYTHONPATH, PYTHONUNBUFFERED="1")


def _plain(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """pretrain_gpt.py as one process without torchrun (world size 1)."""
    env = dict(_env(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return subprocess.run([sys.executable, PRETRAIN, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain_torchrun(args: list[str], out: str, restarts: int = 0) -> subprocess.Popen:
    """``torchrun --nproc-per-node 1 --master-port P`` without --rdzv-id (run id ``none``, torchrun's static
    rendezvous: the launch line of Megatron-LM's examples), its output into ``out``."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
                             str(_free_port()), "--max-restarts", str(restarts), "--monitor-interval", "0.5",
                             PRETRAIN, *args], env=_env(), stdout=open(out, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _new_generation(ckpt: str, after: int, timeout: float = 120) -> lease.Lease:
    deadline = time.time() + timeout
    while time.time() < deadline:
        cur = lease.current(ckpt)
        if cur is not None and cur.generation > after:
            return cur
        time.sleep(0.05)
    raise AssertionError(f"{ckpt}: no lease generation after {after} in {timeout} s")


def test_second_plain_torchrun_refused_restart_takes_the_next_generation_worker_exits_with_its_agent(
        tmp_path) -> None:
    """Job A and job B, both plain torchrun launches without --rdzv-id (run id ``none``), on one --save: B is refused
    before any process group, naming the directory, A's holder and --tenplex-take-over; A trains on and its newest
    checkpoint verifies. A's worker SIGKILLed: its agent restarts it, and the new round takes the next generation at
    once as the same job. Then SIGKILL of A's agent alone: its worker exits within seconds and commits nothing after;
    a new job takes the dead holder's lease over at once and resumes from its newest checkpoint."""
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    agent = _plain_torchrun([*FLAGS, "--save", ckpt, "--load", ckpt, "--tenplex-metrics", log],
                            str(tmp_path / "agent.log"), restarts=1)
    try:
        _wait_for(log, 7)  # past two commits
        (worker,) = psutil.Process(agent.pid).children()
        held = lease.current(ckpt)
        assert held.job.startswith("torchrun-") and held.holder == f"{socket.gethostname()}:{worker.pid}"
        t0 = time.time()
        b_log = str(tmp_path / "b.log")
        b = _plain_torchrun([*FLAGS, "--save", ckpt, "--load", ckpt, "--tenplex-metrics", str(tmp_path / "b.jsonl")],
                            b_log)
        assert b.wait(timeout=120) != 0
        refused_in = time.time() - t0
        out = open(b_log).read()
        assert f"{ckpt} is held by job {held.job!r} (generation {held.generation}, holder " \
               f"{socket.gethostname()}:{worker.pid})" in out and "--tenplex-take-over" in out, out[-3000:]
        assert "> tenplex-megatron: layout" not in out and not os.path.exists(tmp_path / "b.jsonl")  # at start
        assert lease.current(ckpt).generation == held.generation  # nothing written by the refused job
        ran = len(metrics(log))
        _wait_for(log, ran + 4)  # A unharmed: trains on and commits; its newest checkpoint verifies
        newest = directory.committed_iterations(ckpt)[-1]
        assert verify_checkpoint(os.path.join(ckpt, directory.iter_dir_name(newest)), workers=1).ok
        # an elastic restart of A: its agent starts a new worker, which takes the next generation as the same job
        t0 = time.time()
        worker.send_signal(signal.SIGKILL)
        restarted = _new_generation(ckpt, held.generation)
        took = time.time() - t0
        assert restarted.generation == held.generation + 1 and restarted.job == held.job
        _wait_for(log, len(metrics(log)) + 2)  # training resumed
        (worker,) = psutil.Process(agent.pid).children()
        assert restarted.holder == f"{socket.gethostname()}:{worker.pid}"
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
    print(f"second job refused in {refused_in:.1f} s; the restarted round took generation {restarted.generation} "
          f"{took:.1f} s after its worker was killed; worker exited {seconds:.2f} s after its agent was SIGKILLed")
    agent_log = (tmp_path / "agent.log").read_text()
    assert "took the lease over" not in agent_log, agent_log[-3000:]  # the restart was the same job
    assert seconds < 5, seconds
    assert directory.committed_iterations(ckpt) == committed and len(metrics(log)) == ran  # nothing after
    # its holder is dead (this host): a job of another id takes the lease over without waiting out its ttl; the
    # newest checkpoint has a flipped byte: skipped with a warning naming the file, the previous one loads
    bad = os.path.join(ckpt, directory.iter_dir_name(committed[-1]), directory.rank_file_name(0))
    with open(bad, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0x40]))
    third = _plain([*FLAGS, "--save", ckpt, "--load", ckpt, "--train-iters", str(committed[-1] + 1)])
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"loaded iteration {committed[-2]}" in third.stdout, third.stdout[-3000:]
    assert third.stderr.count("skipping a damaged copy") == 1 and f"{bad}" in third.stderr, third.stderr[-3000:]
    assert lease.current(ckpt).released and lease.current(ckpt).generation == restarted.generation + 1


def _split_agent(port: int, ckpt: str, name: str, tmp_path) -> subprocess.Popen:
    """One world-size-1 torchrun job of run id ``split`` with its own rendezvous endpoint."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "split", "--max-restarts",
         "3", PRETRAIN, *FLAGS, "--save", ckpt, "--load", ckpt, "--tenplex-metrics", str(tmp_path / f"{name}.jsonl")],
        env=_env(), stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)


# two agents' rendezvous split and joined again, about 30 s: make test-bench
@pytest.mark.slow
def test_split_rendezvous_leaves_the_newest_generation_writing(tmp_path) -> None:
    """Two rounds of one job (run id ``split``) formed apart, both world size 1, one --save: the later round takes
    a higher generation; the earlier one stops at its next commit with an error saying so, and stops its agent
    (restarts left: a restart would only fence the other), and the later one trains and saves on (every committed
    checkpoint readable, none lost)."""
    ckpt = str(tmp_path / "ckpt")
    first = _split_agent(_free_port(), ckpt, "first", tmp_path)
    second = None
    try:
        _wait_for(str(tmp_path / "first.jsonl"), 4)
        gen_first = lease.current(ckpt).generation
        second = _split_agent(_free_port(), ckpt, "second", tmp_path)
        assert first.wait(timeout=180) != 0  # fenced
        _wait_for(str(tmp_path / "second.jsonl"), 7)  # two commits of its own
        (worker,) = psutil.Process(second.pid).children()
        worker.send_signal(signal.SIGTERM)  # saves the current iteration and exits 0
        assert second.wait(timeout=120) == 0, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                for c in psutil.Process(p.pid).children(recursive=True):
                    c.kill()
                p.kill()
    first_log = (tmp_path / "first.log").read_text()
    assert "a newer generation owns the directory" in first_log, first_log[-3000:]
    m = re.search(r"generation (\d+), holder", first_log.split("a newer generation owns the directory", 1)[1])
    assert m and int(m.group(1)) == gen_first + 1
    assert first_log.count("> tenplex-megatron: layout") == 1, first_log[-3000:]  # its agent did not restart it
    its = directory.committed_iterations(ckpt)
    for it in its:  # every committed checkpoint is whole
        directory.read_metadata(os.path.join(ckpt, directory.iter_dir_name(it)))
    second_ran = [x["iteration"] for x in metrics(str(tmp_path / "second.jsonl"))]
    assert its[-1] == second_ran[-1] and directory.tracker_iteration(ckpt) == its[-1]


RDZV_CONF = rdzv_conf(keep_alive_attempts=3, join_timeout=300)
ETCD_ITERS = 60


def etcd_agent(port: int, ckpt: str, log: str, out: str, name: str, extra: list[str] = ()) -> subprocess.Popen:
    """A torchrun agent of a 1:2-node job whose rendezvous is in etcd (``--rdzv-backend etcd-v2``). With the
    rendezvous store shared with the workers (torch 2.13's default), a node joining a later round waits forever
    for the master address the rank-0 agent wrote in round 0 only: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."""
    flags = [*FLAGS[:FLAGS.index("--train-iters")], "--train-iters", str(ETCD_ITERS), "--save-interval", "10"]
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
         "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "etcd-test",
         "--rdzv-conf", RDZV_CONF, "--max-restarts", "5", "--monitor-interval", "0.5", PRETRAIN, *flags,
         "--save", ckpt, "--load", ckpt, "--tenplex-metrics", log, *extra],
        env=dict(_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), stdout=open(os.path.join(out, f"{name}.log"), "w"),
        stderr=subprocess.STDOUT, start_new_session=True)


# a real etcd server (make etcd) and two agents, about 65 s: make test-bench
@pytest.mark.slow
def test_etcd_rendezvous_survives_losing_the_first_agent(tmp_path) -> None:
    """Two agents meet in etcd; the one started first (c10d would host the rendezvous store in it) is SIGKILLed
    alone: its worker exits with it, and the other agent re-forms the rendezvous through etcd and trains on alone
    to the end, every iteration run."""
    etcd, port = start_etcd(str(tmp_path / "etcd"))
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    a = etcd_agent(port, ckpt, log, str(tmp_path), "a")
    time.sleep(2)
    b = etcd_agent(port, ckpt, log, str(tmp_path), "b")
    try:
        deadline = time.time() + 300
        while time.time() < deadline:  # past the first checkpoint at world size 2
            got = metrics(log) if os.path.exists(log) else []
            if len(got) >= 12 and got[-1]["layout"]["dp"] == 2:
                break
            time.sleep(0.2)
        else:
            raise AssertionError((tmp_path / "a.log").read_text()[-3000:])
        workers = psutil.Process(a.pid).children()
        t0 = time.time()
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=30)
        while not all(_gone(w) for w in workers) and time.time() - t0 < 30:
            time.sleep(0.05)
        orphan_exit = time.time() - t0
        lost_at = len(metrics(log))
        assert b.wait(timeout=400) == 0, (tmp_path / "b.log").read_text()[-4000:]
    finally:
        for p in (a, b):
            if p.poll() is None:
                for c in psutil.Process(p.pid).children(recursive=True):
                    c.kill()
                p.kill()
        etcd.kill()
        etcd.wait()
    got = metrics(log)
    print(f"first agent's worker exited {orphan_exit:.2f} s after it; {len(got) - lost_at} iterations after")
    assert orphan_exit < 5
    assert {m["iteration"] for m in got} == set(range(1, ETCD_ITERS + 1))
    assert got[-1]["iteration"] == ETCD_ITERS and got[-1]["layout"]["dp"] == 1  # the survivor alone, to the end
    assert directory.tracker_iteration(ckpt) == ETCD_ITERS
