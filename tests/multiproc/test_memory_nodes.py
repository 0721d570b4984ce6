"""Host-memory checkpoints across two nodes: two torchrun agents on localhost, one memory directory each.

An uninterrupted 2-process run is the oracle. Then two agents (``--nnodes 2
--nproc-per-node 1 --rdzv-backend c10d``) train with ``--tenplex-memory`` (a
directory per agent: a node), snapshots every 2 iterations replicated to the
other node (K=2), a durable copy every second snapshot, and stop at iteration 6
(durable: 4). Node B is lost (its memory directory deleted) and replaced by a
node C with empty memory; the two agents restart at a new layout (TP 2): the
newest snapshot (6) is complete in A's memory, so it is loaded from there (C's
rank receives its part over torch.distributed), nothing is read from the
durable checkpoint (its shard files are made unreadable), and the losses
continue as the oracle's. Every path a process opens in a memory directory is
logged: none is in another node's.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.harness import PRETRAIN, ROOT, TINY_GPT, metrics, torchrun

pytestmark = pytest.mark.dist
ITERS = 10
FLAGS = [*TINY_GPT, "--vocab-size", "96", "--train-iters", str(ITERS)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agents(tmp, run_id: str, nodes: list[str], extra: list[str], tries: int = 3) -> list[str]:
    """Run one agent per node (memory directory ``tmp/mem_<node>``) until both exit; returns their logs. A launch
    that failed to bind its rendezvous port (another test's process took the free port first: EADDRINUSE, before
    any worker ran) is launched again, at most ``tries`` times."""
    for _ in range(tries - 1):
        logs = _launch(tmp, run_id, nodes, extra)
        if logs is not None:
            return logs
    logs = _launch(tmp, run_id, nodes, extra, last=True)
    assert logs is not None
    return logs


def _launch(tmp, run_id: str, nodes: list[str], extra: list[str], last: bool = False) -> list[str] | None:
    port = _free_port()
    procs = []
    for node in nodes:
        # the workers use the agents' rendezvous store (torchrun's default): no second port to race for
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1",
                   TENPLEX_OPEN_LOG=str(tmp / f"open_{node}.log"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, PRETRAIN,
               *FLAGS, "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"), "--tenplex-memory",
               str(tmp / f"mem_{node}"), "--tenplex-metrics", str(tmp / "m.jsonl"), *extra]
        procs.append(subprocess.Popen(cmd, env=env, stdout=open(tmp / f"{run_id}_{node}.log", "w"),
                                      stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp / f"{run_id}_{node}.log").read_text() for node in nodes]
    if codes != [0, 0] and not last and any("EADDRINUSE" in log for log in logs) \
            and not any("> tenplex" in log for log in logs):  # nothing ran: launch again
        return None
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    return logs


def _opened(tmp, node: str) -> list[str]:
    path = tmp / f"open_{node}.log"
    return [line.split("\t", 1)[1] for line in path.read_text().splitlines()] if path.exists() else []


# two agents, a node lost and a restart at a new layout from peer memory, about 60 s: make test-bench
@pytest.mark.slow
def test_restart_at_new_layout_from_peer_memory_after_losing_a_node(tmp_path) -> None:
    ref_log = str(tmp_path / "ref.jsonl")
    r = torchrun(2, [*FLAGS, "--tenplex-metrics", ref_log])
    assert r.returncode == 0, r.log[-3000:]
    ref = {m["iteration"]: m["loss"] for m in metrics(ref_log)}

    # auto: snapshot 2 replicated at once, 4 and 6 paced by the time since the one before; the exit hurries it
    first = _agents(tmp_path, "first", ["a", "b"], ["--save-interval", "2", "--exit-interval", "6",
                                                     "--tenplex-persist-interval", "2",
                                                     "--tenplex-replication-rate", "auto"])
    log = "\n".join(first)
    assert "persisted" in log and str(tmp_path / "ckpt" / "iter_0000004") in log, log[-3000:]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_0000004", "latest_checkpointed_iteration.txt",
                                                     "tenplex-lease"]
    for node in ("a", "b"):  # K=2 on two nodes: each node's memory holds every rank's file of snapshot 6
        snap = tmp_path / f"mem_{node}" / "iter_0000006"
        assert sorted(os.listdir(snap)) == ["metadata.json", "rank_00000.safetensors", "rank_00001.safetensors"]
        assert not (tmp_path / f"mem_{node}" / "iter_0000002").exists()  # --tenplex-memory-keep 1

    shutil.rmtree(tmp_path / "mem_b")  # node b is lost; node c joins with empty memory
    durable = tmp_path / "ckpt" / "iter_0000004"
    for name in os.listdir(durable):
        if name.endswith(".safetensors"):
            os.chmod(durable / name, 0)  # a read of the durable checkpoint's tensors would fail
    second = _agents(tmp_path, "second", ["a", "c"], ["--tensor-model-parallel-size", "2"])
    log = "\n".join(second)
    assert "loaded iteration 6 from host memory" in log, log[-3000:]
    assert "0 bytes read from durable storage" in log
    assert "tp=1,pp=1,dp=2 -> tp=2,pp=1,dp=1" in log
    for name in os.listdir(durable):
        os.chmod(durable / name, 0o644)

    got = metrics(str(tmp_path / "m.jsonl"))
    assert [m["iteration"] for m in got] == list(range(1, ITERS + 1))
    for m in got:
        assert m["loss"] == pytest.approx(ref[m["iteration"]], rel=1e-5), (m["iteration"], m["loss"])
    # every memory-tier path a node's processes opened is in that node's own memory directory
    for node in ("a", "b", "c"):
        paths = _opened(tmp_path, node)
        assert paths, node
        for p in paths:
            assert p.startswith(str(tmp_path / f"mem_{node}") + os.sep), (node, p)
    # node c held nothing: its rank received its part from node a's rank over torch.distributed
    assert not any("iter_0000006" in p for p in _opened(tmp_path, "c"))
