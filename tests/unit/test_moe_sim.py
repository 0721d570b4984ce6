"""Mixture-of-experts models in the pure layout model and the dry run: the catalogue's MoE entries, experts split
whole by EP and cut by expert TP, every expert covered exactly once at 1,024 GPUs, the grouped dry run equal to one
box per expert, and a save that dropped experts named by the expert check."""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import pytest

from tenplex_megatron.cli import main
from tenplex_megatron.plan.experts import expert_summary, missing_experts
from tenplex_megatron.plan.layout import LayoutError, ParallelLayout, padded_vocab_size
from tenplex_megatron.plan.planner import Planner, partition_errors
from tenplex_megatron.plan.ptc import PTC
from tenplex_megatron.plan.sim.dry_run import dry_run, expert_group
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims, gpt_tensors, is_expert, load_model
from tenplex_megatron.plan.sim.sharding import layout_chunks, layout_runs, source_from_layout

EXPERT_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
SMALL = GPTDims(num_layers=4, hidden_size=16, num_attention_heads=4, vocab_size=50, seq_length=8, swiglu=True,
                tied=False, add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope",
                num_experts=8, moe_ffn_hidden_size=8, moe_shared_expert_intermediate_size=8,
                moe_router_enable_expert_bias=True)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v3-like"])
def test_catalogue_moe_entries(name: str) -> None:
    """Every layer's MLP is a router plus the routed experts stacked (layers, experts, ...); no dense MLP."""
    d = load_model(name)
    assert d.num_experts and d.moe_router_topk <= d.num_experts
    t = gpt_tensors(d, padded_vocab_size(d.vocab_size, 128, 1))
    fc1 = t[EXPERT_FC1]
    assert fc1.global_shape == (d.num_layers, d.num_experts, 2 * d.expert_ffn, d.hidden_size)
    assert (fc1.tp_axis, fc1.tp_parts) == (2, 2)
    assert t["decoder.layers.mlp.router.weight"].global_shape == (d.num_layers, d.num_experts, d.hidden_size)
    assert "decoder.layers.mlp.linear_fc1.weight" not in t
    assert f"optimizer.state.exp_avg.{EXPERT_FC1}" in t
    assert ("decoder.layers.mlp.router.expert_bias" in t) == d.moe_router_enable_expert_bias
    assert not any(k.startswith("optimizer.") and k.endswith("expert_bias") for k in t)  # a buffer, not a parameter
    experts = sum(x.numel for k, x in t.items() if is_expert(x) and x.param is None)
    assert experts == d.num_layers * d.num_experts * 3 * d.expert_ffn * d.hidden_size  # SwiGLU: gate, up, down


def _expert_pairs(chunks) -> Counter:
    """(layer, expert) -> elements of the routed experts' fc1 in ``chunks`` (whole boxes only)."""
    out: Counter = Counter()
    for c in chunks:
        if c.key == EXPERT_FC1 and c.flat is None:
            each = c.numel // (c.shape[0] * c.shape[1])
            for layer in range(c.offsets[0], c.offsets[0] + c.shape[0]):
                for e in range(c.offsets[1], c.offsets[1] + c.shape[1]):
                    out[(layer, e)] += each
    return out


@pytest.mark.parametrize("layout", ["tp=1,pp=1,dp=4,ep=4", "tp=2,pp=2,dp=2,ep=2,etp=1", "tp=2,pp=1,dp=4,ep=2",
                                    "tp=1,pp=2,dp=8,ep=8", "tp=1,pp=1,dp=8"])
def test_experts_split_whole_by_ep(layout: str) -> None:
    """Each rank holds its EP rank's experts whole (cut only by expert TP), every expert lies on expert TP x expert
    DP ranks, and the stored source covers every element of every tensor exactly once."""
    lay = ParallelLayout.parse(layout)
    tensors = gpt_tensors(SMALL, padded_vocab_size(SMALL.vocab_size, 128, lay.tp))
    per_expert = math.prod(tensors[EXPERT_FC1].global_shape[2:])
    holders: dict[tuple[int, int], set[int]] = defaultdict(set)
    for rank, chunks in layout_chunks(tensors, lay, True).items():
        _, ep_rank, _ = lay.expert_rank_coords(rank)
        local = SMALL.num_experts // lay.ep
        for (layer, e), n in _expert_pairs(chunks).items():
            assert ep_rank * local <= e < (ep_rank + 1) * local
            assert n == per_expert // lay.expert_tp
            holders[(layer, e)].add(rank)
    assert len(holders) == SMALL.num_layers * SMALL.num_experts
    assert {len(r) for r in holders.values()} == {lay.expert_tp * lay.expert_dp}
    source = source_from_layout(tensors, lay, True)
    assert partition_errors(source) == {}
    assert not any(missing_experts(source).values())


def test_expert_rank_coords_are_megatrons_order() -> None:
    """tp-ep-dp-pp with the experts' TP and DP: a bijection onto (expert TP, EP, expert DP, PP) coordinates."""
    lay = ParallelLayout(tp=2, pp=2, dp=4, ep=2, etp=1)
    coords = {(*lay.expert_rank_coords(r), lay.rank_coords(r)[1]) for r in range(lay.world_size)}
    assert len(coords) == lay.world_size
    assert lay.expert_rank_coords(1) == (0, 1, 0)  # the next rank is the next EP rank when expert TP is 1
    assert lay.expert_rank_coords(2) == (0, 0, 1)


@pytest.mark.parametrize("src,dst", [("tp=1,pp=1,dp=4,ep=4", "tp=1,pp=1,dp=4,ep=2"),
                                     ("tp=2,pp=2,dp=2,ep=2,etp=1", "tp=1,pp=4,dp=2,ep=2"),
                                     ("tp=1,pp=2,dp=4,ep=4", "tp=2,pp=1,dp=4,ep=2,etp=2")])
def test_grouped_dry_run_equals_one_box_per_expert(src: str, dst: str) -> None:
    """The dry run's boxes of several layers and experts read exactly the bytes of megatron's one box per expert
    (plain optimizer: no flat boundaries), planned with the same planner."""
    a, b = ParallelLayout.parse(src), ParallelLayout.parse(dst)
    assert expert_group(SMALL, a, b) != (1, 1)
    got = dry_run(SMALL, a, b, distributed_optimizer=False)
    tensors = gpt_tensors(SMALL, got.padded_vocab)
    source = source_from_layout(tensors, a, False)
    planner = Planner(source, tensors)
    want = {r: planner.rank_bytes(r, chunks)[0] for r, chunks in layout_chunks(tensors, b, False).items()}
    assert got.read_bytes == want
    assert got.state_bytes == source.total_bytes()


@pytest.mark.parametrize("name,src,dst", [
    ("mixtral-8x7b", "tp=4,pp=4,dp=64,ep=8", "tp=4,pp=8,dp=32,ep=4"),
    ("deepseek-v3-like", "tp=1,pp=16,dp=64,ep=64", "tp=1,pp=8,dp=128,ep=32"),
])
def test_moe_dry_run_at_1024_gpus_covers_every_expert(name: str, src: str, dst: str) -> None:
    """At 1,024 GPUs every destination rank gets a plan (the planner proves each of its chunks covered exactly once),
    each expert is held whole by one EP rank's ranks, and the state is read at least once."""
    d, a, b = load_model(name), ParallelLayout.parse(src), ParallelLayout.parse(dst)
    run = dry_run(d, a, b, True, gpus_per_node=8)
    assert sorted(run.read_bytes) == list(range(b.world_size)) and min(run.read_bytes.values()) > 0
    assert sum(run.read_bytes.values()) >= run.state_bytes
    group = expert_group(d, a, b)
    tensors = gpt_tensors(d, run.padded_vocab)
    seen: Counter = Counter()
    for rank, runs in layout_runs(tensors, b, True, group).items():
        etp_rank, ep_rank, edp_rank = b.expert_rank_coords(rank)
        if etp_rank or edp_rank:
            continue
        pairs = _expert_pairs(c for r in runs for c in r.chunks)
        assert {e // (d.num_experts // b.ep) for _, e in pairs} == {ep_rank}
        seen.update(pairs)
    assert set(seen) == {(layer, e) for layer in range(d.num_layers) for e in range(d.num_experts)}


def test_missing_experts_named() -> None:
    """A save that dropped one expert's chunks: the expert check names the tensor, the layer and the expert."""
    lay = ParallelLayout(dp=2, ep=2)
    source = source_from_layout(gpt_tensors(SMALL, padded_vocab_size(SMALL.vocab_size, 128, 1)), lay, True)
    dropped = PTC(source.tensors, tuple(sc for sc in source.chunks
                                        if not (sc.chunk.key == EXPERT_FC1 and sc.chunk.offsets[:2] == (2, 5))),
                  source.layout)
    summary = expert_summary(dropped, lay.to_json())
    assert summary is not None and not summary.complete
    assert summary.missing[EXPERT_FC1] == ((2, 5),)
    assert (summary.num_experts, summary.ep, summary.expert_dp) == (8, 2, 1)
    assert expert_summary(source, lay.to_json()).complete


def test_ep_must_divide_experts() -> None:
    with pytest.raises(LayoutError, match="--expert-model-parallel-size 3 does not divide --num-experts 8"):
        ParallelLayout(dp=3, ep=3).check_fits(SMALL.shape())


def test_plan_cli_moe(capsys) -> None:
    assert main(["plan", "--model", "deepseek-v3-like", "--from", "tp=1,pp=16,dp=64,ep=64",
                 "--to", "tp=1,pp=8,dp=128,ep=32", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3-like: tp=1,pp=16,dp=64,ep=64 -> tp=1,pp=8,dp=128,ep=32  (1024 -> 1024 GPUs" in out
