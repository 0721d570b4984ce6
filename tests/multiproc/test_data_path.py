"""--data-path under torchrun: megatron-core's GPTDataset over an indexed dataset built by
scripts/build_dataset.py --generate. A job restarted at another layout (TP2 -> DP2 -> DP1 at a fixed
global batch, so 4 -> 2 -> 4 micro-batches per step) sees the same samples in every global batch and
continues the same losses; a bad --data-path is named before training starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.harness import CHILD_PYTHONPATH, PRETRAIN, ROOT, TINY_GPT, layout_flags, metrics, torchrun

pytestmark = pytest.mark.dist

BASE = [a for a in TINY_GPT if a != "--mock-data"] + [
    "--swiglu", "--use-distributed-optimizer", "--split", "100,0,0", "--tokenizer-type", "ByteLevel",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("data") / "corpus")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "build_dataset.py"), "--generate", "300",
                        "--out", out], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH))
    assert p.returncode == 0, p.stderr
    return out


def test_restart_at_other_layouts_continues_losses_on_data_path(data: str, tmp_path) -> None:
    """TP2 for 6 steps (saves at 3 and 6) is the reference; from its iteration-3 checkpoint, DP2 (TP1) runs
    steps 4-5, then DP1 step 6: per-step samples are equal and losses equal within rel 2e-6."""
    args = [*BASE, "--data-path", data, "--train-iters", "6"]
    ck, ck2, ref, el = str(tmp_path / "ck"), str(tmp_path / "ck2"), str(tmp_path / "ref.jsonl"), str(tmp_path / "el.jsonl")
    r = torchrun(2, [*args, *layout_flags(2, 1), "--save", ck, "--save-interval", "3", "--tenplex-metrics", ref])
    assert r.returncode == 0, r.log[-3000:]
    assert "4 micro-batches per step" in r.log and "GPTDataset train split" in r.log
    r = torchrun(2, [*args, *layout_flags(1, 1), "--load", os.path.join(ck, "iter_0000003"), "--save", ck2,
                     "--exit-interval", "5", "--tenplex-metrics", el])
    assert r.returncode == 0, r.log[-3000:]
    assert "loaded iteration 3" in r.log and "2 micro-batches per step" in r.log
    r = torchrun(1, [*args, *layout_flags(1, 1), "--load", ck2, "--tenplex-metrics", el])
    assert r.returncode == 0, r.log[-3000:]
    assert "loaded iteration 5" in r.log and "4 micro-batches per step" in r.log
    want = {m["iteration"]: m for m in metrics(ref)}
    got = metrics(el)
    assert sorted(want) == [1, 2, 3, 4, 5, 6]
    assert [m["iteration"] for m in got] == [4, 5, 6]
    assert [(m["layout"]["tp"], m["layout"]["dp"]) for m in got] == [(1, 2), (1, 2), (1, 1)]
    for m in got:
        assert m["samples"] == want[m["iteration"]]["samples"] == list(range(8 * m["iteration"] - 8, 8 * m["iteration"]))
        assert m["loss"] == pytest.approx(want[m["iteration"]]["loss"], rel=2e-6)
    assert want[6]["loss"] < want[1]["loss"]


def test_bad_data_path_is_named(tmp_path) -> None:
    missing = str(tmp_path / "nothing")
    r = torchrun(1, [*BASE, "--data-path", missing, "--train-iters", "2"])
    assert r.returncode != 0 and f"--data-path {missing}: not a Megatron indexed dataset" in r.log
    (tmp_path / "fake.bin").write_bytes(b"x")
    (tmp_path / "fake.idx").write_bytes(b"not an index")
    fake = str(tmp_path / "fake")
    # The check runs while parsing flags, before torch.distributed: the script alone shows it.
    p = subprocess.run([sys.executable, PRETRAIN, *BASE, "--data-path", fake, "--train-iters", "2"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH, OMP_NUM_THREADS="1"))
    assert p.returncode != 0 and f"--data-path {fake}: {fake}.idx is not a Megatron index file" in p.stderr
