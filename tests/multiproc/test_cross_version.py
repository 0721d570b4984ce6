"""A checkpoint crosses megatron-core versions: written by one release, resumed at a new layout by another, and back.

Run by `make test-compat` (marker ``compat``): this interpreter's megatron-core (0.19.0 or 0.15.3) and the one of
``TENPLEX_CROSS_PYTHON`` (the pinned venv's 0.16.1). Each direction is the re-shard matrix's oracle: the reader's
re-save equals the writer's checkpoint tensor for tensor, bit for bit at full size, and the reader's steps 4-8
equal the writer's uninterrupted run within LOSS_RTOL; each checkpoint records the megatron-core that wrote it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tenplex_megatron import mcore_versions
from tests.harness import ROOT, TINY_GPT, layout_flags, torchrun
from tests.multiproc.test_reshard_matrix import (
    LOSS_RTOL,
    SAVE_AT,
    TRAIN_ITERS,
    assert_losses_continue,
    assert_tensors_equal,
)

pytestmark = [pytest.mark.dist, pytest.mark.compat]
OTHER = os.environ.get("TENPLEX_CROSS_PYTHON") or os.path.join(ROOT, ".venv", "bin", "python")
BASE = [*TINY_GPT, "--vocab-size", "96", "--swiglu", "--use-distributed-optimizer", "--train-iters", str(TRAIN_ITERS)]


def _version(python: str) -> str:
    code = "from tenplex_megatron import mcore_versions as m; print(m.installed().text)"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": ROOT}).stdout.strip()


def _recorded(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "metadata.json")) as f:
        return json.load(f)["megatron_core"]


@pytest.mark.parametrize("direction", ["other-to-this", "this-to-other"])
def test_checkpoint_crosses_versions(tmp_path, direction: str) -> None:
    this, other = sys.executable, OTHER
    v_this, v_other = _version(this), _version(other)
    assert mcore_versions.parse(v_this)[:2] != mcore_versions.parse(v_other)[:2], \
        f"needs two megatron-core release lines: {this} and {other} both have {v_this}"
    # other -> this: TP2 -> DP2; this -> other: PP2 -> TP2
    writer, reader, src, dst = ((other, this, (2, 1), (1, 1)) if direction == "other-to-this"
                                else (this, other, (1, 2), (2, 1)))
    v_writer, v_reader = (v_other, v_this) if writer == other else (v_this, v_other)
    ref, res = str(tmp_path / "ref"), str(tmp_path / "resume")
    r = torchrun(2, [*BASE, *layout_flags(*src), "--save", f"{ref}/ckpt", "--save-interval", str(SAVE_AT),
                     "--tenplex-metrics", f"{ref}/metrics.jsonl"], python=writer)
    assert r.returncode == 0, r.log[-4000:]
    ckpt = f"{ref}/ckpt/iter_{SAVE_AT:07d}"
    r = torchrun(2, [*BASE, *layout_flags(*dst), "--load", ckpt, "--tenplex-resave", f"{res}/resave",
                     "--tenplex-metrics", f"{res}/metrics.jsonl", "--exit-interval", str(TRAIN_ITERS)], python=reader)
    assert r.returncode == 0, r.log[-4000:]
    resaved = f"{res}/resave/iter_{SAVE_AT:07d}"
    assert _recorded(ckpt) == {"version": v_writer, "state_layout": mcore_versions.STATE_LAYOUT_V1}
    assert _recorded(resaved) == {"version": v_reader, "state_layout": mcore_versions.STATE_LAYOUT_V1}
    assert assert_tensors_equal(ckpt, resaved, 96) > 20
    assert_losses_continue(ref, res, LOSS_RTOL)
