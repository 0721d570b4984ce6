"""Bad input gets a clear error naming the file, tensor or constraint, before anything is modified.

Every job runs in one of two 2-rank torchrun launches (tests/multiproc/scenario_run.py: jobs in turn in one
process group, each job's exit status and output recorded as its own launch would have given them): the
checkpoint and the jobs that need none, then the loads of damaged copies of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.harness import ROOT, TINY_GPT, Run, layout_flags, run_scenarios

pytestmark = pytest.mark.dist

MODEL = ["--vocab-size", "96", "--swiglu", "--use-distributed-optimizer", "--train-iters", "4"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--expert-model-parallel-size", "2"]
GROUPED = ["--moe-grouped-gemm", "--bf16"]  # megatron-core's GroupedMLP experts (bf16 only)


def _digest(path: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _copy(ckpt: str, dst: str) -> str:
    shutil.copytree(ckpt, dst)
    return dst


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "tenplex_megatron", *args], capture_output=True, text=True, env=env)


def _mkfifo(path: str) -> None:
    os.remove(path)
    os.mkfifo(path)


def _hostile_copies(ckpt: str, root: str) -> dict[str, str]:
    """Copies of ``ckpt`` (iteration 2 alone) damaged as the hostile-checkpoint probe did (its findings 2 and 4;
    tests/unit/test_hostile_checkpoints.py has every variant through the engine): name -> directory."""
    out = {}

    def copy(name: str) -> tuple[str, str]:
        out[name] = _copy(ckpt, os.path.join(root, name))
        return out[name], os.path.join(out[name], "iter_0000002")

    d, it = copy("truncated_metadata")  # the only copy: before, "no checkpoint ...; starting from scratch", rc 0
    with open(os.path.join(it, "metadata.json"), "r+") as f:
        f.truncate(os.path.getsize(os.path.join(it, "metadata.json")) // 2)
    d, it = copy("metadata_fifo")  # before: the load hung
    _mkfifo(os.path.join(it, "metadata.json"))
    d, it = copy("rank_file_fifo")
    _mkfifo(os.path.join(it, "rank_00001.safetensors"))
    d, it = copy("tracker_fifo")  # a copy that loads: the tracker named in the warning
    _mkfifo(os.path.join(d, "latest_checkpointed_iteration.txt"))
    d, it = copy("newer_damaged")  # the tracker names 4, whose metadata is damaged: before, 2 loaded with no warning
    shutil.copytree(it, os.path.join(d, "iter_0000004"))
    with open(os.path.join(d, "iter_0000004", "metadata.json"), "w") as f:
        f.write("{\n")
    with open(os.path.join(d, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("4")
    return out


def _job(name: str, flags: list[str]) -> dict:
    return {"name": name, "flags": flags}


@dataclass(frozen=True)
class Results:
    root: str
    ckpt: str
    digest_before: dict[str, str]
    runs: dict[str, Run]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    """Two launches of 2 ranks: the checkpoint and the jobs that need none, then the jobs on damaged copies."""
    root = str(tmp_path_factory.mktemp("bad_input"))
    ckpt = os.path.join(root, "ckpt")
    empty = os.path.join(root, "empty")
    os.makedirs(os.path.join(empty, "iter_0000002"))  # nothing to read: the layout check must come first
    small_batch = [*TINY_GPT, *MODEL]
    small_batch[small_batch.index("--micro-batch-size") + 1] = "3"
    odd_heads = [*TINY_GPT, *MODEL]  # 3 heads of 16: TP=2 divides the hidden size, not the heads
    odd_heads[odd_heads.index("--hidden-size") + 1] = "48"
    odd_heads[odd_heads.index("--num-attention-heads") + 1] = "3"
    runs = run_scenarios(2, [
        _job("ckpt", [*TINY_GPT, *MODEL, *layout_flags(2, 1), "--save", ckpt, "--exit-interval", "2"]),
        _job("global_batch", [*small_batch, *layout_flags(1, 1)]),
        _job("layout", [*odd_heads, *layout_flags(2, 1), "--load", empty]),
        _job("context_parallel", [*TINY_GPT, *MODEL, "--context-parallel-size", "2"]),
        _job("no_such_flag", [*TINY_GPT, *MODEL, "--no-such-flag"]),
        _job("moe_ckpt", [*TINY_GPT, *MODEL, *MOE, "--save", os.path.join(root, "moe"), "--exit-interval", "1"]),
        _job("moe_ep_divides", [*TINY_GPT, *MODEL, *MOE[:-1], "3"]),
        _job("grouped_ckpt", [*TINY_GPT, *MODEL, *MOE, *GROUPED, "--save", os.path.join(root, "grouped"),
                              "--exit-interval", "1"]),
    ], os.path.join(root, "first"))
    assert runs["moe_ckpt"].returncode == 0, runs["moe_ckpt"].log[-3000:]
    assert runs["grouped_ckpt"].returncode == 0, runs["grouped_ckpt"].log[-3000:]
    moe, grouped = os.path.join(root, "moe"), os.path.join(root, "grouped")
    moe_before, grouped_before = _digest(moe), _digest(grouped)
    assert runs["ckpt"].returncode == 0, runs["ckpt"].log[-3000:]
    before = _digest(ckpt)
    other_model = [*TINY_GPT, *MODEL, *layout_flags(2, 1), "--load", ckpt, "--save", os.path.join(root, "out")]
    other_model[other_model.index("--hidden-size") + 1] = "32"
    missing = _copy(ckpt, os.path.join(root, "missing"))
    os.remove(os.path.join(missing, "iter_0000002", "rank_00001.safetensors"))
    truncated = _copy(ckpt, os.path.join(root, "truncated"))
    path = os.path.join(truncated, "iter_0000002", "rank_00000.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    outside = _copy(ckpt, os.path.join(root, "outside", "ckpt"))
    it = os.path.join(outside, "iter_0000002")
    shutil.copy(os.path.join(it, "rank_00001.safetensors"), os.path.join(root, "outside", "outside.safetensors"))
    with open(os.path.join(it, "metadata.json")) as f:
        meta = json.load(f)
    for c in meta["ptc"]["chunks"]:
        if c["at"]["file"] == "rank_00001.safetensors":
            c["at"]["file"] = "../../outside.safetensors"  # valid safetensors, but outside the checkpoint
    with open(os.path.join(it, "metadata.json"), "w") as f:
        json.dump(meta, f)
    hostile = _hostile_copies(ckpt, os.path.join(root, "hostile"))
    at_tp2 = [*TINY_GPT, *MODEL, *layout_flags(2, 1)]
    runs.update(run_scenarios(2, [
        *[_job(f"hostile_{name}", [*at_tp2, "--load", path]) for name, path in hostile.items()],
        _job("other_model", other_model),
        _job("missing", [*at_tp2, "--load", missing]),
        _job("truncated", [*at_tp2, "--load", truncated]),
        _job("outside", [*at_tp2, "--load", outside]),
        _job("moe_experts", [*TINY_GPT, *MODEL, *MOE[:1], "8", *MOE[2:], "--load", moe]),
        _job("moe_router", [*TINY_GPT, *MODEL, *MOE, "--moe-router-score-function", "sigmoid",
                            "--moe-router-enable-expert-bias", "--load", moe]),
        _job("grouped_into_sequential", [*TINY_GPT, *MODEL, *MOE, "--bf16", "--load", grouped]),
        _job("sequential_into_grouped", [*TINY_GPT, *MODEL, *MOE, *GROUPED, "--load", moe]),
    ], os.path.join(root, "second")))
    assert _digest(moe) == moe_before and _digest(grouped) == grouped_before
    return Results(root, ckpt, before, runs)


def test_checkpoint_of_another_model_names_tensor_and_shapes(results: Results) -> None:
    r = results.runs["other_model"]
    assert r.returncode != 0
    assert "checkpoint shape (96, 64) does not match model shape (96, 32)" in r.log
    assert "tensor 'embedding.word_embeddings.weight'" in r.log
    assert _digest(results.ckpt) == results.digest_before  # after every job of the second launch: none modified it
    out = os.path.join(results.root, "out")  # at most the lease taken at start: no checkpoint, no staging
    assert not os.path.exists(out) or os.listdir(out) == ["tenplex-lease"]


def test_missing_shard_file_is_named(results: Results) -> None:
    r = results.runs["missing"]
    assert r.returncode != 0
    assert "iter_0000002/rank_00001.safetensors: file is missing" in r.log


def test_truncated_shard_file_is_named(results: Results) -> None:
    r = results.runs["truncated"]
    assert r.returncode != 0
    assert "iter_0000002/rank_00000.safetensors" in r.log and "truncated" in r.log


def test_metadata_naming_a_file_outside_fails_on_every_rank_before_reading(results: Results) -> None:
    """Every rank confines every name at open time, whether it would read that file or not."""
    bad = os.path.join(results.root, "outside", "ckpt")
    it = os.path.join(bad, "iter_0000002")
    r = results.runs["outside"]
    assert r.returncode != 0
    assert "planning failed on 2 rank(s)" in r.log
    for rank in (0, 1):
        assert f"rank {rank}: CheckpointFileError: {it}: the metadata names the file '../../outside.safetensors', " \
               "which has a '..' component" in r.log
    r = _cli("verify", bad)
    assert r.returncode == 1 and "'../../outside.safetensors', which has a '..' component" in r.stdout


def _refused_at_start(r: Run, *needles: str) -> None:
    """The job stops before training, naming the copy and why: never a fresh start over a damaged checkpoint."""
    assert r.returncode == 1, r.log[-3000:]
    assert "starting from scratch" not in r.log and "iteration        1/" not in r.log, r.log[-3000:]
    for n in needles:
        assert n in r.log, (n, r.log[-3000:])


def test_trainer_refuses_a_damaged_only_copy_instead_of_starting_from_scratch(results: Results) -> None:
    it = os.path.join(results.root, "hostile", "truncated_metadata", "iter_0000002")
    _refused_at_start(results.runs["hostile_truncated_metadata"], "pretrain_gpt.py: error: --load ",
                      "no loadable copy of the checkpoint is left (refusing to start from scratch over it)",
                      f"{it}: metadata.json: malformed JSON")


def test_trainer_refuses_fifos_without_waiting(results: Results) -> None:
    """A FIFO in place of metadata.json (refused at start) or of a rank file (refused when the load opens it, on
    every rank: no copy left)."""
    _refused_at_start(results.runs["hostile_metadata_fifo"], "metadata.json: is a FIFO, not a regular file")
    _refused_at_start(results.runs["hostile_rank_file_fifo"], "NoGoodCopyError: no complete copy",
                      "rank_00001.safetensors: is a FIFO, not a regular file")


def test_trainer_loads_past_a_damaged_tracker_or_newest_copy_with_the_warning(results: Results) -> None:
    for name, damaged in (("tracker_fifo", "latest_checkpointed_iteration.txt: is a FIFO"),
                          ("newer_damaged", "iter_0000004: metadata.json: malformed JSON")):
        r = results.runs[f"hostile_{name}"]
        assert r.returncode == 0, r.log[-3000:]
        assert "loaded iteration 2 from " in r.log and "iter_0000002" in r.log, r.log[-3000:]
        warn = [line for line in r.log.splitlines() if "skipping a damaged copy" in line]
        assert len(warn) == 1 and damaged in warn[0], r.log[-3000:]


def test_layout_that_cannot_hold_the_model_fails_before_reading(results: Results) -> None:
    r = results.runs["layout"]
    assert r.returncode != 0
    assert "TP=2 does not divide the number of attention heads (3)" in r.log


def test_cli_inspect_and_plan(results: Results) -> None:
    ckpt = results.ckpt
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
def test_cli_plan_rejects_layouts(results: Results, layout: str, needle: str) -> None:
    r = _cli("plan", results.ckpt, "--to", layout)
    assert r.returncode == 2
    assert needle in r.stderr


def test_cli_names_missing_checkpoint(tmp_path) -> None:
    r = _cli("inspect", str(tmp_path))
    assert r.returncode == 2 and "no complete tenplex checkpoint" in r.stderr


def test_global_batch_that_dp_cannot_divide_names_valid_choices(results: Results) -> None:
    r = results.runs["global_batch"]
    assert r.returncode != 0
    assert "--global-batch-size 8 is not divisible by --micro-batch-size x DP = 3 x 2" in r.log
    assert "valid micro-batch sizes are [1, 2, 4]" in r.log


def test_unsupported_megatron_flag_is_refused(results: Results) -> None:
    r = results.runs["context_parallel"]
    assert r.returncode != 0 and ("Megatron-LM flag --context-parallel-size is not supported by tenplex-megatron: "
                                  "context parallelism is not re-sharded yet") in r.log
    r = results.runs["no_such_flag"]
    assert r.returncode != 0 and "unknown or unsupported flag(s): --no-such-flag" in r.log


def test_moe_checkpoint_of_other_experts_or_router_is_refused(results: Results) -> None:
    """A mixture-of-experts checkpoint with another expert count, or another kind of router, is refused naming the
    router tensor and both values before any state is touched (the checkpoint's digest is unchanged: fixture)."""
    r = results.runs["moe_experts"]
    assert r.returncode != 0
    assert ("tensor 'decoder.layers.mlp.router.weight': the checkpoint's routed experts per MoE layer (num_experts) "
            "is 4, the model's is 8") in r.log
    assert "planning failed on 2 rank(s)" in r.log
    r = results.runs["moe_router"]
    assert r.returncode != 0
    assert ("the checkpoint's router's expert bias (aux-loss-free balancing) (moe_router_enable_expert_bias) is "
            "False, the model's is True") in r.log


def test_checkpoint_of_the_other_kind_of_experts_is_refused(results: Results) -> None:
    """Grouped-GEMM experts (GroupedMLP) and sequential ones (SequentialMLP) store their weights transposed from each
    other: a load across kinds, either way, is refused naming both kinds and the flag that fits the checkpoint,
    before any state is touched (the checkpoints' digests are unchanged: fixture)."""
    grouped = "grouped-GEMM experts (megatron-core's GroupedMLP, --moe-grouped-gemm)"
    sequential = "sequential experts (megatron-core's SequentialMLP, without --moe-grouped-gemm)"
    r = results.runs["grouped_into_sequential"]
    assert r.returncode != 0
    assert f"metadata.json: the checkpoint holds {grouped}, the job builds {sequential};" in r.log
    assert "restart with --moe-grouped-gemm" in r.log and "planning failed on 2 rank(s)" in r.log
    r = results.runs["sequential_into_grouped"]
    assert r.returncode != 0
    assert f"the checkpoint holds {sequential}, the job builds {grouped};" in r.log
    assert "restart without --moe-grouped-gemm" in r.log


def test_moe_expert_parallel_size_must_divide_experts(results: Results) -> None:
    r = results.runs["moe_ep_divides"]
    assert r.returncode != 0
    assert "--expert-model-parallel-size 3 does not divide --num-experts 4 (each EP rank holds whole experts)" in r.log
