"""Losing a whole node in place, during a snapshot's replication: two in-process launchers of 2 ranks each on
localhost (``--nnodes 2``; a memory directory each: a node), TP2 x DP2 with ``--tenplex-memory``, a snapshot every
iteration replicated to the other node in the background, paced (``--tenplex-replication-rate 0.5``: about a
second a snapshot, longer than an iteration, so a replication is under way at almost every moment). Once node 0 reports a replicated snapshot (N) and a newer
one's replication under way (M: snapshots after it are kept on their own node only), node 1 is lost: its launcher,
ranks and helper SIGKILLed at once (its process group), its memory directory removed. Oracle: node 0's ranks
continue in the same processes at TP2 x DP1 from the last snapshot complete in their memory (N, or M if its
replication finished first; node 1's part from node 0's replicas), nothing read from durable storage, nothing
opened in node 1's memory by node 0's processes; every logged iteration's loss equals an uninterrupted run's (fp32,
1e-5), the same samples; the iterations trained twice are exactly those since the snapshot loaded.

Four ranks in two launches plus the 4-rank reference (about 40 CPU seconds, NVRx's monitor processes not counted;
timed on a clock, beside nothing else): the file runs under the ``slow`` marker (``make test-bench``), outside
``make test``'s budget."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from tests.harness import CHILD_PYTHONPATH, PRETRAIN, TINY_GPT, Run, kill_groups, layout_flags, metrics, torchrun
from tests.multiproc.test_inprocess import STATUSES, assert_uninterrupted, calls, memory_loads, pairs

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ITERS = 20  # enough for the helpers to start (an interpreter and torch each) and replicate before the loss
PORT = 29771
BASE = [*TINY_GPT, "--vocab-size", "96", "--train-iters", str(ITERS), *layout_flags(2, 1),
        "--use-distributed-optimizer", "--save-interval", "1"]
PACED = ["--tenplex-replication-rate", "0.5"]  # MB/s: 0.66 MB of a node's snapshot in about 1.3 s
IN_FLIGHT = re.compile(r"replication of iteration (\d+) is still under way: iteration \d+ is kept on its own node "
                       r"only \(iteration (\d+) is the newest replicated snapshot\)")


def launch_nodes(d: object, args: list[str], timeout: float = 420) -> tuple[list[Run], dict[str, int]]:
    """One in-process launcher per node (``--nnodes 2 --node-rank N``, memory ``d/mem-N``, its own open log and
    output ``d/node-N.log``); node 1 is lost (its process group SIGKILLed, its memory removed) once node 0 reports
    a replication under way after a replicated snapshot. Returns each launcher's run and what was seen then."""
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "tenplex_megatron.frontdoor.launch", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--master-port", str(PORT), "--timeout", str(timeout - 10), PRETRAIN, *args,
               "--tenplex-memory", f"{d}/mem-{node}"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=CHILD_PYTHONPATH, PYTHONUNBUFFERED="1",
                   TENPLEX_OPEN_LOG=f"{d}/open-{node}.log")
        with open(f"{d}/node-{node}.log", "w") as out:
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    deadline, seen = time.monotonic() + timeout, {}
    try:
        while procs[0].poll() is None and time.monotonic() < deadline:
            with open(f"{d}/node-0.log") as f:
                found = IN_FLIGHT.findall(f.read())
            if found:
                seen = {"in_flight": int(found[-1][0]), "replicated": int(found[-1][1]),
                        "trained": max(m["iteration"] for m in metrics(f"{d}/out.jsonl"))}
                os.killpg(procs[1].pid, signal.SIGKILL)  # node 1: launcher, ranks, helper
                procs[1].wait()
                shutil.rmtree(f"{d}/mem-1", ignore_errors=True)  # its memory goes with it
                break
            time.sleep(0.05)
        procs[0].wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill_groups(procs)
    runs = []
    for node, p in enumerate(procs):
        with open(f"{d}/node-{node}.log") as f:
            runs.append(Run(p.returncode, f.read()))
    return runs, seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("inprocess_nodes")
    ref = torchrun(4, [*BASE, "--save", str(d / "ref-ckpt"), "--tenplex-metrics", str(d / "ref.jsonl")])
    assert ref.returncode == 0, ref.log[-4000:]
    (node0, node1), seen = launch_nodes(d, [*BASE, "--save", str(d / "ckpt"), "--tenplex-metrics",
                                            str(d / "out.jsonl"), "--tenplex-inprocess", "--tenplex-inprocess-timeout",
                                            "30", *PACED])
    return {"dir": d, "ref": metrics(str(d / "ref.jsonl")), "out": metrics(str(d / "out.jsonl")), "node0": node0,
            "node1": node1, "seen": seen}


def test_the_survivors_continue_from_the_last_complete_snapshot_with_the_uninterrupted_losses(runs: dict) -> None:
    node0, seen = runs["node0"], runs["seen"]
    assert seen, node0.log[-6000:]  # node 1 was lost while a replication was under way
    assert node0.returncode == 0, node0.log[-6000:]
    assert pairs(STATUSES, node0.log) == {0: 0, 1: 0}, node0.log[-3000:]
    got = assert_uninterrupted(runs["out"], runs["ref"], ITERS)
    loads = memory_loads(node0.log)
    assert len(loads) == 1 and loads[0][1:] == ("tp=2,pp=1,dp=2", "tp=2,pp=1,dp=1", 0), node0.log[-6000:]
    loaded = loads[0][0]  # the last complete in node 0's memory: the replicated one, or the one under way
    assert seen["replicated"] <= loaded <= seen["in_flight"], (loaded, seen)
    again = sorted(i for i in got if len(got[i]) == 2)
    assert again == list(range(loaded + 1, max(again, default=loaded) + 1)) and max(again) >= seen["trained"], \
        (again, loaded, seen)  # lost: exactly the iterations since the snapshot loaded
    assert all(len(got[i]) <= 2 for i in got), got
    last = got[ITERS][-1]["layout"]
    assert (last["tp"], last["dp"]) == (2, 1), last


def test_the_survivors_keep_their_processes_and_read_only_their_own_nodes_memory(runs: dict) -> None:
    node0, d = runs["node0"], runs["dir"]
    assert node0.returncode == 0, node0.log[-6000:]
    seen = calls(node0.log)
    assert seen[0] == {(0, 0, 4), (1, 0, 2)} and seen[1] == {(0, 1, 4), (1, 1, 2)}, seen
    opened: dict[str, set[str]] = defaultdict(set)
    with open(f"{d}/open-0.log") as f:
        for line in f:
            pid, path = line.rstrip("\n").split("\t")
            opened[pid].add(path)
    assert opened and not [p for paths in opened.values() for p in paths if p.startswith(os.path.abspath(f"{d}/mem-1"))], opened
