"""Layout choice for a world size (plan/autolayout.py): legality, the memory model, the time model, ranking, errors."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex_megatron.plan.autolayout import (
    GIB,
    LayoutCandidate,
    activation_bytes_per_layer,
    candidate_key,
    choose_layout,
    estimate_memory,
    estimate_time,
    evaluate,
    parse_candidate_key,
    rank_layouts,
    total_parameters,
)
from tenplex_megatron.plan.layout import LayoutError, ParallelLayout
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims, gpt_tensors, load_model

TINY = load_model("tiny")  # 2 layers, hidden 64, 4 heads, SwiGLU FFN 256, fp32
GQA = GPTDims(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2, vocab_size=100, seq_length=16)


@pytest.mark.parametrize("dims, layout, mbs, gbs, kw, expected", [
    (TINY, (4, 1, 1), 1, 8, {"gpus_per_node": 2}, "TP=4 spans more than the 2 GPUs of a node"),
    (TINY, (8, 1, 1), 1, 8, {}, "TP=8 does not divide the attention heads (4)"),
    (GQA, (4, 1, 1), 1, 8, {}, "TP=4 does not divide the query groups (2)"),
    (GPTDims(2, 64, 8, ffn_hidden_size=100), (8, 1, 1), 1, 8, {}, "TP=8 does not divide the FFN hidden size (100)"),
    (TINY, (1, 3, 1), 1, 8, {}, "PP=3 does not divide the 2 layers"),
    (TINY, (1, 1, 2), 1, 8, {"world_size": 4}, "TP x PP x DP = 1 x 1 x 2 = 2 is not the world size 4"),
    (TINY, (1, 1, 3), 1, 8, {}, "DP=3 does not divide the global batch size 8"),
    (TINY, (1, 1, 2), 8, 8, {}, "DP x micro-batch = 2 x 8 = 16 does not divide the global batch size 8"),
    (TINY, (1, 1, 2), 2, 8, {"fixed": {"tp": 2}}, "TP is fixed at 2"),
])
def test_each_legality_rule_refuses_with_its_reason(dims, layout, mbs, gbs, kw, expected) -> None:
    c = evaluate(dims, ParallelLayout(*layout), mbs, gbs, **kw)
    assert not c.legal and not c.usable
    assert expected in c.reasons, c.reasons
    assert c.memory is None and c.modelled is None


def test_a_legal_candidate_has_estimates_and_no_reasons() -> None:
    c = evaluate(GQA, ParallelLayout(2, 2, 1), 2, 8, world_size=4, gpus_per_node=2, memory_gb=1.0)
    assert c.legal and c.fits and c.usable and c.reasons == ()
    assert c.num_microbatches == 4 and c.memory is not None and c.modelled is not None
    assert c.seconds == c.modelled.total > 0


def test_memory_estimate_matches_a_hand_calculation() -> None:
    """4 layers, hidden 64, 4 heads, seq 32, vocab 256, bf16, tied, GELU FFN 4h; TP2 PP2 DP2, mbs 2, global batch 16.

    One layer's parameters: TP-split (qkv 3h*h + 3h, proj h*h, fc1 4h*h + 4h, fc2 4h*h) = 12h^2 + 7h = 49600 -> 24800
    per rank; replicated (two LayerNorms 4h, proj and fc2 biases 2h) = 384; so 25184 per layer, 2 layers per stage.
    Stage 0: 50368 + word embedding (vocab 256 padded to 128*2 = 256) 256*64/2 = 8192 + positions 32*64 = 2048
    -> 60608 parameters. Stage 1: 50368 + final LayerNorm 128 + the tied embedding's copy 8192 = 58688.
    Activations per layer and micro-batch: 32*2*64*(34 + 5*4*32/64) / 2 = 90112 bytes; micro-batches 16/(2*2) = 4;
    stage 0 keeps min(PP - 0, 4) = 2 in flight over its 2 layers: 360448 bytes.
    Stage 0: weights 2*60608 = 121216, gradients 4*60608 = 242432, optimizer 12*60608/2 = 363648.
    """
    dims = GPTDims(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32)
    m = estimate_memory(dims, ParallelLayout(2, 2, 2), 2, 16)
    assert (m.stage, m.weights, m.gradients, m.optimizer, m.activations) == (0, 121216, 242432, 363648, 360448)
    assert m.total == 1087744
    # without the distributed optimizer each rank keeps all its optimizer state
    assert estimate_memory(dims, ParallelLayout(2, 2, 2), 2, 16, distributed_optimizer=False).optimizer == 12 * 60608
    # FlashAttention keeps no seq x seq scores: 32*2*64*34/2 per layer and micro-batch
    assert estimate_memory(dims, ParallelLayout(2, 2, 2), 2, 16, flash_attention=True).activations == 4 * 32 * 2 * 64 * 34 // 2


@pytest.mark.parametrize("name", ["gpt3-1.3b", "llama3-8b"])
def test_memory_never_grows_with_any_degree(name: str) -> None:
    dims = load_model(name)
    degrees = [1, 2, 4, 8]
    pps = [p for p in (1, 2, 4, 8, 16) if dims.num_layers % p == 0]
    est = {(tp, pp, dp, mbs): estimate_memory(dims, ParallelLayout(tp, pp, dp), mbs, 512).total
           for tp in degrees for pp in pps for dp in degrees for mbs in (1, 2)}
    for (tp, pp, dp, mbs), total in est.items():
        for bigger in ((tp * 2, pp, dp, mbs), (tp, pp * 2, dp, mbs), (tp, pp, dp * 2, mbs)):
            if bigger in est:
                assert est[bigger] <= total, (name, (tp, pp, dp, mbs), bigger)
        if (tp, pp, dp, 2) in est and mbs == 1:
            assert est[(tp, pp, dp, 2)] > total  # a bigger micro-batch holds more activations
    # and a higher TP degree strictly lowers it (every large tensor is split)
    assert est[(2, 1, 1, 1)] < est[(1, 1, 1, 1)]


def test_time_model_shapes() -> None:
    """The pipeline bubble shrinks with more micro-batches; TP communication grows with the TP degree; DP only costs >1."""
    dims = load_model("gpt3-1.3b")
    t1 = estimate_time(dims, ParallelLayout(1, 4, 1), 1, 512, 8)
    t8 = estimate_time(dims, ParallelLayout(1, 4, 1), 8, 512, 8)
    assert t1.bubble < t8.bubble and t1.bubble == pytest.approx(t1.compute * 3 / 512)
    tp = [estimate_time(dims, ParallelLayout(t, 1, 1), 1, 512, 8).tp_comm for t in (1, 2, 4, 8)]
    assert tp[0] == 0 and tp[1] < tp[2] < tp[3]
    assert estimate_time(dims, ParallelLayout(1, 1, 1), 1, 512, 8).dp_comm == 0
    assert estimate_time(dims, ParallelLayout(1, 1, 2), 1, 512, 8).dp_comm > 0
    # the DP gradients cross the slower network when a DP group spans nodes
    intra = estimate_time(dims, ParallelLayout(1, 1, 4), 1, 512, 4).dp_comm
    inter = estimate_time(dims, ParallelLayout(1, 1, 8), 1, 512, 4).dp_comm
    assert inter > intra
    # compute: 6 x parameters x tokens over the world's FLOP/s
    assert t1.compute == pytest.approx(6 * total_parameters(dims) * 512 * 2048 / (4 * 150e12))


def test_llama_shape_matches_its_published_parameter_count() -> None:
    """Llama 3 8B: Meta publishes 8,030,261,248 parameters (GQA with 8 groups, SwiGLU, no biases, untied)."""
    dims = load_model("llama3-8b")
    assert dims.qkv_rows == 4096 + 2 * 8 * 128
    assert total_parameters(dims) == 8_030_261_248
    keys = set(gpt_tensors(dims, 128256, optimizer=False))
    assert "embedding.position_embeddings.weight" not in keys and "decoder.layers.mlp.linear_fc1.bias" not in keys
    assert "output_layer.weight" in keys


def test_measured_time_overrides_the_model() -> None:
    dims, args = load_model("gpt3-1.3b"), (12, 4, 512)
    modelled = [c for c in rank_layouts(dims, *args, memory_gb=80) if c.usable]
    worst, second_worst = modelled[-1], modelled[-2]
    assert worst.modelled.total > modelled[0].modelled.total
    measured = {worst.key: 9.0, second_worst.key: 7.0}
    ranked = rank_layouts(dims, *args, memory_gb=80, measured=measured)
    assert [c.key for c in ranked[:2]] == [second_worst.key, worst.key]  # measured first, the faster measured on top
    assert ranked[0].seconds == 7.0 and ranked[0].modelled == second_worst.modelled
    assert choose_layout(dims, *args, memory_gb=80, measured=measured).best.key == second_worst.key
    # a measurement never makes a refused candidate usable
    refused = next(c for c in rank_layouts(dims, *args, memory_gb=80) if not c.usable)
    again = {c.key: c for c in rank_layouts(dims, *args, memory_gb=80, measured={refused.key: 0.001})}
    assert not again[refused.key].usable and again[refused.key].measured_seconds == 0.001


def test_memory_budget_refuses_with_the_estimate() -> None:
    dims = load_model("gpt3-1.3b")
    ranking = rank_layouts(dims, 12, 4, 512, memory_gb=10)
    over = [c for c in ranking if c.legal and not c.fits]
    assert over and all(c.memory.total > 10 * GIB for c in over)
    assert all(re.fullmatch(r"needs \d+\.\d\d GiB per rank \(stage \d+\), over the budget of 10 GiB", c.reasons[0])
               for c in over)
    assert all(c.memory.total <= 10 * GIB for c in ranking if c.usable)


def _refused_lines(message: str) -> dict[tuple[str, int], str]:
    out = {}
    for layout, mbs, reasons in re.findall(r"^  (tp=\d+,pp=\d+,dp=\d+(?:,vpp=\d+)?) mbs=([\d,]+): (.*)$", message, re.M):
        for m in mbs.split(","):
            out[(layout, int(m))] = reasons
    return out


def test_no_legal_layout_lists_every_refused_candidate() -> None:
    """5 processes, 4 heads, global batch 8: nothing is legal, and the error names each candidate and why."""
    with pytest.raises(LayoutError) as e:
        choose_layout(TINY, 5, 4, 8, memory_gb=80)
    msg = str(e.value)
    assert msg.startswith("no usable layout for world size 5 (4 GPUs per node, global batch size 8, 80 GiB per rank)")
    listed = _refused_lines(msg)
    expected = {(str(ParallelLayout(*d)), m) for d in ((1, 1, 5), (1, 5, 1), (5, 1, 1)) for m in (1, 2, 4, 8)}
    assert set(listed) == expected
    for m in (1, 2, 4, 8):
        assert "DP=5 does not divide the global batch size 8" in listed[("tp=1,pp=1,dp=5", m)]
        assert "PP=5 does not divide the 2 layers" in listed[("tp=1,pp=5,dp=1", m)]
        assert "TP=5 does not divide the attention heads (4)" in listed[("tp=5,pp=1,dp=1", m)]
        assert "TP=5 spans more than the 4 GPUs of a node" in listed[("tp=5,pp=1,dp=1", m)]


@pytest.mark.parametrize("kw, expected", [
    ({"world_size": 0}, "world size must be a positive integer"),
    ({"gpus_per_node": 0}, "GPUs per node must be a positive integer"),
    ({"global_batch_size": -8}, "global batch size must be a positive integer"),
    ({"memory_gb": 0}, "memory budget must be positive"),
    ({"micro_batch_sizes": [2, 0]}, "micro-batch sizes must be positive integers"),
    ({"fixed": {"sp": 1}}, "cannot fix ['sp']"),
])
def test_bad_arguments_are_named(kw, expected) -> None:
    args = {"world_size": 4, "gpus_per_node": 4, "global_batch_size": 8, **kw}
    rest = {k: v for k, v in args.items() if k not in ("world_size", "gpus_per_node", "global_batch_size")}
    with pytest.raises(LayoutError, match=re.escape(expected)):
        rank_layouts(TINY, args["world_size"], args["gpus_per_node"], args["global_batch_size"], **rest)


def test_fixed_degrees_keep_the_users_choice() -> None:
    """Explicit flags win: with TP and PP fixed only DP follows the world size (the DP-only baseline)."""
    choice = choose_layout(TINY, 4, 4, 8, fixed={"tp": 2, "pp": 1})
    assert (choice.best.layout.tp, choice.best.layout.pp, choice.best.layout.dp) == (2, 1, 2)
    assert all(c.layout.tp == 2 and c.layout.pp == 1 for c in choice.ranking if c.usable)
    assert any("TP is fixed at 2" in c.reasons for c in choice.refused)


def test_candidate_key_round_trip() -> None:
    key = candidate_key(ParallelLayout(2, 1, 4), 8)
    assert key == "tp=2,pp=1,dp=4,mbs=8"
    assert parse_candidate_key(key) == (ParallelLayout(2, 1, 4), 8)
    for bad in ("tp=2,pp=1,dp=4", "tp=2,pp=1,dp=4,mbs=0", "tp=2,pp=1,dp=4,mbs=x", "tp=a,mbs=1"):
        with pytest.raises(LayoutError):
            parse_candidate_key(bad)


# ---------------------------------------------------------------- properties

@st.composite
def _dims(draw: st.DrawFn) -> GPTDims:
    heads = draw(st.integers(1, 8))
    groups = draw(st.sampled_from([None] + [g for g in range(1, heads + 1) if heads % g == 0]))
    hidden = heads * draw(st.sampled_from([2, 4, 6]))
    return GPTDims(num_layers=draw(st.integers(1, 6)), hidden_size=hidden, num_attention_heads=heads,
                   vocab_size=draw(st.integers(10, 300)), seq_length=draw(st.sampled_from([8, 16, 32])),
                   ffn_hidden_size=draw(st.sampled_from([None, hidden * 3, hidden * 2 + 2])),
                   swiglu=draw(st.booleans()), tied=draw(st.booleans()), bf16=draw(st.booleans()),
                   num_query_groups=groups)


def _satisfies_every_rule(dims: GPTDims, c: LayoutCandidate, world: int, gpn: int, gbs: int) -> bool:
    tp, pp, dp, vpp = c.layout.tp, c.layout.pp, c.layout.dp, c.layout.vpp
    return (tp * pp * dp == world and tp <= gpn and dims.num_attention_heads % tp == 0
            and dims.hidden_size % tp == 0 and dims.ffn % tp == 0
            and (dims.num_query_groups or dims.num_attention_heads) % tp == 0
            and dims.num_layers % (pp * vpp) == 0 and gbs % (dp * c.micro_batch_size) == 0
            and (vpp == 1 or (gbs // (dp * c.micro_batch_size)) % pp == 0))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dims=_dims(), world=st.integers(1, 12), gpn=st.integers(1, 8), gbs=st.integers(1, 32),
       mbs=st.sets(st.integers(1, 8), min_size=1, max_size=4),
       budget=st.sampled_from([None, 0.0001, 0.001, 0.01]), distopt=st.booleans(), data=st.data())
def test_ranking_properties(dims, world, gpn, gbs, mbs, budget, distopt, data) -> None:
    base = rank_layouts(dims, world, gpn, gbs, memory_gb=budget, micro_batch_sizes=sorted(mbs),
                        distributed_optimizer=distopt)
    keys = [c.key for c in base]
    measured = {k: data.draw(st.floats(0.01, 100)) for k in data.draw(st.lists(st.sampled_from(keys), max_size=4))}
    ranking = rank_layouts(dims, world, gpn, gbs, memory_gb=budget, micro_batch_sizes=sorted(mbs),
                           measured=measured, distributed_optimizer=distopt)
    # every (TP, PP, DP) of the world size, at PP > 1 with every interleaving (VPP) that splits a rank's layers
    # into equal chunks, with every micro-batch size, exactly once
    expected = {candidate_key(ParallelLayout(tp, pp, world // (tp * pp), vpp=v), m)
                for tp in range(1, world + 1) for pp in range(1, world + 1) if world % (tp * pp) == 0
                for v in range(1, dims.num_layers + 1)
                if v == 1 or (pp > 1 and dims.num_layers % (pp * v) == 0) for m in mbs}
    assert sorted(c.key for c in ranking) == sorted(expected)
    for c in ranking:
        assert c.legal == _satisfies_every_rule(dims, c, world, gpn, gbs), (c.key, c.reasons)
        assert c.usable == (not c.reasons)
        if c.usable:
            assert budget is None or c.memory.total <= budget * GIB
        if c.legal and not c.fits:
            assert c.memory.total > budget * GIB
        assert c.measured_seconds == measured.get(c.key)
    # usable first: measured by time, then modelled by time; refused after
    usable = [c for c in ranking if c.usable]
    assert ranking[: len(usable)] == tuple(usable)
    timed = [(c.measured_seconds is None, c.seconds) for c in usable]
    assert timed == sorted(timed)
    # choose_layout returns the top of the ranking, or refuses naming every candidate
    if usable:
        choice = choose_layout(dims, world, gpn, gbs, memory_gb=budget, micro_batch_sizes=sorted(mbs),
                               measured=measured, distributed_optimizer=distopt)
        assert choice.best == ranking[0] and choice.ranking == ranking and choice.usable == tuple(usable)
        assert choice.refused == ranking[len(usable):]
    else:
        with pytest.raises(LayoutError) as e:
            choose_layout(dims, world, gpn, gbs, memory_gb=budget, micro_batch_sizes=sorted(mbs),
                          measured=measured, distributed_optimizer=distopt)
        listed = _refused_lines(str(e.value))
        assert set(listed) == {(str(c.layout), c.micro_batch_size) for c in ranking}
        assert all(listed[(str(c.layout), c.micro_batch_size)] == "; ".join(c.reasons) for c in ranking)


def test_activation_formula_is_documented_megatron_form() -> None:
    """A GELU MLP of 4 x hidden: seq x mbs x hidden x (34 + 5 heads seq / hidden) bytes for 16-bit activations,
    divided by TP with sequence parallelism; without it 10 x seq x mbs x hidden stays whole on every TP rank."""
    d = load_model("gpt3-1.3b")
    assert activation_bytes_per_layer(d, 1, 1) == 2048 * 2048 * (34 + 5 * 16 * 2048 / 2048)
    assert activation_bytes_per_layer(d, 4, 2) == 4 * activation_bytes_per_layer(d, 1, 1) / 2
    assert activation_bytes_per_layer(d, 1, 4, sequence_parallel=False) == \
        2048 * 2048 * (10 + (24 + 5 * 16 * 2048 / 2048) / 4)  # Korthikanti et al.'s tensor-parallel form
    assert activation_bytes_per_layer(d, 1, 1, sequence_parallel=False) == activation_bytes_per_layer(d, 1, 1)
    # SwiGLU (TINY: FFN 256 = 4h, FC1 512 wide): 18h + 5as for the rest, 2 x (512 + 256) for the MLP; fp32 doubles
    assert activation_bytes_per_layer(TINY, 1, 1) == 2 * 32 * (18 * 64 + 5 * 4 * 32 + 2 * (512 + 256))


def test_an_interleaved_pipeline_is_chosen_where_its_smaller_bubble_pays() -> None:
    """GPT-3 13B on 16 GPUs with 16 sequences a step: few micro-batches, so the 1F1B bubble is large; the choice
    interleaves (VPP > 1), whose bubble is 1/VPP of the same layout's without it, for VPP times the stage sends and
    more activations in flight."""
    d = load_model("gpt3-13b")
    choice = choose_layout(d, 16, 8, 16, memory_gb=80)
    best = choice.best
    assert best.layout.pp > 1 and best.layout.vpp > 1, best.key
    plain = [c for c in choice.ranking if c.layout == ParallelLayout(best.layout.tp, best.layout.pp, best.layout.dp)
             and c.micro_batch_size == best.micro_batch_size][0]
    assert best.modelled.bubble == pytest.approx(plain.modelled.bubble / best.layout.vpp)
    assert best.modelled.pp_comm == pytest.approx(plain.modelled.pp_comm * best.layout.vpp)
    assert best.memory.activations > plain.memory.activations
    assert best.seconds < plain.seconds


def test_interleaving_needs_micro_batches_a_multiple_of_pp() -> None:
    """megatron-core's interleaved schedule runs micro-batches in groups of PP: 6 micro-batches at PP 4 refused."""
    c = evaluate(GQA, ParallelLayout(1, 2, 1, vpp=2), 1, 8)
    assert c.legal, c.reasons
    odd = evaluate(load_model("gpt3-1.3b"), ParallelLayout(1, 4, 1, vpp=2), 1, 6)
    assert not odd.legal and "needs the 6 micro-batches to be a multiple of PP=4" in "; ".join(odd.reasons)
    uneven = evaluate(GQA, ParallelLayout(1, 2, 1, vpp=3), 1, 8)  # 4 layers cannot be split 2 x 3
    assert not uneven.legal and "PP x VPP = 2 x 3 does not divide the 4 layers" in "; ".join(uneven.reasons)
