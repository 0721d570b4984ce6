"""Grouped-GEMM experts (megatron-core's GroupedMLP, ``--moe-grouped-gemm``) without a model: the trainer's flag and
its rules, the tensors the pure layout model gives them (their parameters' memory order, one box per layer and EP
rank), the planner's coverage proof across EP / expert TP / PP / DP changes, the expert check over distributed-optimizer
flat ranges that cross experts, and the refusal of a checkpoint of the other kind of experts. In-process."""

from __future__ import annotations

from collections import Counter

import pytest

from tenplex_megatron.plan.experts import check_expert_kind, expert_kind, expert_summary, missing_experts
from tenplex_megatron.plan.layout import ParallelLayout, padded_vocab_size
from tenplex_megatron.plan.planner import Planner, partition_errors
from tenplex_megatron.plan.ptc import PTC
from tenplex_megatron.plan.sim.dry_run import dry_run
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims, gpt_tensors, is_grouped
from tenplex_megatron.plan.sim.sharding import layout_chunks, source_from_layout
from tenplex_megatron.training.pretrain import parse_args, spec_from_args

W1, W2 = "decoder.layers.mlp.experts.weight1", "decoder.layers.mlp.experts.weight2"
SEQUENTIAL_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
GROUPED = GPTDims(num_layers=4, hidden_size=16, num_attention_heads=4, vocab_size=50, seq_length=8, swiglu=True,
                  tied=False, add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope",
                  num_experts=8, moe_ffn_hidden_size=8, moe_grouped_gemm=True)
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "2", "--mock-data",
         "--vocab-size", "128", "--num-experts", "4"]


def test_flag_reaches_the_spec_and_its_record() -> None:
    spec = spec_from_args(parse_args([*FLAGS, "--moe-grouped-gemm", "--bf16", "--disable-bias-linear"]))
    assert spec.moe_grouped_gemm and spec.to_json()["moe_grouped_gemm"] is True
    assert not spec_from_args(parse_args(FLAGS)).moe_grouped_gemm
    assert GPTDims.from_record(spec.to_json()).moe_grouped_gemm
    assert not GPTDims.from_record({k: v for k, v in spec.to_json().items() if k != "moe_grouped_gemm"}).moe_grouped_gemm


@pytest.mark.parametrize("flags,message", [
    (["--moe-grouped-gemm", "--disable-bias-linear"], "--moe-grouped-gemm needs --bf16: megatron-core's GroupedMLP"),
    (["--moe-grouped-gemm", "--bf16"], "--moe-grouped-gemm needs --disable-bias-linear:"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm needs --bf16 and --disable-bias-linear:"),
])
def test_flag_rules_are_named(flags: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args([*FLAGS, *flags])
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([*FLAGS[:-2], "--moe-grouped-gemm", "--bf16", "--disable-bias-linear"])
    assert "--moe-grouped-gemm needs --num-experts" in capsys.readouterr().err


@pytest.mark.parametrize("swiglu,parts", [(True, 2), (False, 1)])
def test_catalogue_describes_the_parameters_memory_order(swiglu: bool, parts: int) -> None:
    """weight1 [layers, experts, hidden, parts, ffn] and weight2 [layers, experts, ffn, hidden], expert TP on the ffn
    axis, no biases and none of SequentialMLP's tensors; every element of the experts once."""
    d = GPTDims(**{**GROUPED.__dict__, "swiglu": swiglu})
    t = gpt_tensors(d, padded_vocab_size(d.vocab_size, 128, 1))
    assert (t[W1].global_shape, t[W1].tp_axis, t[W1].tp_parts) == ((4, 8, 16, parts, 8), 4, 1)
    assert (t[W2].global_shape, t[W2].tp_axis) == ((4, 8, 8, 16), 2)
    assert not any("experts.experts." in k for k in t)
    assert is_grouped(t[f"optimizer.state.exp_avg.{W1}"]) and not is_grouped(t["decoder.layers.mlp.router.weight"])
    assert t[W1].numel + t[W2].numel == 4 * 8 * (parts + 1) * 8 * 16


@pytest.mark.parametrize("layout", ["tp=1,pp=1,dp=4,ep=4", "tp=2,pp=2,dp=2,ep=2,etp=1", "tp=2,pp=1,dp=4,ep=2",
                                    "tp=1,pp=2,dp=4,ep=1"])
def test_one_box_per_layer_and_ep_rank(layout: str) -> None:
    """Each rank's GroupedMLP weight1 is one box per layer: all of its EP rank's experts, cut by expert TP on the ffn
    axis (GroupedMLP's one parameter); the stored source partitions every tensor."""
    lay = ParallelLayout.parse(layout)
    tensors = gpt_tensors(GROUPED, padded_vocab_size(GROUPED.vocab_size, 128, lay.tp))
    local = GROUPED.num_experts // lay.ep
    per_layer: Counter = Counter()
    for rank, chunks in layout_chunks(tensors, lay, False).items():
        etp_rank, ep_rank, _ = lay.expert_rank_coords(rank)
        for c in chunks:
            if c.key == W1:
                assert c.shape == (1, local, 16, 2, 8 // lay.expert_tp)
                assert c.offsets[1:] == (ep_rank * local, 0, 0, etp_rank * 8 // lay.expert_tp)
                per_layer[c.offsets[0]] += 1
    assert set(per_layer) == set(range(GROUPED.num_layers))
    source = source_from_layout(tensors, lay, True)
    assert partition_errors(source) == {}
    assert not any(missing_experts(source).values())


@pytest.mark.parametrize("src,dst", [("tp=1,pp=1,dp=2,ep=2", "tp=1,pp=1,dp=2,ep=1"),
                                     ("tp=1,pp=1,dp=2,ep=2", "tp=2,pp=1,dp=1,ep=1"),
                                     ("tp=2,pp=2,dp=2,ep=2,etp=1", "tp=1,pp=4,dp=2,ep=1,etp=2"),
                                     ("tp=1,pp=2,dp=8,ep=8", "tp=2,pp=1,dp=4,ep=2")])
@pytest.mark.parametrize("distopt", [True, False], ids=["distopt", "plain"])
def test_planner_covers_every_destination_element_once(src: str, dst: str, distopt: bool) -> None:
    """The planner's coverage proof over GroupedMLP's boxes and their distributed-optimizer flat ranges: every
    destination rank gets a plan (raising if an element were missing or doubled), and each state byte is read."""
    run = dry_run(GROUPED, ParallelLayout.parse(src), ParallelLayout.parse(dst), distopt)
    tensors = gpt_tensors(GROUPED, run.padded_vocab)
    assert W1 in tensors and sorted(run.read_bytes) == list(range(ParallelLayout.parse(dst).world_size))
    assert sum(run.read_bytes.values()) >= run.state_bytes
    planner = Planner(source_from_layout(tensors, ParallelLayout.parse(src), distopt), tensors)
    for rank, chunks in layout_chunks(tensors, ParallelLayout.parse(dst), distopt).items():
        assert planner.rank_bytes(rank, chunks)[0] == run.read_bytes[rank]


def test_expert_check_counts_flat_ranges_across_experts() -> None:
    """The distributed optimizer's flat ranges cut GroupedMLP's multi-expert boxes anywhere: the expert check counts
    each (layer, expert) slab's share, so a dropped flat range names exactly the experts it touched."""
    lay = ParallelLayout(dp=4, ep=1)
    source = source_from_layout(gpt_tensors(GROUPED, padded_vocab_size(GROUPED.vocab_size, 128, 1)), lay, True)
    key = f"optimizer.state.exp_avg.{W1}"
    flat = [sc.chunk for sc in source.chunks if sc.chunk.key == key and sc.chunk.flat is not None]
    assert flat and expert_summary(source, lay.to_json()).complete
    dropped = flat[0]
    slab = 16 * 2 * 8  # one expert: hidden x parts x ffn
    lo, hi = dropped.flat
    assert lo % slab or hi % slab  # a range that cuts an expert
    want = tuple((dropped.offsets[0], e) for e in range(lo // slab, -(-hi // slab)))
    got = missing_experts(PTC(source.tensors, tuple(sc for sc in source.chunks if sc.chunk != dropped),
                              source.layout))
    assert got[key] == want and not got[W1]


def test_the_other_kind_of_experts_is_refused_naming_both_and_the_flag() -> None:
    grouped = list(gpt_tensors(GROUPED, 128))
    sequential = list(gpt_tensors(GPTDims(**{**GROUPED.__dict__, "moe_grouped_gemm": False}), 128))
    dense = list(gpt_tensors(GPTDims(**{**GROUPED.__dict__, "num_experts": None}), 128))
    assert (expert_kind(grouped), expert_kind(sequential), expert_kind(dense)) == ("grouped", "sequential", None)
    with pytest.raises(ValueError, match=r"^ck/metadata.json: the checkpoint holds grouped-GEMM experts \(megatron-core's "
                                         r"GroupedMLP, --moe-grouped-gemm\), the job builds sequential experts .* "
                                         r"restart with --moe-grouped-gemm$"):
        check_expert_kind("ck/metadata.json", grouped, "sequential")
    with pytest.raises(ValueError, match="restart without --moe-grouped-gemm$"):
        check_expert_kind("ck/metadata.json", sequential, "grouped")
    for saved, job in ((grouped, "grouped"), (sequential, "sequential"), (dense, "grouped"), (grouped, None)):
        check_expert_kind("ck/metadata.json", saved, job)
    assert SEQUENTIAL_FC1 in sequential
