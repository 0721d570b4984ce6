"""The README's public API example (examples/own_loop.py): a plain megatron-core loop saved at TP2 with
``tenplex_megatron.save_checkpoint`` resumes at TP1 x DP2 with ``tenplex_megatron.load_checkpoint`` and its
losses continue the uninterrupted run's."""

from __future__ import annotations

import os

import pytest

from tests.harness import ROOT, metrics, torchrun

pytestmark = pytest.mark.dist
EXAMPLE = os.path.join(ROOT, "examples", "own_loop.py")


def test_own_loop_resumes_at_another_layout(tmp_path) -> None:
    ckpt, ref, resumed = str(tmp_path / "ckpt"), str(tmp_path / "ref.jsonl"), str(tmp_path / "resumed.jsonl")
    r = torchrun(2, ["--tp", "2", "--iters", "6", "--save-interval", "3", "--dir", ckpt, "--metrics", ref],
                 script=EXAMPLE)
    assert r.returncode == 0, r.log[-4000:]
    os.replace(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), os.path.join(ckpt, "tracker.bak"))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")  # resume from iteration 3, not the final save at 6
    r = torchrun(2, ["--tp", "1", "--iters", "6", "--dir", ckpt, "--metrics", resumed], script=EXAMPLE)
    assert r.returncode == 0, r.log[-4000:]
    a = {m["iteration"]: m["loss"] for m in metrics(ref)}
    b = metrics(resumed)
    assert [m["iteration"] for m in b] == [4, 5, 6]
    for m in b:
        assert m["loss"] == pytest.approx(a[m["iteration"]], rel=2e-6), (m, a)
