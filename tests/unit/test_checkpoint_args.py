"""--use-checkpoint-args under --tenplex: Megatron-LM's copying rules over a tenplex checkpoint's record, the
contradictions with flags given explicitly, and the hook's reader over a metadata.json on disk."""

from __future__ import annotations

import argparse
import json

import pytest

from tenplex_megatron.plan import checkpoint_args as table
from tenplex_megatron.storage import directory

SAVED = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64, "ffn_hidden_size": 256,
         "swiglu": False, "position_embedding_type": "rope", "hidden_dropout": 0.0, "num_experts": None,
         "moe_token_dispatcher_type": "alltoall", "tokenizer_type": "GPT2BPETokenizer", "padded_vocab_size": 128,
         "tensor_model_parallel_size": 2}


def _parsed(**over: object) -> dict:
    """Megatron-LM's parsed flags before validate_args: the model flags None where not given, its defaults else."""
    args = {"num_layers": None, "hidden_size": None, "num_attention_heads": None, "seq_length": None,
            "ffn_hidden_size": None, "swiglu": False, "position_embedding_type": "learned_absolute",
            "hidden_dropout": 0.1, "num_experts": None, "moe_ffn_hidden_size": None,
            "moe_token_dispatcher_type": "allgather", "tokenizer_type": "NullTokenizer", "padded_vocab_size": None,
            "tensor_model_parallel_size": 1, "ckpt_format": "torch_dist"}
    return {**args, **over}


def test_the_model_flags_are_copied_as_megatron_lm_copies_them() -> None:
    got = table.from_checkpoint(_parsed(), SAVED, given=())
    # left None on the command line: the checkpoint's; forced: the checkpoint's over the command line's default
    assert {k: got.values[k] for k in ("num_layers", "hidden_size", "seq_length", "position_embedding_type",
                                       "hidden_dropout", "tokenizer_type", "padded_vocab_size")} == \
        {"num_layers": 2, "hidden_size": 64, "seq_length": 64, "position_embedding_type": "rope",
         "hidden_dropout": 0.0, "tokenizer_type": "GPT2BPETokenizer", "padded_vocab_size": 128}
    # not forced and set on the command line (a default): Megatron-LM keeps it; the layout is never copied
    assert "moe_token_dispatcher_type" not in got.values and "ckpt_format" not in got.values
    assert "tensor_model_parallel_size" not in got.values
    assert got.values["moe_ffn_hidden_size"] is None  # a dense checkpoint: no expert width
    assert "kv_channels" in got.missing and not got.contradictions


def test_the_tokenizer_stays_the_command_lines_without_use_tokenizer_model_from_checkpoint_args() -> None:
    got = table.from_checkpoint(_parsed(), SAVED, given=(), tokenizer=False)
    assert "tokenizer_type" not in got.values and "tokenizer_model" not in got.values


def test_a_flag_given_that_the_checkpoint_contradicts_is_named_with_both_values() -> None:
    args = _parsed(num_layers=4, hidden_dropout=0.0, swiglu=True, seq_length=128)
    got = table.from_checkpoint(args, SAVED, given=("num_layers", "hidden_dropout", "swiglu", "seq_length"),
                                options={"num_layers": "--num-layers", "swiglu": "--swiglu"})
    assert got.contradictions == (
        "--num-layers: the command line gives 4, the checkpoint's model 2 (--use-checkpoint-args takes the model "
        "from the checkpoint: drop the flag or make it agree)",
        "--swiglu: the command line gives True, the checkpoint's model False (--use-checkpoint-args takes the model "
        "from the checkpoint: drop the flag or make it agree)")
    # agreeing (0.0 given, 0.0 saved) is fine; a longer sequence is the command line's, as Megatron-LM keeps it
    assert "seq_length" not in got.values and got.values["hidden_dropout"] == 0.0


def test_equal_values_agree_across_json_types_but_a_switch_is_not_a_number() -> None:
    assert not table.from_checkpoint(_parsed(hidden_dropout=0), SAVED, given=("hidden_dropout",)).contradictions
    saved = {**SAVED, "num_layers": 1}
    assert table.from_checkpoint(_parsed(num_layers=True), saved, given=("num_layers",)).contradictions


def test_the_flags_given_are_found_by_every_option_string() -> None:
    argv = ["--num-layers=4", "--disable-bias-linear", "--hidden-size", "64", "--tensor-model-parallel-size", "2"]
    options = {"add_bias_linear": ("--disable-bias-linear",), "num_layers": ("--num-layers",)}
    assert table.given_dests(argv, options) == {"num_layers": "--num-layers", "add_bias_linear": "--disable-bias-linear",
                                                "hidden_size": "--hidden-size"}


def _checkpoint(root, it: int = 4) -> str:
    d = root / directory.iter_dir_name(it)
    d.mkdir()
    (d / directory.METADATA_FILE).write_text(json.dumps(
        {"format": directory.FORMAT_NAME, "format_version": directory.FORMAT_VERSION, "iteration": it,
         "framework": "megatron-core", "model": {**SAVED, "vocab_size": 95, "seed": 1234}, "padded_vocab_size": 128}))
    return str(d)


def test_the_hook_takes_the_model_flags_from_the_tenplex_checkpoint(tmp_path, monkeypatch) -> None:
    from tenplex_megatron.frontdoor import megatron_lm

    path = _checkpoint(tmp_path)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--load", str(tmp_path), "--tensor-model-parallel-size", "1"])
    args = argparse.Namespace(tenplex=True, load=str(tmp_path), use_checkpoint_args=True,
                              use_tokenizer_model_from_checkpoint_args=True, **_parsed())
    got, saved = megatron_lm._load_args_from_checkpoint(args)
    assert got is args and (args.num_layers, args.hidden_size, args.padded_vocab_size, args.iteration) == \
        (2, 64, 128, 4)
    assert args.tensor_model_parallel_size == 1 and saved.num_layers == 2, path


def test_the_hook_stops_on_a_contradiction_before_anything_is_built(tmp_path, monkeypatch, caplog) -> None:
    from tenplex_megatron.frontdoor import megatron_lm

    _checkpoint(tmp_path)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--num-layers", "4", "--load", str(tmp_path)])
    args = argparse.Namespace(tenplex=True, load=str(tmp_path), use_checkpoint_args=True, **_parsed(num_layers=4))
    with caplog.at_level("ERROR", logger="tenplex_megatron"), pytest.raises(SystemExit) as e:
        megatron_lm._load_args_from_checkpoint(args)
    assert e.value.code == 2 and args.hidden_size is None  # nothing copied
    assert "--num-layers: the command line gives 4, the checkpoint's model 2" in caplog.text


def test_the_hook_still_refuses_the_layout_from_the_checkpoint(tmp_path, caplog) -> None:
    from tenplex_megatron.frontdoor import megatron_lm

    _checkpoint(tmp_path)
    args = argparse.Namespace(tenplex=True, load=str(tmp_path), use_checkpoint_args=True,
                              use_mp_args_from_checkpoint_args=True, **_parsed())
    with caplog.at_level("ERROR", logger="tenplex_megatron"), pytest.raises(SystemExit):
        megatron_lm._load_args_from_checkpoint(args)
    assert "--use-mp-args-from-checkpoint-args" in caplog.text and args.num_layers is None
