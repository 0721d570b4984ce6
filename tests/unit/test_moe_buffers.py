"""A mixture of experts' ``dp_reshardable`` checkpoint as megatron-core 0.16.1 saves it at EP2 x expert DP2 (world 4):
the chained optimizer's dense buffer (``chained_0``: embeddings, attention, router, shared expert; cut over DP 4)
and the experts' own buffer per EP rank (``chained_1...dp_group_idx_<EP rank>``: each local expert's fc1, fc2 in
turn, cut over expert DP 2, each bucket padded to a multiple of 128); and at EP1, where megatron-core keeps the
experts in the dense buffer after the router. Described without torch, every expert's state is read from its own EP
rank's buffer (or the dense one), the plan at another EP covers every element once, and buffers that do not fit are
refused naming the tensor.

The index is synthetic, laid out from megatron-core's module order directly (the real one is checked in
``tests/multiproc/test_megatron_adopt.py``); here the layouts no two-rank launch reaches: expert DP 2, end padding.
"""

from __future__ import annotations

import argparse
import math

import pytest

from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.megatron_buffer import Bucket, BufferParam, bucket_layout
from tenplex_megatron.plan.planner import plan_reshard
from tenplex_megatron.plan.sim.sharding import layout_chunks
from tenplex_megatron.storage.distcp_index import DcpIndex, DcpItem, DcpTensor
from tenplex_megatron.storage.megatron_ptc import (
    MegatronCheckpointError,
    TorchDistCheckpoint,
    describe_torch_dist,
    index_model_metas,
)

# sizes that are not multiples of 64: gaps between parameters in a bucket, and padding at its end
H, F, S, E, LAYERS, VOCAB, SEQ, EP, EDP = 48, 30, 20, 4, 2, 128, 32, 2, 2
DENSE_LAYER = {"self_attention.linear_qkv.layer_norm_weight": (H,), "self_attention.linear_qkv.layer_norm_bias": (H,),
               "self_attention.linear_proj.weight": (H, H), "self_attention.linear_qkv.weight": (3 * H, H),
               "mlp.linear_fc1.layer_norm_weight": (H,), "mlp.linear_fc1.layer_norm_bias": (H,),
               "mlp.router.weight": (E, H), "mlp.shared_experts.linear_fc1.weight": (S, H),
               "mlp.shared_experts.linear_fc2.weight": (H, S)}
EXPERT = {"mlp.experts.experts.linear_fc1.weight": (F, H), "mlp.experts.experts.linear_fc2.weight": (H, F)}
PRE = {"embedding.word_embeddings.weight": (VOCAB, H), "embedding.position_embeddings.weight": (SEQ, H)}
POST = {"decoder.final_layernorm.weight": (H,), "decoder.final_layernorm.bias": (H,)}
DTYPE = "dtype_(torch.float32, torch.float32)"


def _key(sub: int | None, group: int, state: str, bucket: int = 0) -> str:
    """A bucket's key (``sub`` None: an optimizer that is not chained)."""
    prefix = "" if sub is None else f"chained_{sub}."
    return f"{prefix}optimizer.distributed.dp_group_idx_{group}.gbuf_idx_0.{DTYPE}.bucket_idx_{bucket}.{state}"


def _expert_bucket() -> Bucket:
    """An EP rank's expert buffer: layer by layer, each local expert's fc1 then fc2 (SequentialMLP's module order)."""
    local = [BufferParam(f"{n}#{i}.{j}", math.prod(EXPERT[n])) for i in range(LAYERS) for j in range(E // EP)
             for n in EXPERT]
    (bucket,) = bucket_layout(local, EDP)
    return bucket


def _checkpoint(saved_ep: int = EP, sub_max: int = 1, shrink_expert: bool = False, ep: int = EP,
                experts_after: int = list(DENSE_LAYER).index("mlp.router.weight") + 1) -> TorchDistCheckpoint:
    """The index of a TP1 PP1 DP4 checkpoint at EP2 (``shrink_expert``: EP rank 1's expert buffer one element short)
    or, ``ep`` 1, at EP1: one optimizer, not chained, the experts in the dense buffer after the layer's first
    ``experts_after`` parameters (the router, as megatron-core's module order has them)."""
    tensors: dict[str, DcpTensor] = {}
    items: dict = {}
    at: dict[str, int] = {}

    def add(key: str, size: tuple[int, ...], chunks: list, writers: list[int] | None = None) -> None:
        tensors[key] = DcpTensor(size, "float32", tuple(chunks))
        for i, (off, sz) in enumerate(chunks):
            name = f"__{writers[i] if writers else 0}_0.distcp"
            items[(key, off)] = DcpItem(name, at.get(name, 0), 4 * math.prod(sz))
            at[name] = at.get(name, 0) + 4 * math.prod(sz)

    for key, size in {**PRE, **POST}.items():
        add(key, size, [((0,) * len(size), size)])
    for name, size in DENSE_LAYER.items():
        add(f"decoder.layers.{name}", (LAYERS, *size), [((i, *(0,) * len(size)), (1, *size)) for i in range(LAYERS)])
    add("decoder.layers.mlp.router.expert_bias", (LAYERS, E), [((i, 0), (1, E)) for i in range(LAYERS)])
    for name, size in EXPERT.items():  # written by the expert-DP rank 0 of each expert's EP rank
        add(f"decoder.layers.{name}", (LAYERS, E, *size),
            [((i, e, 0, 0), (1, 1, *size)) for i in range(LAYERS) for e in range(E)], [e // (E // ep)
                                                                                        for _ in range(LAYERS)
                                                                                        for e in range(E)])
    dense = [BufferParam(k, math.prod(s)) for k, s in PRE.items()]
    for i in range(LAYERS):
        layer = [BufferParam(f"{n}#{i}", math.prod(DENSE_LAYER[n])) for n in DENSE_LAYER]
        experts = [BufferParam(f"{n}#{i}.{j}", math.prod(EXPERT[n])) for j in range(E) for n in EXPERT]
        dense += layer[:experts_after] + (experts if ep == 1 else []) + layer[experts_after:]
    dense += [BufferParam(k, math.prod(s)) for k, s in POST.items()]
    buffers = [(0 if ep > 1 else None, 0, bucket_layout(dense, EP * EDP)[0], lambda r: r)]
    for e in range(ep if ep > 1 else 0):  # expert rank order (expert TP, EP, expert DP): rank e + EP x expert DP rank
        buffers.append((1, e, _expert_bucket(), lambda r, e=e: e + EP * r))
    for sub in range(2, sub_max + 1):  # another sub-optimizer's bucket, as megatron-core chains more of them
        buffers.append((sub, 0, buffers[0][2], lambda r: r))
    for sub, group, bucket, rank in buffers:
        pieces = [(p.start, p.stop - p.start, p.dp_rank) for p in bucket.pieces]
        size = bucket.numel_unpadded
        if shrink_expert and (sub, group) == (1, 1):
            start, n, r = pieces[-1]
            pieces[-1], size = (start, n - 1, r), size - 1
        for state in ("param", "exp_avg", "exp_avg_sq"):
            add(_key(sub, group, state), (size,), [((s,), (n,)) for s, n, _ in pieces], [rank(r) for _, _, r in pieces])
    args = argparse.Namespace(vocab_size=VOCAB, expert_model_parallel_size=saved_ep if ep > 1 else 1)
    return TorchDistCheckpoint("/ckpt", DcpIndex(tensors, (), items), {"args": args, "iteration": 3},
                               "dp_reshardable")


def test_expert_buffers_read_from_each_ep_rank_and_planned_at_another_ep() -> None:
    bucket = _expert_bucket()
    assert bucket.numel_unpadded < bucket.numel and any(p.param is None for p in bucket.pieces)  # padding, both kinds
    ck = _checkpoint()
    metas, layer_keys = index_model_metas(ck)
    assert layer_keys == tuple(f"decoder.layers.{n}" for n in (
        *list(DENSE_LAYER)[:7], *EXPERT, *list(DENSE_LAYER)[7:]))  # the experts between the router and shared expert
    assert metas["decoder.layers.mlp.router.expert_bias"].tp_axis is None
    assert metas["decoder.layers.mlp.experts.experts.linear_fc2.weight"].tp_axis == 3
    ptc = describe_torch_dist(ck, metas, layer_keys, {"exp_avg", "exp_avg_sq"})
    assert ptc.layout == {"tp": 1, "pp": 1, "dp": 4, "ep": 2}
    key_of = {(i.relative_path, i.offset): k for (k, _), i in ck.storage.items()}
    for name in EXPERT:  # an expert's state comes from its own EP rank's buffer, whole
        okey = f"optimizer.state.exp_avg.decoder.layers.{name}"
        per: dict[tuple[int, int], int] = {}
        for sc in ptc.chunks:
            if sc.chunk.key != okey:
                continue
            layer, e = sc.chunk.offsets[:2]
            src = key_of[(sc.location.file, int(sc.location.name.split(":")[0]))]
            assert src.startswith(f"chained_1.optimizer.distributed.dp_group_idx_{e // (E // EP)}."), (e, src)
            per[(layer, e)] = per.get((layer, e), 0) + sc.chunk.numel
        assert per == {(la, e): math.prod(EXPERT[name]) for la in range(LAYERS) for e in range(E)}
    for dst in (ParallelLayout(1, 1, 4), ParallelLayout(1, 2, 2, ep=2), ParallelLayout(2, 1, 2, ep=4, etp=1)):
        plan = plan_reshard(ptc, ptc.tensors, layout_chunks(ptc.tensors, dst, True), strict=True)  # each element once
        assert plan.total_bytes_read == sum(plan.bytes_per_rank().values()) > 0


def test_experts_in_the_dense_buffer_at_ep1() -> None:
    """megatron-core keeps no expert buffer at EP1: the experts are parameters of the dense one, after the router."""
    ck = _checkpoint(ep=1)
    assert not any(k.startswith("chained_") for k in ck.tensors())
    ptc = describe_torch_dist(ck, *index_model_metas(ck), {"exp_avg"})
    assert ptc.layout == {"tp": 1, "pp": 1, "dp": 4}
    okey = "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc2.weight"
    assert sum(sc.chunk.numel for sc in ptc.chunks if sc.chunk.key == okey) == LAYERS * E * H * F
    plan = plan_reshard(ptc, ptc.tensors, layout_chunks(ptc.tensors, ParallelLayout(1, 1, 4, ep=4), True), strict=True)
    assert plan.total_bytes_read > 0
    bad = _checkpoint(ep=1, experts_after=len(DENSE_LAYER))  # experts after the shared expert: no module order's
    with pytest.raises(MegatronCheckpointError, match=r"dp_group_idx_0\.gbuf_idx_0.*do not match"):
        describe_torch_dist(bad, *index_model_metas(bad), {"exp_avg"})


def test_expert_buffer_that_does_not_fit_is_refused_naming_it() -> None:
    ck = _checkpoint(shrink_expert=True)
    with pytest.raises(MegatronCheckpointError, match=r"chained_1\.optimizer\.distributed\.dp_group_idx_1\..*"
                                                      r"do not match .*the experts' buffer of EP rank 1, expert DP 2"):
        describe_torch_dist(ck, *index_model_metas(ck), {"exp_avg"})


def test_other_chained_optimizers_and_contradicting_args_are_refused() -> None:
    ck = _checkpoint(sub_max=2)
    with pytest.raises(MegatronCheckpointError, match=r"chained_2\.optimizer.*more than a dense and an expert"):
        describe_torch_dist(ck, *index_model_metas(ck), {"exp_avg"})
    ck = _checkpoint(saved_ep=4)
    with pytest.raises(MegatronCheckpointError, match=r"2 groups \(EP 2 at expert TP 1 x PP 1\); the saved args "
                                                      r"record expert_model_parallel_size=4"):
        describe_torch_dist(ck, *index_model_metas(ck), {"exp_avg"})
