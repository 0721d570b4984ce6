"""--data-path: megatron-core's GPTDataset over an indexed dataset built by scripts/build_dataset.py; the
global batches do not depend on DP, and a restart at another layout continues the same losses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.harness import ROOT, TINY_GPT, layout_flags, metrics, torchrun

pytestmark = pytest.mark.dist

BASE = [a for a in TINY_GPT if a != "--mock-data"] + ["--swiglu", "--use-distributed-optimizer", "--split", "100,0,0",
                                                      "--tokenizer-type", "ByteLevel"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("data") / "corpus")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "build_dataset.py"), "--generate", "400",
                        "--out", out], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr
    return out


def test_restart_on_data_path_continues_losses_with_fixed_global_batch(data: str, tmp_path) -> None:
    """DP goes 1 -> 2 -> 1 (micro-batches per step 4 -> 2 -> 4) at a fixed global batch of 8."""
    args = [*BASE, "--data-path", data, "--train-iters", "6"]
    r = torchrun(1, [*args, *layout_flags(1, 1), "--tenplex-metrics", f"{tmp_path}/ref.jsonl"])
    assert r.returncode == 0, r.log[-3000:]
    ck = str(tmp_path / "ck")
    for nproc, until in ((1, 2), (2, 4), (1, 6)):
        r = torchrun(nproc, [*args, *layout_flags(1, 1), "--save", ck, "--load", ck, "--exit-interval", str(until),
                             "--tenplex-metrics", f"{tmp_path}/elastic.jsonl"])
        assert r.returncode == 0, r.log[-3000:]
        assert f"{4 // nproc} micro-batches per step" in r.log
    ref = {m["iteration"]: m for m in metrics(f"{tmp_path}/ref.jsonl")}
    got = metrics(f"{tmp_path}/elastic.jsonl")
    assert [m["iteration"] for m in got] == [1, 2, 3, 4, 5, 6]
    for m in got:
        assert m["samples"] == ref[m["iteration"]]["samples"]
        assert m["loss"] == pytest.approx(ref[m["iteration"]]["loss"], rel=2e-6)
    assert got[0]["loss"] > got[-1]["loss"]


def test_bad_data_path_is_named(tmp_path) -> None:
    r = torchrun(1, [*BASE, "--data-path", str(tmp_path / "nothing"), "--train-iters", "2"])
    assert r.returncode != 0 and f"--data-path {tmp_path}/nothing: not a Megatron indexed dataset" in r.log
    (tmp_path / "fake.bin").write_bytes(b"x")
    (tmp_path / "fake.idx").write_bytes(b"not an index")
    r = torchrun(1, [*BASE, "--data-path", str(tmp_path / "fake"), "--train-iters", "2"])
    assert r.returncode != 0 and "fake.idx is not a Megatron index file" in r.log
