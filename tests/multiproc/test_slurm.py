"""The batch scripts of docs/slurm.md, as written, against a real Slurm (munged, slurmctld and two slurmd nodes on
this machine: scripts/slurm/start.sh, the session's ``slurm_cluster`` fixture): a job resubmitted at another node
count and a job requeued after Slurm's signal continue the loss curve of an uninterrupted run at the first layout;
a second Slurm job on the same ``--save`` is refused naming the directory and the first job; a hard-coded
``--nnodes`` is refused before torchrun.

What the tests change in a script (``benchmarks.kit.slurm.substitute``; nothing else): in its block ``# the job's
paths and sizes``, ``TENPLEX`` (this checkout), ``CKPT`` (a temporary directory), ``GPUS_PER_NODE`` (1: a process
per node on the CPU), ``TRAIN_ITERS`` (100), and the sizes of ``MODEL`` and ``TRAIN`` (a 2-layer GPT of hidden size
64, 4 heads, sequence 32, vocabulary 96; a global batch of 8, 2 warm-up iterations). Each job gets this Python's
``bin`` first on ``PATH`` and the checkout on ``PYTHONPATH`` (``job_env``). Slurm's ``--signal`` timer is not waited
for: ``scancel --signal=TERM`` sends the same SIGTERM to every task of the job's steps at a chosen iteration.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from benchmarks.kit import slurm
from tenplex_megatron.storage import lease
from tests.harness import TINY_GPT, metrics, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slurm]
ITERS = 100
SIZES = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "32",
         "--max-position-embeddings": "32", "--vocab-size": "96", "--global-batch-size": "8",
         "--lr-warmup-iters": "2"}
JOB_TIMEOUT = 300  # seconds for one job of a few torch processes on a busy 2-core machine
PACE = 0.9  # seconds an iteration at least in the timer test's first run: 100 outlast the 90 s to Slurm's signal


def _text(name: str, ckpt: str, **more: str) -> str:
    """The page's script ``name`` with this test's paths and sizes."""
    return slurm.substitute(slurm.page_scripts()[name], {"TENPLEX": slurm.ROOT, "CKPT": ckpt, "GPUS_PER_NODE": "1",
                                                         "TRAIN_ITERS": str(ITERS), **more}, SIZES)


def _script(tmp_path, name: str, ckpt: str, **more: str) -> str:
    """The page's script ``name`` with this test's paths and sizes, written into ``tmp_path``; its path."""
    path = str(tmp_path / name)
    with open(path, "w") as f:
        f.write(_text(name, ckpt, **more))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, tuple[float, float]]:
    """The uninterrupted run at the first layout the scripts get on 2 nodes: :func:`uninterrupted`."""
    return uninterrupted(tmp_path_factory.mktemp("reference"))


def uninterrupted(where) -> dict[int, tuple[float, float]]:
    """The uninterrupted run at the first layout the scripts get on 2 nodes (tp=1,pp=1,dp=2, micro-batch 4: what
    ``--tenplex-layout auto`` chooses at 2 nodes of 1 process, asserted in the tests): iteration -> (lr, loss)."""
    flags = slurm.trainer_args(_text("train.sbatch", str(where / "ckpt")))  # the page's flags, this test's sizes
    assert flags[:10] == TINY_GPT[:10] and flags[-2:] == ["--tenplex-layout", "auto"], flags
    out = str(where / "m.jsonl")
    r = torchrun(2, [*flags[:-2], "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                     "--micro-batch-size", "4", "--tenplex-metrics", out], timeout=JOB_TIMEOUT)
    assert r.returncode == 0, r.log[-4000:]
    return {m["iteration"]: (m["lr"], m["loss"]) for m in metrics(out)}


def _same_curve(got: dict[int, tuple[float, float]], want: dict[int, tuple[float, float]]) -> None:
    assert sorted(got) == list(range(1, ITERS + 1)), sorted(got)
    for it, (lr, loss) in got.items():
        assert lr == pytest.approx(want[it][0], rel=1e-6), (it, lr, want[it][0])
        assert loss == pytest.approx(want[it][1], rel=1e-5), (it, loss, want[it][1])


def _stop_with_the_signal(job_id: str, log: str, after: int = 10) -> int:
    """``scancel --signal=TERM`` once iteration ``after`` is logged; the iteration every rank stopped after."""
    slurm.wait_for_text(log, rf"^ iteration\s+{after}/", JOB_TIMEOUT, job_id)
    subprocess.run(["scancel", "--signal=TERM", job_id], check=True, timeout=30)
    m = slurm.wait_for_text(log, r"> tenplex: (?:SIGTERM|a peer's signal) received: stopping after iteration (\d+)",
                            JOB_TIMEOUT, job_id)
    stopped = int(m.group(1))
    slurm.wait_for_text(log, rf"> tenplex: saved iteration {stopped} to ", JOB_TIMEOUT, job_id)
    return stopped


def test_a_job_resubmitted_on_one_node_resumes_the_two_node_job(tmp_path, slurm_cluster, reference) -> None:
    """train.sbatch on 2 nodes, stopped with Slurm's signal: every rank saves the same iteration; resubmitted with
    ``--nodes 1`` (a new job) it loads that checkpoint re-sharded from dp=2 to dp=1 and trains to the end; the two
    jobs' losses are the uninterrupted run's."""
    ckpt = str(tmp_path / "ckpt")
    script = _script(tmp_path, "train.sbatch", ckpt)
    first = slurm.sbatch(script, str(tmp_path))
    log1 = str(tmp_path / f"gpt-{first}.out")
    stopped = _stop_with_the_signal(first, log1)
    assert stopped < ITERS, slurm.tail(log1)  # the signal took effect before the end
    info = slurm.wait_for(first, "ENDED", JOB_TIMEOUT, log1)
    assert info["JobState"] == "COMPLETED" and info["NumNodes"] == "2", info
    text1 = slurm.read(log1)
    assert "--tenplex-layout auto: tp=1,pp=1,dp=2, micro-batch 4" in text1, text1[-4000:]
    assert text1.count("received: stopping after iteration") == 1  # rank 0's line: every rank stopped there
    held = lease.current(ckpt)
    assert held.job == f"slurm-{first}@tenplex" and held.released, held  # a clean end: the next job starts at once
    second = slurm.sbatch(script, str(tmp_path), "--nodes", "1")
    log2 = str(tmp_path / f"gpt-{second}.out")
    info = slurm.wait_for(second, "ENDED", JOB_TIMEOUT, log2)
    text2 = slurm.read(log2)
    assert info["JobState"] == "COMPLETED" and info["NumNodes"] == "1", (info, text2[-4000:])
    assert f"loaded iteration {stopped} from {ckpt}/iter_{stopped:07d}: layout tp=1,pp=1,dp=2 -> tp=1,pp=1,dp=1" \
        in text2, text2[-4000:]
    got = slurm.iterations(text1)
    assert max(got) == stopped
    got.update(slurm.iterations(text2))
    _same_curve(got, reference)


def test_the_signal_saves_and_the_job_requeues_itself_at_another_node_count(tmp_path, slurm_cluster,
                                                                           reference) -> None:
    """train-requeue.sbatch on 2 nodes, stopped with Slurm's signal: every rank stops after the same iteration and
    saves it; the script requeues the job, whose node count is changed to 1 while it waits; the requeued run (the
    same SLURM_JOB_ID, SLURM_RESTART_COUNT 1) takes its directory back, loads that iteration re-sharded and trains to
    the end; the losses are the uninterrupted run's."""
    ckpt = str(tmp_path / "ckpt")
    job_id = slurm.sbatch(_script(tmp_path, "train-requeue.sbatch", ckpt), str(tmp_path))
    log = str(tmp_path / f"gpt-{job_id}.out")
    stopped = _stop_with_the_signal(job_id, log)
    assert stopped < ITERS, slurm.tail(log)  # the signal took effect before the end
    slurm.wait_for_text(log, rf"saved iteration {stopped} of {ITERS}: requeued", JOB_TIMEOUT, job_id)
    slurm.wait_for(job_id, "PENDING", JOB_TIMEOUT, log)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "NumNodes=1", "NumTasks=1"], check=True, timeout=30)
    info = slurm.wait_for(job_id, "ENDED", JOB_TIMEOUT + 60, log)
    text = slurm.read(log)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1" and info["NumNodes"] == "1", (info, text[-4000:])
    assert re.search(rf"^job {job_id} run 1 on 1 node\(s\): n[12]$", text, re.M), text[-4000:]
    assert f"loaded iteration {stopped} from {ckpt}/iter_{stopped:07d}: layout tp=1,pp=1,dp=2 -> tp=1,pp=1,dp=1" \
        in text, text[-4000:]
    assert text.count(": requeued") == 1 and "took the lease over" not in text
    _same_curve(slurm.iterations(text), reference)


def test_slurms_own_timer_signals_before_the_time_limit_and_the_requeued_job_continues(tmp_path, slurm_cluster,
                                                                                       reference) -> None:
    """train-requeue.sbatch submitted with a 2-minute ``--time`` and ``--signal=TERM@30`` on sbatch's command line
    (the script's own ``#SBATCH`` lines overridden, nothing else): Slurm's timer, nobody else, sends SIGTERM to the
    step's tasks before the time limit (it looks every 30 s: 60 to 90 s into each run here, leaving a busy machine
    60 s to start the workers); every rank stops after the
    same iteration and saves it, the job exits and requeues itself, and the requeued run (not paced; its limit raised
    to 10 minutes while it waits, so that a slow start is not cut short by a second signal) continues from that
    iteration to the end with the uninterrupted losses. The first run is paced
    (``TENPLEX_TEST_SECONDS_PER_ITERATION``, tests/site) so that the tiny model is still training when the signal comes."""
    ckpt = str(tmp_path / "ckpt")
    env = slurm.job_env({"TENPLEX_TEST_SECONDS_PER_ITERATION": str(PACE)})
    job_id = slurm.sbatch(_script(tmp_path, "train-requeue.sbatch", ckpt), str(tmp_path), "--time=2",
                          "--signal=TERM@30", env=env)
    log = str(tmp_path / f"gpt-{job_id}.out")
    info = slurm.wait_for(job_id, "RUNNING", JOB_TIMEOUT, log)
    assert info["TimeLimit"] == "00:02:00", info
    m = slurm.wait_for_text(log, r"> tenplex: SIGTERM received: stopping after iteration (\d+)", 180, job_id)
    noticed = time.time() - _epoch(info["StartTime"])
    stopped = int(m.group(1))
    assert 0 < stopped < ITERS and noticed < 120, (stopped, noticed, slurm.tail(log))  # before the time limit
    slurm.wait_for_text(log, rf"saved iteration {stopped} of {ITERS}: requeued", JOB_TIMEOUT, job_id)
    slurm.wait_for(job_id, "PENDING", JOB_TIMEOUT, log)  # a longer limit for the requeued run: its start on a busy
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"], check=True, timeout=30)  # machine
    info = slurm.wait_for(job_id, "ENDED", JOB_TIMEOUT + 60, log)
    text = slurm.read(log)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, text[-4000:])
    assert text.count("stopping after iteration") == 1 and text.count(": requeued") == 1, text[-4000:]
    assert f"loaded iteration {stopped} from {ckpt}/iter_{stopped:07d}: layout tp=1,pp=1,dp=2 -> tp=1,pp=1,dp=2" \
        in text, text[-4000:]
    _same_curve(slurm.iterations(text), reference)


def _epoch(stamp: str) -> float:
    """``scontrol``'s local ``YYYY-MM-DDTHH:MM:SS`` as seconds since the epoch."""
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))


def test_a_second_slurm_job_on_the_same_save_is_refused(tmp_path, slurm_cluster) -> None:
    """Two Slurm jobs of train.sbatch (1 node each) on one --save: while the first trains, the second is refused at
    start, before any process group, naming the directory and the first job's identity (slurm-ID@CLUSTER); the
    first trains on, and stops cleanly on the signal."""
    ckpt = str(tmp_path / "ckpt")
    script = _script(tmp_path, "train.sbatch", ckpt, TRAIN_ITERS="100000")
    first = slurm.sbatch(script, str(tmp_path), "--nodes", "1")
    log = str(tmp_path / f"gpt-{first}.out")
    slurm.wait_for_text(log, r"^ iteration\s+3/", JOB_TIMEOUT, first)
    second = slurm.sbatch(script, str(tmp_path), "--nodes", "1")
    second_log = str(tmp_path / f"gpt-{second}.out")
    slurm.wait_for(second, "ENDED", JOB_TIMEOUT, second_log)
    refused = slurm.read(second_log)
    assert f"pretrain_gpt.py: error: {ckpt} is held by job 'slurm-{first}@tenplex' (generation 1, holder " \
        in refused and "--tenplex-take-over" in refused, refused[-4000:]
    assert "> tenplex-megatron: layout" not in refused  # refused at start: nothing built
    ran = max(slurm.iterations(slurm.read(log)))
    assert slurm.job(first)["JobState"] == "RUNNING"
    _stop_with_the_signal(first, log, after=ran + 2)  # the first job unharmed: it trained on and stops cleanly
    assert slurm.wait_for(first, "ENDED", JOB_TIMEOUT, log)["JobState"] == "COMPLETED"


def test_a_hard_coded_nnodes_is_refused_before_torchrun(tmp_path, slurm_cluster) -> None:
    """train.sbatch with ``--nnodes 2`` in place of ``"$SLURM_NNODES"``, submitted on 1 node: one line naming
    --nnodes and SLURM_NNODES, before torchrun (which would wait 600 s for the second node); nothing is written."""
    ckpt = str(tmp_path / "ckpt")
    path = _script(tmp_path, "train.sbatch", ckpt)
    with open(path) as f:
        text = f.read()
    assert text.count('--nnodes "$SLURM_NNODES"') == 1
    with open(path, "w") as f:
        f.write(text.replace('--nnodes "$SLURM_NNODES"', "--nnodes 2"))
    job_id = slurm.sbatch(path, str(tmp_path), "--nodes", "1")
    log = str(tmp_path / f"gpt-{job_id}.out")
    slurm.wait_for(job_id, "ENDED", 120, log)
    out = slurm.read(log)
    lines = [line for line in out.splitlines() if "error:" in line and "frontdoor.slurm" in line]
    assert len(lines) == 1, out[-3000:]
    assert f"torchrun --nnodes 2 disagrees with Slurm job {job_id} (SLURM_NNODES=1, SLURM_JOB_NODELIST=n1)" \
        in lines[0] and '--nnodes "$SLURM_NNODES"' in lines[0], lines
    assert "Traceback" not in out and not os.path.exists(ckpt), out[-3000:]


@pytest.mark.bench
def test_the_restart_benchmark_times_both_restarts_and_their_ratio(tmp_path, slurm_cluster, capsys) -> None:
    """``python -m benchmarks.slurm --quick``: a 2-node job's checkpoint resumed at 1 node by a resubmission and by
    plain torchrun, each timed to its first iteration, and their ratio."""
    from benchmarks import slurm as bench

    out = str(tmp_path / "r.json")
    assert bench.main(["--quick", "--keep", str(tmp_path / "work"), "--out", out]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^RATIO restart_to_first_iteration 1-node slurm/torchrun = \d+\.\d\d$", printed, re.M), printed
    with open(out) as f:
        runs = json.load(f)["runs"]
    for kind in ("slurm", "torchrun"):
        (run,) = runs[kind]
        assert 0 < run["process_start"] < run["process_group"] < run["first_iteration"] < JOB_TIMEOUT, (kind, run)
