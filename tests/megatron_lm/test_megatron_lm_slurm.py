"""Opt-in: docs/slurm.md's Megatron-LM batch script (train-megatron-lm.sbatch), as written, against the real local
Slurm (the session's ``slurm_cluster``; needs ``MEGATRON_LM_PATH`` and the ``slurm`` marker): on 2 nodes, one
torchrun each running the patched ``pretrain_gpt.py`` with ``--tenplex --tenplex-layout auto``, stopped after
iteration 3 by Megatron-LM's ``--exit-interval`` (saved through the hook); resubmitted with ``--nodes 1`` it loads
that checkpoint re-sharded and trains to the end. Oracle: every iteration's loss equals an uninterrupted 2-process
run's of the same flags (no Slurm), step by step.

Not Slurm's SIGTERM: with ``scancel --signal=TERM`` Megatron-LM's ``--exit-signal-handler`` saved the iteration on
every rank through the hook, and node 0's processes then did not end (core_v0.16.1, the local Slurm; cause not
found: docs/slurm.md says so). The same job's SIGTERM without Slurm, to every process of both launchers, is
test_megatron_lm_sigterm.py (it saves and exits).

What the test changes in the script (the block ``# the job's paths and sizes`` only): ``PRETRAIN`` (a two-line
wrapper that runs the patched copy of the checkout's scripts under test_megatron_lm.py's runner, the CPU shim),
``CKPT``, ``GPUS_PER_NODE`` (1), ``TRAIN_ITERS`` (8), ``MEGATRON`` (the flags test_megatron_lm.py runs Megatron-LM
with on the CPU: gloo, the local transformer, no fusions; and, for the first job, ``--exit-interval 3``) and the sizes in ``MODEL``, ``DATA`` and ``TRAIN``.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from benchmarks.kit import slurm
from tests.megatron_lm.test_megatron_lm import MLM, RUNNER, _env, _log_lines, _losses, _vocab_flag, patched_script

pytestmark = [pytest.mark.megatron_lm, pytest.mark.slurm, pytest.mark.dist,
              pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")]
ITERS = 8
STOP = 3  # the first job stops after this iteration (Megatron-LM's --exit-interval: see the module's docstring)
SIZES = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "64",
         "--max-position-embeddings": "64", "--vocab-size": _vocab_flag(95) if MLM else "96",
         "--global-batch-size": "8", "--micro-batch-size": "2", "--lr-warmup-iters": "2"}
CPU = ("--transformer-impl local --no-persist-layer-norm --use-distributed-optimizer --log-interval 1 --eval-iters 0 "
       "--eval-interval 1000 --deterministic-mode --no-gradient-accumulation-fusion --make-vocab-size-divisible-by 16 "
       "--distributed-backend gloo")
JOB_TIMEOUT = 900  # a Megatron-LM launch takes minutes on the shared 2-core machine
LOADED = re.compile(r"> tenplex: loaded iteration (\d+) from \S+: layout (\S+) -> (\S+),")


def _wrapper(tmp_path) -> str:
    """``PRETRAIN`` for the test: the patched ``pretrain_gpt.py`` run by the CPU runner, as one script path."""
    script = patched_script(tmp_path)
    path = tmp_path / "pretrain_gpt_cpu.py"
    path.write_text(f"import runpy, sys\nsys.argv = [{RUNNER!r}, {script!r}, *sys.argv[1:]]\n"
                    f"runpy.run_path({RUNNER!r}, run_name='__main__')\n")
    return str(path)


def _job_env() -> dict[str, str]:
    env, _ = _env()
    keep = ("PYTHONPATH", "TORCH_COMPILE_DISABLE", "CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "CUDA_DEVICE_MAX_CONNECTIONS",
            "TENPLEX_TEST_HIDE_NVRX")
    return slurm.job_env({k: v for k, v in env.items() if k in keep})


def test_megatron_lm_under_slurm_resubmitted_on_one_node_resumes_the_two_node_job(tmp_path, slurm_cluster) -> None:
    pretrain, ckpt = _wrapper(tmp_path), str(tmp_path / "ckpt")
    scripts = {}
    for name, megatron in (("first", f"{CPU} --exit-interval {STOP}"), ("second", CPU)):
        text = slurm.substitute(slurm.page_scripts()["train-megatron-lm.sbatch"],
                                {"PRETRAIN": pretrain, "CKPT": ckpt, "GPUS_PER_NODE": "1", "TRAIN_ITERS": str(ITERS),
                                 "MEGATRON": megatron}, SIZES)
        scripts[name] = tmp_path / f"{name}.sbatch"
        scripts[name].write_text(text)
    env = _job_env()
    # the uninterrupted run: the script's trainer flags, 2 processes, no Slurm
    flags = slurm.trainer_args(text.replace('"$PRETRAIN"', '"$TENPLEX/scripts/pretrain_gpt.py"'))
    ref_env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        pretrain, *[f.replace(ckpt, str(tmp_path / "ref-ckpt")) for f in flags]],
                       capture_output=True, text=True, env=ref_env, timeout=JOB_TIMEOUT)
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    ref = _losses(p.stdout + p.stderr)
    assert sorted(ref) == list(range(1, ITERS + 1)), (p.stdout + p.stderr)[-3000:]

    first = slurm.sbatch(str(scripts["first"]), str(tmp_path), env=env)
    log1 = str(tmp_path / f"gpt-{first}.out")
    info = slurm.wait_for(first, "ENDED", JOB_TIMEOUT, log1)
    text1 = slurm.read(log1)
    saved = re.findall(r"> tenplex: saved iteration (\d+)", text1)
    assert info["JobState"] == "COMPLETED" and saved == [str(STOP)], (info, text1[-5000:])
    stopped = STOP
    layout = re.search(r"> tenplex: --tenplex-layout auto: (tp=\d+,pp=\d+,dp=\d+)", text1)
    assert layout, text1[-5000:]

    second = slurm.sbatch(str(scripts["second"]), str(tmp_path), "--nodes", "1", env=env)
    log2 = str(tmp_path / f"gpt-{second}.out")
    info = slurm.wait_for(second, "ENDED", JOB_TIMEOUT, log2)
    text2 = slurm.read(log2)
    assert info["JobState"] == "COMPLETED" and info["NumNodes"] == "1", (info, text2[-5000:])
    loaded = LOADED.search(text2)
    assert loaded and (int(loaded.group(1)), loaded.group(2), loaded.group(3)) == \
        (stopped, layout.group(1), "tp=1,pp=1,dp=1"), text2[-5000:]
    assert [it for it, _, _ in _log_lines(text2)] == list(range(stopped + 1, ITERS + 1)), text2[-5000:]
    got = {it: loss for it, loss in _losses(text1).items() if it <= stopped}
    got.update(_losses(text2))
    assert sorted(got) == list(range(1, ITERS + 1)), sorted(got)
    for it, loss in got.items():
        assert loss == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, loss, ref[it])
