"""Planned re-forms in place (the launcher's ``--reform``/``--join``, no NVRx): a job of 2 ranks (one launcher,
TP1, ``--tenplex-memory``) grows to 4 when a second launcher joins with 2 ranks, then those 2 leave on notice
(SIGTERM to their launcher). Oracle: every logged iteration's loss equals an uninterrupted 2-rank run's (fp32, 1e-5
relative; the global batch fixed, the same samples), each iteration trained once, the first launcher's ranks in
the same processes throughout, the departing ranks exit 0, every restore from host memory (nothing read from
durable storage). A newcomer of 1 rank (3 ranks: no legal layout) is refused: the job keeps its world and ends,
the newcomer exits 0 unadmitted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.harness import CHILD_PYTHONPATH, PRETRAIN, TINY_GPT, Run, kill_groups, layout_flags, metrics, torchrun
from tests.multiproc.test_inprocess import STARTED, STATUSES, assert_uninterrupted, memory_loads, pairs

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ITERS = 40  # the 4-rank phase is left on notice before the end (an iteration: about 50 ms here)
PORT = 29791
BASE = [*TINY_GPT, "--vocab-size", "96", "--train-iters", str(ITERS), *layout_flags(1, 1),
        "--use-distributed-optimizer"]
GENERATION = re.compile(r"re-form: generation (\d+): rank (\d+) of (\d+) \(pid (\d+)\)")
TIMELINE = re.compile(r"timeline (\{.*\})")


def launcher(d: object, node: int, args: list[str], join: bool, nproc: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tenplex_megatron.frontdoor.launch", "--reform", *(["--join"] if join else []),
           "--node-rank", str(node), "--nproc-per-node", str(nproc), "--master-port", str(PORT), "--timeout", "300",
           PRETRAIN, *args, "--tenplex-memory", f"{d}/mem-{node}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=CHILD_PYTHONPATH, PYTHONUNBUFFERED="1")
    out = open(f"{d}/node-{node}.log", "w")
    with out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def grow_then_leave(d: object, args: list[str], timeout: float = 360) -> dict[str, object]:
    """Node 0's launcher, then node 1's joining; once the job trained an iteration at 4 ranks, SIGTERM to node 1's
    launcher (its ranks leave). Returns both runs and when the notice was given."""
    procs = [launcher(d, 0, args, join=False), launcher(d, 1, args, join=True)]
    deadline, noticed = time.monotonic() + timeout, None
    try:
        while procs[0].poll() is None and time.monotonic() < deadline:
            if noticed is None and os.path.exists(f"{d}/out.jsonl") and any(
                    m["layout"]["dp"] == 4 for m in metrics(f"{d}/out.jsonl")):
                procs[1].send_signal(signal.SIGTERM)
                noticed = time.time()
            time.sleep(0.05)
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill_groups(procs)
    runs = [Run(p.returncode, read(f"{d}/node-{n}.log")) for n, p in enumerate(procs)]
    return {"node0": runs[0], "node1": runs[1], "noticed": noticed}


def refused(d: object, args: list[str], timeout: float = 240) -> tuple[Run, Run]:
    """Node 0's 2 ranks and a newcomer of 1 (3 ranks: no legal layout, the global batch does not split over DP3)."""
    procs = [launcher(d, 0, args, join=False), launcher(d, 1, args, join=True, nproc=1)]
    try:
        for p in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill_groups(procs)
    return Run(procs[0].returncode, read(f"{d}/node-0.log")), Run(procs[1].returncode, read(f"{d}/node-1.log"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("reform")
    ref = torchrun(2, [*BASE, "--save", str(d / "ref-ckpt"), "--tenplex-metrics", str(d / "ref.jsonl")])
    assert ref.returncode == 0, ref.log[-4000:]
    got = grow_then_leave(d, [*BASE, "--save", str(d / "ckpt"), "--tenplex-metrics", str(d / "out.jsonl")])
    r = d / "refused"
    r.mkdir()
    no = refused(r, [*BASE, "--save", str(r / "ckpt"), "--tenplex-metrics", str(r / "out.jsonl")])
    return {**got, "ref": metrics(str(d / "ref.jsonl")), "out": metrics(str(d / "out.jsonl")), "refused": no,
            "refused_out": metrics(str(r / "out.jsonl"))}


def test_the_job_grows_and_shrinks_with_the_uninterrupted_losses(runs: dict) -> None:
    node0, node1 = runs["node0"], runs["node1"]
    assert node0.returncode == 0 and node1.returncode == 0, node0.log[-5000:] + node1.log[-5000:]
    assert runs["noticed"] is not None, node0.log[-5000:]
    got = assert_uninterrupted(runs["out"], runs["ref"], ITERS)
    assert all(len(v) == 1 for v in got.values()), got  # nothing trained twice
    dps = [got[i][0]["layout"]["dp"] for i in range(1, ITERS + 1)]
    assert 4 in dps and dps[0] == 2 and dps[-1] == 2 and dps.index(4) > 0, dps  # 2, then 4, then 2 again


def test_the_first_ranks_keep_their_processes_and_the_newcomers_leave_cleanly(runs: dict) -> None:
    node0, node1 = runs["node0"], runs["node1"]
    started = pairs(STARTED, node0.log)
    gens = [tuple(map(int, g)) for g in GENERATION.findall(node0.log)]
    assert {(g, r, w) for g, r, w, _ in gens} == {(0, 0, 2), (0, 1, 2), (1, 0, 4), (1, 1, 4), (2, 0, 2), (2, 1, 2)}
    assert all(pid == started[r] for _, r, _, pid in gens), (gens, started)  # the launcher's processes throughout
    joined = [tuple(map(int, g)) for g in GENERATION.findall(node1.log)]
    assert {(g, r, w) for g, r, w, _ in joined} == {(1, 2, 4), (1, 3, 4)}, joined
    assert pairs(STATUSES, node1.log) == {2: 0, 3: 0} and pairs(STATUSES, node0.log) == {0: 0, 1: 0}
    assert node1.log.count("leaves at generation 2") == 2, node1.log[-3000:]


def test_every_restore_came_from_host_memory(runs: dict) -> None:
    loads = memory_loads(runs["node0"].log)
    assert [(a, b, dur) for _, a, b, dur in loads] == [("tp=1,pp=1,dp=2", "tp=1,pp=1,dp=4", 0),
                                                       ("tp=1,pp=1,dp=4", "tp=1,pp=1,dp=2", 0)], \
        runs["node0"].log[-5000:]


def test_a_world_without_a_legal_layout_is_refused_and_the_job_keeps_its_world(runs: dict) -> None:
    node0, node1 = runs["refused"]
    assert node0.returncode == 0 and node1.returncode == 0, node0.log[-5000:] + node1.log[-5000:]
    got = assert_uninterrupted(runs["refused_out"], runs["ref"], ITERS)
    assert {m["layout"]["dp"] for v in got.values() for m in v} == {2} and all(len(v) == 1 for v in got.values())
    assert "a world of 3 rank(s) (1 joining, 0 leaving) has no legal layout: keeping the 2 rank(s)" in node0.log, \
        node0.log[-5000:]
    assert "the job ended before admitting it" in node1.log, node1.log[-3000:]
    assert {(g, r, w) for g, r, w, _ in (tuple(map(int, x)) for x in GENERATION.findall(node0.log))} == \
        {(0, 0, 2), (0, 1, 2)}
