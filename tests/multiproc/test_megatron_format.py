"""Without --tenplex the script checkpoints with megatron-core's dist_checkpointing; with --tenplex a
megatron-core checkpoint is adopted mid-run (loaded by megatron-core's loader), and later saves are tenplex."""

from __future__ import annotations

import os

import pytest

from tenplex_megatron.storage.directory import find_checkpoint, find_megatron_checkpoint
from tests.harness import TINY_GPT, layout_flags, metrics, torchrun

pytestmark = pytest.mark.dist

MODEL = [a for a in TINY_GPT if a != "--tenplex"] + ["--vocab-size", "96", "--swiglu", "--use-distributed-optimizer",
                                                    "--train-iters", "6"]


def test_megatron_checkpoint_then_adoption_by_tenplex(tmp_path) -> None:
    mc, tp = str(tmp_path / "mcore"), str(tmp_path / "tenplex")
    r = torchrun(2, [*MODEL, *layout_flags(2, 1), "--save", mc, "--save-interval", "3",
                     "--tenplex-metrics", f"{tmp_path}/ref.jsonl"])
    assert r.returncode == 0, r.log[-3000:]
    assert "megatron-core dist_checkpointing: saved iteration 3" in r.log
    assert find_megatron_checkpoint(mc) == os.path.join(mc, "iter_0000006") and find_checkpoint(mc) is None
    r = torchrun(2, [*MODEL, *layout_flags(1, 1), "--tenplex", "--load", os.path.join(mc, "iter_0000003"),
                     "--save", tp, "--tenplex-metrics", f"{tmp_path}/adopted.jsonl"])
    assert r.returncode == 0, r.log[-3000:]
    assert "loaded iteration 3" in r.log and "adopted" in r.log
    assert find_checkpoint(tp) == os.path.join(tp, "iter_0000006")
    ref = {m["iteration"]: m for m in metrics(f"{tmp_path}/ref.jsonl")}
    got = metrics(f"{tmp_path}/adopted.jsonl")
    assert [m["iteration"] for m in got] == [4, 5, 6]
    for m in got:
        assert m["samples"] == ref[m["iteration"]]["samples"]
        assert m["loss"] == pytest.approx(ref[m["iteration"]]["loss"], rel=2e-6)
