"""``--tenplex-layout auto`` for a mixture of experts: EP is chosen among those that divide the experts (and, with
PP and the experts' TP, the world size), the memory model counts each rank's share of the experts (over expert TP
x EP) and of their optimizer state (over expert DP), and a given EP is kept. Pure."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from tenplex_megatron.frontdoor.dims import gpt_dims
from tenplex_megatron.plan.autolayout import (
    GIB,
    active_parameters,
    choose_layout,
    estimate_memory,
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


def test_auto_chooses_ep_when_only_ep_fits() -> None:
    """A budget between the EP 8 and the EP 1 memory at TP 1 x PP 1 x DP 8: the choice has EP > 1."""
    fixed = {"tp": 1, "pp": 1}
    low = estimate_memory(MOE, ParallelLayout(dp=8, ep=8), 1, 32).total
    high = estimate_memory(MOE, ParallelLayout(dp=8), 1, 32).total
    assert low < high
    budget = (low + high) / 2 / GIB
    choice = choose_layout(MOE, 8, 8, 32, memory_gb=budget, micro_batch_sizes=(1,), fixed=fixed)
    assert choice.best.layout.ep > 1
    refused = [c for c in choice.ranking if c.layout.ep == 1 and c.legal]
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
                micro_batch_size=1, use_distributed_optimizer=True, make_vocab_size_divisible_by=128)
    return argparse.Namespace(**{**base, **kw})


def test_megatron_lm_hook_chooses_or_keeps_ep() -> None:
    """The Megatron-LM hook: EP chosen unless --expert-model-parallel-size is given; expert TP refused (not modelled)."""
    from tenplex_megatron.integrations.megatron_lm import layout_request

    assert layout_request(_mlm_args(), [], 8, 8).ep is None
    req = layout_request(_mlm_args(expert_model_parallel_size=4), ["--expert-model-parallel-size", "4"], 8, 8)
    assert req.ep == 4 and choose(req).layout.ep == 4
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size is not modelled"):
        layout_request(_mlm_args(), ["--expert-tensor-parallel-size", "1"], 8, 8)
