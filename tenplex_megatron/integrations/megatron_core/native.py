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

The description itself is torch-free (``storage/megatron_ptc.py``, shared with
``python -m tenplex_megatron plan``). At adoption one transformer layer's parameter order comes from the live model (megatron's
``module.parameters()``); the saving layout's TP comes from the model's
chunks, PP from the number of DP groups, DP from the files. Pickles (``.metadata``,
``common.pt``, the optimizer's objects) are read with only plain classes
allowed (``storage/distcp.py``, :data:`SAFE_GLOBALS`) unless ``trust_pickles``.
"""

from __future__ import annotations

import argparse
import io
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tenplex_megatron.engine.optimizer_json import jsonable
from tenplex_megatron.integrations.megatron_core.sharded import describe_model
from tenplex_megatron.plan.ptc import DTYPE_SIZES, StoredChunk
from tenplex_megatron.plan.unsupported import check_saved_args
from tenplex_megatron.storage.distcp import DistcpFiles
from tenplex_megatron.storage.distcp_index import read_dcp_metadata
from tenplex_megatron.storage.megatron_ptc import describe_torch_dist
from tenplex_megatron.storage.megatron_torch_dist import (
    PRE_KEYS,
    MegatronCheckpointError,
    TorchDistCheckpoint,
    read_torch_dist,
)
from tenplex_megatron.storage.parallel_read import Extent
from tenplex_megatron.storage.pickles import PicklePolicy, load_restricted
from tenplex_megatron.storage.source import ForeignMetadata, Opened, UncheckedSource


def safe_globals() -> list[Any]:
    """The plain classes Megatron's pickles may hold besides tensors and containers (one list, as for DeepSpeed):
    the args Namespace, and numpy's RNG state in the legacy format's ``rng_state``."""
    core = np.core if np.lib.NumpyVersion(np.__version__) < "2.0.0" else np._core  # 1.x has a bare np._core
    return [argparse.Namespace, core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


SAFE_GLOBALS = tuple(safe_globals())
_POLICY = PicklePolicy(SAFE_GLOBALS, "Megatron", "one of the plain classes allowed",
                       "--tenplex-trust-pickles (trust_pickles=True)", MegatronCheckpointError)


def load_pickle(path: str, data: bytes | None = None, *, trust_pickles: bool = False, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of a Megatron pickle (a file, memory-mapped with ``mmap``, or ``data``
    read from one) with only :data:`SAFE_GLOBALS` allowed; any other class fails naming the file and the class."""
    src: Any = io.BytesIO(data) if data is not None else path
    if data is None and not os.path.isfile(path):
        raise MegatronCheckpointError(f"{path}: missing")
    return load_restricted(src, path, _POLICY, trust_pickles=trust_pickles, mmap=mmap)


def open_torch_dist(path: str, *, trust_pickles: bool = False) -> TorchDistCheckpoint:
    """Read a ``torch_dist`` checkpoint's ``metadata.json``, index and common state (``common.pt``, or 0.19's
    ``common_state`` object; under the pickle policy), checking the format."""
    return read_torch_dist(path, lambda f, data: load_pickle(f, data, trust_pickles=trust_pickles),
                           trust_pickles=trust_pickles)


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

    def extent(self, sc: StoredChunk) -> Extent:
        """The chunk's bytes in its ``.distcp`` file, for the parallel reader (no checksums: DCP records none)."""
        off, length, numel, skip = (int(x) for x in sc.location.name.split(":"))
        name = self.dtypes[sc.chunk.key]
        size = DTYPE_SIZES[name]
        path, item = self.files.locate(sc.location.file, off, length, numel * size)
        if (skip + sc.chunk.numel) * size > item.nbytes:
            raise MegatronCheckpointError(f"{path}: item at byte {off} holds {item.nbytes // size} elements, the "
                                          f"chunk of {sc.chunk.key!r} needs {skip + sc.chunk.numel}")
        return Extent(path, item.offset + skip * size, sc.chunk.numel * size, size, getattr(torch, name), None, None,
                      f"{path}: item at byte {off} (of {sc.chunk.key!r})", (sc.location.file, sc.location.name))

    def close(self) -> None:
        self.files.close()


def read_object(ck: TorchDistCheckpoint, key: str, files: DistcpFiles, *, trust: bool) -> Any:
    """One pickled object of the index (the distributed optimizer's param groups), read under the pickle policy."""
    infos = [s for (k, _), s in ck.storage.items() if k == key]
    if not infos:
        raise MegatronCheckpointError(f"{ck.path}: the index has no object {key!r}")
    s = infos[0]
    return load_pickle(os.path.join(ck.path, s.relative_path), files.read_bytes(s.relative_path, s.offset, s.length),
                       trust_pickles=trust)


def _optimizer_json(ck: TorchDistCheckpoint, files: DistcpFiles, *, trust: bool) -> dict[str, Any]:
    """Param groups (without params) and step in ``optimizer_state_json``'s form: ``dp_reshardable`` keeps them in
    a sharded object per DP group, ``fully_reshardable`` and plain optimizers in ``common.pt`` (a mixture of experts'
    chained optimizer: one record per sub-optimizer, keyed 0, 1, ...)."""
    if ck.sharding_type == "dp_reshardable":  # one object per sub-optimizer (chained: dense, then experts)
        keys = {}
        for k, _ in ck.storage:
            m = re.fullmatch(r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_0\.optimizer/shard_0_\d+", k)
            if m:
                keys.setdefault(int(m.group(1) or 0), k)
        if not keys:
            raise MegatronCheckpointError(f"{ck.path}: no distributed-optimizer param groups (dp_group_idx_0.optimizer)")
        states = []
        for _, key in sorted(keys.items()):
            obj = read_object(ck, key, files, trust=trust)
            states.extend(obj if isinstance(obj, list) else [obj])
    else:
        opt = ck.common.get("optimizer") or {}
        if opt and all(isinstance(k, int) for k in opt):  # megatron-core's chained optimizer (dense, then experts)
            states = [sub.get("optimizer", sub) if isinstance(sub, dict) else sub for _, sub in sorted(opt.items())]
        else:
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


def open_megatron(path: str, job: Any, *, trust_pickles: bool = False) -> Opened:
    """Describe the ``torch_dist`` checkpoint ``path`` for ``job`` (checked against it) and open it for reading.

    Nothing of the job is touched: an error here (another model, a missing file, a format not understood)
    leaves every rank's state as it was."""
    ck = open_torch_dist(path, trust_pickles=trust_pickles)
    check_saved_args(ck.common_source, ck.common.get("args"))  # a feature tenplex refuses, named before describing
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
        "optimizer": _optimizer_json(ck, source.files, trust=trust_pickles),
        "scheduler": common.get("scheduler", common.get("opt_param_scheduler")),
        "padded_vocab_size": int(ptc.tensors[PRE_KEYS[0]].global_shape[0]) if PRE_KEYS[0] in ptc.tensors else None,
        "extra": {"num_floating_point_operations_so_far": float(common.get("num_floating_point_operations_so_far", 0.0) or 0.0)},
        "source_format": f"megatron torch_dist ({ck.sharding_type or 'model-space optimizer'})",
    }
    if args is not None:  # the saved args' experts and router, for the mixture-of-experts check before any load
        meta["model"] = {k: getattr(args, k) for k in ("num_experts", "moe_router_enable_expert_bias",
                                                       "moe_router_score_function") if hasattr(args, k)}
    return Opened(path, ForeignMetadata.of("megatron torch_dist", meta, meta["consumed_samples"]), ptc, source)


def opener_for(path: str, job: Any, *, trust_pickles: bool = False) -> Callable[[], Opened]:
    """The engine's ``opener`` for a Megatron checkpoint directory."""
    return lambda: open_megatron(path, job, trust_pickles=trust_pickles)


def saved_padded_vocab(path: str, *, trust_pickles: bool = False) -> int | None:
    """The padded vocabulary of a ``torch_dist`` checkpoint's word embedding (None: it has none)."""
    st = read_dcp_metadata(path, trust_pickles=trust_pickles).tensors.get(PRE_KEYS[0])
    return None if st is None else st.size[0]
