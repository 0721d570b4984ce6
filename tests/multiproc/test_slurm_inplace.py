"""The in-place scripts of docs/slurm.md, as written, against the real local Slurm (the session's ``slurm_cluster``):
the in-place launcher ``srun``-ed one per node. ``train-inplace.sbatch`` (``--tenplex-inprocess``): node n2's launcher
and ranks SIGKILLed (its process group, as a failed node takes them) and its memory removed; node n1's rank
continues in the same process at dp=1 from host memory. ``train-reform.sbatch`` (``--reform``): the joining step's launcher
on n2 joins the running job (dp=1 -> 2), then leaves on ``scancel --signal=TERM`` of its step (dp=2 -> 1). Oracle:
every logged iteration's loss and learning rate equal the uninterrupted run's at the first layout (test_slurm.py's
``reference``: 2 ranks, tp=1,pp=1,dp=2).

The tests change what test_slurm.py's change (the paths and sizes block), plus ``MEMORY`` (a temporary directory)
and ``SAVE_INTERVAL`` (a snapshot every iteration in the NVRx case); the first run is paced
(``TENPLEX_TEST_SECONDS_PER_ITERATION``, tests/site) so that the tiny model still trains when the node is lost or
joins (a joining launcher's imports take tens of seconds on the shared 2-core machine).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections import defaultdict

import pytest

from benchmarks.kit import slurm
from tests.multiproc.test_inprocess import memory_loads
from tests.multiproc.test_slurm import ITERS, JOB_TIMEOUT, _script, uninterrupted

pytestmark = [pytest.mark.dist, pytest.mark.slurm]
LAUNCHER = re.compile(r"> tenplex launch: ranks started, pids (\d+):(\d+); .*?\(served by node 0\); launcher pid (\d+)")
GENERATION = re.compile(r"re-form: generation (\d+): rank (\d+) of (\d+) \(pid (\d+)\)")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, tuple[float, float]]:
    return uninterrupted(tmp_path_factory.mktemp("reference"))


def _logged(text: str) -> dict[int, list[tuple[float, float]]]:
    """Iteration -> every (learning rate, loss) logged for it (an iteration trained again after a fault: twice)."""
    got: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for it, lr, loss in slurm.ITERATION.findall(text):
        got[int(it)].append((float(lr), float(loss)))
    return dict(got)


def _same_curve(got: dict[int, list[tuple[float, float]]], want: dict[int, tuple[float, float]]) -> None:
    assert sorted(got) == list(range(1, ITERS + 1)), sorted(got)
    for it, seen in got.items():
        for lr, loss in seen:
            assert lr == pytest.approx(want[it][0], rel=1e-6), (it, lr, want[it][0])
            assert loss == pytest.approx(want[it][1], rel=1e-5), (it, loss, want[it][1])


def test_a_lost_node_leaves_the_job_training_in_place_on_the_other(tmp_path, slurm_cluster, reference) -> None:
    """train-inplace.sbatch on 2 nodes; after iteration 10, node n2's launcher, rank and helpers are SIGKILLed (its
    process group) and its memory directory removed: n1's rank continues in the same process at dp=1 from the
    newest snapshot complete in its own memory (0 bytes from durable storage), trains to the end with the
    uninterrupted losses; the iterations trained again are those since that snapshot."""
    ckpt, memory = str(tmp_path / "ckpt"), str(tmp_path / "mem")
    script = _script(tmp_path, "train-inplace.sbatch", ckpt, MEMORY=memory, SAVE_INTERVAL="1")
    job_id = slurm.sbatch(script, str(tmp_path), env=slurm.job_env({"TENPLEX_TEST_SECONDS_PER_ITERATION": "0.3"}))
    log = str(tmp_path / f"gpt-{job_id}.out")
    launcher = slurm.wait_for_text(log, LAUNCHER.pattern, JOB_TIMEOUT, job_id)
    slurm.wait_for_text(log, r"^ iteration\s+10/", JOB_TIMEOUT, job_id)
    os.killpg(int(launcher.group(3)), signal.SIGKILL)  # n2: its launcher and everything it started
    shutil.rmtree(os.path.join(memory, "n2"))  # its memory goes with it
    info = slurm.wait_for(job_id, "ENDED", JOB_TIMEOUT, log)
    text = slurm.read(log)
    loads = memory_loads(text)
    assert [(a, b, durable) for _, a, b, durable in loads] == [("tp=1,pp=1,dp=2", "tp=1,pp=1,dp=1", 0)], text[-6000:]
    assert "exit statuses 0:0" in text and "srun: error: n2: task 1: Killed" in text, text[-4000:]
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "137:0", info  # the lost task's status (the page)
    got = _logged(text)
    again = sorted(i for i, seen in got.items() if len(seen) == 2)
    loaded = loads[0][0]
    assert again == list(range(loaded + 1, max(again, default=loaded) + 1)), (again, loaded)
    _same_curve(got, reference)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(ITERS)


def test_a_node_joins_the_running_job_and_leaves_it_on_slurms_signal(tmp_path, slurm_cluster, reference) -> None:
    """train-reform.sbatch on 2 nodes: the head step (n1) trains at dp=1, the joining step's launcher (n2) joins at an iteration
    boundary (dp=2); once it trained 3 iterations there, ``scancel --signal=TERM JOBID.STEP`` of the step on n2
    reaches its processes only: its rank leaves at the next boundary and exits 0, n1's rank trains on at dp=1 in the same
    process; every iteration logged once, with the uninterrupted losses."""
    ckpt, memory = str(tmp_path / "ckpt"), str(tmp_path / "mem")
    script = _script(tmp_path, "train-reform.sbatch", ckpt, MEMORY=memory)
    job_id = slurm.sbatch(script, str(tmp_path), env=slurm.job_env({"TENPLEX_TEST_SECONDS_PER_ITERATION": "0.5"}))
    log = str(tmp_path / f"gpt-{job_id}.out")
    grown = slurm.wait_for_text(log, r"re-form: generation 1: rank 0 of 2", JOB_TIMEOUT, job_id)
    joined_at = int(re.findall(r"re-forming after iteration (\d+)", slurm.read(log))[0])
    slurm.wait_for_text(log, rf"^ iteration\s+{joined_at + 3}/", JOB_TIMEOUT, job_id)
    # the joining step: the one on n2 (the two sruns start together: either may get step id 0)
    steps = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %N"], capture_output=True, text=True,
                           timeout=30).stdout.split()
    step = dict(zip(steps[1::2], steps[::2]))["n2"]
    # Slurm 22.05's scancel signals the step, then exits 225 ("Kill job error on job step id J: Invalid job id
    # specified", the page): the signal's effect is what is checked
    subprocess.run(["scancel", "--signal=TERM", step], capture_output=True, timeout=30)
    info = slurm.wait_for(job_id, "ENDED", JOB_TIMEOUT, log)
    text = slurm.read(log)
    assert grown and info["JobState"] == "COMPLETED", (info, text[-6000:])
    gens = {(int(g), int(r), int(w)) for g, r, w, _ in GENERATION.findall(text)}
    assert gens == {(0, 0, 1), (1, 0, 2), (1, 1, 2), (2, 0, 1)}, (gens, text[-6000:])
    pids = {int(p) for g, r, _, p in GENERATION.findall(text) if r == "0"}
    assert len(pids) == 1, pids  # n1's rank in the same process throughout
    assert f"STEP {step} ON n2 CANCELLED" in text and " ON n1 CANCELLED" not in text, text[-6000:]
    assert "leaves at generation 2" in text and "exit statuses 1:0" in text and "exit statuses 0:0" in text, \
        text[-4000:]
    got = _logged(text)
    assert all(len(seen) == 1 for seen in got.values()), got  # nothing trained twice
    _same_curve(got, reference)
