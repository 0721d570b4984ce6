"""The distributed optimizer's ``dp_reshardable`` buckets of a Megatron ``torch_dist`` checkpoint, without torch: each
bucket of the flat buffers cut into flat ranges of the TP-local parameter boxes with megatron-core 0.16.1's buffer
layout at the saving layout (``plan/megatron_buffer.py``), checked piece by piece against the index (padding
included), in the layer parameter order the stored pieces show.

A mixture of experts at EP > 1 has two buffers per rank: the dense one, and the routed experts' own (megatron-core's
``expert_parallel_buffers``: the parameters with ``allreduce`` False, cut over the expert data-parallel group), each
with its sub-optimizer of the chained optimizer (keys ``chained_0.`` and ``chained_1.``; the experts'
``dp_group_idx`` is the rank in the expert TP x EP x PP group). At EP 1 the experts are ordinary parameters of the
dense buffer, where SequentialMLP's local experts sit in module order.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any

from tenplex_megatron.plan.experts import is_expert_key
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.megatron_buffer import BucketArgsError, BufferParam, bucket_layout, saved_bucketing
from tenplex_megatron.plan.ptc import Chunk, StoredChunk, TensorMeta
from tenplex_megatron.plan.sim.gpt_catalogue import EXPERT_BIAS
from tenplex_megatron.plan.sim.sharding import local_param_boxes
from tenplex_megatron.storage.megatron_torch_dist import (
    POST_KEYS,
    PRE_KEYS,
    STATE_NAMES,
    MegatronCheckpointError,
    TorchDistCheckpoint,
    dcp_location,
    is_optimizer_key,
    saved_arg,
)

# a dp_reshardable bucket's tensor; ``chained_N.``: the N-th sub-optimizer of megatron-core's chained optimizer (a
# mixture of experts at EP > 1: 0 dense, 1 the routed experts)
_BUCKET = re.compile(r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                     r"\.bucket_idx_(\d+)\.(\w+)")
#: the two buffers of a rank under the distributed optimizer: the dense parameters', the routed experts' (EP > 1)
DENSE, EXPERTS = "dense", "experts"

# one transformer layer's parameters in megatron-core's ``module.parameters()`` order (the local spec's: the input
# layernorm, the attention's output projection before its QKV, the pre-MLP layernorm, the MLP), by their sharded keys
LAYER_ORDER = ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
               "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
               "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
               "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias", "mlp.linear_fc1.weight",
               "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
# Transformer Engine's spec: no separate norm modules; the attention's norm is a parameter of linear_qkv (built after
# linear_proj, its norm registered before its weight), the MLP's of linear_fc1; the same sharded keys as the local spec
TE_LAYER_ORDER = ("self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
                  "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
                  "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                  "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias", "mlp.linear_fc1.weight",
                  "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
# a mixture-of-experts MLP (megatron-core's MoELayer) after the pre-MLP norm: the router, the routed experts (one
# SequentialMLP local expert's parameters, repeated for each), the shared experts (their gate registered last)
MOE_MLP_ORDER = ("mlp.router.weight", "mlp.router.bias",
                 "mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc1.bias",
                 "mlp.experts.experts.linear_fc2.weight", "mlp.experts.experts.linear_fc2.bias",
                 "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc1.bias",
                 "mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.linear_fc2.bias",
                 "mlp.shared_experts.gate_weight")
# Transformer Engine's MoE layer: its pre-MLP norm is a module of its own (keys ``pre_mlp_layernorm.*``)
TE_MOE_TAIL = ("pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias", *MOE_MLP_ORDER)


def layer_blocks(layer_keys: tuple[str, ...]) -> list[str | tuple[str, ...]]:
    """One transformer layer's parameters in module order (repeats dropped), the routed experts' keys (one local
    expert's parameters, in order) as one block where SequentialMLP's local experts sit; experts that are not
    together fail naming the tensor."""
    out: list[str | list[str]] = []
    block: list[str] | None = None
    for key in dict.fromkeys(layer_keys):
        if not is_expert_key(key):
            out.append(key)
            continue
        if block is None:
            block = []
            out.append(block)
        elif out[-1] is not block:
            raise MegatronCheckpointError(f"tensor {key!r}: the routed experts' parameters are not together in the "
                                          "layer's module order (megatron-core's SequentialMLP holds them)")
        block.append(key)
    return [b if isinstance(b, str) else tuple(b) for b in out]


def stage_params(metas: dict[str, TensorMeta], layer_keys: tuple[str, ...], saved: set[str], layout: ParallelLayout,
                 tp_rank: int, pp_rank: int, ep_rank: int = 0, buffer: str = DENSE
                 ) -> list[tuple[BufferParam, list[tuple[tuple[int, ...], tuple[int, ...]]], str]]:
    """One rank's parameters of one buffer at the saving layout in module order: (buffer entry, part boxes, key).

    ``buffer`` :data:`DENSE`: the (TP, PP) rank's dense parameters, and the routed experts where megatron-core puts
    them in the same buffer (EP 1); :data:`EXPERTS`: the experts of (expert TP rank ``tp_rank``, ``ep_rank``,
    ``pp_rank``) at EP > 1, layer by layer, each local expert's parameters in turn."""
    out = []

    def add(key: str, boxes: list, shared: bool, name: str) -> None:
        n = sum(math.prod(s) for _, s in boxes)
        out.append((BufferParam(name, n, shared), boxes, key))

    blocks = layer_blocks(layer_keys)
    expert_keys = [k for b in blocks if isinstance(b, tuple) for k in b]
    experts_here = buffer == EXPERTS or layout.ep == 1
    if expert_keys and layout.ep == 1 and layout.expert_tp != layout.tp:
        raise MegatronCheckpointError(f"tensor {expert_keys[0]!r}: expert TP {layout.expert_tp} differs from TP "
                                      f"{layout.tp} at EP 1 (the experts in the dense buffer): not supported")
    tied_pp = "output_layer.weight" not in saved and layout.pp > 1
    if pp_rank == 0 and buffer == DENSE:
        for key in PRE_KEYS:
            if key in saved:
                add(key, local_param_boxes(metas[key], layout, tp_rank, pp_rank)[0],
                    tied_pp and key == PRE_KEYS[0], key)
    layers = {k: local_param_boxes(metas[k], layout, tp_rank, pp_rank, ep_rank) for k in dict.fromkeys(layer_keys)}
    local = metas[expert_keys[0]].global_shape[1] // layout.ep if expert_keys else 0
    dense = [b for b in blocks if isinstance(b, str)]
    count = len(layers[dense[0]]) if dense else (len(layers[expert_keys[0]]) // local if expert_keys else 0)
    for i in range(count):
        for block in blocks:
            if isinstance(block, str):
                if buffer == DENSE:
                    add(block, layers[block][i], False, f"{block}#{i}")
            elif experts_here:
                for j in range(local):
                    for key in block:
                        add(key, layers[key][i * local + j], False, f"{key}#{i}.{j}")
    if pp_rank == layout.pp - 1 and buffer == DENSE:
        for key in POST_KEYS:
            if key in saved:
                add(key, local_param_boxes(metas[key], layout, tp_rank, pp_rank)[0], False, key)
        if tied_pp:  # the last stage's copy of the word embedding: its own bucket, a replica of the first stage's
            key = PRE_KEYS[0]
            add(key, local_param_boxes(metas[key], ParallelLayout(layout.tp, 1, layout.dp), tp_rank, 0)[0], True,
                f"{key}#copy")
    unknown = sorted(k for k in saved if not k.startswith("decoder.layers.") and k not in PRE_KEYS + POST_KEYS)
    if unknown:
        raise MegatronCheckpointError(f"tensor(s) {', '.join(unknown)}: not a parameter of megatron-core's GPTModel "
                                      "whose place in the distributed optimizer's buffer tenplex knows")
    return out


def split_flat(lo: int, hi: int, boxes: list) -> list[tuple[int, tuple[int, ...], tuple[int, ...], int, int]]:
    """Flat range ``[lo, hi)`` of a parameter made of ``boxes`` (in memory order): (part start, box..., lo, hi)."""
    out, at = [], 0
    for off, shape in boxes:
        n = math.prod(shape)
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            out.append((at, off, shape, a - at, b - at))
        at += n
    return out


def bucket_groups(ck: TorchDistCheckpoint) -> dict[tuple[str, int], dict[int, dict[str, tuple[str, Any]]]]:
    """The ``dp_reshardable`` bucket tensors: (buffer, DP group) -> bucket -> state -> (key, index entry); the
    buffer is :data:`DENSE`, or :data:`EXPERTS` for the chained optimizer's second sub-optimizer."""
    groups: dict[tuple[str, int], dict[int, dict[str, tuple[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    subs: dict[int | None, str] = {}
    for key, st in ck.tensors().items():
        m = _BUCKET.fullmatch(key)
        if m is None:
            continue
        sub = int(m.group(1)) if m.group(1) is not None else None
        g, gbuf, b, state = int(m.group(2)), int(m.group(3)), int(m.group(5)), m.group(6)
        if gbuf != 0:
            raise MegatronCheckpointError(f"{ck.path}: {key}: more than one grad buffer per sub-optimizer (mixed "
                                          "dtypes) is not supported")
        if sub is not None and sub > 1:
            raise MegatronCheckpointError(
                f"{ck.path}: {key}: a chained optimizer of more than a dense and an expert sub-optimizer (e.g. "
                "--overlap-param-gather-with-optimizer-step) is not supported")
        if state not in STATE_NAMES:
            raise MegatronCheckpointError(f"{ck.path}: {key}: optimizer state {state!r} is not supported (tenplex "
                                          f"reads Adam's: {', '.join(sorted(STATE_NAMES))})")
        subs.setdefault(sub, key)
        groups[(EXPERTS if sub == 1 else DENSE, g)][b][state] = (key, st)
    if None in subs and len(subs) > 1:
        raise MegatronCheckpointError(f"{ck.path}: {subs[None]} and {next(v for k, v in subs.items() if k is not None)}"
                                      ": buckets with and without a chained optimizer's prefix")
    if 1 in subs and 0 not in subs:
        raise MegatronCheckpointError(f"{ck.path}: {subs[1]}: an expert sub-optimizer without the dense one "
                                      "(chained_0.optimizer.distributed.*)")
    return groups


def _group_name(buckets: dict[int, dict[str, tuple[str, Any]]]) -> str:
    """A group's keys' common part, for errors: ``[chained_N.]optimizer.distributed.dp_group_idx_G``."""
    key = next(iter(next(iter(buckets.values())).values()))[0]
    return key.split(".gbuf_idx_")[0]


def _group_ranks(buffer: str, g: int, layout: ParallelLayout) -> tuple[int, int, int, int]:
    """(TP rank, EP rank, PP rank, DP size) of a buffer's ``dp_group_idx``: a dense group's is the rank in megatron's
    TP x PP group (TP fastest); an expert group's, in the expert TP x EP x PP group (expert TP fastest, then EP)."""
    if buffer == EXPERTS:
        etp = layout.expert_tp
        return g % etp, g // etp % layout.ep, g // (etp * layout.ep), layout.expert_dp
    return g % layout.tp, 0, g // layout.tp, layout.dp


def _fitted_buckets(ck: TorchDistCheckpoint, metas: dict[str, TensorMeta], layer_keys: tuple[str, ...],
                    layout: ParallelLayout, groups: dict) -> list[tuple[tuple[str, int], Any, list]]:
    """Every buffer's DP groups' buckets as megatron-core 0.16.1 lays out this parameter order, each stored piece
    checked against them (offsets and sizes, padding included): ((buffer, group), parameters, buckets); a mismatch
    raises."""
    saved = {k for k in ck.tensors() if not is_optimizer_key(k)}
    args = ck.common.get("args")
    out = []
    for (buffer, g), buckets in sorted(groups.items()):
        name = _group_name(buckets)
        tp_rank, ep_rank, pp_rank, dp = _group_ranks(buffer, g, layout)
        params = stage_params(metas, layer_keys, saved, layout, tp_rank, pp_rank, ep_rank, buffer)
        try:
            bucket_size, high_busbw = saved_bucketing(args, layout.dp, pp_rank)
        except BucketArgsError as e:
            raise MegatronCheckpointError(f"{ck.path}: saved args: {e}") from None
        what = f"at {layout}" + (f" (the experts' buffer of EP rank {ep_rank}, expert DP {dp})" if buffer == EXPERTS
                                 else "")
        if not params:
            raise MegatronCheckpointError(f"{ck.path}: {name}: megatron-core 0.16.1 keeps no parameter in this "
                                          f"buffer {what}: another model or layout?")
        layout_buckets = bucket_layout([p for p, _, _ in params], dp, bucket_size, high_busbw)
        if sorted(buckets) != list(range(len(layout_buckets))):
            raise MegatronCheckpointError(
                f"{ck.path}: {name} has buckets {sorted(buckets)}; megatron-core 0.16.1's layout of this "
                f"model {what} has {len(layout_buckets)} (bucket size {bucket_size} from the saved args: "
                "another model?)")
        for b, bucket in enumerate(layout_buckets):
            for _, (key, st) in sorted(buckets[b].items()):
                got = {(offsets[0], sizes[0]) for offsets, sizes in st.chunks}
                want = {(p.start, p.stop - p.start) for p in bucket.pieces}
                if tuple(st.size) != (bucket.numel_unpadded,) or got != want:
                    extra, missing = sorted(got - want), sorted(want - got)
                    raise MegatronCheckpointError(
                        f"{ck.path}: {key}: {st.size[0]} elements in pieces that do not match megatron-core 0.16.1's "
                        f"buffer layout {what} ({bucket.numel_unpadded} elements; first unexpected piece "
                        f"(offset, size) {extra[:1]}, first missing {missing[:1]}): another model or layout?")
        out.append(((buffer, g), params, layout_buckets))
    return out


def _spec_order(ck: TorchDistCheckpoint) -> tuple[tuple[str, ...] | None, str | None]:
    """The layer parameter order of the spec the saved args record (``transformer_impl``), and that record."""
    impl = saved_arg(ck.common.get("args"), "transformer_impl")
    return ({"transformer_engine": TE_LAYER_ORDER + TE_MOE_TAIL, "local": LAYER_ORDER + MOE_MLP_ORDER}.get(str(impl))
            if impl else None, str(impl) if impl else None)


def layer_param_keys(metas: dict[str, TensorMeta]) -> set[str]:
    """The transformer layers' parameters among the model's tensors (the router's expert bias is a buffer)."""
    return {k for k, t in metas.items() if k.startswith("decoder.layers.") and t.param is None
            and not k.endswith(EXPERT_BIAS)}


def layer_order(ck: TorchDistCheckpoint, metas: dict[str, TensorMeta], layout: ParallelLayout,
                candidates: tuple[tuple[str, ...], ...], groups: dict) -> tuple[str, ...]:
    """One transformer layer's parameter order in the distributed optimizer's buffers, as the checkpoint shows it.

    The index holds every parameter's piece of each bucket (its offset and size), not the parameters' names; so
    each candidate order (the live model's, the local spec's, Transformer Engine's, where the attention norm is a
    parameter of ``linear_qkv``) is laid out and kept only if it reproduces every stored piece. One fitting order
    (or several the same) is the checkpoint's; between different ones that fit, the spec the saved args record
    (``transformer_impl``) decides; with none recorded, it is refused: which parameter's state is which is not
    in the checkpoint."""
    layer_keys = layer_param_keys(metas)
    orders = []
    for c in candidates:
        order = tuple(k for k in dict.fromkeys(k if k.startswith("decoder.layers.") else f"decoder.layers.{k}"
                                               for k in c) if k in layer_keys)
        if set(order) == layer_keys and order not in orders:
            orders.append(order)
    errors: list[str] = []
    fits = []
    for order in orders:
        try:
            _fitted_buckets(ck, metas, order, layout, groups)
            fits.append(order)
        except MegatronCheckpointError as e:
            errors.append(str(e))
    if len(fits) == 1:
        return fits[0]
    if not fits:
        if not errors:
            raise MegatronCheckpointError(f"{ck.path}: no parameter order of a transformer layer tried (the live "
                                          "model's, the local spec's, Transformer Engine's) holds every layer "
                                          f"parameter: {', '.join(sorted(layer_keys))}")
        raise MegatronCheckpointError(errors[0] if len(errors) == 1 else
                                      f"{errors[0]} (no parameter order tried fits the stored pieces: the live "
                                      "model's, the local spec's, Transformer Engine's)")
    spec, impl = _spec_order(ck)
    chosen = tuple(f"decoder.layers.{k}" for k in spec if f"decoder.layers.{k}" in layer_keys) if spec else None
    if chosen in fits:
        return chosen
    why = (f"common.pt's args record transformer_impl={impl}, whose order is not one of them" if impl else
           "common.pt's args record no transformer_impl")
    raise MegatronCheckpointError(
        f"{ck.path}: the distributed optimizer's buckets fit {len(fits)} parameter orders of a transformer layer "
        f"({' / '.join(', '.join(k.removeprefix('decoder.layers.') for k in o[:3]) + ', ...' for o in fits)}) and "
        f"{why}: which parameter's optimizer state is which is not in the checkpoint")


def dist_opt_chunks(ck: TorchDistCheckpoint, metas: dict[str, TensorMeta], layer_keys: tuple[str, ...],
                     layout: ParallelLayout, groups: dict, states: set[str]) -> tuple[list[StoredChunk], dict[str, str]]:
    """The ``dp_reshardable`` buckets (the dense buffer's and, at EP > 1, the experts') as flat ranges of the
    TP-local parameter boxes, checked piece by piece, in the layer parameter order the checkpoint's pieces show
    (:func:`layer_order`; ``layer_keys``: the live model's)."""
    dense = sum(1 for b, _ in groups if b == DENSE)
    if dense != layout.tp * layout.pp:
        raise MegatronCheckpointError(f"{ck.path}: {dense} distributed-optimizer groups, expected TP x PP = "
                                      f"{layout.tp * layout.pp} at the saving layout {layout}")
    order = layer_order(ck, metas, layout, (layer_keys, LAYER_ORDER + MOE_MLP_ORDER, TE_LAYER_ORDER + TE_MOE_TAIL),
                        groups)
    out: list[StoredChunk] = []
    dtypes: dict[str, str] = {}
    for group, params, layout_buckets in _fitted_buckets(ck, metas, order, layout, groups):
        where = {p.name: (boxes, key) for p, boxes, key in params}
        for b, bucket in enumerate(layout_buckets):
            for state, (key, st) in sorted(groups[group][b].items()):
                name = STATE_NAMES[state]
                if name not in states:
                    continue
                for piece in bucket.pieces:
                    info = ck.storage.get((key, (piece.start,)))
                    if info is None:
                        raise MegatronCheckpointError(f"{ck.path}: the index has no data for {key} at {piece.start}")
                    if piece.param is None or piece.param.endswith("#copy"):
                        continue  # padding, or the last stage's replica of the word embedding
                    boxes, pkey = where[piece.param]
                    okey = f"optimizer.state.{name}.{pkey}"
                    dtypes[okey] = st.dtype
                    lo = piece.start - piece.param_start
                    for at, off, shape, a, bb in split_flat(lo, piece.stop - piece.param_start, boxes):
                        out.append(StoredChunk(Chunk(okey, tuple(off), tuple(shape), (a, bb)),
                                               dcp_location(ck, info, piece.stop - piece.start, at + a - lo)))
    return out, dtypes
