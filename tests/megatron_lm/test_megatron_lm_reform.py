"""Opt-in: Megatron-LM's own pretrain_gpt.py (patched) with ``--tenplex`` re-formed in place on plan by the
launcher's ``--reform``/``--join`` (no NVRx): a job of 2 ranks (TP1 x DP2, one launcher, ``--tenplex-memory``)
grows to 4 (DP4) when a second launcher joins with 2 ranks, then those 2 leave on notice (SIGTERM to their
launcher). Oracle: every logged iteration's loss equals an uninterrupted torchrun run of 2 ranks (fp32, 1e-5; the
global batch fixed, the same samples), each iteration logged once with its data position, the first launcher's
ranks in the same processes throughout, the departing ranks exit 0, every restore from host memory (0 bytes read
from durable storage; the newcomers' parts from their peers'). Mirrors tests/multiproc/test_reform.py for the
reference trainer. A third launcher joining at the same time with another model and global batch is refused before
it registers, one line naming both flags; the job never counts it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.megatron_lm.test_megatron_lm import (
    FLAGS,
    MLM,
    RUNNER,
    _env,
    _log_lines,
    _losses,
    _run,
    _vocab_flag,
    patched_script,
)
from tests.megatron_lm.test_megatron_lm_inprocess import STARTED, STATUSES, _pairs, _port_pair

pytestmark = [pytest.mark.megatron_lm,
              pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")]

ITERS = 20  # the 4-rank phase is left on notice well before the end
GENERATION = re.compile(r"re-form: generation (\d+): rank (\d+) of (\d+) \(pid (\d+)\)")
LOADED = re.compile(r"loaded iteration (\d+) from host memory .*: layout (\S+) -> (\S+), .* (\d+) bytes read "
                    r"from durable storage")


def launcher(d: object, script: str, node: int, join: bool, port: int, extra: list[str] = (),
             nproc: int = 2, fault: str = "", nnodes: int = 1) -> subprocess.Popen:
    """Node ``node``'s in-process launcher with ``--reform`` (``join``: ``--join``), ``nproc`` ranks, its own memory;
    ``extra``: flags after the job's (the later one wins); ``fault``: its ranks' ``TENPLEX_FAULT``, each fired once;
    ``nnodes``: the launchers the first generation waits for."""
    env, cpu = _env()
    env.update(PYTHONUNBUFFERED="1")
    if fault:
        env.update(TENPLEX_FAULT=fault, TENPLEX_FAULT_ONCE=f"{d}/fired-{node}")
    cmd = [sys.executable, "-m", "tenplex_megatron.frontdoor.launch", "--reform", *(["--join"] if join else []),
           "--nnodes", str(nnodes), "--node-rank", str(node), "--nproc-per-node", str(nproc), "--master-port", str(port),
           "--timeout", "900",
           RUNNER, script, *FLAGS, "--tenplex", *(["--distributed-backend", "gloo"] if cpu else []),
           "--vocab-size", _vocab_flag(95), "--train-iters", str(ITERS), "--save", f"{d}/ckpt", "--load", f"{d}/ckpt",
           "--save-interval", "5", *extra, "--tenplex-memory", f"{d}/mem-{node}"]
    with open(f"{d}/node-{node}.log", "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def segments(log: str) -> dict[int, str]:
    """A launcher's log cut at each generation's first marker (each generation is one call of Megatron-LM's
    ``train``: its own first-iteration logging)."""
    starts = {}
    for m in GENERATION.finditer(log):
        starts.setdefault(int(m.group(1)), m.start())
    cuts = sorted(starts.items(), key=lambda kv: kv[1])
    return {g: log[at:(cuts[i + 1][1] if i + 1 < len(cuts) else len(log))] for i, (g, at) in enumerate(cuts)}


def finish(procs: list[subprocess.Popen], deadline: float) -> None:
    """Each launcher waited for until ``deadline`` (``time.monotonic()``; at least 1 s each), any still running then
    killed with its process group."""
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


#: node 2's flags after the job's: another model and global batch (refused before it registers)
OTHER = ["--hidden-size", "128", "--global-batch-size", "16"]


def grow_then_leave(d: object, script: str, timeout: float = 900) -> dict[str, object]:
    """Node 0's launcher and node 1's joining, started together, and node 2's joining with :data:`OTHER`; once node
    1's rank (the last rank of the world of 4, the one Megatron-LM logs on) logged an iteration, SIGTERM to node
    1's launcher (its ranks leave)."""
    port = _port_pair()
    procs = [launcher(d, script, 0, False, port), launcher(d, script, 1, True, port),
             launcher(d, script, 2, True, port, OTHER, nproc=1)]
    deadline, noticed = time.monotonic() + timeout, False
    try:
        while procs[0].poll() is None and time.monotonic() < deadline:
            if not noticed and _log_lines(_read(f"{d}/node-1.log")):
                procs[1].send_signal(signal.SIGTERM)
                noticed = True
            time.sleep(0.05)
    finally:
        finish(procs, deadline)
    return {"codes": [p.returncode for p in procs], "node0": _read(f"{d}/node-0.log"),
            "node1": _read(f"{d}/node-1.log"), "node2": _read(f"{d}/node-2.log"), "noticed": noticed}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("mlm-reform")
    script = patched_script(d)
    ref = _losses(_run(script, None, 95, ["--train-iters", str(ITERS)], nproc=2))
    assert sorted(ref) == list(range(1, ITERS + 1)), ref
    return {**grow_then_leave(d, script), "ref": ref}


def test_megatron_lm_grows_and_shrinks_in_place_with_the_uninterrupted_losses(runs: dict) -> None:
    node0, node1 = runs["node0"], runs["node1"]
    assert runs["codes"][:2] == [0, 0], node0[-5000:] + node1[-5000:]
    assert runs["noticed"], node1[-5000:]
    parts = [(0, g, seg) for g, seg in segments(node0).items()] + [(1, g, seg) for g, seg in segments(node1).items()]
    logged = {}
    for node, g, seg in parts:
        for it, consumed, _ in _log_lines(seg):
            assert it not in logged, (it, node, g)  # each iteration trained (and logged) once
            assert consumed == 8 * it, (it, consumed)
            logged[it] = (g, _losses(seg)[it])
    assert sorted(logged) == list(range(1, ITERS + 1)), sorted(logged)
    gens = [logged[it][0] for it in range(1, ITERS + 1)]
    assert gens[0] == 0 and 1 in gens and gens[-1] == 2 and gens == sorted(gens), gens  # 2, then 4, then 2 ranks
    rows = []
    for it in range(1, ITERS + 1):
        g, loss = logged[it]
        rows.append(f"{it}: generation {g}: uninterrupted {runs['ref'][it]:.6f} re-formed {loss:.6f}")
        assert loss == pytest.approx(runs["ref"][it], rel=1e-5, abs=5e-6), (it, g, loss, runs["ref"][it])
    print("\n".join(rows))


def test_megatron_lm_first_ranks_keep_their_processes_and_the_newcomers_leave_cleanly(runs: dict) -> None:
    node0, node1 = runs["node0"], runs["node1"]
    started = _pairs(STARTED.search(node0).group(1))
    gens = [tuple(map(int, g)) for g in GENERATION.findall(node0)]
    assert {(g, r, w) for g, r, w, _ in gens} == {(0, 0, 2), (0, 1, 2), (1, 0, 4), (1, 1, 4), (2, 0, 2), (2, 1, 2)}, \
        node0[-5000:]
    assert all(pid == started[r] for _, r, _, pid in gens), (gens, started)  # the launcher's processes throughout
    joined = [tuple(map(int, g)) for g in GENERATION.findall(node1)]
    assert {(g, r, w) for g, r, w, _ in joined} == {(1, 2, 4), (1, 3, 4)}, node1[-5000:]
    assert _pairs(STATUSES.search(node1).group(1)) == {2: 0, 3: 0}
    assert _pairs(STATUSES.search(node0).group(1)) == {0: 0, 1: 0}
    assert node1.count("leaves at generation 2") == 2, node1[-3000:]


def test_megatron_lm_every_re_form_restored_from_host_memory(runs: dict) -> None:
    loads = [(a, b, int(dur)) for _, a, b, dur in LOADED.findall(runs["node0"])]
    assert [(a.rstrip(","), b.rstrip(","), dur) for a, b, dur in loads] == [
        ("tp=1,pp=1,dp=2", "tp=1,pp=1,dp=4", 0), ("tp=1,pp=1,dp=4", "tp=1,pp=1,dp=2", 0)], runs["node0"][-5000:]


def test_megatron_lm_newcomer_with_other_flags_is_refused_and_the_job_untouched(runs: dict) -> None:
    """Node 2 (another --hidden-size and --global-batch-size) is refused before it registers, one line naming both
    flags with both values; the job's worlds are the 2 and 4 ranks above (the losses: the first test)."""
    node2 = runs["node2"]
    assert runs["codes"][2] not in (0, None), node2[-3000:]
    line = ("pretrain_gpt.py: error: --join: this launcher's flags differ from the running job's: "
            "--global-batch-size 16 (the job's: 8); --hidden-size 128 (the job's: 64); not registered "
            "(the job goes on unchanged)")
    assert node2.count(line) == 1, node2[-3000:]
    assert "registered, waiting" not in node2 and not GENERATION.search(node2), node2[-3000:]
    worlds = {int(w) for _, _, w, _ in GENERATION.findall(runs["node0"])}
    assert worlds == {2, 4}, worlds  # never 3 or 5: node 2 was not counted
