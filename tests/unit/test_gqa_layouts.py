"""Grouped-query attention in the pure layout rules (no torch): TP must divide the query groups, in
``ParallelLayout.check_fits`` (the trainer, ``plan``), the layout chooser and ``layouts``; model records name them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tenplex_megatron.plan.autolayout import choose_layout, rank_layouts
from tenplex_megatron.plan.layout import LayoutError, ModelShape, ParallelLayout
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims, gpt_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = GPTDims(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, vocab_size=128, seq_length=32,
                swiglu=True, tied=False, bf16=False, add_bias_linear=False, normalization="RMSNorm",
                position_embedding_type="rope")
#: the reference trainer's record (GPTSpec.to_json) of that model, abridged to the fields a reader uses
TRAINER_RECORD = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "vocab_size": 128, "seq_length": 32,
                  "ffn_hidden_size": None, "swiglu": True, "untie_embeddings_and_output_weights": True, "bf16": False,
                  "make_vocab_size_divisible_by": 16, "position_embedding_type": "rope", "rotary_base": 10000,
                  "rotary_percent": 1.0, "normalization": "RMSNorm", "norm_epsilon": 1e-5, "add_bias_linear": False,
                  "group_query_attention": True, "num_query_groups": 2}


@pytest.mark.parametrize("tp, ok", [(1, True), (2, True), (4, False), (8, False)])
def test_check_fits_needs_tp_to_divide_the_query_groups(tp: int, ok: bool) -> None:
    shape = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=128, num_query_groups=2)
    if ok:
        ParallelLayout(tp, 1, 1).check_fits(shape)
        return
    with pytest.raises(LayoutError, match=rf"TP={tp} does not divide the number of query groups \(--num-query-groups 2\)"):
        ParallelLayout(tp, 1, 1).check_fits(shape)
    ParallelLayout(tp, 1, 1).check_fits(ModelShape(2, 64, 8, 128))  # the same heads without GQA: legal


def test_model_records_name_the_query_groups() -> None:
    assert GPTDims.from_record(TRAINER_RECORD) == LLAMA
    assert ModelShape.from_record(TRAINER_RECORD) == ModelShape(2, 64, 8, 128, 16, num_query_groups=2)
    assert LLAMA.shape(16) == ModelShape.from_record(TRAINER_RECORD)
    # Megatron-LM's defaults (what its hook records without --group-query-attention): one group per head
    hook = {**TRAINER_RECORD, "group_query_attention": False, "num_query_groups": 1}
    assert GPTDims.from_record(hook).num_query_groups is None
    assert ModelShape.from_record(hook).num_query_groups is None
    # a record written before the Llama-style fields existed is a GPT: learned positions, LayerNorm, biases
    old = {k: v for k, v in TRAINER_RECORD.items()
           if k not in ("position_embedding_type", "rotary_base", "rotary_percent", "normalization", "norm_epsilon",
                        "add_bias_linear", "group_query_attention", "num_query_groups")}
    dims = GPTDims.from_record(old)
    assert (dims.num_query_groups, dims.add_bias_linear, dims.normalization, dims.position_embedding_type) == \
        (None, True, "LayerNorm", "learned_absolute")
    keys = set(gpt_tensors(dims, 128, optimizer=False))
    assert "embedding.position_embeddings.weight" in keys and "decoder.layers.linear_qkv.bias" not in keys
    assert "decoder.layers.self_attention.linear_qkv.bias" in keys


def test_llama_tensor_table_has_grouped_qkv_and_no_bias_or_position_table() -> None:
    tensors = gpt_tensors(LLAMA, 128, optimizer=False)
    assert tensors["decoder.layers.self_attention.linear_qkv.weight"].global_shape == (2, 64 + 2 * 2 * 8, 64)
    assert not [k for k in tensors if k.endswith("bias") or "position_embeddings" in k]
    assert "output_layer.weight" in tensors


def test_chooser_refuses_tp_beyond_the_query_groups() -> None:
    ranking = rank_layouts(LLAMA, 8, 8, 16)
    for c in ranking:
        if c.layout.tp > 2:
            assert not c.usable and f"TP={c.layout.tp} does not divide the query groups (2)" in c.reasons, c
    assert {c.layout.tp for c in ranking if c.usable} == {1, 2}
    assert choose_layout(LLAMA, 8, 8, 16).best.layout.tp in (1, 2)
    with pytest.raises(LayoutError, match=r"TP=4 does not divide the query groups \(2\)"):
        choose_layout(LLAMA, 8, 8, 16, fixed={"tp": 4})


def test_layouts_cli_honours_query_groups() -> None:
    """llama3-8b has 32 heads in 8 key/value groups: TP 16 divides the heads but not the groups."""
    p = subprocess.run([sys.executable, "-m", "tenplex_megatron", "layouts", "--model", "llama3-8b", "--gpus", "16",
                        "--gpus-per-node", "16", "--memory-gb", "1000"], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "tp=16,pp=1,dp=1 mbs=1,2,4,8: TP=16 does not divide the query groups (8)" in p.stdout
    assert "tp=8,pp=" in p.stdout
