"""``--use-checkpoint-args`` under ``--tenplex``: the model flags a tenplex checkpoint recorded, copied as Megatron-LM's
``load_args_from_checkpoint`` copies its own checkpoint's, and any contradiction with the command line named.

Megatron-LM (core_v0.15-0.19) copies a fixed list of args: a *forced* one takes the checkpoint's value over the
command line's, another only where the command line left it None. The layout (TP, PP, VPP, EP) is never copied here:
it is the restarted job's own (``--use-mp-args-from-checkpoint-args`` stays refused). Where the user gave a copied
flag explicitly and the checkpoint recorded another value, the job stops naming the flag and both values (Megatron-LM
would overwrite it silently, or build a model the checkpoint does not fit), except for the few that shape no tensor
and that Megatron-LM lets the command line keep (:data:`COMMAND_LINE_WINS`). Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Copied:
    """One arg Megatron-LM's ``load_args_from_checkpoint`` copies: ``force``, the checkpoint's value wins."""

    dest: str
    force: bool


def _rows(names: str, force: bool) -> tuple[Copied, ...]:
    return tuple(Copied(n, force) for n in names.split())


#: every arg Megatron-LM core_v0.15-0.19 copies from a checkpoint (the union of the lines: a dest a line lacks is
#: recorded None there and not copied), in its order; the tokenizer's two only with
#: ``--use-tokenizer-model-from-checkpoint-args`` (its default)
COPIED: tuple[Copied, ...] = (
    *_rows("num_layers hidden_size ffn_hidden_size seq_length num_attention_heads", False),
    *_rows("num_query_groups group_query_attention", True),
    *_rows("kv_channels max_position_embeddings", False),
    *_rows("position_embedding_type add_position_embedding use_rotary_position_embeddings rotary_base rotary_percent "
           "rotary_interleaved add_bias_linear add_qkv_bias squared_relu swiglu untie_embeddings_and_output_weights "
           "apply_layernorm_1p normalization apply_query_key_layer_scaling attention_dropout hidden_dropout "
           "hybrid_override_pattern mtp_hybrid_override_pattern mtp_num_layers mtp_use_repeated_layer spec "
           "hybrid_attention_ratio hybrid_mlp_ratio num_experts moe_layer_freq moe_ffn_hidden_size moe_router_topk",
           True),
    *_rows("moe_token_dispatcher_type", False),
    *_rows("moe_router_pre_softmax moe_grouped_gemm moe_single_grouped_weight moe_single_grouped_bias "
           "moe_shared_expert_intermediate_size moe_router_score_function moe_router_enable_expert_bias "
           "moe_router_topk_scaling_factor mamba_state_dim mamba_head_dim mamba_num_groups mamba_num_heads "
           "is_hybrid_model heterogeneous_layers_config_path heterogeneous_layers_config_encoded_json "
           "moe_latent_size", True),
    *_rows("hybrid_layer_pattern", False),
    *_rows("tokenizer_model tokenizer_type tiktoken_pattern", True),
    *_rows("padded_vocab_size ckpt_format", False),
)
TOKENIZER_MODEL = ("tokenizer_model", "tokenizer_type")
#: copied only where the command line left them None, and shaping no tensor: a value given there is kept, as
#: Megatron-LM keeps it (a longer sequence to fine-tune, another token dispatcher)
COMMAND_LINE_WINS = frozenset({"seq_length", "moe_token_dispatcher_type", "ckpt_format"})


@dataclass(frozen=True)
class ArgsFromCheckpoint:
    """What ``--use-checkpoint-args`` sets: each dest's new value, what the checkpoint did not record, and the
    contradictions with flags given explicitly (the job stops on any)."""

    values: Mapping[str, Any]
    missing: tuple[str, ...]
    contradictions: tuple[str, ...]


def recorded(model: Mapping[str, Any], padded_vocab_size: int | None) -> dict[str, Any]:
    """A tenplex checkpoint's model record (metadata.json ``model``) as Megatron-LM's checkpoint args: the
    padded vocabulary is a field of its own there."""
    return {**model, "padded_vocab_size": padded_vocab_size}


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON holds them (a tuple is a list there; an int where a float was given is the same number)."""
    a, b = (list(v) if isinstance(v, tuple) else v for v in (a, b))
    return a == b and (type(a) is type(b) or not (isinstance(a, bool) or isinstance(b, bool)))


def from_checkpoint(args: Mapping[str, Any], saved: Mapping[str, Any], given: Iterable[str], *,
                    tokenizer: bool = True, options: Mapping[str, str] | None = None) -> ArgsFromCheckpoint:
    """The args ``--use-checkpoint-args`` sets from ``saved`` (:func:`recorded`) over ``args`` (the parsed flags, before
    Megatron-LM checks them), as Megatron-LM's rules copy them; ``given``: the dests the command line set
    explicitly; ``tokenizer``: ``--use-tokenizer-model-from-checkpoint-args``; ``options``: the flag that names each
    dest in a message (default ``--`` and the dest)."""
    given = set(given)
    values: dict[str, Any] = {}
    missing: list[str] = []
    wrong: list[str] = []
    dense = "num_experts" in saved and saved["num_experts"] is None
    for row in COPIED:
        if row.dest in TOKENIZER_MODEL and not tokenizer:
            continue
        have = args.get(row.dest)
        if not row.force and have is not None and (row.dest not in given or row.dest in COMMAND_LINE_WINS):
            continue  # Megatron-LM keeps the command line's value
        value = None if row.dest == "moe_ffn_hidden_size" and dense else saved.get(row.dest)
        if value is None and not (row.dest == "moe_ffn_hidden_size" and dense):
            missing.append(row.dest)
            continue
        if row.dest in given and not _same(have, value):
            flag = (options or {}).get(row.dest, "--" + row.dest.replace("_", "-"))
            wrong.append(f"{flag}: the command line gives {have!r}, the checkpoint's model {value!r} "
                         f"(--use-checkpoint-args takes the model from the checkpoint: drop the flag or make it agree)")
            continue
        values[row.dest] = value
    return ArgsFromCheckpoint(values, tuple(missing), tuple(wrong))


def given_dests(argv: Sequence[str], options: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """The copied dests the command line ``argv`` sets explicitly, each with the option it was given as
    (``options``: each dest's option strings; a dest with none is looked for as ``--`` and the dest)."""
    out = {}
    for row in COPIED:
        for opt in options.get(row.dest) or ("--" + row.dest.replace("_", "-"),):
            if any(a == opt or a.startswith(opt + "=") for a in argv):
                out[row.dest] = opt
                break
    return out
