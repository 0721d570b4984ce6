"""A ``dp_reshardable`` checkpoint written by a Transformer Engine model: the distributed optimizer's parameter order
comes from the checkpoint's own stored pieces, not from the local spec (TE's attention norm is a parameter of
``linear_qkv``, after ``linear_proj``); when the pieces fit several orders and the args do not say which spec
wrote it, the checkpoint is refused instead of planned wrongly.

The index is synthetic (what megatron-core 0.16.1 saves for a 2-layer GPT at DP 1 or 2), built from the TE
module order directly; Transformer Engine itself needs a GPU.
"""

from __future__ import annotations

import argparse
import math

import pytest

from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.megatron_buffer import BufferParam, bucket_layout
from tenplex_megatron.storage.distcp_index import DcpIndex, DcpItem, DcpTensor
from tenplex_megatron.storage.megatron_buckets import LAYER_ORDER, TE_LAYER_ORDER, bucket_groups, layer_order
from tenplex_megatron.storage.megatron_ptc import (
    MegatronCheckpointError,
    TorchDistCheckpoint,
    describe_torch_dist,
    index_model_metas,
)

H, FFN, LAYERS, VOCAB, SEQ = 64, 256, 2, 128, 32
LAYER = {"self_attention.linear_qkv.layer_norm_weight": (H,), "self_attention.linear_qkv.layer_norm_bias": (H,),
         "self_attention.linear_proj.weight": (H, H), "self_attention.linear_proj.bias": (H,),
         "self_attention.linear_qkv.weight": (3 * H, H), "self_attention.linear_qkv.bias": (3 * H,),
         "mlp.linear_fc1.layer_norm_weight": (H,), "mlp.linear_fc1.layer_norm_bias": (H,),
         "mlp.linear_fc1.weight": (FFN, H), "mlp.linear_fc1.bias": (FFN,), "mlp.linear_fc2.weight": (H, FFN),
         "mlp.linear_fc2.bias": (H,)}
PRE = {"embedding.word_embeddings.weight": (VOCAB, H), "embedding.position_embeddings.weight": (SEQ, H)}
POST = {"decoder.final_layernorm.weight": (H,), "decoder.final_layernorm.bias": (H,)}
BUCKET = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.{}"


def _checkpoint(order: tuple[str, ...], dp: int, impl: str | None = None) -> TorchDistCheckpoint:
    """The index of a TP1 PP1 DP ``dp`` torch_dist checkpoint whose layers' parameters were in ``order``."""
    tensors: dict[str, DcpTensor] = {}
    items: dict = {}

    def add(key: str, size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]],
            writer: list[int] | None = None) -> None:
        tensors[key] = DcpTensor(size, "float32", tuple(chunks))
        for i, (off, sz) in enumerate(chunks):
            w = writer[i] if writer else 0
            items[(key, off)] = DcpItem(f"__{w}_0.distcp", 4 * sum(map(math.prod, (s for _, s in chunks[:i]))),
                                        4 * math.prod(sz))

    for key, size in {**PRE, **POST}.items():
        add(key, size, [((0,) * len(size), size)])
    for name, size in LAYER.items():
        add(f"decoder.layers.{name}", (LAYERS, *size), [((i, *(0,) * len(size)), (1, *size)) for i in range(LAYERS)])
    params = [BufferParam(k, math.prod(s)) for k, s in PRE.items()]
    params += [BufferParam(f"{n}#{i}", math.prod(LAYER[n])) for i in range(LAYERS) for n in order]
    params += [BufferParam(k, math.prod(s)) for k, s in POST.items()]
    (bucket,) = bucket_layout(params, dp)
    for state in ("param", "exp_avg", "exp_avg_sq"):
        add(BUCKET.format(state), (bucket.numel_unpadded,), [((p.start,), (p.stop - p.start,)) for p in bucket.pieces],
            [p.dp_rank for p in bucket.pieces])
    args = argparse.Namespace(vocab_size=VOCAB, **({"transformer_impl": impl} if impl else {}))
    return TorchDistCheckpoint("/ckpt", DcpIndex(tensors, (), items), {"args": args, "iteration": 3},
                               "dp_reshardable")


def _keys(order: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"decoder.layers.{n}" for n in order)


@pytest.mark.parametrize("dp", [1, 2])
def test_te_order_read_from_the_checkpoint(dp: int) -> None:
    assert TE_LAYER_ORDER != LAYER_ORDER and set(TE_LAYER_ORDER) == set(LAYER_ORDER) == set(LAYER)
    ck = _checkpoint(TE_LAYER_ORDER, dp)  # no transformer_impl in the args: the pieces alone decide
    metas, local = index_model_metas(ck)
    assert local == _keys(LAYER_ORDER)  # what `plan` assumed before: the local spec's order
    layout = ParallelLayout(1, 1, dp)
    assert layer_order(ck, metas, layout, (local, TE_LAYER_ORDER), bucket_groups(ck)) == _keys(TE_LAYER_ORDER)
    ptc = describe_torch_dist(ck, metas, local, {"exp_avg"})
    assert ptc.layout == layout.to_json()
    # the attention norm's moment is read where TE's order put it in the buffer (after linear_proj's, in reverse)
    params = [BufferParam(k, math.prod(s)) for k, s in PRE.items()]
    params += [BufferParam(f"{n}#{i}", math.prod(LAYER[n])) for i in range(LAYERS) for n in TE_LAYER_ORDER]
    (bucket,) = bucket_layout(params + [BufferParam(k, math.prod(s)) for k, s in POST.items()], dp)
    piece_at = {(i.relative_path, i.offset): p.start for p in bucket.pieces
                if (i := ck.storage[(BUCKET.format("exp_avg"), (p.start,))])}
    key = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    for layer in range(LAYERS):
        start = next(s for n, s, _ in bucket.params if n == f"self_attention.linear_qkv.layer_norm_weight#{layer}")
        got = [sc for sc in ptc.chunks if sc.chunk.key == key and sc.chunk.offsets[0] == layer]
        assert sum(sc.chunk.numel for sc in got) == H
        for sc in got:  # each stored piece of it: where in the bucket its first element lies
            off, _, _, skip = (int(x) for x in sc.location.name.split(":"))
            assert piece_at[(sc.location.file, off)] + skip == start + sc.chunk.flat[0]


def test_local_order_still_read() -> None:
    ck = _checkpoint(LAYER_ORDER, 2)
    metas, local = index_model_metas(ck)
    assert layer_order(ck, metas, ParallelLayout(1, 1, 2), (local, TE_LAYER_ORDER), bucket_groups(ck)) == local


def test_no_order_fits_is_refused_naming_the_bucket() -> None:
    odd = tuple(reversed(LAYER_ORDER))
    ck = _checkpoint(odd, 1)
    metas, local = index_model_metas(ck)
    with pytest.raises(MegatronCheckpointError, match=r"bucket_idx_0\.\w+: .*do not match .*no parameter order"):
        describe_torch_dist(ck, metas, local, {"exp_avg"})


def test_ambiguous_orders_need_the_args() -> None:
    """Two orders that differ only in equal-sized parameters lay out the same pieces: the checkpoint cannot say
    which state is which; the args' transformer_impl can, and without it the checkpoint is refused."""
    swapped = ("self_attention.linear_qkv.layer_norm_bias", "self_attention.linear_qkv.layer_norm_weight",
               *LAYER_ORDER[2:])
    for impl, want in (("local", _keys(LAYER_ORDER)), ("transformer_engine", None), (None, None)):
        ck = _checkpoint(LAYER_ORDER, 1, impl)
        metas, local = index_model_metas(ck)
        candidates = (_keys(swapped), local)
        if want is not None:
            assert layer_order(ck, metas, ParallelLayout(1, 1, 1), candidates, bucket_groups(ck)) == want
            continue
        with pytest.raises(MegatronCheckpointError, match="fit 2 parameter orders .* transformer_impl"):
            layer_order(ck, metas, ParallelLayout(1, 1, 1), candidates, bucket_groups(ck))
