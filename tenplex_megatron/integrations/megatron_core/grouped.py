"""megatron-core's grouped-GEMM experts (``GroupedMLP``) as tensors of their own, in their parameters' memory order.

``GroupedMLP`` keeps a layer's local experts in two parameters whose memory the grouped GEMM reads as
``weight1``: [local experts, hidden, parts x ffn / expert TP] (parts: 2 with a GLU, gate then up projection, else 1)
and ``weight2``: [local experts, ffn / expert TP, hidden]. Its ``sharded_state_dict`` is a factory that transposes
every expert into ``SequentialMLP``'s layout (``experts.experts.linear_fc1.weight``): a copy, so neither a rank's
weight nor a distributed-optimizer rank's flat range of it is a box (or a flat range of one) of that tensor. Each
weight is therefore described as a global tensor in its own memory order, from the facts megatron-core's factory
gives (layer, first expert, expert TP offset, sizes):

- ``...mlp.experts.weight1``: [layers, experts, hidden, parts, ffn], expert TP on the last axis;
- ``...mlp.experts.weight2``: [layers, experts, ffn, hidden], expert TP on axis 2.

A rank's parameter is then one row-major box (layer, its EP rank's experts, its expert-TP slice) and a distributed
optimizer rank's part of it a flat range of that box: the planner's ordinary chunks, so saving needs no gather and
re-sharding across EP, expert TP, TP, PP and DP goes through the planner's coverage proof. Element
(l, e, h, p, f) of weight1 is element (l, e, p x ffn + f, h) of SequentialMLP's fc1, (l, e, f, h) of weight2 is
(l, e, h, f) of its fc2. Checkpoints of the two kinds hold different tensors: a load across kinds is refused
(``plan/experts.py``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from tenplex_megatron.plan.ptc import PTCError
from tenplex_megatron.plan.sim.gpt_catalogue import GROUPED_SUFFIXES

#: megatron-core's (SequentialMLP's) key of each GroupedMLP weight, as its factory names it
CANONICAL_SUFFIXES = MappingProxyType({"weight1": "experts.linear_fc1.weight", "weight2": "experts.linear_fc2.weight"})


@dataclass(frozen=True)
class NativeBox:
    """Where one GroupedMLP parameter lies in its own global tensor: key, global shape, the box's offsets and sizes
    (its row-major order is the parameter's memory), the expert-TP axis, and megatron-core's replica id."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    tp_axis: int
    replica_id: Any


def grouped_weights(models: list[Any]) -> dict[int, str]:
    """``id(parameter) -> "weight1" | "weight2"`` for every GroupedMLP in the (unwrapped) model chunks. Its class is
    looked up where megatron-core defined it, without importing it (a model holding one has imported it)."""
    cls = getattr(sys.modules.get("megatron.core.transformer.moe.experts"), "GroupedMLP", None)
    if cls is None:
        return {}
    out: dict[int, str] = {}
    for model in models:
        for module in model.modules():
            if isinstance(module, cls):
                out[id(module.weight1)] = "weight1"
                out[id(module.weight2)] = "weight2"
    return out


def expert_module_kind(models: list[Any]) -> str | None:
    """``grouped`` (GroupedMLP), ``sequential`` (SequentialMLP, or TEGroupedMLP: SequentialMLP's keys) or None (no
    routed experts) for the (unwrapped) model chunks, from megatron-core's module classes."""
    experts = sys.modules.get("megatron.core.transformer.moe.experts")
    kinds = {"grouped": tuple(c for c in (getattr(experts, "GroupedMLP", None),) if c is not None),
             "sequential": tuple(c for n in ("SequentialMLP", "TEGroupedMLP")
                                 if (c := getattr(experts, n, None)) is not None)}
    for model in models:
        for module in model.modules():
            for kind, classes in kinds.items():
                if classes and isinstance(module, classes):
                    return kind
    return None


def native_key(key: str, which: str) -> str:
    """The grouped tensor's key for a factory key (a model key, or ``optimizer.state.<name>.`` + one)."""
    suffix = CANONICAL_SUFFIXES[which]
    if not key.endswith(suffix):
        raise PTCError(f"tensor {key!r}: a GroupedMLP {which} whose megatron-core key does not end in {suffix!r}")
    out = key[: -len(suffix)] + which
    if not out.endswith(GROUPED_SUFFIXES[which]):
        raise PTCError(f"tensor {key!r}: a GroupedMLP {which} outside an MoE layer's experts ({out!r})")
    return out


def native_box(factory: Any, param: torch.Tensor, which: str) -> NativeBox:
    """The native box of the GroupedMLP parameter behind ``factory`` (its ``data`` the parameter or an optimizer
    state of its shape), from the SequentialMLP-layout parts megatron-core's factory builds on a meta tensor."""
    probe = torch.empty(tuple(param.shape), dtype=param.dtype, device="meta")
    built = replace(factory, data=probe).build()
    parts = sorted((x for x in nested_values(built if isinstance(built, (dict, list)) else [built])
                    if isinstance(x, ShardedTensor)), key=lambda sh: tuple(sh.global_offset))
    key = native_key(factory.key, which)
    if not parts or any(sh.prepend_axis_num != 1 or len(sh.global_shape) != 4 for sh in parts):
        raise PTCError(f"tensor {factory.key!r}: GroupedMLP's factory built {len(parts)} part(s) not of the form "
                       "(layers, experts, rows, columns): cannot describe it")
    first = parts[0]
    layers, experts, rows, cols = first.global_shape
    layer, e0, row0, col0 = first.global_offset
    local_experts, local_rows, local_cols = first.local_shape
    if which == "weight1":  # parts x (E_l, F_l, H) at rows p * ffn + tp offset: native [L, E, H, parts, ffn]
        n = len(parts)
        ffn = rows // n
        for p, sh in enumerate(parts):
            if tuple(sh.global_offset) != (layer, e0, p * ffn + row0, 0) or tuple(sh.local_shape) != tuple(
                    first.local_shape):
                raise PTCError(f"tensor {factory.key!r}: GroupedMLP weight1 part {p} at {sh.global_offset}, expected "
                               f"row {p * ffn + row0} of {rows}: cannot describe it")
        box = NativeBox(key, (layers, experts, cols, n, ffn), (layer, e0, 0, 0, row0),
                        (1, local_experts, local_cols, n, local_rows), 4, first.replica_id)
    else:  # one part (E_l, H, F_l) at column tp offset: native [L, E, ffn, H]
        if len(parts) != 1 or row0 != 0:
            raise PTCError(f"tensor {factory.key!r}: GroupedMLP weight2 built {len(parts)} parts at "
                           f"{first.global_offset}: cannot describe it")
        box = NativeBox(key, (layers, experts, cols, rows), (layer, e0, col0, 0),
                        (1, local_experts, local_cols, local_rows), 2, first.replica_id)
    if math.prod(box.shape) != param.numel():
        raise PTCError(f"tensor {key!r}: box {box.shape} has {math.prod(box.shape)} elements, the GroupedMLP "
                       f"{which} parameter {param.numel()}")
    return box
