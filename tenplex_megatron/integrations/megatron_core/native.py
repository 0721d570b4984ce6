"""Read Megatron's own ``torch_dist`` checkpoints at any layout, in place, as a PTC.

megatron-core re-shards its distributed optimizer's ``dp_reshardable`` state
(Megatron-LM's default) only along DP: at a TP or PP change Megatron-LM
refuses. Here the checkpoint is described as a PTC instead: the model's
TP-local tensors are the ``.distcp`` items torch's distributed-checkpoint index
names (file, offset, length); each bucket of the distributed optimizer's flat
buffers (``...dp_group_idx_G.gbuf_idx_0.dtype_*.bucket_idx_B.{param,exp_avg,
exp_avg_sq}``) is cut into flat ranges of the TP-local parameter boxes with
megatron-core 0.16.1's buffer layout at the saving layout
(``plan/megatron_buffer.py``), checked piece by piece against the index
(padding included). ``fully_reshardable`` and plain-optimizer checkpoints hold
model-space optimizer tensors and are read as they are. The planner and the
executor then read only each new rank's part.

One transformer layer's parameter order comes from the live model (megatron's
``module.parameters()``); the saving layout's TP comes from the model's
chunks, PP from the number of DP groups, DP from the files. Pickles (``.metadata``,
``common.pt``, the optimizer's objects) are read with only plain classes
allowed (``storage/distcp.py``, :data:`SAFE_GLOBALS`) unless ``trust_pickles``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from tenplex_megatron.engine.optimizer_json import jsonable
from tenplex_megatron.integrations.megatron_core.sharded import describe_model
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.megatron_buffer import BufferParam, bucket_layout
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, PTCError, StoredChunk, TensorMeta
from tenplex_megatron.plan.sim.sharding import local_param_boxes
from tenplex_megatron.storage.confine import confine
from tenplex_megatron.storage.distcp import DistcpFiles
from tenplex_megatron.storage.distcp_index import DcpIndex, DcpItem, DcpTensor, read_dcp_metadata
from tenplex_megatron.storage.pickles import PicklePolicy, load_restricted
from tenplex_megatron.storage.safetensors_io import CheckpointFileError
from tenplex_megatron.storage.source import Opened, UncheckedSource

SUPPORTED_BACKENDS = {("torch_dist", 1)}  # metadata.json's (sharded_backend, sharded_backend_version)
SUPPORTED_SHARDING = ("dp_reshardable", "fully_reshardable")
STATE_NAMES = {"param": "fp32_param", "fp32_param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
# megatron-core's GPTModel, outside the transformer layers, in module order
PRE_KEYS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
POST_KEYS = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")
_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.(\w+)")
_RANK_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")


class MegatronCheckpointError(CheckpointFileError):
    """A Megatron checkpoint that tenplex cannot read, or that does not fit the job."""


def safe_globals() -> list[Any]:
    """The plain classes Megatron's pickles may hold besides tensors and containers (one list, as for DeepSpeed):
    the args Namespace, and numpy's RNG state in the legacy format's ``rng_state``."""
    core = getattr(np, "_core", None) or np.core
    return [argparse.Namespace, core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


SAFE_GLOBALS = safe_globals()
_POLICY = PicklePolicy(tuple(SAFE_GLOBALS), "Megatron", "one of the plain classes allowed",
                       "--tenplex-trust-pickles (trust_pickles=True)", MegatronCheckpointError)


def load_pickle(path: str, data: bytes | None = None, trust_pickles: bool = False, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of a Megatron pickle (a file, memory-mapped with ``mmap``, or ``data``
    read from one) with only :data:`SAFE_GLOBALS` allowed; any other class fails naming the file and the class."""
    src: Any = io.BytesIO(data) if data is not None else path
    if data is None and not os.path.isfile(path):
        raise MegatronCheckpointError(f"{path}: missing")
    return load_restricted(src, path, _POLICY, trust_pickles, mmap)


@dataclass(frozen=True)
class TorchDistCheckpoint:
    """What a megatron-core ``torch_dist`` directory holds: its index, common state and optimizer format."""

    path: str
    index: DcpIndex
    common: dict[str, Any]
    sharding_type: str | None  # the distributed optimizer's format; None: a plain optimizer (or none)

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

    def read_object(self, key: str, files: DistcpFiles, trust: bool) -> Any:
        infos = [s for (k, _), s in self.storage.items() if k == key]
        if not infos:
            raise MegatronCheckpointError(f"{self.path}: the index has no object {key!r}")
        s = infos[0]
        return load_pickle(os.path.join(self.path, s.relative_path), files.read_bytes(s.relative_path, s.offset,
                                                                                         s.length), trust)


def open_torch_dist(path: str, trust_pickles: bool = False) -> TorchDistCheckpoint:
    """Read a ``torch_dist`` checkpoint's ``metadata.json``, index and ``common.pt``, checking the format."""
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
    index = read_dcp_metadata(path, trust_pickles)
    common = load_pickle(os.path.join(path, "common.pt"), trust_pickles=trust_pickles)
    if not isinstance(common, dict):
        raise MegatronCheckpointError(f"{os.path.join(path, 'common.pt')}: not a dict")
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
    return TorchDistCheckpoint(path, index, common, sharding)


class DistcpSource(UncheckedSource):
    """Stored chunks of a PTC over ``.distcp`` items: location name ``offset:length:numel:skip`` of the item."""

    def __init__(self, path: str, dtypes: dict[str, str]):
        self.files = DistcpFiles(path)
        self.readers = self.files.readers
        self.dtypes = dtypes

    def flat(self, sc: StoredChunk) -> torch.Tensor:
        off, length, numel, skip = (int(x) for x in sc.location.name.split(":"))
        dtype = getattr(torch, self.dtypes[sc.chunk.key])
        return self.files.tensor(sc.location.file, off, length, dtype, numel).narrow(0, skip, sc.chunk.numel)

    def close(self) -> None:
        self.files.close()


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


def _dist_opt_chunks(ck: TorchDistCheckpoint, metas: dict[str, TensorMeta], layer_keys: tuple[str, ...],
                     layout: ParallelLayout, states: set[str]) -> tuple[list[StoredChunk], dict[str, str]]:
    """The ``dp_reshardable`` buckets as flat ranges of the TP-local parameter boxes, checked piece by piece."""
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
    if len(groups) != layout.tp * layout.pp:
        raise MegatronCheckpointError(f"{ck.path}: {len(groups)} distributed-optimizer groups, expected TP x PP = "
                                      f"{layout.tp * layout.pp} at the saving layout {layout}")
    saved = {k for k in ck.tensors() if not k.startswith("optimizer.")}
    out: list[StoredChunk] = []
    dtypes: dict[str, str] = {}
    for g, buckets in sorted(groups.items()):
        tp_rank, pp_rank = g % layout.tp, g // layout.tp
        params = stage_params(metas, layer_keys, saved, layout, tp_rank, pp_rank)
        layout_buckets = bucket_layout([p for p, _, _ in params], layout.dp)
        where = {p.name: (boxes, key) for p, boxes, key in params}
        if sorted(buckets) != list(range(len(layout_buckets))):
            raise MegatronCheckpointError(
                f"{ck.path}: dp_group_idx_{g} has buckets {sorted(buckets)}; megatron-core 0.16.1's layout of this "
                f"model at {layout} has {len(layout_buckets)} (another model, or bucketed with --overlap-grad-reduce?)")
        for b, bucket in enumerate(layout_buckets):
            for state, (key, st) in sorted(buckets[b].items()):
                got = {(offsets[0], sizes[0]) for offsets, sizes in st.chunks}
                want = {(p.start, p.stop - p.start) for p in bucket.pieces}
                if tuple(st.size) != (bucket.numel_unpadded,) or got != want:
                    extra, missing = sorted(got - want), sorted(want - got)
                    raise MegatronCheckpointError(
                        f"{ck.path}: {key}: {st.size[0]} elements in pieces that do not match megatron-core 0.16.1's "
                        f"buffer layout at {layout} ({bucket.numel_unpadded} elements; first unexpected piece "
                        f"(offset, size) {extra[:1]}, first missing {missing[:1]}): another model or layout?")
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
    tp = _saved_tp(ck, live)
    groups = {int(m.group(1)) for k in saved if (m := _BUCKET.fullmatch(k))}
    pp = max(len(groups) // tp, 1) if groups else 1
    layout = ParallelLayout(tp, pp, max(ck.world() // (tp * pp), 1))
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


def _optimizer_json(ck: TorchDistCheckpoint, files: DistcpFiles, trust: bool) -> dict[str, Any]:
    """Param groups (without params) and step in ``optimizer_state_json``'s form: ``dp_reshardable`` keeps them in
    a sharded object per DP group, ``fully_reshardable`` and plain optimizers in ``common.pt``."""
    if ck.sharding_type == "dp_reshardable":
        key = next((k for k, _ in ck.storage if re.fullmatch(r"optimizer\.distributed\.dp_group_idx_0\.optimizer"
                                                             r"/shard_0_\d+", k)), None)
        if key is None:
            raise MegatronCheckpointError(f"{ck.path}: no distributed-optimizer param groups (dp_group_idx_0.optimizer)")
        obj = ck.read_object(key, files, trust)
        states = obj if isinstance(obj, list) else [obj]
    else:
        opt = ck.common.get("optimizer") or {}
        states = [opt.get("optimizer", opt) if "param_groups" not in opt else opt]
    subs = []
    for sd in states:
        if not isinstance(sd, dict) or "param_groups" not in sd:
            raise MegatronCheckpointError(f"{ck.path}: no optimizer param groups in the checkpoint")
        groups = sd["param_groups"]
        steps = {int(g["step"]) for g in groups if "step" in g}
        common_step = (sd.get("state") or {}).get("common_step")
        if common_step is not None:
            steps.add(int(common_step))
        subs.append({"param_groups": [{k: jsonable(v) for k, v in g.items() if k != "params"} for g in groups],
                     "step": max(steps) if steps else int(ck.common.get("iteration", 0))})
    return {"sub_optimizers": subs}


def open_megatron(path: str, job: Any, trust_pickles: bool = False) -> Opened:
    """Describe the ``torch_dist`` checkpoint ``path`` for ``job`` (checked against it) and open it for reading.

    Nothing of the job is touched: an error here (another model, a missing file, a format not understood)
    leaves every rank's state as it was."""
    ck = open_torch_dist(path, trust_pickles)
    model, layer_keys, _ = describe_model(job)
    wanted = {"exp_avg", "exp_avg_sq"} | ({"fp32_param"} if any(t.dtype != "float32" for t in model.values()) else set())
    ptc = describe_torch_dist(ck, model, layer_keys, wanted)
    source = DistcpSource(path, {k: t.dtype for k, t in ptc.tensors.items()})
    common = ck.common
    args = common.get("args")
    iteration = int(common.get("iteration", 0))
    consumed = common.get("consumed_samples", getattr(args, "consumed_train_samples", None))
    meta = {
        "layout": ptc.layout,
        "iteration": iteration,
        "consumed_samples": int(consumed if consumed is not None else iteration * job.global_batch_size),
        "optimizer": _optimizer_json(ck, source.files, trust_pickles),
        "scheduler": common.get("scheduler", common.get("opt_param_scheduler")),
        "padded_vocab_size": int(ptc.tensors[PRE_KEYS[0]].global_shape[0]) if PRE_KEYS[0] in ptc.tensors else None,
        "extra": {"num_floating_point_operations_so_far": float(common.get("num_floating_point_operations_so_far", 0.0) or 0.0)},
        "source_format": f"megatron torch_dist ({ck.sharding_type or 'model-space optimizer'})",
    }
    return Opened(path, meta, ptc, source)


def opener_for(path: str, job: Any, trust_pickles: bool = False) -> Callable[[], Opened]:
    """The engine's ``opener`` for a Megatron checkpoint directory."""
    return lambda: open_megatron(path, job, trust_pickles)


def saved_padded_vocab(path: str, trust_pickles: bool = False) -> int | None:
    """The padded vocabulary of a ``torch_dist`` checkpoint's word embedding (None: it has none)."""
    st = read_dcp_metadata(path, trust_pickles).tensors.get(PRE_KEYS[0])
    return None if st is None else st.size[0]
