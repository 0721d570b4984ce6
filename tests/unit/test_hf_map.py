"""The torch-free Hugging Face mapping: exact coverage, megatron-core's per-group QKV order, refusals naming the field."""

from __future__ import annotations

import math

import pytest

from tenplex_megatron.plan.hf_map import (
    GPT2,
    LLAMA,
    MIXTRAL,
    HFMapError,
    ModelFacts,
    architecture,
    build_mapping,
    check_flags,
    facts_from_hf_config,
    hf_config,
    parse_size,
    shard_files,
)

GPT2_FACTS = ModelFacts(num_layers=2, hidden_size=8, num_attention_heads=2, num_query_groups=2, ffn_hidden_size=32,
                        vocab_size=11, max_position_embeddings=16)
LLAMA_FACTS = ModelFacts(num_layers=2, hidden_size=16, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=24,
                         vocab_size=11, max_position_embeddings=16, position_embedding_type="rope",
                         normalization="RMSNorm", swiglu=True, add_bias_linear=False, tied=False, rotary_base=5e5,
                         norm_epsilon=1e-6)
MIXTRAL_FACTS = ModelFacts(**{**LLAMA_FACTS.__dict__, "num_experts": 4, "moe_ffn_hidden_size": 12, "moe_router_topk": 2})


@pytest.mark.parametrize("facts", [GPT2_FACTS, LLAMA_FACTS, GPT2_FACTS.__class__(**{**GPT2_FACTS.__dict__, "tied": False}),
                                   MIXTRAL_FACTS])
def test_every_element_is_covered_exactly_once_both_ways(facts: ModelFacts) -> None:
    m = build_mapping(facts)
    meg: dict[str, int] = {k: 0 for k in m.megatron}
    seen_boxes: set[tuple] = set()
    for t in m.hf:
        hf_rows = 0
        axis = 1 if t.links[0].transposed else 0
        hf_ranges = []
        for lk in t.links:
            mt = m.megatron[lk.key]
            assert len(lk.offsets) == len(mt.shape) == len(lk.shape)
            assert all(o + s <= g for o, s, g in zip(lk.offsets, lk.shape, mt.shape)), lk
            box = (lk.key, lk.offsets, lk.shape)
            assert box not in seen_boxes, box
            seen_boxes.add(box)
            meg[lk.key] += math.prod(lk.shape)
            assert lk.layered == (lk.lead > 0) and all(x == 1 for x in lk.shape[: lk.lead])
            rest = lk.shape[lk.lead + 1 :]
            other = t.shape[1 - axis] if len(t.shape) == 2 else 1
            assert math.prod(rest) == other, (t.name, lk)
            hf_ranges.append((lk.lo, lk.lo + lk.n))
            hf_rows += lk.n
        assert hf_rows == t.shape[axis], t.name
        ranges = sorted(hf_ranges)
        assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), t.name
    for key, n in meg.items():
        assert n == math.prod(m.megatron[key].shape), key  # disjoint boxes (checked above) of the full size


def test_grouped_qkv_follows_megatron_core_per_group_order() -> None:
    # 4 query heads in 2 groups, head_dim 1: fused rows are q0 q1 k0 v0 | q2 q3 k1 v1
    f = ModelFacts(1, 4, 4, 2, 8, 5, 8, "rope", "RMSNorm", True, False, True)
    m = build_mapping(f).by_name()
    runs = {p: [(lk.offsets[1], lk.lo, lk.n) for lk in m[f"model.layers.0.self_attn.{p}_proj.weight"].links]
            for p in "qkv"}
    assert runs == {"q": [(0, 0, 2), (4, 2, 2)], "k": [(2, 0, 1), (6, 1, 1)], "v": [(3, 0, 1), (7, 1, 1)]}
    gate, up = (m[f"model.layers.0.mlp.{p}_proj.weight"].links[0] for p in ("gate", "up"))
    assert (gate.offsets, up.offsets, gate.shape) == ((0, 0, 0), (0, 8, 0), (1, 8, 4))


def test_gpt2_conv1d_weights_are_transposed_and_qkv_interleaved_per_head() -> None:
    m = build_mapping(GPT2_FACTS).by_name()  # 2 heads of 4: fused rows q0 k0 v0 q1 k1 v1
    c_attn = m["transformer.h.1.attn.c_attn.weight"]
    assert c_attn.shape == (8, 24) and all(lk.transposed for lk in c_attn.links)
    assert [(lk.offsets, lk.lo) for lk in c_attn.links] == [
        ((1, 0, 0), 0), ((1, 4, 0), 8), ((1, 8, 0), 16), ((1, 12, 0), 4), ((1, 16, 0), 12), ((1, 20, 0), 20)]
    assert not m["transformer.h.1.attn.c_attn.bias"].links[0].transposed
    assert m["transformer.h.0.mlp.c_fc.weight"].shape == (8, 32)
    assert m["transformer.wte.weight"].links[0].key == "embedding.word_embeddings.weight"
    assert "lm_head.weight" not in m  # tied


@pytest.mark.parametrize("facts", [GPT2_FACTS, LLAMA_FACTS, MIXTRAL_FACTS])
def test_config_round_trips_through_hf_config(facts: ModelFacts) -> None:
    name, kw = hf_config(facts, "float32")
    cfg = {**kw, "model_type": {"GPT2Config": GPT2, "LlamaConfig": LLAMA, "MixtralConfig": MIXTRAL}[name]}
    if facts.num_experts:
        # megatron's dense width is unused when every layer is a mixture of experts: the config knows the experts'
        facts = ModelFacts(**{**facts.__dict__, "ffn_hidden_size": facts.moe_ffn_hidden_size})
    assert facts_from_hf_config(cfg) == facts


@pytest.mark.parametrize(("change", "field"), [
    ({"normalization": "RMSNorm"}, "normalization"),
    ({"swiglu": True}, "swiglu"),
    ({"add_bias_linear": False}, "add_bias_linear"),
    ({"num_query_groups": 1}, "num_query_groups"),
    ({"position_embedding_type": "none"}, "position_embedding_type"),
])
def test_models_that_fit_neither_architecture_are_refused_naming_the_field(change: dict, field: str) -> None:
    with pytest.raises(HFMapError, match=field):
        architecture(ModelFacts(**{**GPT2_FACTS.__dict__, **change}))
    with pytest.raises(HFMapError, match="rotary_percent"):
        architecture(ModelFacts(**{**LLAMA_FACTS.__dict__, "rotary_percent": 0.5}))


@pytest.mark.parametrize(("cfg", "field"), [
    ({"model_type": "mistral"}, "model_type"),
    ({"model_type": "gpt2", "activation_function": "gelu_new"}, "activation_function"),
    ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "yarn"}}, "rope_type"),
    ({"model_type": "mixtral", "router_jitter_noise": 0.1}, "router_jitter_noise"),
    ({"model_type": "mixtral", "sliding_window": 8, "max_position_embeddings": 16}, "sliding_window"),
])
def test_unsupported_hf_configs_are_refused_naming_the_field(cfg: dict, field: str) -> None:
    with pytest.raises(HFMapError, match=field):
        facts_from_hf_config(cfg, "x/config.json")


def test_flag_mismatch_names_field_both_values_and_flag() -> None:
    with pytest.raises(HFMapError) as e:
        check_flags(GPT2_FACTS, ModelFacts(**{**GPT2_FACTS.__dict__, "ffn_hidden_size": 64}), "d/config.json")
    assert "ffn_hidden_size is 32 in the Hugging Face config but 64 from the flags (--ffn-hidden-size)" in str(e.value)
    check_flags(GPT2_FACTS, GPT2_FACTS, "d/config.json")


def test_mixtral_maps_router_and_each_expert_onto_megatron_cores_stacked_experts() -> None:
    m = build_mapping(MIXTRAL_FACTS)
    assert m.arch == MIXTRAL
    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert m.megatron[fc1].shape == (2, 4, 24, 16)
    assert m.megatron["decoder.layers.mlp.experts.experts.linear_fc2.weight"].shape == (2, 4, 16, 12)
    assert m.megatron["decoder.layers.mlp.router.weight"].shape == (2, 4, 16)
    by = m.by_name()
    w1, w3, w2 = (by[f"model.layers.1.block_sparse_moe.experts.3.{w}.weight"].links[0] for w in ("w1", "w3", "w2"))
    assert (w1.key, w1.offsets, w1.shape, w1.n) == (fc1, (1, 3, 0, 0), (1, 1, 12, 16), 12)  # the gate: fc1's first half
    assert (w3.offsets, w3.n) == ((1, 3, 12, 0), 12)  # the up projection: its second half
    assert by["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (16, 12) and w2.offsets == (1, 3, 0, 0)
    gate = by["model.layers.0.block_sparse_moe.gate.weight"]
    assert gate.shape == (4, 16) and gate.links[0].offsets == (0, 0, 0)
    assert not any(".mlp." in t.name for t in m.hf)  # no dense MLP


@pytest.mark.parametrize(("routing", "flag"), [
    (("moe_router_pre_softmax", True), "--moe-router-pre-softmax"),
    (("moe_router_score_function", "sigmoid"), "--moe-router-score-function"),
    (("moe_router_enable_expert_bias", True), "--moe-router-enable-expert-bias"),
    (("moe_shared_expert_intermediate_size", 8), "--moe-shared-expert-intermediate-size"),
    (("moe_layer_freq", (1, 0)), "--moe-layer-freq"),
    (("moe_expert_capacity_factor", 1.0), "--moe-expert-capacity-factor"),
])
def test_routing_mixtral_does_not_compute_is_refused_naming_the_flag(routing: tuple, flag: str) -> None:
    run = ModelFacts(**{**MIXTRAL_FACTS.__dict__, "moe_routing": (routing,)})
    with pytest.raises(HFMapError, match=flag):
        architecture(run)
    with pytest.raises(HFMapError, match=flag):
        check_flags(MIXTRAL_FACTS, run, "d/config.json")
    ok = ModelFacts(**{**MIXTRAL_FACTS.__dict__, "moe_routing": (("moe_layer_freq", (1, 1)),
                                                                 ("moe_router_load_balancing_type", "seq_aux_loss"))})
    assert architecture(ok) == MIXTRAL
    with pytest.raises(HFMapError, match="num_experts=4 does not fit a Hugging Face gpt2"):
        architecture(ModelFacts(**{**GPT2_FACTS.__dict__, "num_experts": 4}))


@pytest.mark.parametrize(("change", "text"), [
    ({"num_experts": 8}, "num_local_experts is 4 in the Hugging Face config but 8 from the flags (--num-experts)"),
    ({"moe_router_topk": 1}, "num_experts_per_tok is 2 in the Hugging Face config but 1 from the flags "
                             "(--moe-router-topk)"),
    ({"moe_ffn_hidden_size": 24}, "intermediate_size is 12 in the Hugging Face config but 24 from the flags "
                                  "(--moe-ffn-hidden-size)"),
    ({"num_experts": None, "moe_ffn_hidden_size": None, "moe_router_topk": None}, "(--num-experts)"),
])
def test_mixtral_flag_mismatch_names_the_config_field_and_the_flag(change: dict, text: str) -> None:
    with pytest.raises(HFMapError) as e:
        check_flags(MIXTRAL_FACTS, ModelFacts(**{**MIXTRAL_FACTS.__dict__, **change}), "d/config.json")
    assert text in str(e.value)
    check_flags(MIXTRAL_FACTS, ModelFacts(**{**MIXTRAL_FACTS.__dict__, "ffn_hidden_size": 999}), "d/config.json")


def test_from_model_json_reads_the_trainers_spec() -> None:
    spec = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": None, "seq_length": 16,
            "max_position_embeddings": 16, "vocab_size": 11, "swiglu": False,
            "untie_embeddings_and_output_weights": False}
    assert ModelFacts.from_model_json(spec) == GPT2_FACTS
    assert ModelFacts.from_model_json(LLAMA_FACTS.to_model_json()) == LLAMA_FACTS
    assert ModelFacts.from_model_json(MIXTRAL_FACTS.to_model_json()) == MIXTRAL_FACTS
    pre = ModelFacts(**{**MIXTRAL_FACTS.__dict__, "moe_routing": (("moe_router_pre_softmax", True),)})
    assert ModelFacts.from_model_json(pre.to_model_json()) == pre
    # Megatron-LM's recorded args: defaults are not routing differences, a dense job records no experts
    hook = {**LLAMA_FACTS.to_model_json(), "num_experts": 4, "moe_ffn_hidden_size": None, "moe_router_topk": 2,
            "moe_router_pre_softmax": False, "moe_layer_freq": 1, "moe_router_score_function": "softmax"}
    got = ModelFacts.from_model_json(hook)
    assert (got.num_experts, got.moe_ffn_hidden_size, got.moe_routing) == (4, 24, ())
    with pytest.raises(HFMapError, match="hidden_size"):
        ModelFacts.from_model_json({"num_layers": 2})


@pytest.mark.parametrize("field, flag", [("apply_layernorm_1p", "--apply-layernorm-1p"),
                                         ("qk_layernorm", "--qk-layernorm"),
                                         ("moe_grouped_gemm", "--moe-grouped-gemm")])
def test_settings_the_mapping_does_not_express_are_refused_naming_the_flag(field: str, flag: str) -> None:
    """A model whose math differs with the same tensor shapes (zero-centred norm weights, query/key norms), or whose
    experts are GroupedMLP's grouped weights, is refused for export and import alike, rather than written wrong; off
    (False, as Megatron-LM records it) is fine."""
    model = LLAMA_FACTS.to_model_json()
    assert ModelFacts.from_model_json({**model, field: False}) == LLAMA_FACTS
    with pytest.raises(HFMapError, match=f"{field}=True \\({flag}\\): not mapped"):
        ModelFacts.from_model_json({**model, field: True})


def test_sizes_and_shards() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("100") == 100
    with pytest.raises(HFMapError, match="--max-shard-size"):
        parse_size("lots")
    assert shard_files([4, 4, 4, 10, 1], 8) == [0, 0, 1, 2, 3]
