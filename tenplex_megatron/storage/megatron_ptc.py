"""Megatron's own ``torch_dist`` checkpoint described as a PTC, without torch: the one description that adoption
(``integrations/megatron_core/native.py``, with the live model's tensors) and ``python -m tenplex_megatron plan``
(with :func:`index_model_metas`, the tensors as the index shows them) both use.

The directory is read by ``storage/megatron_torch_dist.py``; the model's TP-local tensors are the ``.distcp`` items
torch's distributed-checkpoint index names (file, offset, length); the distributed optimizer's ``dp_reshardable``
buckets are cut into the parameters' flat ranges by ``storage/megatron_buckets.py``; ``fully_reshardable`` and
plain-optimizer checkpoints hold model-space optimizer tensors, read as they are.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from tenplex_megatron.plan.experts import is_expert_key
from tenplex_megatron.plan.layout import LayoutError, ParallelLayout
from tenplex_megatron.plan.pipeline_split import rule_of
from tenplex_megatron.plan.ptc import PTC, Chunk, PTCError, StoredChunk, TensorMeta
from tenplex_megatron.plan.sim.gpt_catalogue import LAYER_TP_AXES
from tenplex_megatron.storage.megatron_buckets import (
    DENSE,
    EXPERTS,
    LAYER_ORDER,
    MOE_MLP_ORDER,
    bucket_groups,
    dist_opt_chunks,
    layer_param_keys,
)
from tenplex_megatron.storage.megatron_torch_dist import (
    OPTIMIZER_KEY,
    POST_KEYS,
    PRE_KEYS,
    STATE_NAMES,
    MegatronCheckpointError,
    TorchDistCheckpoint,
    dcp_location,
    is_optimizer_key,
    saved_arg,
)

# layer tensors every TP rank holds whole (norms, biases after a row-parallel layer, the router, a shared gate)
_REPLICATED = re.compile(r"(self_attention\.linear_qkv|mlp\.linear_fc1)\.layer_norm_(weight|bias)|"
                         r"(self_attention\.linear_proj|mlp\.linear_fc2)\.bias|pre_mlp_layernorm\.(weight|bias)|"
                         r"mlp\.router\.(weight|bias|expert_bias)|mlp\.(experts\.experts|shared_experts)\.linear_fc2\.bias|"
                         r"mlp\.shared_experts\.gate_weight")
# TP-split layer tensors the dry-run catalogue does not list (a shared expert's fc1 bias)
_TP_AXES = MappingProxyType({**LAYER_TP_AXES, "mlp.shared_experts.linear_fc1.bias": 1})
# the MLPs of a layer (dense, routed experts, shared experts) by their fc1 / fc2 keys' common start: under SwiGLU an
# fc1 is twice as wide as its fc2's input (gate and up: two TP parts)
_FCS = ("mlp.linear_fc", "mlp.experts.experts.linear_fc", "mlp.shared_experts.linear_fc")


def _saved_tp(ck: TorchDistCheckpoint, live: dict[str, TensorMeta], experts: bool = False) -> int | None:
    """The saving layout's TP (``experts``: the routed experts' TP) from how the index cuts a TP-split tensor; None
    when no such tensor is stored."""
    for key, t in sorted(live.items()):
        st = ck.tensors().get(key)
        if t.tp_axis is not None and st is not None and is_expert_key(key, t.param) == experts:
            parts = {offsets[t.tp_axis] for offsets, _ in st.chunks}
            return max(len(parts) // t.tp_parts, 1)
    return None


def _refuse_uneven(ck: TorchDistCheckpoint, args: Any, pp: int) -> None:
    """Megatron's own checkpoint saved with uneven pipeline stages: refused naming the saved flags (adopting it would
    take the distributed optimizer's per-stage buffers at the saved split, which no test has run; a tenplex
    checkpoint of the same job re-shards across splits)."""
    rule = rule_of(args) if args is not None else None
    if pp > 1 and rule is not None and rule.given:
        raise MegatronCheckpointError(f"{ck.path}: saved with uneven pipeline stages ({rule.flags()}): adopting "
                                      "Megatron's own checkpoint at an uneven split is not supported; save it with "
                                      "--tenplex (or at an even split) and restart from that")


def saved_layout(ck: TorchDistCheckpoint, live: dict[str, TensorMeta], groups: dict) -> ParallelLayout:
    """The layout the checkpoint was saved at: TP (and the experts' TP) from the model's chunks, PP from the dense
    buffer's groups, EP from the expert buffer's groups (TP x EP x PP of the experts; without them, the saved
    args'), DP from the files; a count the args contradict, or one no layout has, fails naming both."""
    tp = _saved_tp(ck, live) or 1
    etp = _saved_tp(ck, live, experts=True) or tp
    args = ck.common.get("args")
    dense = [g for b, g in groups if b == DENSE]
    experts = [g for b, g in groups if b == EXPERTS]
    pp = max(len(dense) // tp, 1) if dense else int(saved_arg(args, "pipeline_model_parallel_size") or 1)
    saved_ep = int(saved_arg(args, "expert_model_parallel_size") or 1)
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
    _refuse_uneven(ck, args, pp)
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


def describe_torch_dist(ck: TorchDistCheckpoint, live: dict[str, TensorMeta], layer_keys: tuple[str, ...],
                        wanted: set[str]) -> PTC:
    """The checkpoint as a PTC with the live job's tensor keys (the optimizer's as tenplex names them).

    ``live``: the job's model tensors; ``wanted``: the optimizer states it keeps (``fp32_param`` only when the
    model's weights are not fp32 themselves)."""
    check_model(ck, live)
    saved = ck.tensors()
    groups = bucket_groups(ck)
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
            chunks.append(StoredChunk(Chunk(key, offsets, sizes), dcp_location(ck, ck.storage[(key, offsets)],
                                                                       math.prod(sizes), 0)))
    if ck.sharding_type == "dp_reshardable":
        opt_chunks, dtypes = dist_opt_chunks(ck, metas, layer_keys, layout, groups, wanted)
        chunks.extend(opt_chunks)
        for okey, dtype in dtypes.items():
            pkey = okey.split(".", 3)[3]
            tensors[okey] = replace(metas[pkey], key=okey, dtype=dtype, param=pkey)
    else:  # model-space optimizer tensors: [chained_N.]optimizer.state.<state>.<param key>
        for key, st in saved.items():
            if not is_optimizer_key(key):
                continue
            parts = OPTIMIZER_KEY.sub("optimizer.", key, count=1).split(".", 3)
            if len(parts) < 4 or parts[1] != "state" or parts[2] not in STATE_NAMES:
                raise MegatronCheckpointError(f"{ck.path}: optimizer tensor {key!r} is not supported (tenplex reads "
                                              f"Adam's states: {', '.join(sorted(STATE_NAMES))})")
            name, pkey = STATE_NAMES[parts[2]], parts[3]
            if name not in wanted or pkey not in metas:
                continue
            okey = f"optimizer.state.{name}.{pkey}"
            tensors[okey] = replace(metas[pkey], key=okey, global_shape=st.size, dtype=st.dtype, param=pkey)
            for offsets, sizes in st.chunks:
                chunks.append(StoredChunk(Chunk(okey, offsets, sizes), dcp_location(ck, ck.storage[(key, offsets)],
                                                                            math.prod(sizes), 0)))
    ptc = PTC(tensors, tuple(chunks), layout.to_json())
    try:
        ptc.validate()
    except PTCError as e:
        raise MegatronCheckpointError(f"{ck.path}: {e}") from None
    return ptc


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
    vocab = int(saved_arg(ck.common.get("args"), "vocab_size") or 0) or None
    return {k: gpt_tensor_meta(ck.path, k, tuple(saved[k].size), saved[k].dtype, vocab, tied, parts) for k in keys}


def index_model_metas(ck: TorchDistCheckpoint) -> tuple[dict[str, TensorMeta], tuple[str, ...]]:
    """The model's tensors as the index shows them and one layer's keys in megatron-core's module order
    (:data:`LAYER_ORDER`, a mixture of experts' :data:`MOE_MLP_ORDER`; the index's own order is the writers', not
    the model's, at DP > 1): the live model's stand-in for ``plan``."""
    out = _index_metas(ck, [k for k in ck.tensors() if not is_optimizer_key(k)])
    layer = layer_param_keys(out)
    return out, tuple(k for k in dict.fromkeys(f"decoder.layers.{n}" for n in LAYER_ORDER + MOE_MLP_ORDER)
                      if k in layer)
