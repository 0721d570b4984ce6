"""Opt-in: SIGTERM to every process of a Megatron-LM job, as Slurm's notice reaches a step (issue #54), without Slurm.

The job is docs/slurm.md's Megatron-LM script on one machine: two launchers (``python -m
tenplex_megatron.frontdoor.slurm torchrun --nnodes 2 --node-rank N --nproc-per-node 1``, their agents ignoring
SIGTERM), the patched ``pretrain_gpt.py`` at TP=2 with ``--exit-signal-handler --num-workers 0 --tenplex``. Once
iteration 2 is logged, SIGTERM goes to every process of both launchers' trees, agents and ranks alike (torchrun
starts each worker in a session of its own, so a process group's signal would not reach the ranks; Slurm signals
a step's whole tree or cgroup). The job must save one iteration on every rank and every process must exit 0
within ``BOUND`` seconds (under the agents' 300-s exit barrier, where the hang seen under Slurm ended); a process
still alive then prints its threads' stacks (``tests/site``: faulthandler on SIGUSR1) into the failure. The
resumed run at TP=1 x DP=2 then trains to the end. Oracle: every iteration's loss equals an uninterrupted TP=2
run's with the same flags, step by step. No ``--exit-interval`` anywhere.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.harness import ROOT
from tests.megatron_lm.test_megatron_lm import (
    FLAGS,
    MLM,
    RUNNER,
    _env,
    _log_lines,
    _losses,
    _vocab_flag,
    patched_script,
)

pytestmark = [pytest.mark.megatron_lm, pytest.mark.dist,
              pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")]
ITERS = 30
BOUND = 120.0  # seconds from the signal to the last process's exit (a clean exit takes ~5-25 s on the shared CPU)
START_TIMEOUT = 900.0  # a Megatron-LM launch takes minutes on the shared 2-core machine
SAVED = re.compile(r"> tenplex: saved iteration (\d+) to ")


def _flags(ckpt: pathlib.Path | None, tp: int) -> list[str]:
    base = list(FLAGS)
    base[base.index("--train-iters") + 1] = str(ITERS)
    return [*base, "--tenplex", "--distributed-backend", "gloo", "--vocab-size", _vocab_flag(95),
            "--tensor-model-parallel-size", str(tp), "--exit-signal-handler", "--num-workers", "0",
            *(["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1000"] if ckpt else [])]


def _job_env() -> dict[str, str]:
    env, _ = _env()
    # tests/site: SIGUSR1 prints every thread's stack, in the agents as in the ranks
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "tests", "site"), env["PYTHONPATH"]])
    return env


def _standalone(script: str, flags: list[str]) -> str:
    """One uninterrupted launch of 2 ranks under one agent; its log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", RUNNER, script,
           *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_job_env(), timeout=START_TIMEOUT)
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    return p.stdout + p.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(procs: list[subprocess.Popen]) -> list[psutil.Process]:
    """Every process of the launchers now: each agent and what it started."""
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(p.pid)
            out += [root, *root.children(recursive=True)]
    return out


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)


def _alive(proc: psutil.Process) -> bool:
    """Still running (a zombie has exited: its parent has not reaped it yet)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(log: pathlib.Path, pattern: str, procs: list[subprocess.Popen]) -> None:
    end = time.monotonic() + START_TIMEOUT
    while not re.search(pattern, log.read_text(errors="replace")):
        assert time.monotonic() < end, log.read_text(errors="replace")[-5000:]
        assert all(p.poll() is None for p in procs), log.read_text(errors="replace")[-5000:]
        time.sleep(0.05)


def _signalled_job(script: str, ckpt: pathlib.Path, log: pathlib.Path) -> tuple[list[int | None], float, str]:
    """The 2-node job, SIGTERM to all of it after iteration 2: each launcher's status (None: still running at
    ``BOUND``, then stacks dumped and killed), the seconds until the last process exited, the log."""
    port = _free_port()
    procs = []
    with open(log, "w") as out:
        for node in range(2):
            cmd = [sys.executable, "-m", "tenplex_megatron.frontdoor.slurm", sys.executable, "-m",
                   "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                   "--master-addr", "127.0.0.1", "--master-port", str(port), RUNNER, script, *_flags(ckpt, 2)]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_job_env(),
                                          start_new_session=True))
    try:
        _wait_for(log, r"iteration\s+2/", procs)
        everyone = _tree(procs)
        assert len(everyone) == 4, [p.cmdline() for p in everyone]  # 2 agents, 2 ranks
        t0 = time.monotonic()
        _signal_all(everyone, signal.SIGTERM)
        while any(_alive(p) for p in everyone) and time.monotonic() - t0 < BOUND:
            time.sleep(0.1)
            for p in procs:
                p.poll()
        took = time.monotonic() - t0
        codes = [p.poll() for p in procs]
        if None in codes:  # the hang: every live process's stacks into the log, then the job ended
            _signal_all(_tree(procs), signal.SIGUSR1)
            time.sleep(3)
    finally:
        _signal_all(_tree(procs), signal.SIGKILL)
        for p in procs:
            p.wait()
    return codes, took, log.read_text(errors="replace")


def test_sigterm_to_the_whole_job_saves_exits_and_resumes_on_the_uninterrupted_losses(tmp_path) -> None:
    script = patched_script(tmp_path)
    ref = _losses(_standalone(script, _flags(None, 2)))
    assert sorted(ref) == list(range(1, ITERS + 1)), sorted(ref)

    ckpt = tmp_path / "ckpt"
    codes, took, log = _signalled_job(script, ckpt, tmp_path / "job.log")
    assert codes == [0, 0] and took < BOUND, (codes, f"{took:.1f} s", log[-12000:])
    saved = SAVED.findall(log)
    assert len(saved) == 1 and "exiting program after receiving SIGTERM" in log, log[-5000:]
    stopped = int(saved[0])
    assert 2 <= stopped < ITERS, (stopped, log[-5000:])
    assert max(it for it, _, _ in _log_lines(log)) == stopped, log[-5000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
    print(f"SIGTERM after iteration 2: saved iteration {stopped}, every process exited in {took:.1f} s")

    resumed_log = _standalone(script, _flags(ckpt, 1))
    assert re.search(rf"> tenplex: loaded iteration {stopped} from \S+: layout tp=2,pp=1,dp=1 -> tp=1,pp=1,dp=2",
                     resumed_log), resumed_log[-5000:]
    assert [it for it, _, _ in _log_lines(resumed_log)] == list(range(stopped + 1, ITERS + 1)), resumed_log[-5000:]
    got = {it: loss for it, loss in _losses(log).items() if it <= stopped}
    got.update(_losses(resumed_log))
    assert sorted(got) == list(range(1, ITERS + 1)), sorted(got)
    for it, loss in got.items():
        assert loss == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (it, loss, ref[it])
