"""Bad input gets a clear error naming the file, tensor or constraint, before anything is modified."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.harness import ROOT, TINY_GPT, layout_flags, torchrun

pytestmark = pytest.mark.dist

MODEL = ["--vocab-size", "96", "--swiglu", "--use-distributed-optimizer", "--train-iters", "4"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = str(tmp_path_factory.mktemp("bad_input"))
    r = torchrun(2, [*TINY_GPT, *MODEL, *layout_flags(2, 1), "--save", f"{d}/ckpt", "--exit-interval", "2"])
    assert r.returncode == 0, r.log[-3000:]
    return os.path.join(d, "ckpt")


def _digest(path: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _copy(ckpt: str, tmp_path) -> str:
    dst = os.path.join(str(tmp_path), "ckpt")
    shutil.copytree(ckpt, dst)
    return dst


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "tenplex_megatron", *args], capture_output=True, text=True, env=env)


def test_checkpoint_of_another_model_names_tensor_and_shapes(ckpt: str, tmp_path) -> None:
    before = _digest(ckpt)
    args = [*TINY_GPT, *MODEL, "--load", ckpt, "--save", str(tmp_path / "out")]
    args[args.index("--hidden-size") + 1] = "32"
    r = torchrun(1, args)
    assert r.returncode != 0
    assert "checkpoint shape (96, 64) does not match model shape (96, 32)" in r.log
    assert "tensor 'embedding.word_embeddings.weight'" in r.log
    assert _digest(ckpt) == before
    assert not os.path.exists(tmp_path / "out")


def test_missing_shard_file_is_named(ckpt: str, tmp_path) -> None:
    bad = _copy(ckpt, tmp_path)
    os.remove(os.path.join(bad, "iter_0000002", "rank_00001.safetensors"))
    r = torchrun(1, [*TINY_GPT, *MODEL, "--load", bad])
    assert r.returncode != 0
    assert "iter_0000002/rank_00001.safetensors: file is missing" in r.log


def test_truncated_shard_file_is_named(ckpt: str, tmp_path) -> None:
    bad = _copy(ckpt, tmp_path)
    path = os.path.join(bad, "iter_0000002", "rank_00000.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    r = torchrun(1, [*TINY_GPT, *MODEL, "--load", bad])
    assert r.returncode != 0
    assert "iter_0000002/rank_00000.safetensors" in r.log and "truncated" in r.log


def test_metadata_naming_a_file_outside_fails_on_every_rank_before_reading(ckpt: str, tmp_path) -> None:
    """Every rank confines every name at open time, whether it would read that file or not."""
    bad = _copy(ckpt, tmp_path)
    it = os.path.join(bad, "iter_0000002")
    shutil.copy(os.path.join(it, "rank_00001.safetensors"), tmp_path / "outside.safetensors")  # valid, but outside
    with open(os.path.join(it, "metadata.json")) as f:
        meta = json.load(f)
    for c in meta["ptc"]["chunks"]:
        if c["at"]["file"] == "rank_00001.safetensors":
            c["at"]["file"] = "../../outside.safetensors"
    with open(os.path.join(it, "metadata.json"), "w") as f:
        json.dump(meta, f)
    r = torchrun(2, [*TINY_GPT, *MODEL, *layout_flags(2, 1), "--load", bad])
    assert r.returncode != 0
    assert "planning failed on 2 rank(s)" in r.log
    for rank in (0, 1):
        assert f"rank {rank}: CheckpointFileError: {it}: the metadata names the file '../../outside.safetensors', " \
               "which has a '..' component" in r.log
    r = _cli("verify", bad)
    assert r.returncode == 1 and "'../../outside.safetensors', which has a '..' component" in r.stdout


def test_layout_that_cannot_hold_the_model_fails_before_reading(ckpt: str, tmp_path) -> None:
    bad = _copy(ckpt, tmp_path)
    shutil.rmtree(os.path.join(bad, "iter_0000002"))  # nothing to read: the layout check must come first
    os.makedirs(os.path.join(bad, "iter_0000002"))
    r = torchrun(3, [*TINY_GPT, *MODEL, *layout_flags(3, 1), "--load", bad])
    assert r.returncode != 0
    assert "TP=3 does not divide the number of attention heads (4)" in r.log


def test_cli_inspect_and_plan(ckpt: str) -> None:
    r = _cli("inspect", ckpt, "--tensors")
    assert r.returncode == 0, r.stderr
    assert "iteration    2" in r.stdout and "tp=2 pp=1 dp=1" in r.stdout
    assert "decoder.layers.mlp.linear_fc1.weight" in r.stdout
    r = _cli("plan", ckpt, "--to", "tp=1,pp=2,dp=1", "--gpus-per-node", "1", "--per-rank")
    assert r.returncode == 0, r.stderr
    assert "-> tp=1,pp=2,dp=1" in r.stdout and "rank     1:" in r.stdout and "cross-node" in r.stdout
    r = _cli("verify", ckpt, "--all")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"OK       {ckpt}/iter_0000002: iteration 2, 2 files,") and "1 of 1" in r.stdout


@pytest.mark.parametrize(
    "layout,needle",
    [
        ("tp=3,pp=1,dp=1", "TP=3 does not divide the number of attention heads (4)"),
        ("tp=1,pp=3,dp=1", "PP=3 does not divide the number of layers (2)"),
        ("tp=2,pp=x", "not an integer"),
    ],
)
def test_cli_plan_rejects_layouts(ckpt: str, layout: str, needle: str) -> None:
    r = _cli("plan", ckpt, "--to", layout)
    assert r.returncode == 2
    assert needle in r.stderr


def test_cli_names_missing_checkpoint(tmp_path) -> None:
    r = _cli("inspect", str(tmp_path))
    assert r.returncode == 2 and "no complete tenplex checkpoint" in r.stderr


def test_global_batch_that_dp_cannot_divide_names_valid_choices(tmp_path) -> None:
    args = [*TINY_GPT, *MODEL]
    args[args.index("--micro-batch-size") + 1] = "3"
    r = torchrun(2, [*args, *layout_flags(1, 1)])
    assert r.returncode != 0
    assert "--global-batch-size 8 is not divisible by --micro-batch-size x DP = 3 x 2" in r.log
    assert "valid micro-batch sizes are [1, 2, 4]" in r.log


def test_unsupported_megatron_flag_is_refused(tmp_path) -> None:
    r = torchrun(1, [*TINY_GPT, *MODEL, "--sequence-parallel"])
    assert r.returncode != 0 and "Megatron-LM flag --sequence-parallel is not supported" in r.log
    r = torchrun(1, [*TINY_GPT, *MODEL, "--no-such-flag"])
    assert r.returncode != 0 and "unknown or unsupported flag(s): --no-such-flag" in r.log
