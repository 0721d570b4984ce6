"""``--tenplex-layout auto`` for a mixture of experts: EP and expert TP are chosen among megatron-core's legal ones
(EP divides the experts, expert TP the experts' FFN hidden size, expert TP x EP x PP the world size; expert TP
need not be TP), the memory model counts each rank's share of the experts (over expert TP x EP) and of their
optimizer state (over expert DP), the time model EP's all-to-all and expert TP's all-gathers and reduce-scatters of
the routed tokens, and a given EP or expert TP is kept. Pure."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from tenplex_megatron.frontdoor.dims import gpt_dims
from tenplex_megatron.plan import autolayout
from tenplex_megatron.plan.autolayout import (
    GIB,
    active_parameters,
    choose_layout,
    estimate_memory,
    evaluate,
    rank_layouts,
    stage_parameters,
    total_parameters,
)
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.layout_choice import LayoutRequest, choose
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims, load_model

MOE = GPTDims(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=1000, seq_length=128, swiglu=True,
              tied=False, add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope",
              num_experts=8, moe_ffn_hidden_size=512, moe_router_topk=2, bf16=True)


def test_ep_candidates_divide_experts_and_world() -> None:
    ranking = rank_layouts(MOE, 8, 8, 32, micro_batch_sizes=(1,))
    eps = {c.layout.ep for c in ranking if c.usable}
    assert eps == {1, 2, 4, 8}
    for c in ranking:
        lay = c.layout
        assert MOE.num_experts % lay.ep == 0 and 8 % (lay.expert_tp * lay.ep * lay.pp) == 0
        assert MOE.expert_ffn % lay.expert_tp == 0


def test_expert_tp_candidates_are_megatron_cores_legal_ones() -> None:
    """Every (EP, expert TP) with EP | experts, expert TP | the experts' FFN width and expert TP x EP x PP | world, at
    every TP (expert TP differs from TP in both directions); none other."""
    ranking = rank_layouts(MOE, 8, 8, 32, micro_batch_sizes=(1,))
    got = {(c.layout.tp, c.layout.pp, c.layout.ep, c.layout.expert_tp) for c in ranking}
    want = {(tp, pp, ep, etp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if 8 % (tp * pp) == 0
            for ep in (1, 2, 4, 8) for etp in (1, 2, 4, 8) if 8 % (etp * ep * pp) == 0}
    assert got == want
    assert {(1, 4)} <= {(c.layout.tp, c.layout.expert_tp) for c in ranking if c.usable}  # expert TP above TP
    assert {(4, 1)} <= {(c.layout.tp, c.layout.expert_tp) for c in ranking if c.usable}  # and below
    # an FFN width of 6: expert TP 1 or 2 only, whatever the world allows
    odd = replace(MOE, moe_ffn_hidden_size=6)
    assert {c.layout.expert_tp for c in rank_layouts(odd, 8, 8, 32, micro_batch_sizes=(1,))} == {1, 2}


@pytest.mark.parametrize("layout, kw, reason", [
    (ParallelLayout(1, 1, 8, etp=4), {"gpus_per_node": 2}, "expert TP=4 spans more than the 2 GPUs of a node"),
    (ParallelLayout(1, 1, 8, etp=8), {}, "expert TP=8 does not divide the experts' FFN hidden size (4)"),
    (ParallelLayout(2, 1, 4, ep=2), {"sequence_parallel": False},
     "TP=2 with a mixture of experts needs --sequence-parallel (megatron-core refuses to train without it)"),
])
def test_expert_layout_rules_refuse_with_their_reason(layout: ParallelLayout, kw: dict, reason: str) -> None:
    dims = replace(MOE, moe_ffn_hidden_size=4) if "FFN" in reason else MOE
    c = evaluate(dims, layout, 1, 32, **kw)
    assert not c.legal and reason in c.reasons, c.reasons


def test_experts_with_biases_need_expert_tp_1_and_ep_above_1() -> None:
    """megatron-core adds experts' biases only at expert TP 1 (TransformerConfig), and its expert MLP fails with
    them at EP 1 x expert TP 1: with --add-bias-linear only expert TP 1 x EP > 1 is usable."""
    biased = replace(MOE, add_bias_linear=True)
    usable = {(c.layout.ep, c.layout.expert_tp) for c in rank_layouts(biased, 8, 8, 32, micro_batch_sizes=(1,))
              if c.usable}
    assert usable == {(2, 1), (4, 1), (8, 1)}
    assert "expert TP=2 with linear biases" in " ".join(evaluate(biased, ParallelLayout(2, 1, 4, ep=2), 1, 32).reasons)
    assert "EP=1 x expert TP=1 with linear biases" in " ".join(evaluate(biased, ParallelLayout(dp=8), 1, 32).reasons)


def test_auto_keeps_the_experts_whole_at_a_tp_that_attention_gets() -> None:
    """TP 2 fixed (the user's --tensor-model-parallel-size): the choice cuts the experts by EP, not by TP's 2. The
    reason is the model's: for the same experts per rank (expert TP x EP = 2), expert TP 2 all-gathers and
    reduce-scatters every routed token over its group (4 x (2 - 1) R) where EP 2 sends half of them (4 x R x 1/2),
    so expert TP 1 x EP 2 is modelled faster by exactly that difference; and expert TP keeps the gathered tokens
    (2 x hidden per routed copy on each of its ranks), EP not."""
    choice = choose_layout(MOE, 8, 8, 32, micro_batch_sizes=(1,), fixed={"tp": 2, "pp": 1})
    best = choice.best
    assert best.layout.tp == 2 and best.layout.expert_tp == 1 and best.layout.ep > 1
    by_layout = {c.layout: c for c in choice.ranking}
    cut = by_layout[replace(best.layout, ep=best.layout.ep // 2, etp=2)]  # expert TP = TP, same experts per rank
    assert cut.usable and cut.layout.expert_dp == best.layout.expert_dp
    assert replace(cut.memory, activations=0) == replace(best.memory, activations=0)
    h, k, tokens = MOE.hidden_size, MOE.moe_router_topk, MOE.seq_length // 2  # per rank: 1/TP of the sequence
    assert cut.memory.activations - best.memory.activations == MOE.num_layers * tokens * k * 2 * h * (2 - 1)
    assert best.modelled.etp_comm == 0 and cut.modelled.etp_comm > 0
    assert cut.modelled.total - best.modelled.total == pytest.approx(
        cut.modelled.etp_comm + cut.modelled.ep_comm - best.modelled.ep_comm)
    assert cut.modelled.etp_comm > best.modelled.ep_comm - cut.modelled.ep_comm
    # the old choice (expert TP = TP) ranks below
    assert choice.ranking.index(cut) > choice.ranking.index(best)


def test_auto_chooses_expert_tp_above_tp_when_ep_runs_out_of_experts() -> None:
    """Two large experts at TP 1 (fixed): EP divides their memory by at most 2, so under a budget only expert TP x
    EP = 8 meets, expert TP 4 x EP 2 is chosen (expert TP > TP); every candidate with fewer expert shards is refused
    for memory, naming the budget."""
    big = replace(MOE, num_experts=2, moe_ffn_hidden_size=8192)
    fixed = {"tp": 1, "pp": 1}
    need = {(etp, ep): estimate_memory(big, ParallelLayout(dp=8, ep=ep, etp=etp), 1, 32).total
            for etp in (1, 2, 4, 8) for ep in (1, 2) if etp * ep <= 8}
    budget = (max(v for (etp, ep), v in need.items() if etp * ep == 8) +
              min(v for (etp, ep), v in need.items() if etp * ep == 4)) / 2 / GIB
    choice = choose_layout(big, 8, 8, 32, memory_gb=budget, micro_batch_sizes=(1,), fixed=fixed)
    assert (choice.best.layout.tp, choice.best.layout.expert_tp, choice.best.layout.ep) == (1, 4, 2)
    for c in choice.ranking:
        if c.legal and c.layout.expert_tp * c.layout.ep < 8:
            assert not c.fits and f"over the budget of {budget:g} GiB" in c.reasons[-1]


def test_deepseek_v3_like_at_1024_gpus_ranks_every_expert_layout() -> None:
    """Every TP, PP, VPP, EP and expert TP of 1,024 GPUs for a 256-expert model, with 4 micro-batch sizes: tens of
    thousands of candidates, expert TP among the usable, the first usable (its CPU time is measured by
    ``python -m benchmarks.planning --autolayout``, not here)."""
    ranking = rank_layouts(load_model("deepseek-v3-like"), 1024, 8, 4096)
    assert len(ranking) > 20000 and any(c.usable and c.layout.etp for c in ranking)
    assert ranking[0].usable


def test_dense_model_has_no_ep_candidates() -> None:
    dense = replace(MOE, num_experts=None)
    assert {c.layout.ep for c in rank_layouts(dense, 8, 8, 32, micro_batch_sizes=(1,))} == {1}


def test_memory_counts_each_ranks_experts() -> None:
    """EP divides the experts' weights, gradients and (over expert DP) their optimizer state; the rest is unchanged."""
    one, four = ParallelLayout(dp=8), ParallelLayout(dp=8, ep=4)
    e1 = stage_parameters(MOE, one, experts=True)
    e4 = stage_parameters(MOE, four, experts=True)
    assert e4 == [n // 4 for n in e1] and e1[0] > 0
    assert stage_parameters(MOE, one, experts=False) == stage_parameters(MOE, four, experts=False)
    m1, m4 = estimate_memory(MOE, one, 1, 32), estimate_memory(MOE, four, 1, 32)
    assert m1.weights - m4.weights == 2 * (e1[0] - e4[0])  # bf16 weights
    assert m1.gradients - m4.gradients == 4 * (e1[0] - e4[0])
    # expert DP is 8 at EP 1 and 2 at EP 4: each rank keeps 12 bytes x (its experts / expert DP) of optimizer state
    assert m4.optimizer - m1.optimizer == pytest.approx(12 * (e4[0] / four.expert_dp - e1[0] / one.expert_dp), abs=2)
    assert m1.activations == m4.activations


def test_moe_activations_count_the_routed_copies() -> None:
    """MOE (hidden 256, 8 heads, seq 128, bf16, SwiGLU, 8 experts of FFN 512, top-2), per token: 10h + 8h + 5as for
    the rest of the layer, 8 x 8 bytes of fp32 router logits and probabilities, and per routed copy the experts'
    input 2h (times expert TP), FC1 2 x 1024, the activation 2 x 512 and the weighted output 2h; all over TP."""
    h, rest = 256, 18 * 256 + 5 * 8 * 128
    copy = 2 * h + 2 * 1024 + 2 * 512 + 2 * h
    assert autolayout.activation_bytes_per_layer(MOE, 1, 1) == 128 * (rest + 64 + 2 * copy)
    assert autolayout.activation_bytes_per_layer(MOE, 2, 2) == 2 * 128 * (rest + 64 + 2 * copy) / 2
    # expert TP 2: each rank gets every copy of its expert TP group's tokens, with half of each expert's FFN
    assert autolayout.activation_bytes_per_layer(MOE, 1, 1, expert_tp=2) == 128 * (rest + 64 + 2 * (copy + 2 * h))
    # top-k and a shared expert (FFN 384) add theirs; the routed experts' count past the dense MLP they replace
    top4 = replace(MOE, moe_router_topk=4, moe_shared_expert_intermediate_size=384)
    assert autolayout.activation_bytes_per_layer(top4, 1, 1) == 128 * (rest + 64 + 4 * copy + 2 * 768 + 2 * 384)
    dense = replace(MOE, num_experts=None)
    assert autolayout.activation_bytes_per_layer(MOE, 1, 1) > autolayout.activation_bytes_per_layer(dense, 1, 1)
    # estimate_memory uses the layout's expert TP (at TP 2: expert TP 2 unless set to 1)
    etp1, etp2 = ParallelLayout(tp=2, dp=4, etp=1), ParallelLayout(tp=2, dp=4)
    assert estimate_memory(MOE, etp2, 1, 32).activations > estimate_memory(MOE, etp1, 1, 32).activations


def test_auto_chooses_ep_when_only_ep_fits() -> None:
    """A budget between the EP 8 and the EP 1 memory at TP 1 x PP 1 x DP 8: the choice has EP > 1 (expert TP would
    divide the experts too, at a higher modelled cost)."""
    fixed = {"tp": 1, "pp": 1}
    low = estimate_memory(MOE, ParallelLayout(dp=8, ep=8), 1, 32).total
    high = estimate_memory(MOE, ParallelLayout(dp=8), 1, 32).total
    assert low < high
    budget = (low + high) / 2 / GIB
    choice = choose_layout(MOE, 8, 8, 32, memory_gb=budget, micro_batch_sizes=(1,), fixed=fixed)
    assert choice.best.layout.ep > 1
    refused = [c for c in choice.ranking if c.layout.ep == 1 and c.layout.expert_tp == 1 and c.legal]
    assert refused and all(not c.fits for c in refused)


def test_given_ep_is_kept() -> None:
    req = LayoutRequest("auto", MOE, 8, 8, 32, tp=1, pp=1, ep=2)
    assert choose(req).layout.ep == 2


def test_active_parameters_count_top_k_experts() -> None:
    d = load_model("mixtral-8x7b")
    expert = sum(stage_parameters(d, ParallelLayout(), experts=True))
    assert active_parameters(d) == total_parameters(d) - expert + expert * d.moe_router_topk // d.num_experts


def test_gpt_dims_reads_moe_flags() -> None:
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=96, seq_length=32,
                              ffn_hidden_size=None, swiglu=True, num_query_groups=1, num_experts=4,
                              moe_ffn_hidden_size=48, moe_router_topk=2, moe_shared_expert_intermediate_size=None,
                              moe_router_enable_expert_bias=True)
    d = gpt_dims(args)
    assert (d.num_experts, d.expert_ffn, d.moe_router_topk, d.moe_router_enable_expert_bias) == (4, 48, 2, True)
    assert d.shape().num_experts == 4


def _mlm_args(**kw: object) -> argparse.Namespace:
    base = dict(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=1000, seq_length=128,
                ffn_hidden_size=None, swiglu=True, num_query_groups=1, num_experts=8, moe_ffn_hidden_size=512,
                moe_router_topk=2, global_batch_size=32, tenplex_layout="auto", tenplex_memory_budget=None,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                micro_batch_size=1, use_distributed_optimizer=True, make_vocab_size_divisible_by=128,
                add_bias_linear=False)
    return argparse.Namespace(**{**base, **kw})


def test_megatron_lm_hook_chooses_or_keeps_ep() -> None:
    """The Megatron-LM hook: EP and expert TP chosen unless --expert-model-parallel-size /
    --expert-tensor-parallel-size is given; without --sequence-parallel a mixture of experts stays at TP 1."""
    from tenplex_megatron.frontdoor.megatron_lm import layout_request

    req = layout_request(_mlm_args(), [], 8, 8)
    assert req.ep is None and req.expert_tp is None and not req.sequence_parallel
    assert choose(req).layout.tp == 1
    req = layout_request(_mlm_args(expert_model_parallel_size=4), ["--expert-model-parallel-size", "4"], 8, 8)
    assert req.ep == 4 and choose(req).layout.ep == 4
    req = layout_request(_mlm_args(expert_tensor_parallel_size=2), ["--expert-tensor-parallel-size", "2"], 8, 8)
    assert req.expert_tp == 2 and choose(req).layout.expert_tp == 2


def test_megatron_lm_hook_applies_the_chosen_expert_tp(monkeypatch, capsys) -> None:
    """--tenplex-layout auto under Megatron-LM with TP 2 and --sequence-parallel: Megatron-LM's args get the chosen
    expert TP (1: validate_args would otherwise set TP's 2) and EP, and the log line spells the expert layout."""
    from tenplex_megatron.frontdoor.megatron_lm import choose_layout_for_args

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    args = _mlm_args(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=None)
    chosen = choose_layout_for_args(args, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert chosen is not None and chosen.layout.tp == 2 and chosen.layout.expert_tp == 1
    assert (args.tensor_model_parallel_size, args.expert_tensor_parallel_size, args.expert_model_parallel_size) == \
        (2, 1, chosen.layout.ep)
    out = capsys.readouterr().out
    assert f"expert TP 1 x EP {chosen.layout.ep} x expert DP {chosen.layout.expert_dp}" in out, out
    assert f"tp=2,pp={chosen.layout.pp},dp={chosen.layout.dp},sp," in out, out  # SP, as the trainer prints it


def test_trainer_applies_the_chosen_expert_tp(monkeypatch) -> None:
    """The reference trainer's flags with --tenplex-layout auto: the chosen expert TP lands in
    --expert-tensor-parallel-size (the layout the job then builds, training/pretrain.layout_from_args, reads it); a
    given one is kept."""
    from tenplex_megatron.training.pretrain import parse_args

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    flags = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
             "--vocab-size", "1000", "--swiglu", "--disable-bias-linear", "--num-experts", "8",
             "--moe-ffn-hidden-size", "512", "--moe-router-topk", "2", "--global-batch-size", "32", "--bf16",
             "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tenplex",
             "--use-distributed-optimizer", "--tenplex-layout", "auto", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "1", "--sequence-parallel"]
    args = parse_args(flags)
    req = args.tenplex_layout_request
    assert (req.dims.num_experts, req.dims.expert_ffn, req.tp, req.expert_tp, req.sequence_parallel) == \
        (8, 512, 2, None, True)
    want = choose(req).layout
    assert (args.tensor_model_parallel_size, args.expert_tensor_parallel_size, args.expert_model_parallel_size) == \
        (2, want.expert_tp, want.ep) and want.expert_tp == 1
    args = parse_args([*flags, "--expert-tensor-parallel-size", "2"])
    assert args.expert_tensor_parallel_size == 2 and args.expert_model_parallel_size * 2 <= 8
