"""Describe a live megatron-core job as PTC chunks, from megatron-core's own sharding metadata.

The model's chunks come from ``GPTModel.sharded_state_dict()`` (global shape,
offsets, prepended layer axis, ``replica_id``; ``ShardedTensorFactory`` entries
such as SwiGLU's fc1 are expanded by building them on meta tensors; GroupedMLP's
experts, whose factory transposes, are described in their own memory order by
``grouped.py``). The distributed optimizer's chunks are each DP rank's
contiguous flat range of the TP-local parameter (``param_range``), described as
a flat range of that box, so saving needs no gather. The plain optimizer's come from its own
``sharded_state_dict``. Every chunk keeps a reference to the live tensor, so
loading writes straight into the model and the optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)

from tenplex_megatron.engine.chunks import LocalChunk, tensor_table
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.integrations.megatron_core.grouped import grouped_weights, native_box
from tenplex_megatron.integrations.megatron_core.optimizer import is_distributed_optimizer, sub_optimizers
from tenplex_megatron.plan.ptc import Chunk, PTCError, TensorMeta
from tenplex_megatron.storage.safetensors_io import torch_dtype_name


class ModelArgumentError(TenplexError, ValueError):
    """A model given to ``save_checkpoint``/``load_checkpoint`` whose chunks or vocabulary do not fit."""


def extra_state_keys(model_sd: Any) -> list[str]:
    """The keys of Transformer Engine's ``_extra_state`` objects (FP8 scaling factors and amax history) in a model's
    sharded state dict: megatron-core describes them as ``ShardedObject``s; tenplex keeps them per rank
    (``extra_state.py``), not as PTC tensors. megatron-core's own linear layers (the MoE experts' included) yield
    them too, holding None: nothing to keep there."""
    return sorted({v.key for v in nested_values(model_sd) if isinstance(v, ShardedObject)
                   and v.key.endswith("_extra_state") and v.data is not None})


def unwrap(module: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def model_keys(chunks: int) -> list[str]:
    """Megatron-LM's keys of the model chunks in a checkpoint: ``model``, or ``model0``, ``model1``, ... with one
    chunk per virtual pipeline stage."""
    return ["model"] if chunks == 1 else [f"model{i}" for i in range(chunks)]


def model_sharded_state_dict(job: Any) -> dict:
    """Every model chunk's sharded state dict (one chunk per virtual pipeline stage), as Megatron-LM keys them."""
    chunks = {key: unwrap(m).sharded_state_dict(metadata={"singleton_local_shards": False})
              for key, m in zip(model_keys(len(job.model)), job.model)}
    return chunks["model"] if len(chunks) == 1 else chunks


def _is_main(replica_id: Any) -> bool:
    return is_main_replica(replica_id)


@dataclass(frozen=True)
class _Ctx:
    """What describing needs besides megatron's per-tensor metadata."""

    padded_vocab: int
    vocab_size: int
    tp: int
    etp: int  # the experts' TP (megatron-core's expert_tensor_parallel_size)
    stages: dict[int, str]  # id(param) -> "first" / "last" for non-layer parameters
    tied: int | None  # id of the word embedding shared with the output layer
    grouped: dict[int, str]  # id(param) -> "weight1" / "weight2" of a GroupedMLP (grouped-GEMM experts)


def _meta(sh: Any, dtype: torch.dtype, param: torch.Tensor, ctx: _Ctx, param_key: str | None) -> TensorMeta:
    vocab_rows = None
    if getattr(sh, "allow_shape_mismatch", False) and sh.global_shape and sh.global_shape[0] == ctx.padded_vocab:
        vocab_rows = ctx.vocab_size
    tp_axis = None
    tp_parts = 1
    if getattr(param, "tensor_model_parallel", False) and getattr(param, "partition_dim", -1) >= 0:
        tp_axis = param.partition_dim + sh.prepend_axis_num
        # a routed expert's tensor has two prepended axes (layer, expert: SequentialMLP's global expert index), and
        # is split by the experts' own TP
        tp = ctx.etp if sh.prepend_axis_num >= 2 else ctx.tp
        tp_parts = max(sh.axis_fragmentations[tp_axis] // tp, 1)
    stage = "layers" if sh.prepend_axis_num else ctx.stages.get(id(param), "")
    return TensorMeta(
        key=sh.key,
        global_shape=tuple(sh.global_shape),
        dtype=torch_dtype_name(dtype),
        vocab_rows=vocab_rows,
        tp_axis=tp_axis,
        tp_parts=tp_parts,
        stage=stage,
        tied=ctx.tied is not None and id(param) == ctx.tied,
        param=param_key,
    )


def _tensor_chunk(
    sh: Any, data: torch.Tensor, flat: tuple[int, int] | None, param: torch.Tensor, ctx: _Ctx, param_key: str | None
) -> LocalChunk:
    box = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    chunk = Chunk(sh.key, tuple(sh.global_offset), box, flat)
    return LocalChunk(_meta(sh, data.dtype, param, ctx, param_key), chunk, data, _is_main(sh.replica_id))


def _factory_chunks(
    factory: Any, data: torch.Tensor, param: torch.Tensor, flat: tuple[int, int] | None, ctx: _Ctx,
    param_key: str | None,
) -> list[LocalChunk]:
    """Expand a ShardedTensorFactory by building it on a meta tensor to learn each part's flat interval."""

    probe = torch.empty(tuple(param.shape), dtype=data.dtype, device="meta")
    built = replace(factory, data=probe).build()
    parts = [x for x in nested_values(built if isinstance(built, (dict, list)) else [built]) if isinstance(x, ShardedTensor)]
    out = []
    full = data.view(-1) if flat is None else data
    for sub in parts:
        # a part must be a contiguous view of the parameter (a copy, such as a transposed one, maps to no interval)
        if not sub.data.is_contiguous() or (sub.data is not probe and sub.data._base is not probe):
            raise PTCError(f"tensor {factory.key!r}: factory part is not a contiguous slice; cannot describe it")
        lo = sub.data.storage_offset()
        hi = lo + sub.data.numel()
        if flat is None:
            out.append(_tensor_chunk(sub, full[lo:hi], None, param, ctx, param_key))
            continue
        a, b = flat
        s, e = max(a, lo), min(b, hi)
        if s < e:
            out.append(_tensor_chunk(sub, full[s - a : e - a], (s - lo, e - lo), param, ctx, param_key))
    return out


def _grouped_chunks(
    factory: Any, data: torch.Tensor, param: torch.Tensor, flat: tuple[int, int] | None, ctx: _Ctx,
) -> list[LocalChunk]:
    """A GroupedMLP weight (or its optimizer state, keyed ``optimizer.state.<name>.<weight's key>``) as one box of
    its own tensor (``grouped.py``): the whole parameter, or a distributed-optimizer rank's flat range of it."""
    box = native_box(factory, param, ctx.grouped[id(param)])
    state = box.key.startswith("optimizer.state.")
    meta = TensorMeta(key=box.key, global_shape=box.global_shape, dtype=torch_dtype_name(data.dtype),
                      tp_axis=box.tp_axis, stage="layers", param=box.key.split(".", 3)[3] if state else None)
    chunk = Chunk(box.key, box.offsets, box.shape, flat)
    return [LocalChunk(meta, chunk, data if flat is not None else data.view(-1), _is_main(box.replica_id))]


def _entries(tree: Any) -> Iterable[Any]:

    for v in nested_values(tree):
        if isinstance(v, (ShardedTensor, ShardedTensorFactory)):
            yield v


def _expand(
    sh: Any, data: torch.Tensor, param: torch.Tensor, flat: tuple[int, int] | None, ctx: _Ctx,
    param_key: str | None = None,
) -> list[LocalChunk]:

    if isinstance(sh, ShardedTensorFactory):
        if id(param) in ctx.grouped:
            return _grouped_chunks(sh, data, param, flat, ctx)
        return _factory_chunks(sh, data, param, flat, ctx, param_key)
    return [_tensor_chunk(sh, data, flat, param, ctx, param_key)]


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _dist_optimizer_chunks(opt: Any, model_sd: dict, ctx: _Ctx) -> list[LocalChunk]:
    """Each DP rank's flat range of every TP-local parameter's fp32 main weight and Adam moments."""
    by_param = {id(sh.data): sh for sh in _entries(model_sd)}
    out: list[LocalChunk] = []
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for gbuf_range_map in per_bucket:
                for model_param, range_map in gbuf_range_map["param_map"].items():
                    r = range_map["param"]
                    sh = by_param.get(id(model_param))
                    if sh is None:
                        raise PTCError(f"a parameter of shape {tuple(model_param.shape)} has no sharded metadata")
                    replica = (*sh.replica_id[:2], opt.distributed_optimizer_instance_id)
                    for state_key, t in opt._get_main_param_and_optimizer_states(model_param).items():
                        if state_key == "step":
                            continue
                        name = "fp32_param" if state_key == "param" else state_key
                        if name == "fp32_param" and _aliases(t, model_param):
                            continue  # fp32 model: the main weight is the model weight itself
                        osh = replace(sh, key=f"optimizer.state.{name}.{sh.key}", replica_id=replica)
                        out.extend(_expand(osh, t, model_param, (r.start, r.end), ctx, sh.key))
    return out


def _plain_optimizer_chunks(opt: Any, model_sd: dict, ctx: _Ctx) -> list[LocalChunk]:
    """The plain optimizer's state via its own ``sharded_state_dict`` (keys ``optimizer.state.<name>.<param>``)."""
    by_key = {sh.key: sh.data for sh in _entries(model_sd)}
    sd = opt.sharded_state_dict(model_sd, is_loading=False)
    out: list[LocalChunk] = []
    for sh in _entries(sd):
        param_key = sh.key.split(".", 3)[3] if sh.key.startswith("optimizer.state.") else None
        param = by_key.get(param_key, sh.data) if param_key else sh.data
        out.extend(_expand(sh, sh.data, param, None, ctx, param_key))
    return out


def _context(job: Any) -> _Ctx:
    stages: dict[int, str] = {}
    tied = None
    for model in map(unwrap, job.model):  # with VPP, the first stage is chunk 0 and the last the last chunk
        for name, role in (("embedding", "first"), ("output_layer", "last")):
            module = getattr(model, name, None)
            if module is not None:
                stages.update({id(p): role for p in module.parameters()})
        final_ln = getattr(getattr(model, "decoder", None), "final_layernorm", None)
        if final_ln is not None:
            stages.update({id(p): "last" for p in final_ln.parameters()})
        if getattr(model, "share_embeddings_and_output_weights", False) and getattr(model, "pre_process", False):
            tied = id(model.shared_embedding_or_output_weight())
        if getattr(model, "share_embeddings_and_output_weights", False) and getattr(model, "post_process", False):
            out = model.shared_embedding_or_output_weight()
            stages[id(out)] = "first"  # the last stage's copy of the word embedding
            tied = id(out)
    return _Ctx(job.padded_vocab_size, job.spec.vocab_size, job.layout.tp, job.layout.expert_tp, stages, tied,
                grouped_weights([unwrap(m) for m in job.model]))


def model_chunks(job: Any) -> list[LocalChunk]:
    """The model's chunks only, no optimizer state: what a weights-only load (a Hugging Face import) fills."""
    ctx = _context(job)
    return [c for sh in _entries(model_sharded_state_dict(job)) for c in _expand(sh, sh.data, sh.data, None, ctx)]


def describe_job(job: Any) -> tuple[dict[str, TensorMeta], list[LocalChunk]]:
    """All chunks this rank holds (model, then optimizer), with their tensor metadata."""
    ctx = _context(job)
    model_sd = model_sharded_state_dict(job)
    chunks: list[LocalChunk] = []
    for sh in _entries(model_sd):
        chunks.extend(_expand(sh, sh.data, sh.data, None, ctx))
    for opt in sub_optimizers(job.optimizer):
        if is_distributed_optimizer(opt):
            chunks.extend(_dist_optimizer_chunks(opt, model_sd, ctx))
        else:
            chunks.extend(_plain_optimizer_chunks(opt, model_sd, ctx))
    return tensor_table(chunks), chunks


def describe_model(job: Any) -> tuple[dict[str, TensorMeta], tuple[str, ...], dict[str, str]]:
    """The model's tensor metadata; one transformer layer's parameters' keys in ``module.parameters()`` order (the
    order megatron-core's grad buffer lays them out, reversed); and each key's module parameter name (layers as
    ``decoder.layers.{}.<name>``: the legacy format's state-dict names). No optimizer state is touched."""
    ctx = _context(job)
    model_sd = model_sharded_state_dict(job)
    chunks: list[LocalChunk] = []
    keys: dict[int, str] = {}
    for sh in _entries(model_sd):
        chunks.extend(_expand(sh, sh.data, sh.data, None, ctx))
        keys.setdefault(id(sh.data), sh.key)
    order: list[str] = []
    names: dict[str, str] = {}
    first_layer = None
    for name, p in unwrap(job.model[0]).named_parameters():
        if id(p) not in keys:
            continue
        parts = name.split(".")
        if parts[:2] != ["decoder", "layers"]:
            names.setdefault(keys[id(p)], name)
            continue
        first_layer = parts[2] if first_layer is None else first_layer
        if parts[2] == first_layer:
            order.append(keys[id(p)])
            names[keys[id(p)]] = ".".join(["decoder", "layers", "{}", *parts[3:]])
    return tensor_table(chunks), tuple(order), names
