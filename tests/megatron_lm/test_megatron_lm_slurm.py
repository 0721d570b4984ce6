"""Opt-in: docs/slurm.md's Megatron-LM batch script (train-megatron-lm.sbatch), as written, against the real local
Slurm (the session's ``slurm_cluster``; needs ``MEGATRON_LM_PATH`` and the ``slurm`` marker): on 2 nodes, one
torchrun each running the patched ``pretrain_gpt.py`` with ``--tenplex --tenplex-layout auto``, stopped with
Slurm's own notice (``scancel --signal=TERM``: SIGTERM to every process of the job's steps) once iteration 2 is
logged: Megatron-LM's ``--exit-signal-handler`` saves one iteration on every rank through the hook and the job
ends, every process gone within ``BOUND`` seconds of the signal. Resubmitted with ``--nodes 1`` it loads that
checkpoint re-sharded (dp=2 -> dp=1), is stopped the same way, and resubmitted on 2 nodes it loads the second
checkpoint re-sharded back (dp=1 -> dp=2) and trains to the end. Oracle: every iteration's loss equals an
uninterrupted 2-process run's of the same flags (no Slurm), step by step.

What the test changes in the script (the block ``# the job's paths and sizes`` only): ``PRETRAIN`` (a two-line
wrapper that runs the patched copy of the checkout's scripts under test_megatron_lm.py's runner, the CPU shim),
``CKPT``, ``GPUS_PER_NODE`` (1), ``TRAIN_ITERS`` (40), ``MEGATRON`` (the flags test_megatron_lm.py runs Megatron-LM
with on the CPU: gloo, the local transformer, no fusions) and the sizes in ``MODEL``, ``DATA`` and ``TRAIN``. A job
still running ``BOUND`` seconds after its signal gets ``scancel --signal=USR1`` first (``tests/site`` on the job's
``PYTHONPATH``: every process prints its threads' stacks into the job's log), then the failure with the log.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from benchmarks.kit import slurm
from tenplex_megatron.storage.directory import committed_iterations
from tests.megatron_lm.test_megatron_lm import MLM, RUNNER, _env, _log_lines, _losses, _vocab_flag, patched_script

pytestmark = [pytest.mark.megatron_lm, pytest.mark.slurm, pytest.mark.dist,
              pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")]
ITERS = 40
SIZES = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "64",
         "--max-position-embeddings": "64", "--vocab-size": _vocab_flag(95) if MLM else "96",
         "--global-batch-size": "8", "--micro-batch-size": "2", "--lr-warmup-iters": "2"}
CPU = ("--transformer-impl local --no-persist-layer-norm --use-distributed-optimizer --log-interval 1 --eval-iters 0 "
       "--eval-interval 1000 --deterministic-mode --no-gradient-accumulation-fusion --make-vocab-size-divisible-by 16 "
       "--distributed-backend gloo")
JOB_TIMEOUT = 900  # a Megatron-LM launch takes minutes on the shared 2-core machine
BOUND = 120.0  # seconds from Slurm's signal to the job's end (5-11 s on the shared CPU; the agents' barrier is 300)
LOADED = re.compile(r"> tenplex: loaded iteration (\d+) from \S+: layout (\S+) -> (\S+),")
SAVED = re.compile(r"> tenplex: saved iteration (\d+) to ")


def _wrapper(tmp_path) -> str:
    """``PRETRAIN`` for the test: the patched ``pretrain_gpt.py`` run by the CPU runner, as one script path."""
    script = patched_script(tmp_path)
    path = tmp_path / "pretrain_gpt_cpu.py"
    path.write_text(f"import runpy, sys\nsys.argv = [{RUNNER!r}, {script!r}, *sys.argv[1:]]\n"
                    f"runpy.run_path({RUNNER!r}, run_name='__main__')\n")
    return str(path)


def _job_env() -> dict[str, str]:
    """The opt-in suite's environment for a job, with ``tests/site`` on its path (stacks on SIGUSR1)."""
    env, _ = _env()
    keep = ("PYTHONPATH", "TORCH_COMPILE_DISABLE", "CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "CUDA_DEVICE_MAX_CONNECTIONS",
            "TENPLEX_TEST_HIDE_NVRX")
    env = slurm.job_env({k: v for k, v in env.items() if k in keep})
    env["PYTHONPATH"] += ":" + slurm.ROOT + "/tests/site"
    return env


def _uninterrupted(tmp_path, text: str, pretrain: str, env: dict[str, str]) -> dict[int, float]:
    """The script's trainer flags, 2 processes, no Slurm, nothing saved: iteration -> loss."""
    flags = slurm.trainer_args(text.replace('"$PRETRAIN"', '"$TENPLEX/scripts/pretrain_gpt.py"'))
    ckpt = flags[flags.index("--save") + 1]
    ref_env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        pretrain, *[f.replace(ckpt, str(tmp_path / "ref-ckpt")) for f in flags]],
                       capture_output=True, text=True, env=ref_env, timeout=JOB_TIMEOUT)
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    ref = _losses(p.stdout + p.stderr)
    assert sorted(ref) == list(range(1, ITERS + 1)), (p.stdout + p.stderr)[-3000:]
    return ref


def _end(job_id: str, log: str, since: float) -> dict[str, str]:
    """The job's fields once it ends, at most ``BOUND`` s after ``since``; else its stacks (SIGUSR1) and a failure."""
    try:
        return slurm.wait_for(job_id, "ENDED", max(1.0, since + BOUND - time.time()), log)
    except slurm.SlurmError:
        subprocess.run(["scancel", "--signal=USR1", job_id], timeout=30)
        time.sleep(10)
        subprocess.run(["scancel", job_id], timeout=30)
        pytest.fail(f"job {job_id} still running {BOUND:.0f} s after Slurm's SIGTERM; its log with the stacks:\n"
                    f"{slurm.tail(log, 20000)}")


def _run(script: str, tmp_path, env: dict[str, str], *options: str, stop: bool) -> tuple[str, dict[str, str]]:
    """Submit ``script``; with ``stop``, ``scancel --signal=TERM`` once its second iteration is logged. Its log and
    its fields at its end."""
    job_id = slurm.sbatch(script, str(tmp_path), *options, env=env)
    log = str(tmp_path / f"gpt-{job_id}.out")
    if not stop:
        info = slurm.wait_for(job_id, "ENDED", JOB_TIMEOUT, log)
        return slurm.read(log), info
    slurm.wait_for_text(log, r"iteration\s+\d+/\s*\d+ \|[\s\S]*iteration\s+\d+/\s*\d+ \|", JOB_TIMEOUT, job_id)
    subprocess.run(["scancel", "--signal=TERM", job_id], check=True, timeout=30)
    info = _end(job_id, log, time.time())
    return slurm.read(log), info


def _stopped(text: str, info: dict[str, str], nodes: str) -> int:
    """The iteration a job stopped on Slurm's signal saved: one save, Megatron-LM's exit on SIGTERM, a clean end."""
    saved = SAVED.findall(text)
    assert info["JobState"] == "COMPLETED" and info["NumNodes"] == nodes and len(saved) == 1, (info, text[-5000:])
    assert "exiting program after receiving SIGTERM" in text, text[-5000:]
    assert int(saved[0]) < ITERS, text[-5000:]  # the signal took effect before the end
    assert [it for it, _, _ in _log_lines(text)][-1] == int(saved[0]), text[-5000:]  # nothing after the save
    return int(saved[0])


def test_megatron_lm_under_slurm_stopped_by_its_signal_resumes_on_one_node_and_back_on_two(tmp_path,
                                                                                           slurm_cluster) -> None:
    pretrain, ckpt = _wrapper(tmp_path), str(tmp_path / "ckpt")
    text = slurm.substitute(slurm.page_scripts()["train-megatron-lm.sbatch"],
                            {"PRETRAIN": pretrain, "CKPT": ckpt, "GPUS_PER_NODE": "1", "TRAIN_ITERS": str(ITERS),
                             "MEGATRON": CPU}, SIZES)
    script = tmp_path / "train-megatron-lm.sbatch"
    script.write_text(text)
    env = _job_env()
    ref = _uninterrupted(tmp_path, text, pretrain, env)

    text1, info = _run(str(script), tmp_path, env, stop=True)
    first = _stopped(text1, info, "2")
    layout = re.search(r"> tenplex: --tenplex-layout auto: (tp=\d+,pp=\d+,dp=\d+)", text1)
    assert layout and committed_iterations(ckpt) == [first], text1[-5000:]

    text2, info = _run(str(script), tmp_path, env, "--nodes", "1", stop=True)
    second = _stopped(text2, info, "1")
    loaded = LOADED.search(text2)
    assert loaded and (int(loaded.group(1)), loaded.group(2), loaded.group(3)) == \
        (first, layout.group(1), "tp=1,pp=1,dp=1"), text2[-5000:]
    assert committed_iterations(ckpt)[-1] == second > first, text2[-5000:]

    text3, info = _run(str(script), tmp_path, env, stop=False)
    assert info["JobState"] == "COMPLETED" and info["NumNodes"] == "2", (info, text3[-5000:])
    loaded = LOADED.search(text3)
    assert loaded and (int(loaded.group(1)), loaded.group(2), loaded.group(3)) == \
        (second, "tp=1,pp=1,dp=1", layout.group(1)), text3[-5000:]

    got: dict[int, float] = {}
    for text, start in ((text1, 1), (text2, first + 1), (text3, second + 1)):
        assert [it for it, _, _ in _log_lines(text)][0] == start, text[-5000:]  # nothing trained twice or skipped
        got.update(_losses(text))
    assert sorted(got) == list(range(1, ITERS + 1)), sorted(got)
    for it, loss in got.items():
        assert loss == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, loss, ref[it])
