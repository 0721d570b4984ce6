"""A model's dimensions for the layout choice, read from parsed flags (the trainer's or Megatron-LM's: both use
Megatron-LM's flag names), so ``--tenplex-layout auto`` sizes the same model the same way behind either door."""

from __future__ import annotations

from typing import Any

from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims

GPT2_VOCAB = 50257  # the vocabulary assumed when a tokenizer sets it at start-up (it only weighs in the estimates)


def gpt_dims(args: Any) -> GPTDims:
    """The GPT (or Llama-style) model ``args`` describes: biases, norm, position embedding and experts included."""
    gqa = bool(getattr(args, "group_query_attention", False))
    return GPTDims(num_layers=int(args.num_layers), hidden_size=int(args.hidden_size),
                   num_attention_heads=int(args.num_attention_heads),
                   vocab_size=int(getattr(args, "vocab_size", None) or GPT2_VOCAB),
                   seq_length=int(args.seq_length), ffn_hidden_size=getattr(args, "ffn_hidden_size", None),
                   swiglu=bool(getattr(args, "swiglu", False)),
                   tied=not getattr(args, "untie_embeddings_and_output_weights", False),
                   bf16=bool(getattr(args, "bf16", False)),
                   num_query_groups=args.num_query_groups if gqa else None,
                   add_bias_linear=bool(getattr(args, "add_bias_linear", True)),
                   normalization=str(getattr(args, "normalization", "LayerNorm")),
                   position_embedding_type=str(getattr(args, "position_embedding_type", "learned_absolute")),
                   num_experts=getattr(args, "num_experts", None) or None,
                   moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None),
                   moe_router_topk=int(getattr(args, "moe_router_topk", None) or 2),
                   moe_shared_expert_intermediate_size=getattr(args, "moe_shared_expert_intermediate_size", None),
                   moe_router_enable_expert_bias=bool(getattr(args, "moe_router_enable_expert_bias", False)))
