"""Megatron's own ``torch_dist`` checkpoint described as a PTC, without torch: the one description that adoption
(``integrations/megatron_core/native.py``, with the live model's tensors) and ``python -m tenplex_megatron plan``
(with :func:`index_model_metas`, the tensors as the index shows them) both use.

The model's TP-local tensors are the ``.distcp`` items torch's distributed-checkpoint index names (file, offset,
length); each bucket of the distributed optimizer's flat ``dp_reshardable`` buffers is cut into flat ranges of the
TP-local parameter boxes with megatron-core 0.16.1's buffer layout at the saving layout
(``plan/megatron_buffer.py``), checked piece by piece against the index (padding included); ``fully_reshardable``
and plain-optimizer checkpoints hold model-space optimizer tensors, read as they are.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.megatron_buffer import BucketArgsError, BufferParam, bucket_layout, saved_bucketing
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, PTCError, StoredChunk, TensorMeta
from tenplex_megatron.plan.sim.gpt_catalogue import LAYER_TP_AXES
from tenplex_megatron.plan.sim.sharding import local_param_boxes
from tenplex_megatron.storage.confine import confine
from tenplex_megatron.storage.distcp_index import DcpIndex, DcpItem, DcpTensor, read_dcp_metadata
from tenplex_megatron.storage.files import CheckpointFileError

SUPPORTED_BACKENDS = {("torch_dist", 1)}  # metadata.json's (sharded_backend, sharded_backend_version)
SUPPORTED_SHARDING = ("dp_reshardable", "fully_reshardable")
STATE_NAMES = {"param": "fp32_param", "fp32_param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
# megatron-core's GPTModel, outside the transformer layers, in module order
PRE_KEYS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
POST_KEYS = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")
_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.(\w+)")
_RANK_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")
#: megatron-core 0.19+ saves the common state as ShardedObject("common_state", global shape (1,), offset (0,)),
#: rank 0's replica written, instead of common.pt.
COMMON_STATE_KEY = "common_state/shard_0_1"


class MegatronCheckpointError(CheckpointFileError):
    """A Megatron checkpoint that tenplex cannot read, or that does not fit the job."""


@dataclass(frozen=True)
class TorchDistCheckpoint:
    """What a megatron-core ``torch_dist`` directory holds: its index, common state and optimizer format."""

    path: str
    index: DcpIndex
    common: dict[str, Any]
    sharding_type: str | None  # the distributed optimizer's format; None: a plain optimizer (or none)
    common_source: str = ""  # where ``common`` was read: ``common.pt``, or the .distcp object (megatron-core 0.19+)

    @property
    def storage(self) -> dict[tuple[str, tuple[int, ...]], DcpItem]:
        return self.index.items

    def tensors(self) -> dict[str, DcpTensor]:
        return self.index.tensors

    def world(self) -> int:
        ranks = {int(m.group(1)) for s in self.storage.values() if (m := _RANK_FILE.fullmatch(s.relative_path))}
        return max(ranks) + 1 if ranks else 1

    def writer(self, info: Any) -> int:
        m = _RANK_FILE.fullmatch(info.relative_path)
        return int(m.group(1)) if m else 0


def common_state(path: str, index: DcpIndex) -> tuple[str, bytes | None]:
    """Where a ``torch_dist`` checkpoint keeps its common (non-tensor) state: ``common.pt`` (megatron-core up to 0.18,
    and what 0.19 still reads first), or, from 0.19, the ``common_state`` object inside the ``.distcp`` files (the
    pickle's bytes returned with a name for errors). Neither: ``common.pt``, whose reader reports it missing."""
    legacy = os.path.join(path, "common.pt")
    item = index.items.get((COMMON_STATE_KEY, ()))
    if os.path.isfile(legacy) or item is None:
        return legacy, None
    name = f"{os.path.join(path, item.relative_path)} (object {COMMON_STATE_KEY!r})"
    try:
        with open(confine(path, item.relative_path, "the torch_dist index"), "rb") as f:
            f.seek(item.offset)
            data = f.read(item.length)
    except OSError as e:
        raise MegatronCheckpointError(f"{name}: unreadable ({e})") from None
    if len(data) != item.length:
        raise MegatronCheckpointError(f"{name}: the index names {item.length} bytes at {item.offset}, the file has "
                                      f"{len(data)} there (truncated?)")
    return name, data


def common_dict(name: str, data: bytes | None, obj: Any) -> dict[str, Any]:
    """The common state as read from ``common.pt`` (a dict) or 0.19's object (``data``: the dict in a one-item list,
    as megatron-core saves a sharded object's data); anything else fails naming where it was read."""
    if data is not None and isinstance(obj, (list, tuple)) and len(obj) == 1:
        obj = obj[0]
    if not isinstance(obj, dict):
        raise MegatronCheckpointError(f"{name}: not a dict")
    return obj


def read_torch_dist(path: str, load_common: Callable[[str, bytes | None], Any], *,
                    trust_pickles: bool = False) -> TorchDistCheckpoint:
    """Read a ``torch_dist`` checkpoint's ``metadata.json``, index and common state (:func:`common_state`; with
    ``load_common(name, data)``, data None meaning the file ``name``: torch's restricted ``torch.load`` at adoption,
    the torch-free reader in the cli), checking the format."""
    try:
        with open(os.path.join(path, "metadata.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise MegatronCheckpointError(f"{os.path.join(path, 'metadata.json')}: unreadable ({e})") from None
    found = (meta.get("sharded_backend"), meta.get("sharded_backend_version"))
    if found not in SUPPORTED_BACKENDS:
        supported = ", ".join(f"{b} version {v}" for b, v in sorted(SUPPORTED_BACKENDS))
        raise MegatronCheckpointError(f"{os.path.join(path, 'metadata.json')}: sharded backend {found[0]} version "
                                      f"{found[1]} is not supported (tenplex reads {supported})")
    index = read_dcp_metadata(path, trust_pickles=trust_pickles)
    source, data = common_state(path, index)
    common = common_dict(source, data, load_common(source, data))
    content = common.get("content_metadata") or {}
    opt = common.get("optimizer") or {}
    sharding = opt.get("param_state_sharding_type") if isinstance(opt, dict) else None
    sharding = sharding or (content.get("distrib_optim_sharding_type") if any(
        k.startswith("optimizer.distributed.") for k in index.tensors) else None)
    if sharding is not None and sharding not in SUPPORTED_SHARDING:
        raise MegatronCheckpointError(f"{path}: distributed-optimizer format {sharding!r} is not supported "
                                      f"(tenplex reads {', '.join(SUPPORTED_SHARDING)})")
    for name in sorted({s.relative_path for s in index.items.values()}):  # every rank's file, whoever reads it
        if not os.path.isfile(confine(path, name, "the torch_dist index")):
            raise MegatronCheckpointError(f"{os.path.join(path, name)}: missing (the index names it: every rank's "
                                          "file must be there)")
    return TorchDistCheckpoint(path, index, common, sharding, source)


def _loc(ck: TorchDistCheckpoint, info: Any, numel: int, skip: int) -> Location:
    return Location(info.relative_path, f"{info.offset}:{info.length}:{numel}:{skip}", ck.writer(info))


def _saved_tp(ck: TorchDistCheckpoint, live: dict[str, TensorMeta]) -> int:
    for key, t in sorted(live.items()):
        st = ck.tensors().get(key)
        if t.tp_axis is not None and st is not None:
            parts = {offsets[t.tp_axis] for offsets, _ in st.chunks}
            return max(len(parts) // t.tp_parts, 1)
    return 1


def check_model(ck: TorchDistCheckpoint, live: dict[str, TensorMeta]) -> None:
    """Refuse another model's checkpoint: every model tensor present with the same shape (vocabulary rows apart)."""
    saved = ck.tensors()
    for key, t in sorted(live.items()):
        if t.param is not None:
            continue
        st = saved.get(key)
        if st is None:
            raise MegatronCheckpointError(f"{ck.path}: the checkpoint has no tensor {key!r}: is it from a different "
                                          "model?")
        shape = st.size
        same = shape[1:] == t.global_shape[1:] if t.vocab_rows is not None else shape == t.global_shape
        if not same:
            raise MegatronCheckpointError(f"{ck.path}: tensor {key!r} has shape {list(shape)} in the checkpoint, "
                                          f"{list(t.global_shape)} in the model: is it from a different model?")


def stage_params(metas: dict[str, TensorMeta], layer_keys: tuple[str, ...], saved: set[str], layout: ParallelLayout,
                  tp_rank: int, pp_rank: int) -> list[tuple[BufferParam, list[tuple[tuple[int, ...], tuple[int, ...]]],
                                                              str]]:
    """One (TP, PP) rank's parameters at the saving layout in module order: (buffer entry, part boxes, key)."""
    out = []

    def add(key: str, boxes: list, shared: bool, name: str) -> None:
        n = sum(math.prod(s) for _, s in boxes)
        out.append((BufferParam(name, n, shared), boxes, key))

    tied_pp = "output_layer.weight" not in saved and layout.pp > 1
    if pp_rank == 0:
        for key in PRE_KEYS:
            if key in saved:
                add(key, local_param_boxes(metas[key], layout, tp_rank, pp_rank)[0],
                    tied_pp and key == PRE_KEYS[0], key)
    layers = {k: local_param_boxes(metas[k], layout, tp_rank, pp_rank) for k in layer_keys}
    per = next(iter(layers.values()), [])
    for i in range(len(per)):
        for key in layer_keys:
            add(key, layers[key][i], False, f"{key}#{i}")
    if pp_rank == layout.pp - 1:
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


def _bucket_groups(ck: TorchDistCheckpoint) -> dict[int, dict[int, dict[str, tuple[str, Any]]]]:
    """The ``dp_reshardable`` bucket tensors: DP group -> bucket -> state -> (key, index entry)."""
    groups: dict[int, dict[int, dict[str, tuple[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for key, st in ck.tensors().items():
        m = _BUCKET.fullmatch(key)
        if m is None:
            continue
        g, gbuf, b, state = int(m.group(1)), int(m.group(2)), int(m.group(4)), m.group(5)
        if gbuf != 0:
            raise MegatronCheckpointError(f"{ck.path}: {key}: more than one grad buffer (mixed dtypes or experts) "
                                          "is not supported")
        if state not in STATE_NAMES:
            raise MegatronCheckpointError(f"{ck.path}: {key}: optimizer state {state!r} is not supported (tenplex "
                                          f"reads Adam's: {', '.join(sorted(STATE_NAMES))})")
        groups[g][b][state] = (key, st)
    return groups


def _fitted_buckets(ck: TorchDistCheckpoint, metas: dict[str, TensorMeta], layer_keys: tuple[str, ...],
                    layout: ParallelLayout, groups: dict) -> list[tuple[int, Any, list]]:
    """Every DP group's buckets as megatron-core 0.16.1 lays out this parameter order, each stored piece checked
    against them (offsets and sizes, padding included): (group, parameters, buckets); a mismatch raises."""
    saved = {k for k in ck.tensors() if not k.startswith("optimizer.")}
    args = ck.common.get("args")
    out = []
    for g, buckets in sorted(groups.items()):
        tp_rank, pp_rank = g % layout.tp, g // layout.tp
        params = stage_params(metas, layer_keys, saved, layout, tp_rank, pp_rank)
        try:
            bucket_size, high_busbw = saved_bucketing(args, layout.dp, pp_rank)
        except BucketArgsError as e:
            raise MegatronCheckpointError(f"{ck.path}: saved args: {e}") from None
        layout_buckets = bucket_layout([p for p, _, _ in params], layout.dp, bucket_size, high_busbw)
        if sorted(buckets) != list(range(len(layout_buckets))):
            raise MegatronCheckpointError(
                f"{ck.path}: dp_group_idx_{g} has buckets {sorted(buckets)}; megatron-core 0.16.1's layout of this "
                f"model at {layout} has {len(layout_buckets)} (bucket size {bucket_size} from the saved args: "
                "another model?)")
        for b, bucket in enumerate(layout_buckets):
            for _, (key, st) in sorted(buckets[b].items()):
                got = {(offsets[0], sizes[0]) for offsets, sizes in st.chunks}
                want = {(p.start, p.stop - p.start) for p in bucket.pieces}
                if tuple(st.size) != (bucket.numel_unpadded,) or got != want:
                    extra, missing = sorted(got - want), sorted(want - got)
                    raise MegatronCheckpointError(
                        f"{ck.path}: {key}: {st.size[0]} elements in pieces that do not match megatron-core 0.16.1's "
                        f"buffer layout at {layout} ({bucket.numel_unpadded} elements; first unexpected piece "
                        f"(offset, size) {extra[:1]}, first missing {missing[:1]}): another model or layout?")
        out.append((g, params, layout_buckets))
    return out


def _spec_order(ck: TorchDistCheckpoint) -> tuple[tuple[str, ...] | None, str | None]:
    """The layer parameter order of the spec the saved args record (``transformer_impl``), and that record."""
    args = ck.common.get("args")
    impl = args.get("transformer_impl") if isinstance(args, dict) else getattr(args, "transformer_impl", None)
    return ({"transformer_engine": TE_LAYER_ORDER, "local": LAYER_ORDER}.get(str(impl)) if impl else None,
            str(impl) if impl else None)


def layer_order(ck: TorchDistCheckpoint, metas: dict[str, TensorMeta], layout: ParallelLayout,
                candidates: tuple[tuple[str, ...], ...], groups: dict) -> tuple[str, ...]:
    """One transformer layer's parameter order in the distributed optimizer's buffer, as the checkpoint shows it.

    The index holds every parameter's piece of each bucket (its offset and size), not the parameters' names; so
    each candidate order (the live model's, the local spec's, Transformer Engine's, where the attention norm is a
    parameter of ``linear_qkv``) is laid out and kept only if it reproduces every stored piece. One fitting order
    (or several the same) is the checkpoint's; between different ones that fit, the spec the saved args record
    (``transformer_impl``) decides; with none recorded, it is refused: which parameter's state is which is not
    in the checkpoint."""
    layer_keys = {k for k in metas if k.startswith("decoder.layers.")}
    orders = []
    for c in candidates:
        order = tuple(k for k in (k if k.startswith("decoder.layers.") else f"decoder.layers.{k}" for k in c)
                      if k in layer_keys)
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


def _dist_opt_chunks(ck: TorchDistCheckpoint, metas: dict[str, TensorMeta], layer_keys: tuple[str, ...],
                     layout: ParallelLayout, states: set[str]) -> tuple[list[StoredChunk], dict[str, str]]:
    """The ``dp_reshardable`` buckets as flat ranges of the TP-local parameter boxes, checked piece by piece, in the
    layer parameter order the checkpoint's pieces show (:func:`layer_order`; ``layer_keys``: the live model's)."""
    groups = _bucket_groups(ck)
    if len(groups) != layout.tp * layout.pp:
        raise MegatronCheckpointError(f"{ck.path}: {len(groups)} distributed-optimizer groups, expected TP x PP = "
                                      f"{layout.tp * layout.pp} at the saving layout {layout}")
    order = layer_order(ck, metas, layout, (layer_keys, LAYER_ORDER, TE_LAYER_ORDER), groups)
    out: list[StoredChunk] = []
    dtypes: dict[str, str] = {}
    for g, params, layout_buckets in _fitted_buckets(ck, metas, order, layout, groups):
        where = {p.name: (boxes, key) for p, boxes, key in params}
        for b, bucket in enumerate(layout_buckets):
            for state, (key, st) in sorted(groups[g][b].items()):
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
                                               _loc(ck, info, piece.stop - piece.start, at + a - lo)))
    return out, dtypes


def describe_torch_dist(ck: TorchDistCheckpoint, live: dict[str, TensorMeta], layer_keys: tuple[str, ...],
                        wanted: set[str]) -> PTC:
    """The checkpoint as a PTC with the live job's tensor keys (the optimizer's as tenplex names them).

    ``live``: the job's model tensors; ``wanted``: the optimizer states it keeps (``fp32_param`` only when the
    model's weights are not fp32 themselves)."""
    check_model(ck, live)
    saved = ck.tensors()
    chained = sorted(k for k in saved if k.startswith("chained_"))
    if chained:
        raise MegatronCheckpointError(
            f"{ck.path}: {chained[0]}: a chained (dense + expert) distributed optimizer saved dp_reshardable is not "
            "adopted yet: save the mixture of experts with --dist-ckpt-optim-fully-reshardable, or with --tenplex")
    tp = _saved_tp(ck, live)
    groups = {int(m.group(1)) for k in saved if (m := _BUCKET.fullmatch(k))}
    pp = max(len(groups) // tp, 1) if groups else 1
    ep = int(getattr(ck.common.get("args"), "expert_model_parallel_size", None) or 1)
    dp = max(ck.world() // (tp * pp), 1)
    layout = ParallelLayout(tp, pp, dp, ep=ep if (tp * pp * dp) % (tp * ep * pp) == 0 else 1)
    model = {k: t for k, t in live.items() if t.param is None}
    metas = {k: replace(t, global_shape=saved[k].size, dtype=saved[k].dtype) for k, t in model.items()}
    tensors: dict[str, TensorMeta] = dict(metas)
    chunks: list[StoredChunk] = []
    for key in metas:
        for offsets, sizes in saved[key].chunks:
            chunks.append(StoredChunk(Chunk(key, offsets, sizes), _loc(ck, ck.storage[(key, offsets)],
                                                                       math.prod(sizes), 0)))
    if ck.sharding_type == "dp_reshardable":
        opt_chunks, dtypes = _dist_opt_chunks(ck, metas, layer_keys, layout, wanted)
        chunks.extend(opt_chunks)
        for okey, dtype in dtypes.items():
            pkey = okey.split(".", 3)[3]
            tensors[okey] = replace(metas[pkey], key=okey, dtype=dtype, param=pkey)
    else:  # model-space optimizer tensors: optimizer.state.<state>.<param key>
        for key, st in saved.items():
            if not key.startswith("optimizer."):
                continue
            parts = key.split(".", 3)
            if len(parts) < 4 or parts[1] != "state" or parts[2] not in STATE_NAMES:
                raise MegatronCheckpointError(f"{ck.path}: optimizer tensor {key!r} is not supported (tenplex reads "
                                              f"Adam's states: {', '.join(sorted(STATE_NAMES))})")
            name, pkey = STATE_NAMES[parts[2]], parts[3]
            if name not in wanted or pkey not in metas:
                continue
            okey = f"optimizer.state.{name}.{pkey}"
            tensors[okey] = replace(metas[pkey], key=okey, global_shape=st.size, dtype=st.dtype, param=pkey)
            for offsets, sizes in st.chunks:
                chunks.append(StoredChunk(Chunk(okey, offsets, sizes), _loc(ck, ck.storage[(key, offsets)],
                                                                            math.prod(sizes), 0)))
    ptc = PTC(tensors, tuple(chunks), layout.to_json())
    try:
        ptc.validate()
    except PTCError as e:
        raise MegatronCheckpointError(f"{ck.path}: {e}") from None
    return ptc




# the axis TP splits a stacked layer tensor along (axis 0: the layers)
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
_REPLICATED = re.compile(r"(self_attention\.linear_qkv|mlp\.linear_fc1)\.layer_norm_(weight|bias)|"
                         r"(self_attention\.linear_proj|mlp\.linear_fc2)\.bias")


def gpt_tensor_meta(path: str, key: str, size: tuple[int, ...], dtype: str, vocab_size: int | None, tied: bool,
                    fc1_parts: int) -> TensorMeta:
    """How TP and PP split the megatron-core GPTModel tensor ``key`` (global ``size``; layers stacked on axis 0), as
    ``plan/sim/gpt_catalogue.gpt_tensors`` models it (its :data:`LAYER_TP_AXES`); another tensor fails naming it."""
    if key in (PRE_KEYS[0], "output_layer.weight"):
        first = key == PRE_KEYS[0]
        return TensorMeta(key, size, dtype, vocab_size or size[0], 0, 1, "first" if first else "last", first and tied)
    if key == PRE_KEYS[1]:
        return TensorMeta(key, size, dtype, stage="first")
    if key in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
        return TensorMeta(key, size, dtype, stage="last")
    name = key[len("decoder.layers."):]
    if key.startswith("decoder.layers.") and (name in LAYER_TP_AXES or _REPLICATED.fullmatch(name)):
        return TensorMeta(key, size, dtype, tp_axis=LAYER_TP_AXES.get(name),
                          tp_parts=fc1_parts if name.startswith("mlp.linear_fc1.") else 1, stage="layers")
    raise MegatronCheckpointError(f"{path}: tensor {key!r}: not a parameter of megatron-core's GPTModel that `plan` "
                                  "knows how TP and PP split (adopt it with --tenplex, which takes the split from the "
                                  "model)")


def index_model_metas(ck: TorchDistCheckpoint) -> tuple[dict[str, TensorMeta], tuple[str, ...]]:
    """The model's tensors as the index shows them and one layer's keys in megatron-core's module order
    (:data:`LAYER_ORDER`; the index's own order is the writers', not the model's, at DP > 1): the live model's
    stand-in for ``plan``."""
    saved = {k: t for k, t in ck.tensors().items() if not k.startswith("optimizer.")}
    args = ck.common.get("args")
    fc1, fc2 = saved.get("decoder.layers.mlp.linear_fc1.weight"), saved.get("decoder.layers.mlp.linear_fc2.weight")
    parts = fc1.size[1] // fc2.size[2] if fc1 is not None and fc2 is not None else 1
    tied = "output_layer.weight" not in saved
    vocab = int(getattr(args, "vocab_size", 0) or 0) or None
    out = {k: gpt_tensor_meta(ck.path, k, tuple(t.size), t.dtype, vocab, tied, parts) for k, t in saved.items()}
    return out, tuple(f"decoder.layers.{n}" for n in LAYER_ORDER if f"decoder.layers.{n}" in saved)
