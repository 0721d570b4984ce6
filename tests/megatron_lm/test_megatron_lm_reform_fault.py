"""Opt-in: Megatron-LM's own pretrain_gpt.py (patched) re-formed in place meeting faults, the reference trainer's
collisions (tests/multiproc/test_reform_collisions.py) through Megatron-LM. First, a rank lost while the job grows.

Node 0's launcher (``--reform``, 2 ranks at DP2, ``--tenplex-memory``) holds its rank 0 at generation 0's load
(``TENPLEX_FAULT`` ``reform.start@0#0:stop``) until node 1's 2 ranks (``--join``) registered, so the job grows to 4
at its first boundary; node 0's rank 1 is then SIGKILLed at generation 1's load (``reform.start@1#1:kill``: the
4-rank process group made, the model built). The survivors agree on 2 ranks (3 have no legal layout at global
batch 8, micro-batch 2): node 0's rank 0 and node 1's first; node 1's second waits as a spare and exits 0 at the
end. Oracle: every logged iteration's loss equals an uninterrupted torchrun run of 2 ranks (fp32, 1e-5), each
iteration once with its data position; every restore from host memory (0 bytes from durable storage); node 0's
rank 0 in one process throughout; every launcher exits 0 (a rank ended by a signal is the fault the job survived).

A leave notice and a fault at once: two launchers of 2 ranks from the start (DP4); once node 1's last rank logged
iteration 6 (the snapshot of 5 taken), SIGTERM to node 1's launcher and SIGKILL to node 0's rank 1 at the same
moment. Node 0's rank 0 continues alone (DP1, the same global batch), node 1's ranks exit 0. Oracle: every logged
loss equals the uninterrupted run's (an iteration trained again after the fault, from the snapshot before it, to
the same loss and data position), every iteration to the end logged, every restore from host memory.

A join while a re-form is under way, then a newcomer lost while joining: node 0 (1 rank) is held at generation 0's
load until newcomer A (1 rank) registered, and at generation 1's (A joining) until newcomer B (2 ranks) registered;
B's second rank is SIGKILLed at generation 2's load (4 ranks). B, registered during a re-form, is admitted at the
next boundary; after the loss the survivors go on at 2 ranks (3 have no legal layout), B's first rank a spare that
exits 0. Oracle as above.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

from tests.megatron_lm.test_megatron_lm import MLM, _log_lines, _losses, _run, patched_script
from tests.megatron_lm.test_megatron_lm_inprocess import STARTED, STATUSES, _pairs, _port_pair
from tests.megatron_lm.test_megatron_lm_reform import GENERATION, ITERS, LOADED, _read, finish, launcher, segments

pytestmark = [pytest.mark.megatron_lm,
              pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")]
DEADLINE = 900.0
REGISTERED = "registered, waiting for the next re-form"


def _until(what: str, ok: object, d: object) -> None:
    deadline = time.monotonic() + DEADLINE
    while not ok():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {DEADLINE:.0f} s\n" + _read(f"{d}/node-0.log")[-3000:]
                                 + _read(f"{d}/node-1.log")[-3000:])
        time.sleep(0.05)


def _held(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


def _ended(d: object, procs: list[subprocess.Popen]) -> dict[str, object]:
    """The launchers' exit codes and each node's log, once they ended."""
    return {"codes": [p.returncode for p in procs],
            **{f"node{n}": _read(f"{d}/node-{n}.log") for n in range(len(procs))}}


def lose_a_rank_in_a_grow(d: object, script: str) -> dict[str, object]:
    port = _port_pair()
    procs = [launcher(d, script, 0, False, port, fault="reform.start@0#0:stop,reform.start@1#1:kill")]
    try:
        _until("node 0's ranks started", lambda: STARTED.search(_read(f"{d}/node-0.log")), d)
        rank0 = _pairs(STARTED.search(_read(f"{d}/node-0.log")).group(1))[0]
        _until("rank 0 held at generation 0's load", lambda: _held(rank0), d)
        procs.append(launcher(d, script, 1, True, port))
        _until("node 1's ranks registered", lambda: _read(f"{d}/node-1.log").count(REGISTERED) == 2, d)
        os.kill(rank0, signal.SIGCONT)
    finally:
        finish(procs, time.monotonic() + DEADLINE)
    return _ended(d, procs)


def leave_and_fault_at_once(d: object, script: str) -> dict[str, object]:
    port = _port_pair()
    procs = [launcher(d, script, node, False, port, nnodes=2) for node in (0, 1)]
    try:
        _until("node 1's last rank logged iteration 6",
               lambda: any(it >= 6 for it, _, _ in _log_lines(_read(f"{d}/node-1.log"))), d)
        rank1 = _pairs(STARTED.search(_read(f"{d}/node-0.log")).group(1))[1]
        procs[1].send_signal(signal.SIGTERM)
        os.kill(rank1, signal.SIGKILL)
    finally:
        finish(procs, time.monotonic() + DEADLINE)
    return _ended(d, procs)


def hold_then_lose_a_newcomer(d: object, script: str) -> dict[str, object]:
    port = _port_pair()
    procs = [launcher(d, script, 0, False, port, nproc=1, fault="reform.start@0#0:stop,reform.start@0#1:stop"),
             launcher(d, script, 1, True, port, nproc=1)]
    try:
        _until("node 0's rank started", lambda: STARTED.search(_read(f"{d}/node-0.log")), d)
        rank0 = _pairs(STARTED.search(_read(f"{d}/node-0.log")).group(1))[0]
        _until("rank 0 held at generation 0 and A registered",
               lambda: _held(rank0) and REGISTERED in _read(f"{d}/node-1.log"), d)
        os.kill(rank0, signal.SIGCONT)
        _until("rank 0 held at generation 1 (A joining)", lambda: _held(rank0), d)
        procs.append(launcher(d, script, 2, True, port, fault="reform.start@3#2:kill"))
        _until("B registered during the re-form", lambda: _read(f"{d}/node-2.log").count(REGISTERED) == 2, d)
        os.kill(rank0, signal.SIGCONT)
    finally:
        finish(procs, time.monotonic() + DEADLINE)
    return _ended(d, procs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("mlm-reform-fault")
    script = patched_script(d)
    ref = _losses(_run(script, None, 95, ["--train-iters", str(ITERS)], nproc=2))
    assert sorted(ref) == list(range(1, ITERS + 1)), ref
    (d / "leave").mkdir()
    (d / "hold").mkdir()
    return {**lose_a_rank_in_a_grow(d, script), "ref": ref, "leave": leave_and_fault_at_once(d / "leave", script),
            "hold": hold_then_lose_a_newcomer(d / "hold", script)}


def _logged(ref: dict[int, float], logs: tuple[str, ...], again: bool = False) -> dict[int, float]:
    """Every logged iteration's loss, checked against the uninterrupted run's with its data position; ``again``:
    an iteration may be logged twice (trained again after a fault) if to the same loss."""
    logged: dict[int, float] = {}
    for log in logs:
        for seg in segments(log).values():
            losses = _losses(seg)
            for it, consumed, _ in _log_lines(seg):
                assert (again or it not in logged) and consumed == 8 * it, (it, consumed)
                logged[it] = losses[it]
                assert losses[it] == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, losses[it])
    assert sorted(logged) == list(range(1, ITERS + 1)), sorted(logged)
    loads = {(a.rstrip(","), b.rstrip(","), int(n)) for _, a, b, n in LOADED.findall("".join(logs))}
    assert loads and all(n == 0 for _, _, n in loads), loads  # every restore from host memory
    return logged


def test_megatron_lm_loses_a_rank_while_growing_and_continues_with_the_uninterrupted_losses(runs: dict) -> None:
    node0, node1 = runs["node0"], runs["node1"]
    assert runs["codes"] == [0, 0], node0[-5000:] + node1[-5000:]
    worlds = {(int(g), int(w)) for g, _, w, _ in GENERATION.findall(node0)}
    assert worlds == {(0, 2), (1, 4), (2, 2)}, node0[-5000:]
    assert _pairs(STATUSES.search(node0).group(1)) == {0: 0, 1: -signal.SIGKILL}, node0[-3000:]
    assert _pairs(STATUSES.search(node1).group(1)) == {2: 0, 3: 0}, node1[-3000:]
    assert "waits as a spare from generation 2" in node1, node1[-3000:]
    started = _pairs(STARTED.search(node0).group(1))
    assert all(int(pid) == started[0] for _, r, _, pid in GENERATION.findall(node0) if r == "0")  # one process
    _logged(runs["ref"], (node0, node1))


def test_megatron_lm_leave_notice_and_a_fault_at_once_continue_with_the_uninterrupted_losses(runs: dict) -> None:
    node0, node1 = runs["leave"]["node0"], runs["leave"]["node1"]
    assert runs["leave"]["codes"] == [0, 0], node0[-5000:] + node1[-5000:]
    assert _pairs(STATUSES.search(node1).group(1)) == {2: 0, 3: 0}, node1[-3000:]
    assert node1.count("leaves at generation") == 2, node1[-3000:]
    assert _pairs(STATUSES.search(node0).group(1)) == {0: 0, 1: -signal.SIGKILL}, node0[-3000:]
    worlds = [(int(g), int(w)) for g, r, w, _ in GENERATION.findall(node0) if r == "0"]
    assert worlds[0] == (0, 4) and worlds[-1][1] == 1, worlds  # rank 0 alone at the end
    started = _pairs(STARTED.search(node0).group(1))
    assert all(int(pid) == started[0] for _, r, _, pid in GENERATION.findall(node0) if r == "0")  # one process
    _logged(runs["ref"], (node1, node0), again=True)


def test_megatron_lm_join_during_a_reform_then_a_newcomer_lost_while_joining(runs: dict) -> None:
    got = runs["hold"]
    node0, a, b = got["node0"], got["node1"], got["node2"]
    assert got["codes"] == [0, 0, 0], node0[-4000:] + a[-3000:] + b[-3000:]
    worlds = {(int(g), int(w)) for g, _, w, _ in GENERATION.findall(node0)}
    assert worlds == {(0, 1), (1, 2), (2, 4), (3, 2)}, node0[-5000:]
    assert {(int(g), int(r)) for g, r, _, _ in GENERATION.findall(b)} >= {(2, 2), (2, 3)}, b[-3000:]
    assert "generation 2 failed" in node0 and "waits as a spare from generation 3" in b, b[-3000:]
    assert sorted(_pairs(STATUSES.search(b).group(1)).values()) == [-signal.SIGKILL, 0], b[-3000:]
    started = _pairs(STARTED.search(node0).group(1))
    assert all(int(pid) == started[0] for _, r, _, pid in GENERATION.findall(node0) if r == "0")  # one process
    _logged(runs["ref"], (node0, a, b), again=True)
