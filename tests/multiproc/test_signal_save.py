"""Nothing lost on notice: SIGTERM to one rank of a running ``--tenplex`` job makes every rank stop after the
same iteration, save a tenplex checkpoint of that iteration and exit 0 (torchrun then reports success)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tenplex_megatron.storage.directory import find_checkpoint, read_metadata
from tests.harness import CHILD_PYTHONPATH, PRETRAIN, TINY_GPT, metrics

pytestmark = pytest.mark.dist


def _workers(pid: int) -> list[psutil.Process]:
    return [c for c in psutil.Process(pid).children(recursive=True) if "pretrain_gpt.py" in " ".join(c.cmdline())]


def test_sigterm_to_one_rank_saves_the_current_iteration_and_exits_0(tmp_path) -> None:
    save, log = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=CHILD_PYTHONPATH, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", PRETRAIN,
           *TINY_GPT, "--vocab-size", "96", "--train-iters", "100000", "--save", save, "--save-interval", "1000",
           "--tenplex-metrics", log]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and len(metrics(log) if os.path.exists(log) else []) < 3:
            time.sleep(0.2)
        ranks = sorted(_workers(p.pid), key=lambda c: int(c.environ().get("RANK", "0")))
        assert len(ranks) == 2, "workers not found"
        ranks[1].send_signal(signal.SIGTERM)  # rank 1 only: rank 0 learns of it at the next iteration boundary
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out[-4000:]
    done = metrics(log)[-1]["iteration"]
    assert f"SIGTERM received: stopping after iteration {done}" in out or \
        f"a peer's signal received: stopping after iteration {done}" in out, out[-4000:]
    ckpt = find_checkpoint(save)
    assert ckpt is not None and read_metadata(ckpt)["iteration"] == done  # the iteration it stopped at, complete
    assert json.loads(json.dumps(read_metadata(ckpt)["consumed_samples"])) == done * 8
