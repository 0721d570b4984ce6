"""``--async-save`` with ``--tenplex``: a save returns once the state is captured in host memory (the tier, in
/dev/shm by default) and a helper process writes it to ``--save`` in the background, committed before the next save
and at exit; a job restarted at another layout from those durable checkpoints (the node's memory gone) continues
the uninterrupted run's losses."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time

import psutil
import pytest

from tenplex_megatron.frontdoor.memory_flags import async_save_dir
from tenplex_megatron.storage.directory import committed_iterations, find_checkpoint, partial_dirs
from tests.harness import (
    CHILD_PYTHONPATH,
    PRETRAIN,
    TINY_GPT,
    kill_groups,
    layout_flags,
    metrics,
    torchrun,
    torchrun_cmd,
)

pytestmark = pytest.mark.dist


def test_async_saves_are_written_in_the_background_and_resume_at_another_layout(tmp_path) -> None:
    save = str(tmp_path / "ckpt")
    ref, first, resumed = (str(tmp_path / f"{n}.jsonl") for n in ("ref", "first", "resumed"))
    common = [*TINY_GPT, "--vocab-size", "96", "--train-iters", "6"]
    mem = async_save_dir(save)
    try:
        r = torchrun(2, [*common, *layout_flags(2, 1), "--tenplex-metrics", ref])
        assert r.returncode == 0, r.log[-4000:]
        r = torchrun(2, [*common, *layout_flags(2, 1), "--save", save, "--save-interval", "2", "--exit-interval", "4",
                         "--async-save", "--tenplex-metrics", first])
        assert r.returncode == 0, r.log[-4000:]
        assert "persisting in the background" in r.log and f"host memory {mem}" in r.log, r.log[-4000:]
        assert committed_iterations(save) == [2, 4]  # both written by the helper, committed by the job
        shutil.rmtree(mem)  # the node's memory is gone: the restart reads the durable checkpoint
        r = torchrun(2, [*common, *layout_flags(1, 1), "--load", save, "--tenplex-metrics", resumed])
        assert r.returncode == 0, r.log[-4000:]
        assert f"loaded iteration 4 from {save}/iter_0000004" in r.log, r.log[-4000:]
    finally:
        shutil.rmtree(mem, ignore_errors=True)
    a = {m["iteration"]: m["loss"] for m in metrics(ref)}
    got = {m["iteration"]: m["loss"] for m in [*metrics(first), *metrics(resumed)]}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for it, loss in got.items():
        assert loss == pytest.approx(a[it], rel=2e-6), (it, loss, a[it])


HELPER_MODULE = "tenplex_megatron.memory.helper"


def _stopped_helper(pid: int) -> psutil.Process | None:
    """The node's background helper under launcher ``pid`` once it is stopped (the fault point's SIGSTOP), else
    None."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for proc in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if HELPER_MODULE in " ".join(proc.cmdline()) and proc.status() == psutil.STATUS_STOPPED:
                    return proc
    return None


def _killed_while_persisting(tmp_path, args: list[str], timeout: float = 240) -> tuple[list[str], str]:
    """Launch the job with the helper stopped half way through persisting iteration 4 (``TENPLEX_FAULT``
    ``persist.copy#4:stop``, the crash tests' fault point); once it is, SIGKILL its whole process group (the agent,
    the ranks, the helper); returns the command lines of the processes that were there, and the log."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=CHILD_PYTHONPATH, PYTHONUNBUFFERED="1",
               TENPLEX_FAULT="persist.copy#4:stop")
    out = tmp_path / "killed.log"
    with open(out, "w") as f:
        p = subprocess.Popen(torchrun_cmd(2, PRETRAIN, args), env=env, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        deadline = time.time() + timeout
        while (helper := _stopped_helper(p.pid)) is None:
            assert p.poll() is None and time.time() < deadline, f"no stopped helper ({p.poll()}):\n{out.read_text()}"
            time.sleep(0.2)
        there = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        assert helper in there
        lines = [" ".join(x.cmdline()) for x in there]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
        _, alive = psutil.wait_procs(there, timeout=60)
        assert not alive, alive
        return lines, out.read_text()
    finally:
        kill_groups([p])


@pytest.mark.slow
def test_kill_during_an_async_persist_loses_no_complete_checkpoint(tmp_path) -> None:
    """Every process of an ``--async-save`` job (agent, ranks, the background helper) SIGKILLed while iteration 4 is
    being persisted (the helper stopped half way through a file): iteration 2 stays the committed checkpoint, the
    half-written staging directory of 4 is never chosen; with the node's memory gone, a restart at TP1 x DP2 loads
    iteration 2 and continues the uninterrupted run's losses; with the memory kept, a restart at TP1 x DP2 takes
    iteration 4 from it."""
    save = str(tmp_path / "ckpt")
    ref = str(tmp_path / "ref.jsonl")
    common = [*TINY_GPT, "--vocab-size", "96", "--train-iters", "6"]
    mem = async_save_dir(save)
    try:
        r = torchrun(2, [*common, *layout_flags(2, 1), "--tenplex-metrics", ref])
        assert r.returncode == 0, r.log[-4000:]
        there, log = _killed_while_persisting(tmp_path, [*common, *layout_flags(2, 1), "--save", save,
                                                         "--save-interval", "2", "--async-save"])
        assert sum(HELPER_MODULE in line for line in there) == 1 and len(there) >= 4, there  # agent, 2 ranks, helper
        assert "snapshot of iteration 4 in host memory" in log, log[-4000:]
        # what a restart finds: iteration 2 committed and whole, 4 only a staging directory (no metadata.json)
        assert committed_iterations(save) == [2] and find_checkpoint(save) == f"{save}/iter_0000002"
        staging = partial_dirs(save)
        assert staging == [f"{save}/iter_0000004.tenplex-partial"], staging
        assert os.listdir(staging[0]) and "metadata.json" not in os.listdir(staging[0])
        assert os.path.isdir(f"{mem}/iter_0000004")  # the complete snapshot, in the node's memory
        durable = str(tmp_path / "durable")
        shutil.copytree(save, durable)  # the node's memory gone (the restart below names no memory directory)
        r = torchrun(2, [*common, *layout_flags(1, 1), "--load", durable, "--tenplex-metrics", f"{durable}.jsonl"])
        assert r.returncode == 0, r.log[-4000:]
        assert f"loaded iteration 2 from {durable}/iter_0000002" in r.log, r.log[-4000:]
        # the memory kept: the same --save with --async-save finds iteration 4 in it
        r = torchrun(2, [*common, *layout_flags(1, 1), "--load", save, "--save", save, "--async-save",
                         "--tenplex-metrics", f"{save}.jsonl"])
        assert r.returncode == 0, r.log[-4000:]
        assert "loaded iteration 4 from host memory" in r.log, r.log[-4000:]
    finally:
        shutil.rmtree(mem, ignore_errors=True)
    want = {m["iteration"]: m["loss"] for m in metrics(ref)}
    for path, first in ((f"{durable}.jsonl", 3), (f"{save}.jsonl", 5)):
        got = {m["iteration"]: m["loss"] for m in metrics(path)}
        assert sorted(got) == list(range(first, 7)), (path, got)
        for it, loss in got.items():
            assert loss == pytest.approx(want[it], rel=2e-6), (path, it, loss, want[it])
