"""The tensors of a megatron-core GPT job (local layer spec) from its dimensions alone. Pure Python.

Used only for dry-run planning of jobs that have no checkpoint yet (``plan
--model gpt3-175b``); a real job is always described from megatron-core's own
metadata. Keys, shapes and sharding facts match what
``integrations/megatron_core/sharded.py`` records for megatron-core 0.16 (the layout model
is checked against live jobs in tests/multiproc/test_reshard_matrix.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources
from types import MappingProxyType
from typing import Any

from tenplex_megatron.errors import TenplexError
from tenplex_megatron.plan.layout import ModelShape, record_query_groups
from tenplex_megatron.plan.ptc import TensorMeta

#: The catalogue ships inside the package (read with importlib.resources, so an installed wheel has it too).
CATALOGUE = "models.json"


class UnknownModelError(TenplexError, KeyError):
    """A model name the catalogue does not hold; the message lists the names it does."""


@dataclass(frozen=True)
class GPTDims:
    """A GPT's dimensions, named after Megatron-LM's flags; the defaults are GPT-3's (learned positions, biases, LayerNorm).

    ``num_query_groups`` (grouped-query attention) None means one group per head;
    ``add_bias_linear`` False is ``--disable-bias-linear``; ``normalization``
    ``RMSNorm`` has no bias; ``position_embedding_type`` ``rope`` has no
    position-embedding table. ``num_experts`` makes every layer's MLP a mixture of experts (megatron-core's
    ``SequentialMLP``, ``--moe-layer-freq 1``): a router, that many routed experts of width ``moe_ffn_hidden_size``
    (default ``ffn_hidden_size``) and optionally shared experts; ``moe_router_topk`` changes no tensor.
    ``moe_grouped_gemm``: the routed experts are megatron-core's ``GroupedMLP`` (two tensors per layer in their
    parameters' memory order, ``integrations/megatron_core/grouped.py``).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int = 50257
    seq_length: int = 2048
    ffn_hidden_size: int | None = None
    swiglu: bool = False
    tied: bool = True
    bf16: bool = True
    num_query_groups: int | None = None
    add_bias_linear: bool = True
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_enable_expert_bias: bool = False
    moe_grouped_gemm: bool = False

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def expert_ffn(self) -> int:
        """Each routed expert's FFN width: ``moe_ffn_hidden_size``, else the dense FFN's (megatron-core's default)."""
        return self.moe_ffn_hidden_size or self.ffn

    @property
    def query_groups(self) -> int:
        """Key/value head groups: ``num_query_groups``, or one per attention head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def qkv_rows(self) -> int:
        """Output rows of the fused QKV projection: the queries plus a key and a value per query group."""
        if self.num_query_groups is None:
            return 3 * self.hidden_size
        return self.hidden_size + 2 * self.query_groups * (self.hidden_size // self.num_attention_heads)

    def shape(self, make_vocab_size_divisible_by: int = 128) -> ModelShape:
        """The dimensions a parallel layout must divide (``ParallelLayout.check_fits``)."""
        return ModelShape(self.num_layers, self.hidden_size, self.num_attention_heads, self.vocab_size,
                          make_vocab_size_divisible_by, self.num_query_groups, self.num_experts,
                          self.expert_ffn if self.num_experts else None)

    @classmethod
    def from_record(cls, model: dict[str, Any]) -> GPTDims:
        """The dimensions in a checkpoint's ``model`` record (the reference trainer's or the Megatron-LM hook's,
        both named after Megatron-LM's flags). A record written before the Llama-style fields existed is a GPT:
        learned positions, LayerNorm, biases, one key/value group per head."""
        return cls(
            num_layers=int(model["num_layers"]),
            hidden_size=int(model["hidden_size"]),
            num_attention_heads=int(model["num_attention_heads"]),
            vocab_size=int(model["vocab_size"]),
            seq_length=int(model.get("seq_length") or 2048),
            ffn_hidden_size=model.get("ffn_hidden_size"),
            swiglu=bool(model.get("swiglu", False)),
            tied=not model.get("untie_embeddings_and_output_weights", False),
            bf16=bool(model.get("bf16", False)),
            num_query_groups=record_query_groups(model),
            add_bias_linear=bool(model.get("add_bias_linear", True)),
            normalization=str(model.get("normalization") or "LayerNorm"),
            position_embedding_type=str(model.get("position_embedding_type") or "learned_absolute"),
            num_experts=int(model["num_experts"]) if model.get("num_experts") else None,
            moe_ffn_hidden_size=model.get("moe_ffn_hidden_size"),
            moe_router_topk=int(model.get("moe_router_topk") or 2),
            moe_shared_expert_intermediate_size=model.get("moe_shared_expert_intermediate_size"),
            moe_router_enable_expert_bias=bool(model.get("moe_router_enable_expert_bias", False)),
            moe_grouped_gemm=bool(model.get("moe_grouped_gemm", False)),
        )


def catalogue(path: str | None = None) -> dict[str, dict]:
    """Every named model shape: the packaged ``models.json``, or the JSON file at ``path``."""
    if path is None:
        text = resources.files(__package__).joinpath(CATALOGUE).read_text()
    else:
        with open(path) as f:
            text = f.read()
    return json.loads(text)["models"]


def load_model(name: str, path: str | None = None) -> GPTDims:
    """A named model shape from the catalogue (``plan/sim/models.json``); the error lists the known names."""
    models = catalogue(path)
    if name not in models:
        raise UnknownModelError(f"unknown model {name!r}; known: {', '.join(sorted(models))}")
    fields = set(GPTDims.__dataclass_fields__)
    return GPTDims(**{k: v for k, v in models[name].items() if k in fields})


# the TP-split axis of a transformer layer's parameters (stacked layers on axis 0); the others are replicated over TP.
# Routed experts stack (layer, expert) on axes 0 and 1 and are split by the experts' own TP.
LAYER_TP_AXES = MappingProxyType({
    "self_attention.linear_qkv.weight": 1, "self_attention.linear_qkv.bias": 1, "mlp.linear_fc1.weight": 1,
    "mlp.linear_fc1.bias": 1, "self_attention.linear_proj.weight": 2, "mlp.linear_fc2.weight": 2,
    "mlp.shared_experts.linear_fc1.weight": 1, "mlp.shared_experts.linear_fc2.weight": 2,
    "mlp.experts.experts.linear_fc1.weight": 2, "mlp.experts.experts.linear_fc1.bias": 2,
    "mlp.experts.experts.linear_fc2.weight": 3, "mlp.experts.weight1": 4, "mlp.experts.weight2": 2})
#: What names a routed expert's tensor (megatron-core's SequentialMLP: ``...mlp.experts.experts.linear_fc1.weight``;
#: its GroupedMLP: ``...mlp.experts.weight1``).
EXPERTS = ".mlp.experts."
#: The grouped-GEMM experts' (GroupedMLP's) two tensors, by parameter: [layers, experts, hidden, parts, ffn] and
#: [layers, experts, ffn, hidden], each EP rank's experts one box per layer (one parameter)
GROUPED_SUFFIXES = MappingProxyType({"weight1": "mlp.experts.weight1", "weight2": "mlp.experts.weight2"})


def is_grouped(t: TensorMeta) -> bool:
    """Whether ``t`` (a parameter or its optimizer state) is a GroupedMLP weight: one box holds all of an EP rank's
    experts of a layer."""
    return (t.param or t.key).endswith(tuple(GROUPED_SUFFIXES.values()))


def is_expert(t: TensorMeta) -> bool:
    """Whether ``t`` (a parameter or its optimizer state) is a routed expert's: axis 1 counts experts, EP splits it
    whole and the experts' own TP (and their own data-parallel group) applies."""
    return EXPERTS in (t.param or t.key)


def gpt_tensors(d: GPTDims, padded_vocab: int, optimizer: bool = True) -> dict[str, TensorMeta]:
    """Model tensors, then Adam moments (and fp32 main weights for bf16) of every parameter."""
    h, L, f = d.hidden_size, d.num_layers, d.ffn
    f1 = 2 * f if d.swiglu else f
    parts = 2 if d.swiglu else 1
    dt = "bfloat16" if d.bf16 else "float32"

    def layer(name: str, shape: tuple[int, ...], tp_parts: int = 1) -> TensorMeta:
        return TensorMeta(f"decoder.layers.{name}", (L, *shape), dt, tp_axis=LAYER_TP_AXES.get(name), tp_parts=tp_parts,
                          stage="layers")

    params = [TensorMeta("embedding.word_embeddings.weight", (padded_vocab, h), dt, d.vocab_size, 0, 1, "first", d.tied)]
    if d.position_embedding_type == "learned_absolute":
        params.append(TensorMeta("embedding.position_embeddings.weight", (d.seq_length, h), dt, stage="first"))
    norm_bias = d.normalization == "LayerNorm"
    bias = d.add_bias_linear
    moe = bool(d.num_experts)
    layers = [
        (layer("self_attention.linear_qkv.layer_norm_weight", (h,)), True),
        (layer("self_attention.linear_qkv.layer_norm_bias", (h,)), norm_bias),
        (layer("self_attention.linear_qkv.weight", (d.qkv_rows, h)), True),
        (layer("self_attention.linear_qkv.bias", (d.qkv_rows,)), bias),
        (layer("self_attention.linear_proj.weight", (h, h)), True),
        (layer("self_attention.linear_proj.bias", (h,)), bias),
        (layer("mlp.linear_fc1.layer_norm_weight", (h,)), True),
        (layer("mlp.linear_fc1.layer_norm_bias", (h,)), norm_bias),
        (layer("mlp.linear_fc1.weight", (f1, h), parts), not moe),
        (layer("mlp.linear_fc1.bias", (f1,), parts), bias and not moe),
        (layer("mlp.linear_fc2.weight", (h, f)), not moe),
        (layer("mlp.linear_fc2.bias", (h,)), bias and not moe),
        *(_moe_layers(d, layer, dt, parts) if moe else []),
        (TensorMeta("decoder.final_layernorm.weight", (h,), dt, stage="last"), True),
        (TensorMeta("decoder.final_layernorm.bias", (h,), dt, stage="last"), norm_bias),
    ]
    params += [t for t, present in layers if present]
    if not d.tied:
        params.append(TensorMeta("output_layer.weight", (padded_vocab, h), dt, d.vocab_size, 0, 1, "last"))
    out = {t.key: t for t in params}
    if optimizer:
        states = ["exp_avg", "exp_avg_sq"] + (["fp32_param"] if d.bf16 else [])
        for t in params:
            if t.key.endswith(EXPERT_BIAS):  # a buffer the router updates itself: no optimizer state
                continue
            for s in states:
                k = f"optimizer.state.{s}.{t.key}"
                out[k] = TensorMeta(k, t.global_shape, "float32", t.vocab_rows, t.tp_axis, t.tp_parts, t.stage, t.tied, t.key)
    return out


#: The router's per-expert bias (aux-loss-free balancing): a float32 buffer, not a parameter.
EXPERT_BIAS = "mlp.router.expert_bias"


def _moe_layers(d: GPTDims, layer: Callable[..., TensorMeta], dt: str, parts: int) -> list[tuple[TensorMeta, bool]]:
    """A mixture-of-experts MLP's tensors (every layer's): router, its expert bias, the routed experts stacked as
    (layer, expert, ...), shared experts (megatron-core 0.16's keys and shapes for SequentialMLP, or GroupedMLP's
    two weights, which have no biases)."""
    h, e, ef = d.hidden_size, int(d.num_experts or 0), d.expert_ffn
    ef1 = 2 * ef if d.swiglu else ef
    sf = d.moe_shared_expert_intermediate_size
    sf1 = (2 * sf if d.swiglu else sf) if sf else 0
    bias = d.add_bias_linear
    g = d.moe_grouped_gemm
    return [
        (layer("mlp.router.weight", (e, h)), True),
        (layer("mlp.router.bias", (e,)), bias),
        (replace(layer(EXPERT_BIAS, (e,)), dtype="float32"), d.moe_router_enable_expert_bias),
        (layer("mlp.experts.experts.linear_fc1.weight", (e, ef1, h), parts), not g),
        (layer("mlp.experts.experts.linear_fc1.bias", (e, ef1), parts), bias and not g),
        (layer("mlp.experts.experts.linear_fc2.weight", (e, h, ef)), not g),
        (layer("mlp.experts.experts.linear_fc2.bias", (e, h)), bias and not g),
        (layer(GROUPED_SUFFIXES["weight1"], (e, h, parts, ef)), g),
        (layer(GROUPED_SUFFIXES["weight2"], (e, ef, h)), g),
        (layer("mlp.shared_experts.linear_fc1.weight", (sf1, h), parts), bool(sf)),
        (layer("mlp.shared_experts.linear_fc2.weight", (h, sf or 0)), bool(sf)),
    ]
