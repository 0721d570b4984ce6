"""The reference trainer's Llama-style flags (Megatron-LM's names): parsing, the errors naming the flag, the
recorded model spec, and ``--tenplex-layout auto`` honouring ``--num-query-groups``. In-process, no torchrun."""

from __future__ import annotations

import pytest

from tenplex_megatron.training.gpt import GPTSpec
from tenplex_megatron.training.pretrain import parse_args, spec_from_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "2", "--mock-data",
        "--vocab-size", "128"]
LLAMA = ["--swiglu", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--rotary-base",
         "500000", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--disable-bias-linear",
         "--group-query-attention", "--num-query-groups", "2"]


def test_llama_flags_reach_the_model_spec_and_its_record() -> None:
    spec = spec_from_args(parse_args([*BASE, *LLAMA, "--tensor-model-parallel-size", "2"]))
    assert (spec.position_embedding_type, spec.rotary_base, spec.rotary_percent, spec.normalization, spec.norm_epsilon,
            spec.add_bias_linear, spec.group_query_attention, spec.num_query_groups, spec.query_groups) == \
        ("rope", 500000, 1.0, "RMSNorm", 1e-6, False, True, 2, 2)
    assert spec.shape().num_query_groups == 2
    assert GPTSpec.from_json(spec.to_json()) == spec
    gpt = spec_from_args(parse_args(BASE))  # Megatron-LM's defaults: a GPT
    assert (gpt.position_embedding_type, gpt.normalization, gpt.add_bias_linear, gpt.query_groups) == \
        ("learned_absolute", "LayerNorm", True, None)


def test_record_written_before_the_llama_fields_loads_as_a_gpt() -> None:
    old = {k: v for k, v in GPTSpec().to_json().items()
           if k not in ("position_embedding_type", "rotary_base", "rotary_percent", "normalization", "norm_epsilon",
                        "add_bias_linear", "group_query_attention", "num_query_groups")}
    assert GPTSpec.from_json(old) == GPTSpec()


@pytest.mark.parametrize("flags, message", [
    (["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"],
     "--tensor-model-parallel-size 4 does not divide --num-query-groups 2"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups 3 does not divide --num-attention-heads 8"),
    (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups 0 must be >= 1"),
    (["--num-query-groups", "2"], "--num-query-groups needs --group-query-attention"),
    (["--rotary-base", "500000"], "--rotary-base needs --position-embedding-type rope"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0"], "--rotary-percent 0.0 must be in (0, 1]"),
    (["--normalization", "RMSNorm", "--norm-epsilon", "0"], "--norm-epsilon 0.0 must be > 0"),
    (["--normalization", "L2Norm"], "--normalization: invalid choice: 'L2Norm'"),
    (["--position-embedding-type", "mrope"], "--position-embedding-type: invalid choice: 'mrope'"),
])
def test_bad_llama_flags_are_named(flags: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args([*BASE, *flags])
    assert message in capsys.readouterr().err


def test_layout_auto_honours_query_groups(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    gqa = ["--group-query-attention", "--num-query-groups", "2", "--tenplex-layout", "auto"]
    i = BASE.index("--micro-batch-size")
    args = parse_args([*BASE[:i], *BASE[i + 2:], *gqa])  # the chooser picks the micro-batch size too
    assert args.tensor_model_parallel_size in (1, 2)
    with pytest.raises(SystemExit):
        parse_args([*BASE, *gqa, "--tensor-model-parallel-size", "4"])
    assert "TP=4 does not divide the query groups (2)" in capsys.readouterr().err
