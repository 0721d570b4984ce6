"""Opt-in: Megatron-LM's own pretrain_gpt.py with our patch, restarted at another layout with --tenplex.

Needs ``MEGATRON_LM_PATH`` (a core_v0.16.x checkout, never committed here) and a
GPU: Megatron-LM's ``initialize_megatron`` asserts CUDA. Runs
``pytest -m megatron_lm tests/megatron_lm``. The checkout is not modified: the
patch is applied to a copy of its top-level scripts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.megatron_lm
MLM = os.environ.get("MEGATRON_LM_PATH")
PATCH = os.path.join(ROOT, "patches", "megatron-lm-core_v0.16.x.patch")
RUNNER = os.path.join(ROOT, "tests", "megatron_lm", "run_megatron_lm.py")

FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "8",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "96", "--make-vocab-size-divisible-by", "16",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--transformer-impl", "local",
    "--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0", "--tenplex",
    "--deterministic-mode", "--no-gradient-accumulation-fusion",
]


def _losses(log: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", log)}


def _run(script: str, tp: int, extra: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=f"{MLM}:{ROOT}", OMP_NUM_THREADS="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", RUNNER, script,
           *FLAGS, "--tensor-model-parallel-size", str(tp), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    return p.stdout + p.stderr


@pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.x checkout")
def test_megatron_lm_restart_at_another_layout_continues_losses(tmp_path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("Megatron-LM's training loop requires CUDA")
    work = tmp_path / "mlm"
    work.mkdir()
    for name in os.listdir(MLM):
        if name.endswith(".py"):
            shutil.copy(os.path.join(MLM, name), work / name)
    subprocess.run(["git", "apply", "--directory", ".", PATCH], cwd=work, check=True)
    script = str(work / "pretrain_gpt.py")
    ref = _losses(_run(script, 2, []))
    ckpt = str(tmp_path / "ckpt")
    _run(script, 2, ["--save", ckpt, "--save-interval", "4", "--exit-interval", "4"])
    log = _run(script, 1, ["--load", ckpt, "--save", ckpt])  # 2 GPUs: TP2 -> TP1 x DP2
    assert "> tenplex: loaded iteration 4" in log
    resumed = _losses(log)
    assert sorted(resumed) == [5, 6, 7, 8]
    for it, loss in resumed.items():
        assert loss == pytest.approx(ref[it], rel=1e-4), (it, loss, ref[it])
