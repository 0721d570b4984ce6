"""Describe a live DeepSpeed engine (ZeRO stage 1, 2 or 3; PipelineModule stages) as PTC chunks.

Every trainable parameter is a tensor of its full shape, named as
``engine.module.named_parameters()`` names it (a PipelineModule names layers by
their global index, so names do not depend on the PP size). ZeRO keeps each
DP rank's share of the fp32 master weights and Adam moments as one flat
partition per parameter group; what a rank holds of parameter ``p`` is a
contiguous flat range of ``p``. That is exactly a PTC chunk with a flat range,
so describing needs no gather:

- stages 1/2 (and the BF16_Optimizer): DeepSpeed's own ``_hp_mapping`` of each
  parameter gives the range in the parameter and in the partition;
- stage 3: each parameter is split into equal ranges of ``ds_tensor.numel()``
  elements; the rank's ranges are concatenated in the flat fp32 partition.

Model weights are chunks too: whole (replicated over DP) at stages 1/2, the
rank's ``ds_tensor`` range at stage 3. Every chunk keeps its live tensor, so a
load writes straight into the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.optimizer_json import fresh_step, step_in_groups
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.plan.ptc import Chunk, PTCError, TensorMeta
from tenplex_megatron.storage.safetensors_io import torch_dtype_name

STATE_KEYS = ("exp_avg", "exp_avg_sq")  # Adam's moments: what torch Adam/AdamW keep per element
SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "FusedAdam")  # FusedAdam: DeepSpeed's (its default on GPUs)


class DeepSpeedStateError(TenplexError, ValueError):
    """A DeepSpeed engine or checkpoint this integration cannot describe."""


@dataclass(frozen=True)
class EngineLayout:
    """Where this rank sits: ZeRO stage, DP and PP sizes and its coordinates."""

    zero_stage: int
    dp: int
    pp: int
    dp_rank: int
    stage_id: int


def engine_layout(engine: Any) -> EngineLayout:
    """The engine's ZeRO stage, DP/PP sizes and this rank's DP rank and pipeline stage."""
    stage = int(engine.zero_optimization_stage())
    if stage not in (1, 2, 3):
        raise DeepSpeedStateError(
            f"zero_optimization.stage={stage}: tenplex re-shards ZeRO stages 1, 2 and 3 "
            "(stage 0 keeps an unpartitioned optimizer; use stage 1 for the same memory at no cost)")
    pp = int(getattr(engine, "num_stages", 1) or 1)
    stage_id = int(getattr(engine, "stage_id", 0) or 0)
    dp_rank = dist.get_rank(group=engine.data_parallel_group) if dist.is_initialized() else 0
    return EngineLayout(stage, int(engine.dp_world_size), pp, dp_rank, stage_id)


def param_names(engine: Any) -> dict[int, str]:
    """id(parameter) -> its name in the module (tied parameters appear once)."""
    return {id(p): name for name, p in engine.module.named_parameters()}


def inner_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The client's torch optimizer inside DeepSpeed's ZeRO wrapper, checked to be Adam/AdamW."""
    zo = engine.optimizer
    inner = getattr(zo, "optimizer", None)
    if inner is None:
        raise DeepSpeedStateError(f"engine optimizer {type(zo).__name__} wraps no optimizer")
    if type(inner).__name__ not in SUPPORTED_OPTIMIZERS or step_in_groups(inner):  # another library's FusedAdam
        raise DeepSpeedStateError(
            f"optimizer {type(inner).__name__}: tenplex re-shards the state of {', '.join(SUPPORTED_OPTIMIZERS)}")
    if any(g.get("amsgrad") for g in inner.param_groups):
        raise DeepSpeedStateError("optimizer with amsgrad=True: max_exp_avg_sq is not re-sharded")
    return inner


def _hp_groups(zo: Any) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """Stages 1/2: (params, flat fp32 partition) per param group."""
    if hasattr(zo, "bit16_groups") and hasattr(zo, "single_partition_of_fp32_groups"):
        return list(zip(zo.bit16_groups, zo.single_partition_of_fp32_groups))
    if hasattr(zo, "bf16_groups") and hasattr(zo, "fp32_groups_flat_partition"):
        return list(zip(zo.bf16_groups, zo.fp32_groups_flat_partition))
    raise DeepSpeedStateError(f"optimizer {type(zo).__name__}: not a ZeRO stage 1/2 or BF16 optimizer")


def _flat_partitions(engine: Any) -> list[torch.Tensor]:
    """The flat fp32 partitions that key Adam's state (ZeRO-3 empties the param groups between steps)."""
    zo = engine.optimizer
    if int(engine.zero_optimization_stage()) == 3:
        return list(zo.fp32_partitioned_groups_flat)
    return [flat for _, flat in _hp_groups(zo)]


def allocate_state(engine: Any) -> None:
    """Create Adam's state for every flat fp32 partition (a fresh engine has none) so a load fills it in place."""
    inner = inner_optimizer(engine)
    for flat in _flat_partitions(engine):
        st = inner.state[flat]
        st.setdefault("step", fresh_step(inner, inner.param_groups[0], flat))
        for k in STATE_KEYS:
            if k not in st:
                st[k] = torch.zeros_like(flat, memory_format=torch.preserve_format)
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # stages 1/2: point each parameter's optimizer fragments at the new state
        link()


def _state_of(inner: torch.optim.Optimizer, flat: torch.Tensor, key: str) -> torch.Tensor | None:
    st = inner.state.get(flat)
    return None if st is None else st.get(key)


def _meta(name: str, shape: tuple[int, ...], dtype: torch.dtype, param: str | None = None) -> TensorMeta:
    return TensorMeta(key=name, global_shape=shape, dtype=torch_dtype_name(dtype), param=param)


def _flat_chunk(key: str, shape: tuple[int, ...], start: int, stop: int) -> Chunk:
    return Chunk(key, (0,) * len(shape), shape, (start, stop))


def _optimizer_chunks(
    inner: torch.optim.Optimizer, name: str, shape: tuple[int, ...], flat: torch.Tensor,
    in_param: tuple[int, int], in_flat: int,
) -> list[LocalChunk]:
    """fp32 master and Adam moments of one parameter's range ``in_param``, at ``in_flat`` in the partition."""
    n = in_param[1] - in_param[0]
    out = []
    for state, t in (("fp32_param", flat), *((k, _state_of(inner, flat, k)) for k in STATE_KEYS)):
        if t is None:
            raise DeepSpeedStateError(f"parameter {name!r}: optimizer state {state!r} does not exist (call allocate_state)")
        key = f"optimizer.state.{state}.{name}"
        out.append(LocalChunk(_meta(key, shape, t.dtype, name), _flat_chunk(key, shape, *in_param),
                              t.narrow(0, in_flat, n), True))
    return out


def _stage12_chunks(engine: Any, lay: EngineLayout) -> list[LocalChunk]:
    zo = engine.optimizer
    inner = inner_optimizer(engine)
    names = param_names(engine)
    out: list[LocalChunk] = []
    for params, flat in _hp_groups(zo):
        for p in params:
            name = names.get(id(p))
            if name is None:
                raise DeepSpeedStateError(f"a parameter of shape {tuple(p.shape)} is not in engine.module")
            shape = tuple(p.shape)
            key = f"model.{name}"
            out.append(LocalChunk(_meta(key, shape, p.dtype), Chunk(key, (0,) * len(shape), shape), p.data,
                                  lay.dp_rank == 0))
            m = getattr(p, "_hp_mapping", None)
            if m is None:
                continue  # no element of p in this rank's partition
            lo, n, at = m.lp_fragment_address.start, m.lp_fragment_address.numel, m.hp_fragment_address.start
            out.extend(_optimizer_chunks(inner, name, shape, flat, (lo, lo + n), at))
    return out


def _stage3_chunks(engine: Any, lay: EngineLayout) -> list[LocalChunk]:
    zo = engine.optimizer
    inner = inner_optimizer(engine)
    names = param_names(engine)
    if getattr(zo, "swap_optimizer", False) or getattr(zo, "offload_param", False):
        raise DeepSpeedStateError("ZeRO-3 with NVMe/CPU offload is not supported by tenplex")
    out: list[LocalChunk] = []
    for params, flat in zip(zo.fp16_groups, zo.fp32_partitioned_groups_flat):
        at = 0
        for p in params:
            name = names.get(id(p))
            if name is None:
                raise DeepSpeedStateError(f"a ZeRO-3 parameter (ds_id {p.ds_id}) is not in engine.module")
            shape = tuple(p.ds_shape)
            size = p.ds_tensor.numel()  # equal share per rank, the last one padded
            lo = min(lay.dp_rank * size, p.ds_numel)
            hi = min(lo + size, p.ds_numel)
            if hi > lo:
                key = f"model.{name}"
                out.append(LocalChunk(_meta(key, shape, p.ds_tensor.dtype), _flat_chunk(key, shape, lo, hi),
                                      p.ds_tensor.data.narrow(0, 0, hi - lo), True))
                out.extend(_optimizer_chunks(inner, name, shape, flat, (lo, hi), at))
            at += size
        if at != flat.numel():
            raise DeepSpeedStateError(f"ZeRO-3 partition holds {flat.numel()} elements, its parameters {at}")
    return out


def describe_engine(engine: Any) -> tuple[EngineLayout, list[LocalChunk]]:
    """This rank's layout and every chunk it holds (model weights, fp32 master, Adam moments)."""
    lay = engine_layout(engine)
    if lay.zero_stage == 3:
        return lay, _stage3_chunks(engine, lay)
    return lay, _stage12_chunks(engine, lay)


def check_param_shapes(ours: dict[str, TensorMeta], saved: dict[str, TensorMeta], where: str) -> None:
    """Refuse a checkpoint whose parameters differ in name or shape from the engine's (a different model)."""
    mine = {k: m.global_shape for k, m in ours.items() if k.startswith("model.")}
    theirs = {k: m.global_shape for k, m in saved.items() if k.startswith("model.")}
    missing = sorted(set(mine) - set(theirs))
    if missing:
        raise PTCError(f"{where}: the checkpoint has no parameter {missing[0][6:]!r} "
                       f"({len(missing)} missing): is it from a different model?")
    for k in sorted(mine):
        if mine[k] != theirs[k]:
            raise PTCError(f"{where}: parameter {k[6:]!r} has shape {list(theirs[k])} in the checkpoint, "
                           f"{list(mine[k])} in the engine: is it from a different model?")


def tied_copies(engine: Any, lay: EngineLayout) -> set[str]:
    """Names of a pipeline's tied parameters whose copy on this stage is not the one to save.

    Each stage of a tied group (the word embedding on the first and last
    stage) keeps its own identical copy and optimizer state: only the lowest
    stage's is written; on load every copy is filled from it.
    """
    comms = getattr(engine.module, "tied_comms", None)
    if not comms:
        return set()
    topo = engine.module._topo
    out: set[str] = set()
    for key, c in comms.items():
        stages = sorted({topo.get_coord(r).pipe for r in c["ranks"]})
        if lay.stage_id != stages[0]:
            out.update(name for name, _ in c["module"].named_parameters(prefix=f"tied_modules.{key}"))
    return out
