"""Megatron's own ``torch_dist`` checkpoint directory read without torch: ``metadata.json``'s format checked, torch's
distributed-checkpoint index, the common state (``common.pt``, or megatron-core 0.19's object in the ``.distcp``
files) and the distributed optimizer's format; the names its description as a PTC (``storage/megatron_ptc.py``,
``storage/megatron_buckets.py``) shares.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tenplex_megatron.plan.ptc import Location
from tenplex_megatron.storage.confine import confine
from tenplex_megatron.storage.distcp_index import DcpIndex, DcpItem, DcpTensor, read_dcp_metadata
from tenplex_megatron.storage.files import CheckpointFileError

SUPPORTED_BACKENDS = frozenset({("torch_dist", 1)})  # metadata.json's (sharded_backend, sharded_backend_version)
SUPPORTED_SHARDING = ("dp_reshardable", "fully_reshardable")
STATE_NAMES = MappingProxyType({"param": "fp32_param", "fp32_param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"})
# megatron-core's GPTModel, outside the transformer layers, in module order
PRE_KEYS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
POST_KEYS = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")
_DISTRIBUTED = re.compile(r"(?:chained_\d+\.)?optimizer\.distributed\.")
#: the start of an optimizer tensor's key: ``optimizer.``, or a chained sub-optimizer's ``chained_N.optimizer.``
OPTIMIZER_KEY = re.compile(r"(?:chained_\d+\.)?optimizer\.")
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
    return OPTIMIZER_KEY.match(key) is not None


def dcp_location(ck: TorchDistCheckpoint, info: Any, numel: int, skip: int) -> Location:
    """Where a stored chunk lies: index entry ``info``'s file, offset and length, its ``numel`` elements from
    element ``skip``, and the rank that wrote it."""
    return Location(info.relative_path, f"{info.offset}:{info.length}:{numel}:{skip}", ck.writer(info))


def saved_arg(args: Any, name: str) -> Any:
    """Argument ``name`` of the saved args (a namespace, or a dict); None when it is not recorded."""
    return args.get(name) if isinstance(args, dict) else getattr(args, name, None)
