"""Losing ranks in place (``--tenplex-inprocess``, NVRx's in-process restart): 4 ranks at TP2 x DP2 with
``--tenplex-memory``, rank 3 killed mid-run; the survivors continue in the same processes at the largest world with a
legal layout (2: TP2 x DP1; the third survivor waits as a spare), restored from host memory; rank 0 killed during
that re-shard, the spare takes its place. A SIGSTOPped rank; no legal layout left. Oracle: every logged
iteration's loss equals an uninterrupted run at TP2 x DP2 (fp32, 1e-5 relative), the same samples (data position
exact), the survivors' process ids unchanged, nothing read from durable storage."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable

import pytest

from tenplex_megatron.storage import directory, lease
from tests.harness import CHILD_PYTHONPATH, PRETRAIN, TINY_GPT, Run, layout_flags, metrics, torchrun

pytestmark = pytest.mark.dist

ITERS = 8
FENCE_ITERS = 40  # the fenced job's: far more than it reaches before the other job takes its directory over
BASE = [*TINY_GPT, "--vocab-size", "96", "--train-iters", str(ITERS), *layout_flags(2, 1),
        "--use-distributed-optimizer", "--save-interval", "1"]
CALL = re.compile(r"in place: call (\d+): rank (\d+) of (\d+) \(initial rank (\d+), pid (\d+)\)")
STARTED = re.compile(r"ranks started, pids ((?:\d+:\d+ ?)+)")
STATUSES = re.compile(r"exit statuses ((?:\d+:-?\d+ ?)+)")
LAUNCHER = re.compile(r"launcher pid (\d+)")
OTHER_JOB = "another-job"


def launch_inprocess(nproc: int, args: list[str], port: int, env: dict[str, str] | None = None,
                     timeout: float = 240, during: Callable[[subprocess.Popen], None] | None = None) -> Run:
    """``python -m tenplex_megatron.frontdoor.launch`` (the stores served outside the ranks) running PRETRAIN;
    ``during`` is called with the launcher's process while it runs."""
    cmd = [sys.executable, "-m", "tenplex_megatron.frontdoor.launch", "--nproc-per-node", str(nproc), "--master-port",
           str(port), "--timeout", str(timeout - 10), PRETRAIN, *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=CHILD_PYTHONPATH, PYTHONUNBUFFERED="1", **(env or {}))
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        try:
            if during is not None:
                during(p)
            rc = p.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = 124
        out.seek(0)
        return Run(rc, out.read() + ("\nTIMEOUT" if rc == 124 else ""))


def take_over_at(save: str, ref: str, iteration: int, seen: dict[str, object], timeout: float = 180) -> \
        Callable[[subprocess.Popen], None]:
    """While the job runs: once ``ref`` (its metrics) reaches ``iteration``, another job takes ``save`` over (a
    real second process, ``--tenplex-take-over``'s path); ``seen`` records the newest committed checkpoint then."""

    def act(p: subprocess.Popen) -> None:
        deadline = time.monotonic() + timeout
        while p.poll() is None and time.monotonic() < deadline:
            if os.path.exists(ref) and any(m["iteration"] >= iteration for m in metrics(ref)):
                break
            time.sleep(0.05)
        other = subprocess.run([sys.executable, "-c", "import sys; from tenplex_megatron.storage import lease; "
                                f"print(lease.LeaseSet().acquire(sys.argv[1], {OTHER_JOB!r}, take_over=True).generation)", save],
                               capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH),
                               timeout=60)
        seen.update(generation=int(other.stdout), committed=directory.tracker_iteration(save), alive=p.poll() is None)

    return act


def pairs(pattern: re.Pattern[str], log: str) -> dict[int, int]:
    """``rank:value`` pairs of the launcher's first line matching ``pattern``."""
    m = pattern.search(log)
    assert m, log[-4000:]
    return {int(r): int(v) for r, v in (x.split(":") for x in m.group(1).split())}


def by_iteration(entries: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = defaultdict(list)
    for m in entries:
        out[m["iteration"]].append(m)
    return out


def assert_uninterrupted(out: list[dict], ref: list[dict], iters: int = ITERS) -> dict[int, list[dict]]:
    """Every logged iteration, repeated ones included, trained on the reference's samples to its loss and LR."""
    ref_by_it = {m["iteration"]: m for m in ref}
    assert sorted(ref_by_it) == list(range(1, iters + 1))
    got = by_iteration(out)
    assert sorted(got) == list(range(1, iters + 1)), [m["iteration"] for m in out]
    for it, entries in got.items():
        for m in entries:  # before a fault and again after it: the same step
            assert m["loss"] == pytest.approx(ref_by_it[it]["loss"], rel=1e-5), (it, m["layout"])
            assert m["samples"] == ref_by_it[it]["samples"], it  # the data position, exact
            assert m["lr"] == pytest.approx(ref_by_it[it]["lr"], rel=1e-6), it
    return got


def calls(log: str) -> dict[int, set[tuple[int, int, int]]]:
    """Each initial rank's calls of the wrapped training: (call, rank, world); every pid the launcher's."""
    started = pairs(STARTED, log)
    out: dict[int, set[tuple[int, int, int]]] = defaultdict(set)
    for call, rank, world, initial, pid in (tuple(map(int, m)) for m in CALL.findall(log)):
        assert pid == started[initial], (initial, pid, started)  # the launcher's process, never a new one
        out[initial].add((call, rank, world))
    return out


def memory_loads(log: str) -> list[tuple[int, str, str, int]]:
    """Each restart from host memory: (iteration, layout before, layout after, bytes read from durable storage)."""
    found = re.findall(r"loaded iteration (\d+) from host memory .*: layout (\S+) -> (\S+), .* (\d+) bytes read "
                       r"from durable storage", log)
    return [(int(i), a.rstrip(","), b.rstrip(","), int(d)) for i, a, b, d in found]


def inplace_args(d: object, tag: str, *extra: str) -> list[str]:
    return [*BASE, "--save", f"{d}/{tag}-ckpt", "--tenplex-memory", f"{d}/{tag}-mem", "--tenplex-metrics",
            f"{d}/{tag}.jsonl", "--tenplex-inprocess", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The module's launches, once: the uninterrupted reference at TP2 x DP2 (torchrun); 4 ranks in place losing
    rank 3 while it writes its snapshot of iteration 3, then rank 0 during the re-shard that follows (a nested
    restart; ``TENPLEX_FAULT``: SIGKILL, each once); 2 ranks at DP2, one SIGSTOPped in its snapshot of iteration 3; 2 ranks at TP2, one killed
    (no legal layout for one), without --tenplex-memory (durable checkpoints only)."""
    d = tmp_path_factory.mktemp("inprocess")
    ref = torchrun(4, [*BASE, "--save", str(d / "ref-ckpt"), "--tenplex-metrics", str(d / "ref.jsonl")])
    assert ref.returncode == 0, ref.log[-4000:]
    lose = launch_inprocess(4, inplace_args(d, "lose", "--tenplex-inprocess-timeout", "30"), port=29731,
                            env={"TENPLEX_FAULT": "memory.write@3#3,load.copy@0",
                                 "TENPLEX_FAULT_ONCE": str(d / "once")}, timeout=420)
    stop = launch_inprocess(2, inplace_args(d, "stop", *layout_flags(1, 1), "--tenplex-inprocess-timeout", "8"),
                            port=29741, env={"TENPLEX_FAULT": "memory.write@1#3:stop"})
    none = launch_inprocess(2, [*BASE, "--save", str(d / "none-ckpt"), "--tenplex-inprocess",
                                "--tenplex-inprocess-timeout", "15"], port=29751, env={"TENPLEX_FAULT": "save.tensors@1#3"})
    seen: dict[str, object] = {}
    fence = launch_inprocess(2, [*BASE, "--train-iters", str(FENCE_ITERS), "--save", str(d / "fence-ckpt"),
                                 "--tenplex-metrics", str(d / "fence.jsonl"), "--tenplex-inprocess",
                                 "--tenplex-inprocess-timeout", "15"], port=29761,
                             during=take_over_at(str(d / "fence-ckpt"), str(d / "fence.jsonl"), 2, seen))
    return {"ref": metrics(str(d / "ref.jsonl")), "lose": lose, "lose_out": metrics(str(d / "lose.jsonl")),
            "stop": stop, "stop_out": metrics(str(d / "stop.jsonl")), "none": none, "dir": d,
            "fence": fence, "fence_seen": seen, "fence_out": metrics(str(d / "fence.jsonl"))}


def test_survivors_continue_with_the_uninterrupted_losses(runs: dict) -> None:
    run = runs["lose"]
    assert run.returncode == 0, run.log[-6000:]
    assert pairs(STATUSES, run.log) == {0: -9, 1: 0, 2: 0, 3: -9}, run.log[-3000:]  # the two faults: SIGKILLs
    got = assert_uninterrupted(runs["lose_out"], runs["ref"])
    assert len(got[3]) == 2 and all(len(got[i]) == 1 for i in got if i != 3), got  # 3 trained again, once
    first, last = got[1][0]["layout"], got[ITERS][-1]["layout"]
    assert (first["tp"], first["dp"]) == (2, 2) and (last["tp"], last["dp"]) == (2, 1), (first, last)


def test_survivors_keep_their_processes_and_the_spare_joins(runs: dict) -> None:
    run = runs["lose"]
    assert run.returncode == 0, run.log[-6000:]
    seen = calls(run.log)
    assert seen[3] == {(0, 3, 4)}, seen  # died in the first call
    assert seen[0] == {(0, 0, 4), (1, 0, 2)}, seen  # rank 0 survived the first fault, died re-sharding in the second
    assert {(c, w) for c, _, w in seen[1]} == {(0, 4), (1, 2), (2, 2)}, seen  # re-entered twice in the same process
    # the third survivor waited as a spare (3 ranks left: no legal layout at 3 with TP2), then replaced rank 0
    assert {(c, w) for c, _, w in seen[2]} == {(0, 4), (2, 2)}, seen
    assert {r for c, r, _ in seen[1] | seen[2] if c == 2} == {0, 1}, seen


def test_state_came_from_host_memory(runs: dict) -> None:
    run = runs["lose"]
    assert run.returncode == 0, run.log[-6000:]
    # the first fault struck while iteration 3's snapshot was written: the newest complete one is iteration 2's;
    # the load that the second fault interrupted says nothing, the one after it loads the same snapshot
    assert memory_loads(run.log) == [(2, "tp=2,pp=1,dp=2", "tp=2,pp=1,dp=1", 0)], run.log[-6000:]


def test_a_stopped_rank_is_ended_and_the_other_continues(runs: dict) -> None:
    run = runs["stop"]
    assert run.returncode == 0, run.log[-6000:]
    statuses = pairs(STATUSES, run.log)
    assert statuses[0] == 0 and statuses[1] < 0, statuses  # ended by a signal (NVRx's hard timeout)
    assert calls(run.log)[0] == {(0, 0, 2), (1, 0, 1)}
    got = assert_uninterrupted(runs["stop_out"], runs["ref"])
    assert got[ITERS][-1]["layout"]["dp"] == 1
    assert memory_loads(run.log) == [(2, "tp=1,pp=1,dp=2", "tp=1,pp=1,dp=1", 0)], run.log[-6000:]


def test_no_legal_layout_left_ends_the_job_naming_why(runs: dict) -> None:
    run = runs["none"]
    assert pairs(STATUSES, run.log)[0] == 2 and run.returncode == 2, run.log[-6000:]
    assert "1 rank(s) left and no legal layout at any world size up to it (world size 1: " \
        "--tensor-model-parallel-size x --pipeline-model-parallel-size = 2 x 1 does not divide it)" in run.log, \
        run.log[-6000:]
    assert "--tenplex-inprocess: no legal layout for the ranks left; exiting" in run.log
    # warned at start: without host memory a fault costs the iterations since the last durable checkpoint
    assert run.log.count("> tenplex: warning: --tenplex-inprocess without --tenplex-memory: after a fault the "
                         "survivors load the newest durable checkpoint of ") == 1, run.log[-6000:]
    assert "(saved every 1 iterations): the iterations trained since it are lost and trained again" in run.log


def lease_file(d: str) -> dict:
    """The newest generation's lease file of ``d``, as JSON."""
    gens = lease.generations(d)
    with open(lease.gen_path(d, gens[-1])) as f:
        return dict(json.load(f), generations=gens)


def test_survivors_keep_the_jobs_lease_generation(runs: dict) -> None:
    """Two restarts in place (rank 3, then rank 0, the lease's taker) took no new generation of either directory:
    the one the job took at its start, in the launcher's name (it outlives every rank), kept live by the
    survivors and released at the end (released: the next job takes it at once)."""
    run, d = runs["lose"], runs["dir"]
    assert run.returncode == 0, run.log[-6000:]
    launcher = int(LAUNCHER.search(run.log).group(1))
    for kept in (f"{d}/lose-ckpt", f"{d}/lose-mem"):
        got = lease_file(kept)
        assert got["generations"] == [1], (kept, got)
        assert got["holder"] == f"{socket.gethostname()}:{launcher}" and got["job"] == "127.0.0.1:29731", got
        assert got["released"] is True, got
    assert "newer generation" not in run.log, run.log[-6000:]


def test_a_fenced_job_stops_and_never_takes_the_lease_back(runs: dict) -> None:
    """Another job takes the in-place job's --save over mid-run: the job's next commit is fenced, every rank exits
    3 (the fence is raised on every rank of the collective commit) or is ended by the launcher, which exits 3; nothing is committed after the take-over, and no restart in place
    takes the directory back (the other job's generation stays the newest)."""
    run, seen, d = runs["fence"], runs["fence_seen"], runs["dir"]
    assert seen["alive"], run.log[-6000:]  # taken over while the job ran
    assert run.returncode == 3, run.log[-6000:]
    statuses = pairs(STATUSES, run.log)
    assert 3 in statuses.values() and all(c in (3, -9) for c in statuses.values()), run.log[-3000:]
    assert "a newer generation owns the directory" in run.log, run.log[-6000:]
    if -9 in statuses.values():  # a rank still running when another exited 3 was ended by the launcher
        assert "exited 3 (fenced: another job owns a checkpoint directory): ending the ranks left" in run.log
    got = lease_file(f"{d}/fence-ckpt")
    assert got["job"] == OTHER_JOB and got["generations"][-1] == seen["generation"], got
    # a commit that checked the fence just before the take-over may land; none after it
    assert directory.tracker_iteration(f"{d}/fence-ckpt") <= (seen["committed"] or 0) + 1, seen
    assert max(m["iteration"] for m in runs["fence_out"]) < FENCE_ITERS
