#!/usr/bin/env python
"""The time from a resubmission at another node count to its first iteration under Slurm, beside the same restart
under plain torchrun.

    python -m benchmarks.slurm [--repeats 3] [--out r.json]
    python -m benchmarks.slurm --quick          # one repetition

Needs the local Slurm of ``scripts/slurm/start.sh`` (started here when none answers, and stopped at the end). A
job of ``docs/slurm.md``'s ``train.sbatch`` (its paths and sizes changed as the Slurm tests change them: a 2-layer
GPT of hidden size 64, a global batch of 8, one process per node) trains on 2 nodes and is stopped with Slurm's
signal after a few iterations: a checkpoint at tp=1,pp=1,dp=2. Then, in turns, from a fresh copy of that checkpoint
each time:

* **slurm**: ``sbatch --nodes 1 train.sbatch`` (a new job): from the ``sbatch`` call to the first iteration the
  trainer reports (its ``timeline`` line: scheduling, srun, the launcher, torchrun, the worker's imports, the
  process group, the load re-sharded to dp=1, one iteration);
* **torchrun**: the same trainer arguments (``benchmarks.kit.slurm.trainer_args``) under ``torchrun
  --nproc-per-node 1 --master-port P`` on this machine, no Slurm: from its start to the first iteration.

Each restart trains 2 iterations past the checkpoint. Reported: the median of each over the repetitions, their
parts (to the worker's process start, to its process group, to the first iteration), and ``RATIO
restart_to_first_iteration 1-node slurm/torchrun``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.kit import slurm
from benchmarks.kit.agents import free_port
from benchmarks.kit.report import Column, Table, machine, ratio_key, ratio_line

SIZES = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "32",
         "--max-position-embeddings": "32", "--vocab-size": "96", "--global-batch-size": "8",
         "--lr-warmup-iters": "2"}
TIMEOUT = 300.0


def script(ckpt: str, iters: int) -> str:
    """``train.sbatch`` of docs/slurm.md with this benchmark's paths and sizes."""
    return slurm.substitute(slurm.page_scripts()["train.sbatch"], {"TENPLEX": slurm.ROOT, "CKPT": ckpt,
                                                                   "GPUS_PER_NODE": "1", "TRAIN_ITERS": str(iters)},
                            SIZES)


def write(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    return path


def seed_checkpoint(work: str) -> int:
    """A checkpoint of a 2-node job stopped with Slurm's signal after a few iterations; its iteration."""
    ckpt = os.path.join(work, "seed")
    job = slurm.sbatch(write(os.path.join(work, "seed.sbatch"), script(ckpt, 100000)), work)
    log = os.path.join(work, f"gpt-{job}.out")
    slurm.wait_for_text(log, r"^ iteration\s+5/", TIMEOUT, job)
    subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=30)
    info = slurm.wait_for(job, "ENDED", TIMEOUT, log)
    saved = slurm.read(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).strip()
    if info["JobState"] != "COMPLETED" or not saved.isdigit():
        raise slurm.SlurmError(f"the seed job {job} did not save ({info['JobState']}):\n{slurm.tail(log)}")
    return int(saved)


def fresh_copy(work: str, name: str) -> str:
    """A copy of the seed checkpoint (its lease released) for one restart."""
    ckpt = os.path.join(work, name)
    shutil.copytree(os.path.join(work, "seed"), ckpt)
    return ckpt


def parts(start: float, timeline: dict[str, float]) -> dict[str, float]:
    """Seconds from ``start`` to the worker's process start, its process group and its first iteration."""
    return {k: timeline[k] - start for k in ("process_start", "process_group", "first_iteration")}


def under_slurm(work: str, saved: int, rep: int) -> dict[str, float]:
    """A resubmission at 1 node of the 2-node job's checkpoint: ``sbatch`` to its first iteration."""
    path = write(os.path.join(work, f"slurm{rep}.sbatch"), script(fresh_copy(work, f"slurm{rep}"), saved + 2))
    t0 = time.time()
    job = slurm.sbatch(path, work, "--nodes", "1")
    log = os.path.join(work, f"gpt-{job}.out")
    info = slurm.wait_for(job, "ENDED", TIMEOUT, log)
    lines = slurm.timelines(slurm.read(log))
    if info["JobState"] != "COMPLETED" or len(lines) != 1 or f"loaded iteration {saved}" not in slurm.read(log):
        raise slurm.SlurmError(f"job {job} ({info['JobState']}) did not resume:\n{slurm.tail(log)}")
    return parts(t0, lines[0])


def under_torchrun(work: str, saved: int, rep: int) -> dict[str, float]:
    """The same restart under plain torchrun on this machine (no Slurm): its start to its first iteration."""
    args = slurm.trainer_args(script(fresh_copy(work, f"torchrun{rep}"), saved + 2))
    log = os.path.join(work, f"torchrun{rep}.log")
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(["torchrun", "--nproc-per-node", "1", "--master-port", str(free_port()),
                             slurm.TRAINER, *args], stdout=f, stderr=subprocess.STDOUT, env=slurm.job_env(),
                            timeout=TIMEOUT).returncode
    lines = slurm.timelines(slurm.read(log))
    if rc != 0 or len(lines) != 1 or f"loaded iteration {saved}" not in slurm.read(log):
        raise slurm.SlurmError(f"torchrun restart failed (exit {rc}):\n{slurm.tail(log)}")
    return parts(t0, lines[0])


def report(runs: dict[str, list[dict[str, float]]]) -> list[str]:
    """The table of medians and the RATIO line."""
    med = {k: {p: statistics.median(r[p] for r in v) for p in v[0]} for k, v in runs.items()}
    t = Table([Column("restart at 1 node", 18, "<"), Column("to process start s", 19),
               Column("to process group s", 19), Column("to first iteration s", 21), Column("runs", 5)])
    lines = [t.header()]
    for k, m in med.items():
        lines.append(t.row(k, f"{m['process_start']:.2f}", f"{m['process_group']:.2f}",
                           f"{m['first_iteration']:.2f}", str(len(runs[k]))))
    ratio = med["slurm"]["first_iteration"] / med["torchrun"]["first_iteration"]
    lines.append(ratio_line(ratio_key("restart_to_first_iteration", "1-node", "slurm", "torchrun"), ratio))
    return lines


def run(repeats: int, work: str) -> dict[str, Any]:
    """The seed checkpoint, then ``repeats`` restarts of each kind in turns; the runs and the report."""
    saved = seed_checkpoint(work)
    runs: dict[str, list[dict[str, float]]] = {"slurm": [], "torchrun": []}
    for rep in range(repeats):
        runs["slurm"].append(under_slurm(work, saved, rep))
        runs["torchrun"].append(under_torchrun(work, saved, rep))
    return {"saved_iteration": saved, "runs": runs, "report": report(runs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.slurm", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="restarts of each kind (default 3)")
    p.add_argument("--quick", action="store_true", help="one restart of each kind")
    p.add_argument("--out", default=None, help="write the runs and the report as JSON here")
    p.add_argument("--keep", default=None, help="work in this directory and keep it (default: a temporary one)")
    a = p.parse_args(argv)
    started = not slurm.cluster_up()
    slurm.start_cluster()
    work = a.keep or tempfile.mkdtemp(prefix="bench-slurm-")
    os.makedirs(work, exist_ok=True)
    try:
        result = run(1 if a.quick else a.repeats, work)
    finally:
        if started:
            slurm.stop_cluster()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    result.update(command=" ".join(["python -m benchmarks.slurm", *(argv if argv is not None else sys.argv[1:])]),
                  machine=machine(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  commit=subprocess.run(["git", "-C", slurm.ROOT, "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True).stdout.strip())
    print("\n".join(result["report"]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
