"""How a megatron-core GPT's tensors map onto a Hugging Face transformers checkpoint's, without torch.

One table serves both directions. Every Hugging Face tensor is the union of
:class:`Link` s: a box of a megatron-core global tensor (layer axis first for
the decoder's layers) that equals a contiguous range of the HF tensor's rows
(of its columns for GPT-2's transposed ``Conv1D`` weights). Export reads the
boxes and writes the ranges; import describes the ranges as stored chunks of
the boxes, so the planner reads only what each rank holds. The transforms are:
megatron-core's per-group fused QKV (per query group: its query heads, then
its key head, then its value head) against separate or concatenated q/k/v,
SwiGLU's fused gate/up, GPT-2's transposed ``Conv1D`` weights, and the padded
vocabulary rows, which Hugging Face does not have. A mixture of experts (Mixtral)
maps megatron-core's router and its routed experts, stacked (layer, expert) on
their first two axes, onto ``block_sparse_moe.gate`` and one
``block_sparse_moe.experts.N.w1/w3/w2`` per expert. Keys are megatron-core's
``sharded_state_dict`` keys, in which the layer norms before attention and MLP
are named as Transformer Engine's fused layers name them
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), local spec or not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tenplex_megatron.errors import TenplexError

GPT2 = "gpt2"
LLAMA = "llama"
MIXTRAL = "mixtral"
EXPERT_PREFIX = "decoder.layers.mlp.experts.experts."  # megatron-core's routed experts: (layer, expert, ...)

# megatron-core routing settings that Mixtral's router (softmax over all experts, top-k, renormalised: megatron-core's
# default softmax after the top-k) cannot express: Megatron-LM's argument name -> (values that fit, flag)
MOE_ROUTING: dict[str, tuple[tuple[Any, ...], str]] = MappingProxyType({
    "moe_router_score_function": (("softmax",), "--moe-router-score-function"),
    "moe_router_pre_softmax": ((False,), "--moe-router-pre-softmax"),
    "moe_router_enable_expert_bias": ((False,), "--moe-router-enable-expert-bias"),
    "moe_shared_expert_intermediate_size": ((None, 0), "--moe-shared-expert-intermediate-size"),
    "moe_layer_freq": ((1,), "--moe-layer-freq"),
    "moe_router_topk_scaling_factor": ((None, 1.0), "--moe-router-topk-scaling-factor"),
    "moe_router_num_groups": ((None,), "--moe-router-num-groups"),
    "moe_router_group_topk": ((None,), "--moe-router-group-topk"),
    "moe_expert_capacity_factor": ((None,), "--moe-expert-capacity-factor"),
    "moe_input_jitter_eps": ((None, 0.0), "--moe-input-jitter-eps"),
    "moe_router_load_balancing_type": (("aux_loss", "seq_aux_loss", "global_aux_loss", "none"),
                                       "--moe-router-load-balancing-type"),
})
MOE_DEFAULTS = MappingProxyType({"moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
                "moe_router_enable_expert_bias": False, "moe_layer_freq": 1,
                "moe_router_load_balancing_type": "aux_loss"})


#: settings that change what a model computes without changing any tensor's shape, that neither direction of the
#: mapping expresses: Megatron-LM argument name -> (its flag, what would go wrong)
UNMAPPED = MappingProxyType({
    "apply_layernorm_1p": ("--apply-layernorm-1p", "the norms' stored weights are weight - 1 (zero-centred gamma)"),
    "qk_layernorm": ("--qk-layernorm", "the query/key norms have no place in the Hugging Face model"),
    "moe_grouped_gemm": ("--moe-grouped-gemm", "megatron-core's GroupedMLP keeps the experts in two grouped weights, "
                         "transposed from Mixtral's experts.N.w1/w3/w2, which map onto SequentialMLP's"),
})


class HFMapError(TenplexError, ValueError):
    """A model or a Hugging Face config that the mapping cannot express; the message names the field."""


@dataclass(frozen=True)
class ModelFacts:
    """The layout-independent facts of a megatron-core GPT that decide its Hugging Face form."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int  # real rows (the tokenizer's), without megatron's padding
    max_position_embeddings: int
    position_embedding_type: str = "learned_absolute"  # or "rope"
    normalization: str = "LayerNorm"  # or "RMSNorm"
    swiglu: bool = False
    add_bias_linear: bool = True
    tied: bool = True  # word embedding shared with the output layer
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    norm_epsilon: float = 1e-5
    # mixture of experts (None: dense): routed experts per layer, each one's FFN width, experts per token, and the
    # routing settings that differ from megatron-core's defaults as (Megatron-LM argument name, value) pairs
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int | None = None
    moe_routing: tuple[tuple[str, Any], ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_model_json(self) -> dict[str, Any]:
        """The form :meth:`from_model_json` reads (Megatron-LM's argument names)."""
        d = {k: v for k, v in self.__dict__.items() if k not in ("tied", "moe_routing")}
        return {**d, **dict(self.moe_routing), "untie_embeddings_and_output_weights": not self.tied}

    @classmethod
    def from_model_json(cls, d: dict[str, Any]) -> ModelFacts:
        """From a checkpoint's ``metadata["model"]`` (the trainer's GPTSpec or the Megatron-LM hook's recorded args)."""

        def get(name: str, default: Any = None) -> Any:
            v = d.get(name)
            return default if v is None else v

        for name, (flag, why) in UNMAPPED.items():
            if d.get(name):
                raise HFMapError(f"{name}={d[name]!r} ({flag}): not mapped to or from Hugging Face ({why}); the "
                                 "weights would be exported or imported wrong")

        try:
            h = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            groups = int(get("num_query_groups", heads)) if get("group_query_attention", True) else heads
            add_bias = bool(get("add_bias_linear", not get("disable_bias_linear", False)))
            experts = int(d["num_experts"]) if d.get("num_experts") else None
            ffn = int(get("ffn_hidden_size", 4 * h))
            routing = tuple((k, tuple(v) if isinstance(v, list) else v) for k in MOE_ROUTING
                            if experts and (v := d.get(k)) is not None and v != MOE_DEFAULTS.get(k))
            return cls(
                num_layers=int(d["num_layers"]),
                hidden_size=h,
                num_attention_heads=heads,
                num_query_groups=groups,
                ffn_hidden_size=ffn,
                vocab_size=int(d["vocab_size"]),
                max_position_embeddings=int(get("max_position_embeddings", get("seq_length"))),
                position_embedding_type=str(get("position_embedding_type", "learned_absolute")),
                normalization=str(get("normalization", "LayerNorm")),
                swiglu=bool(get("swiglu", False)),
                add_bias_linear=add_bias,
                tied=not bool(get("untie_embeddings_and_output_weights", False)),
                rotary_base=float(get("rotary_base", 10000.0)),
                rotary_percent=float(get("rotary_percent", 1.0)),
                norm_epsilon=float(get("norm_epsilon", get("layernorm_epsilon", 1e-5))),
                num_experts=experts,
                moe_ffn_hidden_size=int(get("moe_ffn_hidden_size", ffn)) if experts else None,
                moe_router_topk=int(get("moe_router_topk", 2)) if experts else None,
                moe_routing=routing,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise HFMapError(f"the checkpoint's model description lacks or garbles {e}") from None


def check_routing(f: ModelFacts) -> None:
    """Refuse a mixture of experts whose routing Mixtral's cannot reproduce, naming the setting and its flag.

    Mixtral takes the softmax over all experts, keeps the top k and renormalises them: exactly megatron-core's
    default softmax over the top-k logits (``moe_router_pre_softmax`` off). Pre-softmax top-k (not renormalised),
    sigmoid scores, an expert bias, shared experts, dense layers between MoE layers, scaled or group-limited
    top-k, token dropping (a capacity factor) and input jitter have no Mixtral counterpart.
    """
    for name, value in f.moe_routing:
        ok, flag = MOE_ROUTING[name]
        fits = value in ok or (name == "moe_layer_freq" and isinstance(value, tuple) and set(value) == {1})
        if not fits:
            raise HFMapError(f"{name}={value!r} ({flag}) does not fit a Hugging Face Mixtral model, whose router takes "
                             "the softmax over all experts, keeps the top k and renormalises them (megatron-core's "
                             f"default post-top-k softmax, every layer a mixture of experts; fits: {flag} "
                             f"{' or '.join(map(repr, ok))})")


def architecture(f: ModelFacts) -> str:
    """``gpt2`` (learned positions, LayerNorm, GELU, biases, multi-head), ``llama`` (rope, RMSNorm, SwiGLU, no
    biases, grouped-query attention allowed) or ``mixtral`` (a llama whose MLPs are routed experts, routed as
    :func:`check_routing` says); anything else is refused naming the field that fits neither."""
    if f.hidden_size % f.num_attention_heads:
        raise HFMapError(f"hidden_size {f.hidden_size} is not a multiple of num_attention_heads {f.num_attention_heads}")
    if f.num_attention_heads % f.num_query_groups:
        raise HFMapError(f"num_attention_heads {f.num_attention_heads} is not a multiple of num_query_groups "
                         f"{f.num_query_groups}")
    if f.position_embedding_type == "learned_absolute":
        want = {"normalization": (f.normalization, "LayerNorm"), "swiglu": (f.swiglu, False),
                "add_bias_linear": (f.add_bias_linear, True),
                "num_query_groups": (f.num_query_groups, f.num_attention_heads)}
        name = GPT2
    elif f.position_embedding_type == "rope":
        want = {"normalization": (f.normalization, "RMSNorm"), "swiglu": (f.swiglu, True),
                "add_bias_linear": (f.add_bias_linear, False), "rotary_percent": (f.rotary_percent, 1.0)}
        name = LLAMA
    else:
        raise HFMapError(f"position_embedding_type {f.position_embedding_type!r} fits neither a GPT-2 "
                         "(learned_absolute) nor a Llama (rope) Hugging Face model")
    if f.num_experts:
        if name == GPT2:
            raise HFMapError(f"num_experts={f.num_experts} does not fit a Hugging Face gpt2 model (a mixture of "
                             "experts is written as Mixtral: rotary positions, RMSNorm, SwiGLU, no biases)")
        name = MIXTRAL
    for field, (got, need) in want.items():
        if got != need:
            pos = "learned absolute positions" if name == GPT2 else "rotary positions"
            raise HFMapError(f"{field}={got!r} does not fit a Hugging Face {name} model ({pos} need {field}={need!r})")
    if name == MIXTRAL:
        check_routing(f)
    return name


def hf_config(f: ModelFacts, dtype: str) -> tuple[str, dict[str, Any]]:
    """The transformers config class name and its keyword arguments for this model."""
    arch = architecture(f)
    if arch == GPT2:
        return "GPT2Config", {
            "vocab_size": f.vocab_size, "n_positions": f.max_position_embeddings, "n_embd": f.hidden_size,
            "n_layer": f.num_layers, "n_head": f.num_attention_heads, "n_inner": f.ffn_hidden_size,
            "activation_function": "gelu", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "layer_norm_epsilon": f.norm_epsilon, "tie_word_embeddings": f.tied, "bos_token_id": None,
            "eos_token_id": None, "architectures": ["GPT2LMHeadModel"], "dtype": dtype,
        }
    if arch == MIXTRAL:
        return "MixtralConfig", {
            "vocab_size": f.vocab_size, "hidden_size": f.hidden_size, "intermediate_size": f.moe_ffn_hidden_size,
            "num_hidden_layers": f.num_layers, "num_attention_heads": f.num_attention_heads,
            "num_key_value_heads": f.num_query_groups, "head_dim": f.head_dim, "hidden_act": "silu",
            "max_position_embeddings": f.max_position_embeddings, "rms_norm_eps": f.norm_epsilon,
            "rope_parameters": {"rope_type": "default", "rope_theta": f.rotary_base}, "sliding_window": None,
            "num_local_experts": f.num_experts, "num_experts_per_tok": f.moe_router_topk, "router_jitter_noise": 0.0,
            "tie_word_embeddings": f.tied, "bos_token_id": None, "eos_token_id": None,
            "architectures": ["MixtralForCausalLM"], "dtype": dtype,
        }
    return "LlamaConfig", {
        "vocab_size": f.vocab_size, "hidden_size": f.hidden_size, "intermediate_size": f.ffn_hidden_size,
        "num_hidden_layers": f.num_layers, "num_attention_heads": f.num_attention_heads,
        "num_key_value_heads": f.num_query_groups, "head_dim": f.head_dim, "hidden_act": "silu",
        "max_position_embeddings": f.max_position_embeddings, "rms_norm_eps": f.norm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": f.rotary_base}, "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": f.tied, "bos_token_id": None, "eos_token_id": None,
        "architectures": ["LlamaForCausalLM"], "dtype": dtype,
    }


def facts_from_hf_config(cfg: dict[str, Any], path: str = "config.json") -> ModelFacts:
    """A Hugging Face ``config.json`` as :class:`ModelFacts`; an unsupported architecture is refused naming the field."""
    mt = cfg.get("model_type")

    def need(name: str) -> Any:
        if cfg.get(name) is None:
            raise HFMapError(f"{path}: model_type {mt!r} config has no {name!r}")
        return cfg[name]

    def check(name: str, ok: Any, default: Any) -> None:
        got = cfg.get(name, default)
        if got not in ok:
            raise HFMapError(f"{path}: {name}={got!r} is not supported (supported: {', '.join(map(repr, ok))})")

    if mt == GPT2:
        check("activation_function", ("gelu",), "gelu_new")
        for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
            check(name, (False,), False)
        check("scale_attn_weights", (True,), True)
        h = int(need("n_embd"))
        return ModelFacts(int(need("n_layer")), h, int(need("n_head")), int(need("n_head")),
                          int(cfg.get("n_inner") or 4 * h), int(need("vocab_size")), int(need("n_positions")),
                          tied=bool(cfg.get("tie_word_embeddings", True)),
                          norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)))
    if mt in (LLAMA, MIXTRAL):
        check("hidden_act", ("silu",), "silu")
        check("attention_bias", (False,), False)
        check("mlp_bias", (False,), False)
        if mt == MIXTRAL:
            check("router_jitter_noise", (0, 0.0), 0.0)  # noise on the router's input while training
            window = cfg.get("sliding_window")
            if window is not None and int(window) < int(need("max_position_embeddings")):
                raise HFMapError(f"{path}: sliding_window={window} is not supported (megatron-core attends to the "
                                 "whole sequence; supported: null, or at least max_position_embeddings)")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype != "default":
            raise HFMapError(f"{path}: rope_type {rtype!r} is not supported (supported: 'default')")
        h, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        head_dim = cfg.get("head_dim") or h // heads
        if head_dim * heads != h:
            raise HFMapError(f"{path}: head_dim={head_dim} x num_attention_heads={heads} != hidden_size={h}")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        ffn = int(need("intermediate_size"))
        moe: dict[str, Any] = {}
        if mt == MIXTRAL:
            moe = {"num_experts": int(need("num_local_experts")), "moe_ffn_hidden_size": ffn,
                   "moe_router_topk": int(need("num_experts_per_tok"))}
        return ModelFacts(int(need("num_hidden_layers")), h, heads, int(cfg.get("num_key_value_heads") or heads),
                          ffn, int(need("vocab_size")), int(need("max_position_embeddings")),
                          position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                          tied=bool(cfg.get("tie_word_embeddings", False)), rotary_base=float(theta),
                          norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)), **moe)
    raise HFMapError(f"{path}: model_type={mt!r} is not supported (supported: 'gpt2', 'llama', 'mixtral')")


# fields compared between a Hugging Face config and a run's flags, with the flag that sets each
FLAG_NAMES = MappingProxyType({
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups", "ffn_hidden_size": "--ffn-hidden-size", "vocab_size": "--vocab-size",
    "max_position_embeddings": "--max-position-embeddings", "position_embedding_type": "--position-embedding-type",
    "normalization": "--normalization", "swiglu": "--swiglu", "add_bias_linear": "--disable-bias-linear",
    "tied": "--untie-embeddings-and-output-weights", "rotary_base": "--rotary-base",
    "rotary_percent": "--rotary-percent", "norm_epsilon": "--norm-epsilon",
    "num_experts": "--num-experts", "moe_router_topk": "--moe-router-topk", "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
})
# the mixture-of-experts fields under their names in a Mixtral config.json
MIXTRAL_FIELDS = MappingProxyType({"num_experts": "num_local_experts", "moe_router_topk": "num_experts_per_tok",
                  "moe_ffn_hidden_size": "intermediate_size"})


def check_flags(hf: ModelFacts, run: ModelFacts, path: str) -> None:
    """Refuse a run whose flags describe another model than the Hugging Face config: name the field, both values
    and the flag; for a mixture of experts, also a routing that Mixtral's router does not compute."""
    for name, flag in FLAG_NAMES.items():
        a, b = getattr(hf, name), getattr(run, name)
        if name in ("rotary_base", "rotary_percent") and hf.position_embedding_type != "rope":
            continue
        if name == "ffn_hidden_size" and hf.num_experts:
            continue  # every Mixtral layer is a mixture of experts: the dense width is unused (moe_ffn_hidden_size)
        if a != b:
            field = MIXTRAL_FIELDS.get(name, name) if hf.num_experts else name
            raise HFMapError(f"{path}: {field} is {a!r} in the Hugging Face config but {b!r} from the flags ({flag})")
    if run.num_experts:
        check_routing(run)


@dataclass(frozen=True)
class MTensor:
    """A megatron-core global tensor (layer axis first for the decoder's layers) as the mapping sees it."""

    key: str
    shape: tuple[int, ...]
    vocab_rows: int | None = None


@dataclass(frozen=True)
class Link:
    """Box ``offsets``/``shape`` of megatron tensor ``key`` = rows ``[lo, lo + n)`` of HF tensor ``hf`` (its columns
    when ``transposed``), ``n`` the box's first non-layer size."""

    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    hf: str
    lo: int
    transposed: bool = False

    @property
    def n(self) -> int:
        return self.shape[self.lead]

    @property
    def layered(self) -> bool:
        return self.key.startswith("decoder.layers.")

    @property
    def lead(self) -> int:
        """Index axes before the rows: layer and expert for a routed expert, layer for a layer, none otherwise."""
        return 2 if self.key.startswith(EXPERT_PREFIX) else 1 if self.layered else 0


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the Hugging Face checkpoint: its name, shape and the megatron boxes it is made of."""

    name: str
    shape: tuple[int, ...]
    links: tuple[Link, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Mapping:
    """The whole correspondence: megatron tensors (unpadded vocabulary) and the HF tensors in checkpoint order."""

    arch: str
    megatron: dict[str, MTensor]
    hf: tuple[HFTensor, ...]

    def by_name(self) -> dict[str, HFTensor]:
        return {t.name: t for t in self.hf}


def _qkv_rows(f: ModelFacts) -> list[tuple[str, int, int, int]]:
    """(part, fused row, part row, rows) runs of megatron-core's per-group fused QKV: per group its q, k, v heads."""
    hn, groups = f.head_dim, f.num_query_groups
    qpg = f.num_attention_heads // groups
    out = []
    for g in range(groups):
        base = g * (qpg + 2) * hn
        out += [("q", base, g * qpg * hn, qpg * hn), ("k", base + qpg * hn, g * hn, hn),
                ("v", base + (qpg + 1) * hn, g * hn, hn)]
    return out


@dataclass
class _Parts:
    """One mapping as it is built: the megatron-core tensors by key and the HF tensors in order."""

    layers: int
    vocab: int
    M: dict[str, MTensor]
    out: list[HFTensor]

    def mt(self, key: str, shape: tuple[int, ...], vocab: bool = False) -> MTensor:
        """Record megatron-core tensor ``key`` (its vocabulary rows padded where ``vocab``)."""
        self.M[key] = MTensor(key, shape, self.vocab if vocab else None)
        return self.M[key]

    def whole(self, name: str, key: str, shape: tuple[int, ...], vocab: bool = False, transposed: bool = False) -> None:
        """An HF tensor that is the whole of megatron-core's ``key`` (transposed for GPT-2's ``Conv1D``)."""
        self.mt(key, shape, vocab)
        hshape = (shape[1], shape[0]) if transposed else shape
        self.out.append(HFTensor(name, hshape, (Link(key, (0,) * len(shape), shape, name, 0, transposed),)))

    def layer(self, name: str, key: str, shape: tuple[int, ...], runs: list[tuple[int, int, int]] | None = None,
              transposed: bool = False, hshape: tuple[int, ...] | None = None) -> None:
        """Layer tensors: ``runs`` of (megatron row, HF row, rows); default the whole tensor."""
        L = self.layers
        if key not in self.M:
            self.mt(key, (L, *shape))
        runs = runs or [(0, 0, shape[0])]
        hs = hshape or ((shape[1], shape[0]) if transposed else shape)
        for i in range(L):
            links = tuple(Link(key, (i, m0, *([0] * (len(shape) - 1))), (1, n, *shape[1:]), name.format(i), h0,
                               transposed) for m0, h0, n in runs)
            self.out.append(HFTensor(name.format(i), hs, links))


def _gpt2(b: _Parts, f: ModelFacts, qkv: int) -> None:
    """GPT-2's tensors: learned positions, fused QKV as one transposed ``c_attn``, biases, final layer norm."""
    h, ffn, V = f.hidden_size, f.ffn_hidden_size, f.vocab_size
    P = "transformer."
    b.whole(P + "wte.weight", "embedding.word_embeddings.weight", (V, h), vocab=True)
    b.whole(P + "wpe.weight", "embedding.position_embeddings.weight", (f.max_position_embeddings, h))
    qkv_runs = [(m0, {"q": 0, "k": h, "v": 2 * h}[part] + h0, n) for part, m0, h0, n in _qkv_rows(f)]
    for i_name, key, shape, runs, tr in (
        ("ln_1.weight", "self_attention.linear_qkv.layer_norm_weight", (h,), None, False),
        ("ln_1.bias", "self_attention.linear_qkv.layer_norm_bias", (h,), None, False),
        ("attn.c_attn.weight", "self_attention.linear_qkv.weight", (qkv, h), qkv_runs, True),
        ("attn.c_attn.bias", "self_attention.linear_qkv.bias", (qkv,), qkv_runs, False),
        ("attn.c_proj.weight", "self_attention.linear_proj.weight", (h, h), None, True),
        ("attn.c_proj.bias", "self_attention.linear_proj.bias", (h,), None, False),
        ("ln_2.weight", "mlp.linear_fc1.layer_norm_weight", (h,), None, False),
        ("ln_2.bias", "mlp.linear_fc1.layer_norm_bias", (h,), None, False),
        ("mlp.c_fc.weight", "mlp.linear_fc1.weight", (ffn, h), None, True),
        ("mlp.c_fc.bias", "mlp.linear_fc1.bias", (ffn,), None, False),
        ("mlp.c_proj.weight", "mlp.linear_fc2.weight", (h, ffn), None, True),
        ("mlp.c_proj.bias", "mlp.linear_fc2.bias", (h,), None, False),
    ):
        b.layer(P + "h.{}." + i_name, "decoder.layers." + key, shape, runs, tr)
    b.whole(P + "ln_f.weight", "decoder.final_layernorm.weight", (h,))
    b.whole(P + "ln_f.bias", "decoder.final_layernorm.bias", (h,))


def _llama_attention(b: _Parts, f: ModelFacts, qkv: int, P: str) -> None:
    """Llama's embedding and attention: separate q/k/v projections out of the per-group fused QKV, the layer norms."""
    h, L = f.hidden_size, f.num_layers
    b.whole(P + "embed_tokens.weight", "embedding.word_embeddings.weight", (f.vocab_size, h), vocab=True)
    rows = _qkv_rows(f)
    sizes = {"q": f.num_attention_heads * f.head_dim, "k": f.num_query_groups * f.head_dim}
    sizes["v"] = sizes["k"]
    b.mt("decoder.layers.self_attention.linear_qkv.weight", (L, qkv, h))
    for i in range(L):
        for part in "qkv":
            runs = [(m0, h0, n) for p, m0, h0, n in rows if p == part]
            name = f"{P}layers.{i}.self_attn.{part}_proj.weight"
            links = tuple(Link("decoder.layers.self_attention.linear_qkv.weight", (i, m0, 0), (1, n, h), name, h0)
                          for m0, h0, n in runs)
            b.out.append(HFTensor(name, (sizes[part], h), links))
    b.layer(P + "layers.{}.input_layernorm.weight", "decoder.layers.self_attention.linear_qkv.layer_norm_weight", (h,))
    b.layer(P + "layers.{}.self_attn.o_proj.weight", "decoder.layers.self_attention.linear_proj.weight", (h, h),
            hshape=(h, h))
    b.layer(P + "layers.{}.post_attention_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight", (h,))


def _mixtral_experts(b: _Parts, f: ModelFacts, P: str) -> None:
    """Mixtral's router and routed experts: megatron-core's (layer, expert) stacks as one w1/w3/w2 per expert."""
    h, L = f.hidden_size, f.num_layers
    E, moe_ffn = f.num_experts or 0, f.moe_ffn_hidden_size or f.ffn_hidden_size
    b.layer(P + "layers.{}.block_sparse_moe.gate.weight", "decoder.layers.mlp.router.weight", (E, h))
    fc1_key, fc2_key = EXPERT_PREFIX + "linear_fc1.weight", EXPERT_PREFIX + "linear_fc2.weight"
    b.mt(fc1_key, (L, E, 2 * moe_ffn, h))
    b.mt(fc2_key, (L, E, h, moe_ffn))
    for i in range(L):
        for e in range(E):
            base = f"{P}layers.{i}.block_sparse_moe.experts.{e}."
            # w1 the gate (SiLU'd), w3 the up projection: megatron-core's fused fc1 is [gate; up]
            for w, key, m0, shape in (("w1", fc1_key, 0, (moe_ffn, h)), ("w3", fc1_key, moe_ffn, (moe_ffn, h)),
                                      ("w2", fc2_key, 0, (h, moe_ffn))):
                name = base + w + ".weight"
                b.out.append(HFTensor(name, shape, (Link(key, (i, e, m0, 0), (1, 1, *shape), name, 0),)))


def _llama_mlp(b: _Parts, f: ModelFacts, P: str) -> None:
    """Llama's dense MLP: SwiGLU's fused fc1 as gate and up projections, fc2 as the down projection."""
    h, ffn, L = f.hidden_size, f.ffn_hidden_size, f.num_layers
    fc1 = 2 * ffn if f.swiglu else ffn
    b.mt("decoder.layers.mlp.linear_fc1.weight", (L, fc1, h))
    for i in range(L):
        for part, m0 in (("gate", 0), ("up", ffn)):
            name = f"{P}layers.{i}.mlp.{part}_proj.weight"
            b.out.append(HFTensor(name, (ffn, h), (Link("decoder.layers.mlp.linear_fc1.weight", (i, m0, 0),
                                                        (1, ffn, h), name, 0),)))
    b.layer(P + "layers.{}.mlp.down_proj.weight", "decoder.layers.mlp.linear_fc2.weight", (h, ffn), hshape=(h, ffn))


def build_mapping(f: ModelFacts) -> Mapping:
    """The mapping for this model (refused as :func:`architecture` says when it fits no HF architecture)."""
    arch = architecture(f)
    h, V = f.hidden_size, f.vocab_size
    qkv = (f.num_attention_heads + 2 * f.num_query_groups) * f.head_dim
    b = _Parts(f.num_layers, V, {}, [])
    if arch == GPT2:
        _gpt2(b, f, qkv)
    else:
        P = "model."
        _llama_attention(b, f, qkv, P)
        if arch == MIXTRAL:
            _mixtral_experts(b, f, P)
        else:
            _llama_mlp(b, f, P)
        b.whole(P + "norm.weight", "decoder.final_layernorm.weight", (h,))
    if not f.tied:
        b.whole("lm_head.weight", "output_layer.weight", (V, h), vocab=True)
    return Mapping(arch, b.M, tuple(b.out))


# tensors a Hugging Face checkpoint may hold that are not weights of the model (old buffers) or are tied copies
IGNORABLE_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def ignorable(name: str, mapping: Mapping, tied: bool) -> bool:
    """Whether an HF tensor outside the mapping may be skipped at import (a buffer, or the tied output layer)."""
    return name.endswith(IGNORABLE_SUFFIXES) or (tied and name == "lm_head.weight")


def shard_files(sizes: list[int], max_shard_bytes: int) -> list[int]:
    """Greedy assignment of tensors (in order) to shards of at most ``max_shard_bytes`` (a bigger tensor alone)."""
    out, shard, used = [], 0, 0
    for n in sizes:
        if used and used + n > max_shard_bytes:
            shard, used = shard + 1, 0
        out.append(shard)
        used += n
    return out


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``10GiB``, ``1000000`` -> bytes (as transformers' ``max_shard_size``)."""
    t = text.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    for u, mult in units.items():
        if t.endswith(u):
            try:
                return int(float(t[: -len(u)]) * mult)
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise HFMapError(f"--max-shard-size {text!r} is not a size (e.g. 5GB, 500MB, 2GiB)") from None
