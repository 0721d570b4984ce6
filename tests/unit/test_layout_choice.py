"""``--tenplex-layout`` for any trainer (plan/layout_choice.py) and in the Megatron-LM hook, without Megatron-LM:
the request from Megatron-LM's parsed flags, flags on the command line fixing a degree, measured times
winning over the model, the few candidates ``measure`` times, and the refusal of an impossible world size."""

from __future__ import annotations

import argparse
import json

import pytest

from tenplex_megatron.frontdoor.megatron_lm import choose_layout_for_args, layout_request
from tenplex_megatron.plan.autolayout import candidate_key
from tenplex_megatron.plan.layout import LayoutError, ParallelLayout
from tenplex_megatron.plan.layout_choice import LayoutRequest, choose, rank, to_measure
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims, gpt_tensors
from tenplex_megatron.training.layout_choice import request as trainer_request
from tenplex_megatron.training.pretrain import parse_args

TINY = GPTDims(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=96, seq_length=32, bf16=False)


def _megatron_args(**kw: object) -> argparse.Namespace:
    """What Megatron-LM's parse_args leaves for the attributes the hook reads (its own defaults)."""
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=None,
                group_query_attention=False, ffn_hidden_size=256, seq_length=32, vocab_size=96, swiglu=False,
                untie_embeddings_and_output_weights=False, bf16=False, global_batch_size=8, micro_batch_size=None,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                expert_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                use_distributed_optimizer=True, make_vocab_size_divisible_by=16, tenplex_layout="auto",
                tenplex_memory_budget=None, rank=0)
    base.update(kw)
    return argparse.Namespace(**base)


def test_megatron_lm_flags_become_the_same_request_and_choice_as_the_reference_trainer() -> None:
    args = _megatron_args()
    req = layout_request(args, [], 4, 4)
    assert req.dims.num_layers == 2 and req.dims.num_attention_heads == 4 and req.global_batch_size == 8
    assert req.tp is None and req.pp is None and req.micro_batch_size is None  # defaults do not fix anything
    want = choose(LayoutRequest("auto", req.dims, 4, 4, 8, distributed_optimizer=True,
                                make_vocab_size_divisible_by=16))
    assert choose(req) == want and want.layout.world_size == 4


def test_a_degree_given_on_the_command_line_wins(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    args = _megatron_args(tensor_model_parallel_size=2)
    chosen = choose_layout_for_args(args, ["--tensor-model-parallel-size", "2", "--tenplex-layout", "auto"])
    assert chosen is not None and chosen.layout.tp == 2 and args.tensor_model_parallel_size == 2
    assert args.pipeline_model_parallel_size == chosen.layout.pp and args.micro_batch_size == chosen.micro_batch_size
    args = _megatron_args(micro_batch_size=1)
    assert choose_layout_for_args(args, ["--micro-batch-size=1"]).micro_batch_size == 1
    assert choose_layout_for_args(_megatron_args(tenplex_layout=None), []) is None  # no flag: nothing changes


def test_a_table_in_the_hook_gives_its_row(tmp_path, monkeypatch, capsys) -> None:
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"version": 1, "layouts": {"2": {"tp": 1, "pp": 2, "dp": 1, "micro_batch_size": 4}}}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = _megatron_args(tenplex_layout=str(table))
    chosen = choose_layout_for_args(args, [])
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.micro_batch_size) == (1, 2, 4)
    assert chosen.why == f"from {table}"
    capsys.readouterr()
    monkeypatch.setenv("RANK", "0")  # the hook logs its choice once, with the logger's one prefix, on rank 0
    choose_layout_for_args(_megatron_args(tenplex_layout=str(table)), [])
    monkeypatch.setenv("RANK", "1")
    choose_layout_for_args(_megatron_args(tenplex_layout=str(table)), [])
    out = capsys.readouterr().out
    assert out.count(f"> tenplex: --tenplex-layout {table}: tp=1,pp=2,dp=1, micro-batch 4 (from {table})\n") == 1


def test_no_legal_layout_in_the_hook_lists_every_refused_candidate(monkeypatch, capsys) -> None:
    for var in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    args = _megatron_args()
    with pytest.raises(SystemExit) as e:
        choose_layout_for_args(args, [])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--tenplex-layout auto at world size 3" in err and "TP=3 does not divide the attention heads (4)" in err
    assert "tp=1,pp=1,dp=3" in err and "does not divide the global batch size 8" in err
    assert args.tensor_model_parallel_size == 1  # nothing was changed


@pytest.mark.parametrize("kw,flag", [({"context_parallel_size": 2}, "--context-parallel-size"),
                                     ({"global_batch_size": None}, "--global-batch-size")])
def test_what_the_choice_does_not_model_is_refused_naming_the_flag(kw: dict, flag: str) -> None:
    with pytest.raises(LayoutError, match=flag):
        layout_request(_megatron_args(**kw), [], 2, 2)


def test_measured_times_win_over_the_model_and_only_unmeasured_top_candidates_are_timed() -> None:
    req = LayoutRequest("measure", TINY, 2, 2, 8)
    choice = rank(req)
    top3 = to_measure(choice, {}, 3)
    assert len(top3) == 3 and [c.key for c in top3] == [c.key for c in choice.usable[:3]]
    slowest_modelled = top3[-1]
    measured = {top3[0].key: 0.5, top3[1].key: 0.4, slowest_modelled.key: 0.1}
    chosen = choose(req, measured)
    assert candidate_key(chosen.layout, chosen.micro_batch_size) == slowest_modelled.key
    assert "measured 0.1 s/iteration" in chosen.why
    assert to_measure(rank(req, measured), measured, 3) == ()  # all measured: no trial on a second start
    assert choose(LayoutRequest("auto", TINY, 2, 2, 8, tp=2)).layout == ParallelLayout(2, 1, 1)


LLAMA_FLAGS = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope",
               "--untie-embeddings-and-output-weights"]


def test_a_llama_style_model_is_sized_the_same_behind_either_door() -> None:
    """The hook once built the dims without biases, norm and position embedding: a Llama-style model under
    Megatron-LM was sized as a GPT-style one. Both doors now read them with one function (frontdoor/dims.py)."""
    trainer = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                          "--seq-length", "32", "--vocab-size", "96", "--ffn-hidden-size", "256",
                          "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tenplex", "--tenplex-layout",
                          "auto", *LLAMA_FLAGS])
    hook = _megatron_args(swiglu=True, normalization="RMSNorm", add_bias_linear=False,
                          position_embedding_type="rope", untie_embeddings_and_output_weights=True)
    dims = layout_request(hook, [], 4, 4).dims
    assert dims == trainer_request(trainer, 4, 4).dims
    assert (dims.add_bias_linear, dims.normalization, dims.position_embedding_type) == (False, "RMSNorm", "rope")
    gpt_style = layout_request(_megatron_args(swiglu=True, untie_embeddings_and_output_weights=True), [], 4, 4).dims
    names = set(gpt_tensors(dims, 96))
    assert names < set(gpt_tensors(gpt_style, 96))  # no bias, norm bias or position table: fewer tensors


GPT3_13B_FLAGS = ["--num-layers", "40", "--hidden-size", "5120", "--num-attention-heads", "40", "--seq-length", "2048",
                  "--vocab-size", "50257", "--global-batch-size", "16", "--bf16"]


def test_auto_interleaves_the_pipeline_behind_either_door(monkeypatch) -> None:
    """Where the model's choice is an interleaved pipeline (GPT-3 13B, 16 GPUs, 16 sequences a step), the trainer
    runs it (--num-virtual-stages-per-pipeline-rank as if given) and the hook hands it to Megatron-LM's
    validate_args the same way; a given interleaving flag is refused under --tenplex-layout, not ignored."""
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = parse_args([*GPT3_13B_FLAGS, "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tenplex",
                       "--tenplex-layout", "auto", "--tenplex-memory-budget", "80"])
    vpp = args.virtual_pipeline_model_parallel_size
    assert vpp > 1 and args.num_virtual_stages_per_pipeline_rank == vpp
    assert args.num_layers % (args.pipeline_model_parallel_size * vpp) == 0
    hook = _megatron_args(num_layers=40, hidden_size=5120, num_attention_heads=40, ffn_hidden_size=None,
                          seq_length=2048, vocab_size=50257, global_batch_size=16, bf16=True,
                          num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None,
                          tenplex_memory_budget=80, use_distributed_optimizer=args.use_distributed_optimizer,
                          make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    choose_layout_for_args(hook, [])
    assert (hook.tensor_model_parallel_size, hook.pipeline_model_parallel_size, hook.micro_batch_size) == \
        (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.micro_batch_size)
    assert hook.num_virtual_stages_per_pipeline_rank == vpp
    with pytest.raises(SystemExit):
        parse_args([*GPT3_13B_FLAGS, "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tenplex",
                    "--tenplex-layout", "auto", "--num-virtual-stages-per-pipeline-rank", "2"])
    with pytest.raises(LayoutError, match="--num-virtual-stages-per-pipeline-rank is not modelled"):
        layout_request(_megatron_args(num_virtual_stages_per_pipeline_rank=2), [], 2, 2)


def test_auto_keeps_to_the_batch_sizes_of_a_ramp_still_to_come(monkeypatch) -> None:
    """--rampup-batch-size 2 2 64 to a global batch of 8 on 4 ranks: every global batch still to come (2, 4, 6, 8)
    splits into micro-batch x DP at the chosen layout, though without the ramp auto chooses one that does not; with
    the micro-batch size and TP fixed so that nothing fits, the refusal names the batch size."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    plain = choose_layout_for_args(_megatron_args(), [])
    assert 2 % (plain.micro_batch_size * plain.layout.dp), plain  # the final batch's choice misfits the ramp
    ramp = dict(rampup_batch_size=["2", "2", "64"], train_samples=200, seq_length=32)
    chosen = choose_layout_for_args(_megatron_args(**ramp), [])
    assert all(b % (chosen.micro_batch_size * chosen.layout.dp) == 0 for b in (2, 4, 6, 8)), chosen
    args = _megatron_args(**ramp, micro_batch_size=2)
    req = layout_request(args, ["--micro-batch-size", "2", "--tensor-model-parallel-size", "1",
                                "--pipeline-model-parallel-size", "1"], 4, 4)
    assert req.batch_sizes == (2, 4, 6, 8)
    with pytest.raises(LayoutError, match="the global batch of 2 still to come is not divisible by micro-batch x DP "
                                          "= 2 x 4"):
        choose(req)
