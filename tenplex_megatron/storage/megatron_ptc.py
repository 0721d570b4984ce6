"""Megatron's own ``torch_dist`` checkpoint described as a PTC, without torch: the one description that adoption
(``integrations/megatron_core/native.py``, with the live model's tensors) and ``python -m tenplex_megatron plan``
(with :func:`index_model_metas`, the tensors as the index shows them) both use.

The model's TP-local tensors are the ``.distcp`` items torch's distributed-checkpoint index names (file, offset,
length); each bucket of the distributed optimizer's flat ``dp_reshardable`` buffers is cut into flat ranges of the
TP-local parameter boxes with megatron-core 0.16.1's buffer layout at the saving layout
(``plan/megatron_buffer.py``), checked piece by piece against the index (padding included); ``fully_reshardable``
and plain-optimizer checkpoints hold model-space optimizer tensors, read as they are.

A mixture of experts at EP > 1 has two buffers per rank: the dense one, and the routed experts' own (megatron-core's
``expert_parallel_buffers``: the parameters with ``allreduce`` False, cut over the expert data-parallel group), each
with its sub-optimizer of the chained optimizer (keys ``chained_0.`` and ``chained_1.``; the experts'
``dp_group_idx`` is the rank in the expert TP x EP x PP group). At EP 1 the experts are ordinary parameters of the
dense buffer, where SequentialMLP's local experts sit in module order.
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

from tenplex_megatron.plan.experts import is_expert_key
from tenplex_megatron.plan.layout import LayoutError, ParallelLayout
from tenplex_megatron.plan.megatron_buffer import BucketArgsError, BufferParam, bucket_layout, saved_bucketing
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, PTCError, StoredChunk, TensorMeta
from tenplex_megatron.plan.sim.gpt_catalogue import EXPERT_BIAS, LAYER_TP_AXES
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
# a dp_reshardable bucket's tensor; ``chained_N.``: the N-th sub-optimizer of megatron-core's chained optimizer (a
# mixture of experts at EP > 1: 0 dense, 1 the routed experts)
_BUCKET = re.compile(r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                     r"\.bucket_idx_(\d+)\.(\w+)")
_DISTRIBUTED = re.compile(r"(?:chained_\d+\.)?optimizer\.distributed\.")
_OPTIMIZER = re.compile(r"(?:chained_\d+\.)?optimizer\.")
#: the two buffers of a rank under the distributed optimizer: the dense parameters', the routed experts' (EP > 1)
DENSE, EXPERTS = "dense", "experts"
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


def sharding_type(path: str, common: dict[str, Any], index: DcpIndex) -> str | None:
    """The distributed optimizer's format (``dp_reshardable``, ``fully_reshardable``, ...) as ``common.pt`` records
    it (a chained optimizer: each sub-optimizer's, which must agree), else the content metadata's when the index has
    distributed-optimizer tensors; None: a plain optimizer, or none."""
    opt = common.get("optimizer") or {}
    # megatron-core's chained optimizer (a mixture of experts: dense, then experts) keeps one record per sub-optimizer
    subs = ([v for _, v in sorted(opt.items())] if isinstance(opt, dict) and opt and all(isinstance(k, int) for k in opt)
            else [opt])
    kinds = sorted({str(s["param_state_sharding_type"]) for s in subs
                    if isinstance(s, dict) and s.get("param_state_sharding_type")})
    if len(kinds) > 1:
        raise MegatronCheckpointError(f"{path}: the chained optimizer's sub-optimizers were saved in different "
                                      f"distributed-optimizer formats ({', '.join(kinds)})")
    if kinds:
        return kinds[0]
    content = common.get("content_metadata") or {}
    return content.get("distrib_optim_sharding_type") if any(_DISTRIBUTED.match(k) for k in index.tensors) else None


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
    sharding = sharding_type(path, common, index)
    if sharding is not None and sharding not in SUPPORTED_SHARDING:
        raise MegatronCheckpointError(f"{path}: distributed-optimizer format {sharding!r} is not supported "
                                      f"(tenplex reads {', '.join(SUPPORTED_SHARDING)})")
    for name in sorted({s.relative_path for s in index.items.values()}):  # every rank's file, whoever reads it
        if not os.path.isfile(confine(path, name, "the torch_dist index")):
            raise MegatronCheckpointError(f"{os.path.join(path, name)}: missing (the index names it: every rank's "
                                          "file must be there)")
    return TorchDistCheckpoint(path, index, common, sharding, source)


def is_optimizer_key(key: str) -> bool:
    """Whether an index key is the optimizer's (``optimizer.``, or a chained sub-optimizer's ``chained_N.optimizer.``)."""
    return _OPTIMIZER.match(key) is not None


def _loc(ck: TorchDistCheckpoint, info: Any, numel: int, skip: int) -> Location:
    return Location(info.relative_path, f"{info.offset}:{info.length}:{numel}:{skip}", ck.writer(info))


def _saved_tp(ck: TorchDistCheckpoint, live: dict[str, TensorMeta], experts: bool = False) -> int | None:
    """The saving layout's TP (``experts``: the routed experts' TP) from how the index cuts a TP-split tensor; None
    when no such tensor is stored."""
    for key, t in sorted(live.items()):
        st = ck.tensors().get(key)
        if t.tp_axis is not None and st is not None and is_expert_key(key, t.param) == experts:
            parts = {offsets[t.tp_axis] for offsets, _ in st.chunks}
            return max(len(parts) // t.tp_parts, 1)
    return None


def _arg(args: Any, name: str) -> Any:
    return args.get(name) if isinstance(args, dict) else getattr(args, name, None)


def saved_layout(ck: TorchDistCheckpoint, live: dict[str, TensorMeta], groups: dict) -> ParallelLayout:
    """The layout the checkpoint was saved at: TP (and the experts' TP) from the model's chunks, PP from the dense
    buffer's groups, EP from the expert buffer's groups (TP x EP x PP of the experts; without them, the saved
    args'), DP from the files; a count the args contradict, or one no layout has, fails naming both."""
    tp = _saved_tp(ck, live) or 1
    etp = _saved_tp(ck, live, experts=True) or tp
    args = ck.common.get("args")
    dense = [g for b, g in groups if b == DENSE]
    experts = [g for b, g in groups if b == EXPERTS]
    pp = max(len(dense) // tp, 1) if dense else int(_arg(args, "pipeline_model_parallel_size") or 1)
    saved_ep = int(_arg(args, "expert_model_parallel_size") or 1)
    ep = saved_ep
    if experts:
        ep, rest = divmod(len(experts), etp * pp)
        if rest or ep < 2:
            raise MegatronCheckpointError(
                f"{ck.path}: {len(experts)} expert distributed-optimizer groups, not expert TP x EP x PP (expert TP "
                f"{etp}, PP {pp}) for an EP > 1")
        if args is not None and saved_ep != ep:
            raise MegatronCheckpointError(f"{ck.path}: the expert buffer has {len(experts)} groups (EP {ep} at "
                                          f"expert TP {etp} x PP {pp}); the saved args record "
                                          f"expert_model_parallel_size={saved_ep}")
    elif ck.sharding_type == "dp_reshardable" and saved_ep > 1:
        raise MegatronCheckpointError(f"{ck.path}: the saved args record expert_model_parallel_size={saved_ep}, but "
                                      "the checkpoint has no expert buffer (chained_1.optimizer.distributed.*)")
    dp = max(ck.world() // (tp * pp), 1)
    try:
        return ParallelLayout(tp, pp, dp, ep=ep, etp=etp)
    except LayoutError as e:
        if experts:
            raise MegatronCheckpointError(f"{ck.path}: saving layout TP {tp} PP {pp} DP {dp} EP {ep} expert TP "
                                          f"{etp}: {e}") from None
        return ParallelLayout(tp, pp, dp)  # the args' EP (a model-space optimizer) does not fit the files: as before


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


def _bucket_groups(ck: TorchDistCheckpoint) -> dict[tuple[str, int], dict[int, dict[str, tuple[str, Any]]]]:
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
    impl = _arg(ck.common.get("args"), "transformer_impl")
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


def _dist_opt_chunks(ck: TorchDistCheckpoint, metas: dict[str, TensorMeta], layer_keys: tuple[str, ...],
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
                                               _loc(ck, info, piece.stop - piece.start, at + a - lo)))
    return out, dtypes


def describe_torch_dist(ck: TorchDistCheckpoint, live: dict[str, TensorMeta], layer_keys: tuple[str, ...],
                        wanted: set[str]) -> PTC:
    """The checkpoint as a PTC with the live job's tensor keys (the optimizer's as tenplex names them).

    ``live``: the job's model tensors; ``wanted``: the optimizer states it keeps (``fp32_param`` only when the
    model's weights are not fp32 themselves)."""
    check_model(ck, live)
    saved = ck.tensors()
    groups = _bucket_groups(ck)
    layout = saved_layout(ck, live, groups)
    model = {k: t for k, t in live.items() if t.param is None}
    # a pipeline stage's live model lacks the other stages' embedding or final norm: those as the index shows them
    model.update(_index_metas(ck, [k for k in saved if not is_optimizer_key(k) and k not in model
                                   and (k in PRE_KEYS or k in POST_KEYS)]))
    metas = {k: replace(t, global_shape=saved[k].size, dtype=saved[k].dtype) for k, t in model.items()}
    tensors: dict[str, TensorMeta] = dict(metas)
    chunks: list[StoredChunk] = []
    for key in metas:
        for offsets, sizes in saved[key].chunks:
            chunks.append(StoredChunk(Chunk(key, offsets, sizes), _loc(ck, ck.storage[(key, offsets)],
                                                                       math.prod(sizes), 0)))
    if ck.sharding_type == "dp_reshardable":
        opt_chunks, dtypes = _dist_opt_chunks(ck, metas, layer_keys, layout, groups, wanted)
        chunks.extend(opt_chunks)
        for okey, dtype in dtypes.items():
            pkey = okey.split(".", 3)[3]
            tensors[okey] = replace(metas[pkey], key=okey, dtype=dtype, param=pkey)
    else:  # model-space optimizer tensors: [chained_N.]optimizer.state.<state>.<param key>
        for key, st in saved.items():
            if not is_optimizer_key(key):
                continue
            parts = _OPTIMIZER.sub("optimizer.", key, count=1).split(".", 3)
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
_REPLICATED = re.compile(r"(self_attention\.linear_qkv|mlp\.linear_fc1)\.layer_norm_(weight|bias)|"
                         r"(self_attention\.linear_proj|mlp\.linear_fc2)\.bias|pre_mlp_layernorm\.(weight|bias)|"
                         r"mlp\.router\.(weight|bias|expert_bias)|mlp\.(experts\.experts|shared_experts)\.linear_fc2\.bias|"
                         r"mlp\.shared_experts\.gate_weight")
# TP-split layer tensors the dry-run catalogue does not list (a shared expert's fc1 bias)
_TP_AXES = {**LAYER_TP_AXES, "mlp.shared_experts.linear_fc1.bias": 1}
# the MLPs of a layer (dense, routed experts, shared experts) by their fc1 / fc2 keys' common start: under SwiGLU an
# fc1 is twice as wide as its fc2's input (gate and up: two TP parts)
_FCS = ("mlp.linear_fc", "mlp.experts.experts.linear_fc", "mlp.shared_experts.linear_fc")


def gpt_tensor_meta(path: str, key: str, size: tuple[int, ...], dtype: str, vocab_size: int | None, tied: bool,
                    fc1_parts: int | dict[str, int]) -> TensorMeta:
    """How TP and PP split the megatron-core GPTModel tensor ``key`` (global ``size``; layers stacked on axis 0, a
    routed expert's on axes 0 and 1), as ``plan/sim/gpt_catalogue.gpt_tensors`` models it (its
    :data:`LAYER_TP_AXES`); ``fc1_parts``: SwiGLU's two parts or one, for all fc1s or per MLP (keyed by
    :data:`_FCS`); another tensor fails naming it."""
    if key in (PRE_KEYS[0], "output_layer.weight"):
        first = key == PRE_KEYS[0]
        return TensorMeta(key, size, dtype, vocab_size or size[0], 0, 1, "first" if first else "last", first and tied)
    if key == PRE_KEYS[1]:
        return TensorMeta(key, size, dtype, stage="first")
    if key in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
        return TensorMeta(key, size, dtype, stage="last")
    name = key[len("decoder.layers."):]
    if key.startswith("decoder.layers.") and (name in _TP_AXES or _REPLICATED.fullmatch(name)):
        fc = next((fc for fc in _FCS if name.startswith(f"{fc}1.")), None)
        parts = 1 if fc is None else fc1_parts if isinstance(fc1_parts, int) else fc1_parts.get(fc, 1)
        return TensorMeta(key, size, dtype, tp_axis=_TP_AXES.get(name), tp_parts=parts, stage="layers")
    raise MegatronCheckpointError(f"{path}: tensor {key!r}: not a parameter of megatron-core's GPTModel that `plan` "
                                  "knows how TP and PP split (adopt it with --tenplex, which takes the split from the "
                                  "model)")


def _index_metas(ck: TorchDistCheckpoint, keys: list[str]) -> dict[str, TensorMeta]:
    """The model tensors ``keys`` as the index shows them, split as :func:`gpt_tensor_meta` knows."""
    saved = ck.tensors()
    parts = {}
    for fc in _FCS:  # SwiGLU's fc1 is twice as wide as fc2's input: gate and up, two TP parts
        fc1, fc2 = saved.get(f"decoder.layers.{fc}1.weight"), saved.get(f"decoder.layers.{fc}2.weight")
        parts[fc] = fc1.size[-2] // fc2.size[-1] if fc1 is not None and fc2 is not None and fc2.size[-1] else 1
    tied = "output_layer.weight" not in saved
    vocab = int(_arg(ck.common.get("args"), "vocab_size") or 0) or None
    return {k: gpt_tensor_meta(ck.path, k, tuple(saved[k].size), saved[k].dtype, vocab, tied, parts) for k in keys}


def index_model_metas(ck: TorchDistCheckpoint) -> tuple[dict[str, TensorMeta], tuple[str, ...]]:
    """The model's tensors as the index shows them and one layer's keys in megatron-core's module order
    (:data:`LAYER_ORDER`, a mixture of experts' :data:`MOE_MLP_ORDER`; the index's own order is the writers', not
    the model's, at DP > 1): the live model's stand-in for ``plan``."""
    out = _index_metas(ck, [k for k in ck.tensors() if not is_optimizer_key(k)])
    layer = layer_param_keys(out)
    return out, tuple(k for k in dict.fromkeys(f"decoder.layers.{n}" for n in LAYER_ORDER + MOE_MLP_ORDER)
                      if k in layer)
