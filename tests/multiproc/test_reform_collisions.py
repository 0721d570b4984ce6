"""Planned re-forms in place (``--reform``) meeting each other and faults, three launches (``TENPLEX_FAULT`` at
``reform.start``, a generation's process group just made: ``stop`` holds a rank there until the test lets it go,
``kill`` loses it there):

- *a join while a re-form is under way, then a newcomer that dies while joining*: node 0 (1 rank) is held at the
  start of generation 0 until newcomer A (1 rank) registered, and at the start of generation 1 (A joining) until
  newcomer B (2 ranks) registered; B's second rank dies as generation 2 (4 ranks) starts. B registered during a
  re-form is admitted at the next boundary; after the loss the survivors agree on 2 ranks (3 have no legal layout),
  B's first rank waits as a spare and exits 0 when the job ends;
- *a fault during a grow*: node 0 (2 ranks) grows with A (2 ranks); node 0's rank 1 dies as the 4-rank generation
  starts: the job continues at 2 ranks (node 0's rank 0 and A's first), A's second a spare;
- *a leave notice and a fault at once*: two nodes of 2 ranks (4 ranks from the start); SIGTERM to node 1's launcher
  and SIGKILL to node 0's rank 1 at the same moment: rank 0 continues alone, node 1's ranks exit 0; this launch
  runs with ``--tenplex-layout auto``: TP2 x DP2 at 4 ranks, then the chooser's layout for 1 rank.

Oracle for each: every logged iteration's loss equals an uninterrupted run's (1e-5; iterations trained again after
a fault to the same loss), every launcher exits 0, every committed durable checkpoint verifies. The leases: one
generation per directory through the re-forms and the fault, in the launchers' names."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tenplex_megatron.storage import directory, lease
from tenplex_megatron.storage.verify_ckpt import verify_checkpoint
from tenplex_megatron.training import layout_choice, pretrain
from tests.harness import CHILD_PYTHONPATH, PRETRAIN, TINY_GPT, Run, kill_groups, layout_flags, metrics, torchrun
from tests.multiproc.test_inprocess import LAUNCHER, STARTED, STATUSES, assert_uninterrupted, pairs

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ITERS = 30
PORTS = {"hold": 29811, "grow": 29821, "leave": 29831}
BASE = [*TINY_GPT, "--vocab-size", "96", "--train-iters", str(ITERS), *layout_flags(1, 1),
        "--use-distributed-optimizer", "--micro-batch-size", "1",  # legal worlds: 1, 2, 4, 8
        "--tenplex-inprocess-timeout", "600", "--save-interval", "5"]  # a held rank's peers wait in a collective
_MBS = TINY_GPT.index("--micro-batch-size")
# the leave launch: --tenplex-layout auto chooses TP, PP, DP and the micro-batch size for each generation's world
AUTO = [*TINY_GPT[:_MBS], *TINY_GPT[_MBS + 2:], "--vocab-size", "96", "--train-iters", str(ITERS),
        "--use-distributed-optimizer", "--tenplex-layout", "auto", "--save-interval", "5"]
GENERATION = re.compile(r"re-form: generation (\d+): rank (\d+) of (\d+) \(pid (\d+)\)")
REGISTERED = "registered, waiting for the next re-form"
DEADLINE = 600.0


def launcher(d: str, name: str, node: int, nproc: int, port: int, *, join: bool = False, nnodes: int = 1,
             fault: str = "", flags: list[str] = BASE) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tenplex_megatron.frontdoor.launch", "--reform", *(["--join"] if join else []),
           "--nnodes", str(nnodes), "--node-rank", str(node), "--nproc-per-node", str(nproc), "--master-port",
           str(port), "--timeout", str(DEADLINE), PRETRAIN, *flags, "--save", f"{d}/ckpt", "--tenplex-metrics",
           f"{d}/out.jsonl", "--tenplex-memory", f"{d}/mem-{name}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=CHILD_PYTHONPATH, PYTHONUNBUFFERED="1")
    if fault:
        env.update(TENPLEX_FAULT=fault, TENPLEX_FAULT_ONCE=f"{d}/fired-{name}")
    with open(f"{d}/{name}.log", "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def until(what: str, ok: object, d: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not ok():  # type: ignore[operator]
        if time.monotonic() > deadline:
            logs = "".join(read(os.path.join(d, n))[-3000:] for n in sorted(os.listdir(d)) if n.endswith(".log"))
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{logs}")
        time.sleep(0.05)


def held(pid: int) -> bool:
    """Whether ``pid`` stopped itself (``TENPLEX_FAULT``'s ``stop``)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


def first_pid(d: str, name: str) -> int:
    until(f"{name}'s ranks started", lambda: STARTED.search(read(f"{d}/{name}.log")), d)
    return min(pairs(STARTED, read(f"{d}/{name}.log")).items())[1]


def finish(d: str, procs: dict[str, subprocess.Popen]) -> dict[str, Run]:
    try:
        for p in procs.values():
            p.wait(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill_groups(list(procs.values()))
    return {n: Run(p.returncode, read(f"{d}/{n}.log")) for n, p in procs.items()}


def hold_then_lose_a_newcomer(d: str) -> dict[str, Run]:
    port = PORTS["hold"]
    procs = {"node0": launcher(d, "node0", 0, 1, port, fault="reform.start@0#0:stop,reform.start@0#1:stop"),
             "a": launcher(d, "a", 1, 1, port, join=True)}
    rank0 = first_pid(d, "node0")
    until("rank 0 held at generation 0 and A registered",
          lambda: held(rank0) and REGISTERED in read(f"{d}/a.log"), d)
    os.kill(rank0, signal.SIGCONT)
    until("rank 0 held at generation 1 (A joining)", lambda: held(rank0), d)
    procs["b"] = launcher(d, "b", 2, 2, port, join=True, fault="reform.start@3#2:kill")
    until("B registered during the re-form", lambda: read(f"{d}/b.log").count(REGISTERED) == 2, d)
    os.kill(rank0, signal.SIGCONT)
    return finish(d, procs)


def lose_a_rank_in_a_grow(d: str) -> dict[str, Run]:
    port = PORTS["grow"]
    procs = {"node0": launcher(d, "node0", 0, 2, port, fault="reform.start@0#0:stop,reform.start@1#1:kill"),
             "a": launcher(d, "a", 1, 2, port, join=True)}
    rank0 = first_pid(d, "node0")
    until("rank 0 held and A registered", lambda: held(rank0) and read(f"{d}/a.log").count(REGISTERED) == 2, d)
    os.kill(rank0, signal.SIGCONT)
    return finish(d, procs)


def leave_and_fault_at_once(d: str) -> dict[str, Run]:
    port = PORTS["leave"]
    procs = {n: launcher(d, n, r, 2, port, nnodes=2, flags=AUTO) for r, n in enumerate(("node0", "node1"))}
    until("5 iterations at 4 ranks", lambda: os.path.exists(f"{d}/out.jsonl") and sum(
        m["layout"]["tp"] * m["layout"]["dp"] == 4 for m in metrics(f"{d}/out.jsonl")) >= 5, d)
    rank1 = pairs(STARTED, read(f"{d}/node0.log"))[1]
    procs["node1"].send_signal(signal.SIGTERM)
    os.kill(rank1, signal.SIGKILL)
    return finish(d, procs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("collide")
    ref = torchrun(2, [*BASE, "--save", str(d / "ref-ckpt"), "--tenplex-metrics", str(d / "ref.jsonl")])
    assert ref.returncode == 0, ref.log[-4000:]
    out: dict[str, object] = {"ref": metrics(str(d / "ref.jsonl"))}
    for name, go in (("hold", hold_then_lose_a_newcomer), ("grow", lose_a_rank_in_a_grow),
                     ("leave", leave_and_fault_at_once)):
        sub = d / name
        sub.mkdir()
        out[name] = (go(str(sub)), str(sub))
    return out


def gens(log: str) -> set[tuple[int, int, int]]:
    return {(int(g), int(r), int(w)) for g, r, w, _ in GENERATION.findall(log)}


def check_job(runs: dict, name: str) -> tuple[dict[str, Run], dict[int, list[dict]]]:
    """Every launcher exits 0, the losses are the uninterrupted run's, every committed checkpoint verifies."""
    got, d = runs[name]
    assert all(r.returncode == 0 for r in got.values()), "".join(r.log[-4000:] for r in got.values())
    by_it = assert_uninterrupted(metrics(f"{d}/out.jsonl"), runs["ref"], ITERS)
    committed = directory.committed_iterations(f"{d}/ckpt")
    assert ITERS in committed and all(
        verify_checkpoint(os.path.join(d, "ckpt", directory.iter_dir_name(i)), workers=1).ok for i in committed)
    return got, by_it


def test_a_join_during_a_reform_then_a_newcomer_lost_while_joining(runs: dict) -> None:
    got, by_it = check_job(runs, "hold")
    node0, a, b = got["node0"], got["a"], got["b"]
    assert {(g, w) for g, _, w in gens(node0.log)} == {(0, 1), (1, 2), (2, 4), (3, 2)}, node0.log[-4000:]
    assert (2, 2, 4) in gens(b.log) and (2, 3, 4) in gens(b.log)  # B admitted at the boundary after A's re-form
    assert "generation 2 failed" in node0.log and "waits as a spare from generation 3" in b.log, b.log[-3000:]
    assert "the job ended before admitting it" not in a.log
    assert sorted(pairs(STATUSES, b.log).values()) == [-signal.SIGKILL, 0], b.log[-3000:]  # B's 2nd rank lost
    dps = [m["layout"]["dp"] for i in sorted(by_it) for m in by_it[i]]
    assert dps[0] == 1 and 2 in dps and dps[-1] == 2 and 4 not in dps, dps  # the layout it had, after the loss


def test_a_rank_lost_during_a_grow(runs: dict) -> None:
    got, by_it = check_job(runs, "grow")
    node0, a = got["node0"], got["a"]
    assert {(g, w) for g, _, w in gens(node0.log)} == {(0, 2), (1, 4), (2, 2)}, node0.log[-4000:]
    assert pairs(STATUSES, node0.log) == {0: 0, 1: -signal.SIGKILL}
    assert (2, 1, 2) in gens(a.log) and "waits as a spare from generation 2" in a.log, a.log[-3000:]
    assert by_it[ITERS][-1]["layout"]["dp"] == 2


def test_a_leave_notice_and_a_fault_at_once(runs: dict) -> None:
    got, by_it = check_job(runs, "leave")
    node0, node1 = got["node0"], got["node1"]
    assert pairs(STATUSES, node1.log) == {2: 0, 3: 0} and node1.log.count("leaves at generation") == 2, \
        node1.log[-3000:]
    assert pairs(STATUSES, node0.log) == {0: 0, 1: -signal.SIGKILL}
    # --tenplex-layout auto: each generation at the auto chooser's layout for its world (TP2 x DP2, then 1 rank)
    args, _ = pretrain.build_parser().parse_known_args(AUTO)
    seen = {(m["layout"]["tp"], m["layout"]["pp"], m["layout"]["dp"]) for v in by_it.values() for m in v}
    chosen = {w: layout_choice.choose_for(args, w, 2).layout for w in (4, 1)}
    assert seen == {(c.tp, c.pp, c.dp) for c in chosen.values()} and chosen[4].tp == 2, (seen, chosen)
    assert by_it[ITERS][-1]["layout"]["tp"] * by_it[ITERS][-1]["layout"]["dp"] == 1


def test_one_lease_generation_across_reforms_and_faults(runs: dict) -> None:
    """The launcher's lease set kept across generations: one generation per directory, held in the name of the launcher
    that took it (node 0's for --save), released at the job's clean end."""
    got, d = runs["grow"]
    for where, name in (("ckpt", "node0"), ("mem-node0", "node0"), ("mem-a", "a")):
        assert lease.generations(f"{d}/{where}") == [1], (where, lease.generations(f"{d}/{where}"))  # never taken again
        held = lease.current(f"{d}/{where}")
        launcher_pid = int(LAUNCHER.search(got[name].log).group(1))
        assert held is not None and held.holder.endswith(f":{launcher_pid}") and held.released, (where, held)
