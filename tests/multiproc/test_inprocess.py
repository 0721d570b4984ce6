"""Losing a rank in place (``--tenplex-inprocess``, NVRx's in-process restart): 4 ranks at TP2 x DP2 with
``--tenplex-memory``, rank 3 killed mid-run; the survivors continue in the same processes at the largest world with a
legal layout (2: TP2 x DP1; the third survivor waits as a spare), restored from host memory. Oracle: every logged
iteration's loss equals an uninterrupted run at TP2 x DP2 (fp32, 1e-5 relative), the same samples (data position
exact), the survivors' process ids unchanged, nothing read from durable storage."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.harness import CHILD_PYTHONPATH, PRETRAIN, TINY_GPT, Run, layout_flags, metrics, torchrun

pytestmark = pytest.mark.dist

ITERS = 8
BASE = [*TINY_GPT, "--vocab-size", "96", "--train-iters", str(ITERS), *layout_flags(2, 1),
        "--use-distributed-optimizer", "--save-interval", "1"]
CALL = re.compile(r"in place: call (\d+): rank (\d+) of (\d+) \(initial rank (\d+), pid (\d+)\)")
STARTED = re.compile(r"ranks started, pids ((?:\d+:\d+ ?)+)")
STATUSES = re.compile(r"exit statuses ((?:\d+:-?\d+ ?)+)")


def launch_inprocess(nproc: int, args: list[str], port: int, env: dict[str, str] | None = None,
                     timeout: float = 240) -> Run:
    """``python -m tenplex_megatron.frontdoor.launch`` (the stores served outside the ranks) running PRETRAIN."""
    cmd = [sys.executable, "-m", "tenplex_megatron.frontdoor.launch", "--nproc-per-node", str(nproc), "--master-port",
           str(port), "--timeout", str(timeout - 10), PRETRAIN, *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=CHILD_PYTHONPATH, PYTHONUNBUFFERED="1", **(env or {}))
    try:
        p = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Run(124, out + "\nTIMEOUT")
    return Run(p.returncode, p.stdout + p.stderr)


def pairs(pattern: re.Pattern[str], log: str) -> dict[int, int]:
    """``rank:value`` pairs of the launcher's first line matching ``pattern``."""
    m = pattern.search(log)
    assert m, log[-4000:]
    return {int(r): int(v) for r, v in (x.split(":") for x in m.group(1).split())}


@pytest.fixture(scope="module")
def lose_rank3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The uninterrupted reference at TP2 x DP2 (torchrun) and the in-place job that loses rank 3 while it writes
    its snapshot of iteration 4 (``TENPLEX_FAULT``: SIGKILL), run once for the module's checks."""
    d = tmp_path_factory.mktemp("inprocess")
    ref = torchrun(4, [*BASE, "--save", str(d / "ref-ckpt"), "--tenplex-metrics", str(d / "ref.jsonl")])
    assert ref.returncode == 0, ref.log[-4000:]
    run = launch_inprocess(4, [*BASE, "--save", str(d / "ckpt"), "--tenplex-memory", str(d / "mem"),
                               "--tenplex-metrics", str(d / "out.jsonl"), "--tenplex-inprocess",
                               "--tenplex-inprocess-timeout", "15"],
                           port=29731, env={"TENPLEX_FAULT": "memory.write@3#4"})
    return {"ref": metrics(str(d / "ref.jsonl")), "out": metrics(str(d / "out.jsonl")), "run": run}


def test_survivors_continue_with_the_uninterrupted_losses(lose_rank3: dict) -> None:
    run, ref, out = lose_rank3["run"], lose_rank3["ref"], lose_rank3["out"]
    assert run.returncode == 0, run.log[-6000:]
    assert pairs(STATUSES, run.log)[3] == -9, run.log[-3000:]  # the fault: rank 3 SIGKILLed
    ref_by_it = {m["iteration"]: m for m in ref}
    assert sorted(ref_by_it) == list(range(1, ITERS + 1))
    by_it = defaultdict(list)
    for m in out:
        by_it[m["iteration"]].append(m)
    assert sorted(by_it) == list(range(1, ITERS + 1)), [m["iteration"] for m in out]
    assert any(len(v) > 1 for v in by_it.values()) or by_it[ITERS][-1]["layout"] != by_it[1][0]["layout"]
    for it, entries in by_it.items():
        for m in entries:  # before the fault and again after it: the same step
            assert m["loss"] == pytest.approx(ref_by_it[it]["loss"], rel=1e-5), (it, m["layout"])
            assert m["samples"] == ref_by_it[it]["samples"], it  # the data position, exact
            assert m["lr"] == pytest.approx(ref_by_it[it]["lr"], rel=1e-6), it
    first, last = by_it[1][0]["layout"], by_it[ITERS][-1]["layout"]
    assert (first["tp"], first["dp"]) == (2, 2) and (last["tp"], last["dp"]) == (2, 1), (first, last)


def test_survivors_keep_their_processes(lose_rank3: dict) -> None:
    run = lose_rank3["run"]
    assert run.returncode == 0, run.log[-6000:]
    started = pairs(STARTED, run.log)
    calls = [tuple(map(int, m)) for m in CALL.findall(run.log)]
    by_initial = defaultdict(set)
    for call, rank, world, initial, pid in calls:
        assert pid == started[initial], (initial, pid, started)  # the launcher's process, never a new one
        by_initial[initial].add((call, rank, world))
    assert by_initial[3] == {(0, 3, 4)}, by_initial  # rank 3 died in the first call
    for initial in (0, 1):  # the admitted survivors: re-entered at world 2 in the same processes
        assert {(0, initial, 4), (1, initial, 2)} <= by_initial[initial], by_initial
    assert (1, 2, 2) not in by_initial[2], by_initial  # the third survivor waits as a spare
    assert pairs(STATUSES, run.log)[2] == 0, run.log[-3000:]


def test_state_came_from_host_memory(lose_rank3: dict) -> None:
    run = lose_rank3["run"]
    assert run.returncode == 0, run.log[-6000:]
    loads = re.findall(r"loaded iteration (\d+) from host memory .*: layout (\S+) -> (\S+), .* (\d+) bytes read from "
                       r"durable storage", run.log)
    assert len(loads) == 1, run.log[-6000:]
    it, before, after, durable = loads[0]
    # the fault struck while iteration 4's snapshot was written: the newest complete one is iteration 3's
    assert (int(it), before.rstrip(","), after.rstrip(","), int(durable)) == (3, "tp=2,pp=1,dp=2", "tp=2,pp=1,dp=1", 0)
