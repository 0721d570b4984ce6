"""The fast dry-run planning path gives exactly what the original (slow) path gave.

``reference_plan.py`` is a frozen copy of the layout model, writer assignment
and planner as they were before they were made fast; every figure is computed
by both and compared for equality (no expected numbers are written here):
the source PTC a save would write, every rank's chunks, full per-rank plans
(pieces, fills, bytes by file) for a few ranks, and the ``plan --model`` report
(state, bytes read in total and per rank, cross-node bytes, central baseline).
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import astuple

import pytest

from tenplex_megatron.cli import main
from tenplex_megatron.plan.layout import ParallelLayout, padded_vocab_size, restart_padded_vocab_size
from tenplex_megatron.plan.planner import Planner, plan_reshard
from tenplex_megatron.plan.sim.dry_run import dry_run
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims, gpt_tensors, load_model
from tenplex_megatron.plan.sim.sharding import layout_chunks, layout_holdings, resize_vocab, source_from_layout
from tenplex_megatron.storage.directory import FORMAT_NAME, FORMAT_VERSION, commit, prepare_partial
from tests.unit import reference_plan as ref

# a model whose padded vocabulary changes with TP (100 rows: 128 at TP=1, 384 at TP=3), untied, SwiGLU, fp32
ODD = GPTDims(num_layers=6, hidden_size=48, num_attention_heads=6, vocab_size=100, seq_length=16, swiglu=True,
              tied=False, bf16=False)
MODELS = {"odd": ODD, **{name: load_model(name) for name in ("tiny", "gpt3-125m", "gpt3-350m")}}

CASES = [
    # (model, from, to, distributed optimizer)
    ("tiny", "tp=2,pp=1,dp=2", "tp=4,pp=1,dp=1", True),  # TP change
    ("tiny", "tp=1,pp=2,dp=2", "tp=1,pp=1,dp=3", True),  # PP and DP change
    ("tiny", "tp=2,pp=2,dp=1", "tp=2,pp=2,dp=1", True),  # unchanged
    ("tiny", "tp=2,pp=1,dp=2", "tp=1,pp=2,dp=2", False),  # TP and PP change, no distributed optimizer
    ("odd", "tp=1,pp=2,dp=2", "tp=3,pp=3,dp=1", True),  # vocab padding grows 128 -> 384, untied
    ("odd", "tp=3,pp=1,dp=2", "tp=2,pp=2,dp=2", True),  # vocab padding shrinks 384 -> 128
    ("odd", "tp=6,pp=3,dp=1", "tp=2,pp=1,dp=5", False),
    ("gpt3-125m", "tp=2,pp=2,dp=2", "tp=2,pp=2,dp=4", True),  # DP change only
    ("gpt3-125m", "tp=2,pp=1,dp=2", "tp=3,pp=2,dp=1", True),  # vocab padding 50432 -> 50304
    ("gpt3-125m", "tp=4,pp=3,dp=2", "tp=2,pp=4,dp=3", True),  # everything changes
    ("gpt3-350m", "tp=4,pp=4,dp=2", "tp=4,pp=2,dp=4", True),  # the 175B shape of change, smaller
    ("gpt3-350m", "tp=2,pp=8,dp=2", "tp=8,pp=2,dp=1", False),
]
NODES = [None, 1, 3, 8]


def _case(name: str, src: str, dst: str):
    dims = MODELS[name]
    s, d = ParallelLayout.parse(src), ParallelLayout.parse(dst)
    tensors = gpt_tensors(dims, padded_vocab_size(dims.vocab_size, 128, s.tp))
    padded = restart_padded_vocab_size(dims.vocab_size, 128, d.tp, tensors["embedding.word_embeddings.weight"].global_shape[0])
    return dims, s, d, tensors, resize_vocab(tensors, padded)


@pytest.mark.parametrize("name,src,dst,distopt", CASES)
def test_layout_model_and_source_ptc_match_the_reference(name, src, dst, distopt) -> None:
    _, s, d, tensors, dst_tensors = _case(name, src, dst)
    assert dst_tensors == ref.resize_vocab(tensors, dst_tensors["embedding.word_embeddings.weight"].global_shape[0])
    for t, lay in ((tensors, s), (dst_tensors, d)):
        assert layout_holdings(t, lay, distopt) == ref.layout_holdings(t, lay, distopt)
        assert layout_chunks(t, lay, distopt) == ref.layout_chunks(t, lay, distopt)
    assert source_from_layout(tensors, s, distopt) == ref.source_from_layout(tensors, s, distopt)  # chunk order too


def _rank_plan(p) -> tuple:
    """A RankPlan as plain values (the reference's Piece and Fill are other classes, so never equal)."""
    return (p.rank, p.chunks, [astuple(x) for x in p.pieces], [astuple(x) for x in p.fills], p.bytes_read,
            p.bytes_by_file)


@pytest.mark.parametrize("name,src,dst,distopt", CASES)
def test_rank_plans_and_rank_bytes_match_the_reference(name, src, dst, distopt) -> None:
    _, s, d, tensors, dst_tensors = _case(name, src, dst)
    source = ref.source_from_layout(tensors, s, distopt)
    chunks = ref.layout_chunks(dst_tensors, d, distopt)
    world = d.world_size
    some = sorted({0, 1 % world, world // 2, world - 1})
    hosts = {r: f"h{r // 2}" for r in chunks}
    got = plan_reshard(source, dst_tensors, chunks, hosts=hosts, ranks=some)
    want = ref.plan_reshard(source, dst_tensors, chunks, hosts=hosts, ranks=some)
    assert got.sources == want.sources and got.unused_tensors == want.unused_tensors
    assert {r: _rank_plan(p) for r, p in got.ranks.items()} == {r: _rank_plan(p) for r, p in want.ranks.items()}
    planner, ref_planner = Planner(source, dst_tensors), ref.Planner(source, dst_tensors)
    for g in (1, 3):  # the bytes read do not depend on the node size; cross-node ones do
        for r, cs in chunks.items():
            assert planner.rank_bytes(r, cs, hosts[r], g) == ref_planner.rank_bytes(r, cs, hosts[r], g), (r, g)


def _cli_report(name: str, src: str, dst: str, distopt: bool, gpus_per_node: int | None) -> dict:
    argv = ["plan", "--model", name, "--from", src, "--to", dst, "--json",
            "--distributed-optimizer" if distopt else "--no-distributed-optimizer"]
    if gpus_per_node:
        argv += ["--gpus-per-node", str(gpus_per_node)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


FIGURES = ("state_bytes", "bytes_total", "bytes_per_rank_max", "bytes_per_rank_mean", "bytes_cross_node",
           "central_bytes_through_one_rank")


@pytest.mark.parametrize(
    "name,src,dst,distopt,gpus_per_node",
    [(*c, g) for c in CASES if c[0] != "odd" for g in (NODES if c[0] != "gpt3-350m" else [None, 8])],
)
def test_plan_model_report_matches_the_reference(name, src, dst, distopt, gpus_per_node) -> None:
    got = _cli_report(name, src, dst, distopt, gpus_per_node)
    want = ref.model_report(MODELS[name], ParallelLayout.parse(src), ParallelLayout.parse(dst), distopt, gpus_per_node)
    assert {k: got[k] for k in FIGURES} == {k: want[k] for k in FIGURES}


@pytest.mark.parametrize("name,src,dst,distopt", [c for c in CASES if c[0] == "odd"])
@pytest.mark.parametrize("gpus_per_node", NODES)
def test_dry_run_of_a_model_outside_the_catalogue_matches_the_reference(name, src, dst, distopt, gpus_per_node) -> None:
    s, d = ParallelLayout.parse(src), ParallelLayout.parse(dst)
    got = dry_run(MODELS[name], s, d, distopt, gpus_per_node)
    want = ref.model_report(MODELS[name], s, d, distopt, gpus_per_node)
    assert got.state_bytes == want["state_bytes"]
    assert got.central_bytes == want["central_bytes_through_one_rank"]
    assert got.read_bytes == {r: b for r, (b, _) in want["per_rank"].items()}
    assert got.cross_node == ({r: c for r, (_, c) in want["per_rank"].items()} if gpus_per_node else None)


def test_gpt3_175b_on_1024_gpus_is_planned() -> None:
    """The issue's example completes (its time is printed by the command, not asserted here)."""
    got = dry_run(load_model("gpt3-175b"), ParallelLayout(8, 16, 8), ParallelLayout(8, 8, 16), True, 8)
    reads, cross = list(got.read_bytes.values()), got.cross_node
    assert sorted(got.read_bytes) == list(range(1024)) and cross is not None and sorted(cross) == list(range(1024))
    assert 0 < min(reads) <= max(reads) and all(0 <= cross[r] <= got.read_bytes[r] for r in cross)
    assert got.state_bytes < sum(reads) < got.central_bytes  # every DP replica reads its weights; less than central
    assert got.padded_vocab == 51200


@pytest.mark.parametrize("name,src,dst,distopt", [c for c in CASES if c[0] == "tiny"])
def test_plan_of_a_checkpoint_agrees_with_plan_of_the_model(tmp_path, name, src, dst, distopt) -> None:
    """``plan CKPT`` (full per-rank plans) and ``plan --model`` (runs) report the same bytes for the same source."""
    dims, s, _, tensors, _ = _case(name, src, dst)
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "iteration": 3, "layout": s.to_json(),
            "use_distributed_optimizer": distopt, "padded_vocab_size": tensors["embedding.word_embeddings.weight"].global_shape[0],
            "model": {"num_layers": dims.num_layers, "hidden_size": dims.hidden_size, "vocab_size": dims.vocab_size,
                      "num_attention_heads": dims.num_attention_heads, "make_vocab_size_divisible_by": 128},
            "ptc": ref.source_from_layout(tensors, s, distopt).to_json()}
    prepare_partial(str(tmp_path), 3)
    commit(str(tmp_path), 3, meta, {})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(tmp_path), "--to", dst, "--gpus-per-node", "2", "--json"]) == 0
    got = json.loads(out.getvalue())
    assert got["plan_seconds"] > 0 and got["read_seconds"] > 0
    want = _cli_report(name, src, dst, distopt, 2)
    assert {k: got[k] for k in FIGURES[:-1]} == {k: want[k] for k in FIGURES[:-1]}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(tmp_path), "--to", dst]) == 0
    assert out.getvalue().startswith(f"plan         {s} -> {ParallelLayout.parse(dst)}  "), out.getvalue()
