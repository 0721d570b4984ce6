"""Megatron-LM's legacy ``--ckpt-format torch`` checkpoint described as a PTC, without torch: the one description
that adoption (``integrations/megatron_core/legacy.py``: files read by ``torch.load``, the live model's tensors) and
``python -m tenplex_megatron plan`` (files read by ``megatron_summary.read_torch_pickle``, the tensors as the files show
them: :func:`legacy_model_metas`) both use. Only tensors' shapes are used here, never their data.

``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holds one (TP, PP) rank's model state dict (layers numbered
locally), the optimizer's param groups and ``args``; ``distrib_optim.pt`` the distributed optimizer's state gathered
over DP, per grad buffer one flat tensor per state, laid out as megatron-core 0.16.1's buffer at the saving (TP, PP)
(``plan/megatron_buffer.py``, checked against the sizes). Without the distributed optimizer the state is the plain
optimizer's, numbered by megatron-core's ``_get_param_groups`` (weight-decayed parameters, then bias and 1-D ones).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from tenplex_megatron.plan.experts import is_expert_key
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.megatron_buffer import bucket_layout
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, PTCError, StoredChunk, TensorMeta
from tenplex_megatron.plan.sim.gpt_catalogue import LAYER_TP_AXES
from tenplex_megatron.storage.confine import confine
from tenplex_megatron.storage.megatron_buckets import split_flat, stage_params
from tenplex_megatron.storage.megatron_ptc import gpt_tensor_meta
from tenplex_megatron.storage.megatron_torch_dist import POST_KEYS, PRE_KEYS, MegatronCheckpointError

SUPPORTED_VERSIONS = (3.0,)  # Megatron-LM's checkpoint_version
MODEL_FILE, OPTIM_FILE = "model_optim_rng.pt", "distrib_optim.pt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def legacy_layout(path: str, args: Any = None) -> ParallelLayout:
    """The saving (TP, PP): ``args``' (Megatron-LM records them) or the rank directories', every rank's file
    checked to be there."""
    ranks = [(int(m.group(1)), int(m.group(2) or 0)) for n in os.listdir(path) if (m := _RANK_DIR.fullmatch(n))]
    tp = int(getattr(args, "tensor_model_parallel_size", 0) or max(t for t, _ in ranks) + 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 0) or max(p for _, p in ranks) + 1)
    for t in range(tp):
        for p in range(pp):
            name = rank_dir(t, p, pp)
            f = os.path.join(path, name, MODEL_FILE)
            if not os.path.isfile(confine(path, os.path.join(name, MODEL_FILE), "the legacy layout")):
                raise MegatronCheckpointError(f"{f}: missing (the checkpoint was written at TP{tp} PP{pp})")
    return ParallelLayout(tp, pp, 1)


def _local_shape(boxes: list, axis: int | None, prepend: int) -> tuple[int, ...]:
    shape = list(boxes[0][1])
    if axis is not None and len(boxes) > 1:
        shape[axis] = sum(s[axis] for _, s in boxes)
    return tuple(shape[prepend:])


def describe_legacy(path: str, load: Callable[[str], Any], model: dict[str, TensorMeta], layer_keys: tuple[str, ...],
                    module_names: dict[str, str]) -> tuple[PTC, dict[str, Any], Any]:
    """The legacy iteration directory ``path`` as a PTC for ``model`` (checked against it), with rank 0's state dict
    and the args; ``load(relative path)`` reads one file (``torch.load`` at adoption, tensor stubs in the cli)."""
    experts = sorted(k for k in model if is_expert_key(k))
    if experts:
        raise MegatronCheckpointError(f"{path}: tensor {experts[0]!r}: a mixture of experts in Megatron's legacy "
                                      "torch format is not adopted (save it as torch_dist, Megatron-LM's default, or "
                                      "with --tenplex)")
    layout = legacy_layout(path)
    first = load(os.path.join(rank_dir(0, 0, layout.pp), MODEL_FILE))
    version = first.get("checkpoint_version")
    if version not in SUPPORTED_VERSIONS:
        raise MegatronCheckpointError(f"{os.path.join(path, rank_dir(0, 0, layout.pp), MODEL_FILE)}: "
                                      f"checkpoint_version {version} is not supported (tenplex reads "
                                      f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
    args = first.get("args")
    layout = legacy_layout(path, args)  # again with the sizes Megatron-LM recorded: a missing rank directory is named
    layout = ParallelLayout(layout.tp, layout.pp, int(getattr(args, "data_parallel_size", 1) or 1))
    emb = first["model"].get(PRE_KEYS[0])
    metas = dict(model)
    if emb is not None and PRE_KEYS[0] in metas:
        rows = int(emb.shape[0]) * layout.tp
        for k, t in model.items():
            if t.vocab_rows is not None:
                metas[k] = replace(t, global_shape=(rows, *t.global_shape[1:]))
    wanted = {"exp_avg", "exp_avg_sq"} | ({"fp32_param"} if any(t.dtype != "float32" for t in model.values()) else set())
    tensors: dict[str, TensorMeta] = dict(metas)
    chunks: list[StoredChunk] = []
    saved = set(metas)
    for p in range(layout.pp):
        for t in range(layout.tp):
            rdir = rank_dir(t, p, layout.pp)
            fname = os.path.join(rdir, MODEL_FILE)
            sd = load(fname)
            states = sd.get("model") or {}
            params = stage_params(metas, layer_keys, saved, layout, t, p)
            count: dict[str, int] = {}
            by_name: dict[str, tuple[list, str, bool]] = {}
            for bp, boxes, key in params:
                if bp.name.endswith("#copy"):
                    name = "output_layer.weight"
                elif "#" in bp.name:
                    count[key] = count.get(key, -1) + 1
                    name = module_names[key].format(count[key])
                else:
                    name = module_names.get(key, key)
                local = states.get(name)
                meta = metas[key]
                want = _local_shape(boxes, meta.tp_axis, 1 if meta.stage == "layers" else 0)
                if local is None:
                    raise MegatronCheckpointError(f"{os.path.join(path, fname)}: no tensor {name!r}: is it from a "
                                                  "different model?")
                if tuple(local.shape) != want:
                    raise MegatronCheckpointError(
                        f"{os.path.join(path, fname)}: tensor {name!r} has shape {list(local.shape)}, the model's at "
                        f"{layout} would be {list(want)}: is it from a different model?")
                by_name[name] = (boxes, key, bp.name.endswith("#copy"))
                if bp.name.endswith("#copy"):
                    continue
                for at, off, shape, _, _ in split_flat(0, bp.numel, boxes):
                    chunks.append(StoredChunk(Chunk(key, tuple(off), tuple(shape)),
                                              Location(fname, f"model/{name}:{at}", t + p * layout.tp)))
            if os.path.isfile(os.path.join(path, rdir, OPTIM_FILE)):
                chunks.extend(_optimizer_chunks(path, load, rdir, sd, params, layout, t, p, wanted, tensors, metas))
            else:
                chunks.extend(_plain_optimizer_chunks(path, rdir, sd, by_name, t + p * layout.tp, wanted, tensors,
                                                      metas))
    unknown = sorted(k for k in (first.get("model") or {}) if not k.endswith("_extra_state")
                     and not _LAYER.fullmatch(k) and k not in PRE_KEYS + POST_KEYS)
    if unknown:
        raise MegatronCheckpointError(f"{os.path.join(path, rank_dir(0, 0, layout.pp), MODEL_FILE)}: tensor(s) "
                                      f"{', '.join(unknown)} are not parameters of megatron-core's GPTModel")
    ptc = PTC(tensors, tuple(chunks), layout.to_json())
    try:
        ptc.validate()
    except PTCError as e:
        raise MegatronCheckpointError(f"{path}: {e}") from None
    return ptc, first, args


def rank_dir(t: int, p: int, pp: int) -> str:
    return f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"


def _optimizer_chunks(path: str, load: Callable[[str], Any], rdir: str, sd: dict[str, Any], params: list, layout: ParallelLayout,
                      t: int, p: int, wanted: set[str], tensors: dict[str, TensorMeta],
                      metas: dict[str, TensorMeta]) -> list[StoredChunk]:
    """The distributed optimizer's gathered buffer of one (TP, PP) rank as whole TP-local boxes."""
    fname = os.path.join(rdir, OPTIM_FILE)
    state = load(fname)
    if not isinstance(state, dict) or set(k for k in state if isinstance(k, int)) != {0}:
        raise MegatronCheckpointError(f"{os.path.join(path, fname)}: not one grad buffer's state (mixed dtypes or "
                                      "experts are not supported)")
    (per_dtype,) = state[0].values()
    names = {k for k in per_dtype if k != "numel_unpadded"}
    if not names <= {"param", "exp_avg", "exp_avg_sq"}:
        raise MegatronCheckpointError(f"{os.path.join(path, fname)}: optimizer state {sorted(names)} is not "
                                      "supported (tenplex reads Adam's: param, exp_avg, exp_avg_sq)")
    buckets = bucket_layout([bp for bp, _, _ in params], max(layout.dp, 1))
    total = sum(b.numel_unpadded for b in buckets)
    for n in sorted(names):
        if per_dtype[n].numel() != total or int(per_dtype.get("numel_unpadded", total)) != total:
            raise MegatronCheckpointError(
                f"{os.path.join(path, fname)}: {n} has {per_dtype[n].numel()} elements, megatron-core 0.16.1's "
                f"buffer layout of this model at TP{layout.tp} PP{layout.pp} has {total}: another model or layout?")
    where = {bp.name: (boxes, key) for bp, boxes, key in params}
    out = []
    base = 0
    for b in buckets:
        for name, s, e in b.params:
            if name.endswith("#copy"):
                continue
            boxes, key = where[name]
            for n in sorted(names):
                tname = "fp32_param" if n == "param" else n
                if tname not in wanted:
                    continue
                okey = f"optimizer.state.{tname}.{key}"
                tensors.setdefault(okey, replace(metas[key], key=okey, dtype="float32", param=key))
                for at, off, shape, _, _ in split_flat(0, e - s, boxes):
                    out.append(StoredChunk(Chunk(okey, tuple(off), tuple(shape)),
                                           Location(fname, f"optim/{n}:{base + s + at}", t + p * layout.tp)))
        base += b.numel_unpadded
    return out


def inner_optimizer(opt: Any) -> dict[str, Any]:
    """The torch optimizer's state dict inside megatron-core's plain (itself) or Float16 (``optimizer``) one."""
    if not isinstance(opt, dict):
        return {}
    return opt if "param_groups" in opt else opt.get("optimizer") or {}


_ADAM = frozenset({"exp_avg", "exp_avg_sq"})


def _plain_optimizer_chunks(path: str, rdir: str, sd: dict[str, Any], by_name: dict[str, tuple[list, str, bool]],
                            rank: int, wanted: set[str], tensors: dict[str, TensorMeta],
                            metas: dict[str, TensorMeta]) -> list[StoredChunk]:
    """A plain optimizer's per-parameter state in one (TP, PP) rank's ``model_optim_rng.pt``, whole TP-local boxes.

    The state's parameter numbering is megatron-core's ``_get_param_groups``: in each param group (weight-decayed,
    ``wd_mult`` 1, first; bias and 1-D parameters, ``wd_mult`` 0, after) the rank's parameters in model order."""
    fname = os.path.join(rdir, MODEL_FILE)
    where = os.path.join(path, fname)
    opt = sd.get("optimizer")
    inner = inner_optimizer(opt)
    groups, state = inner.get("param_groups"), inner.get("state")
    if not groups or not state:
        raise MegatronCheckpointError(f"{os.path.join(path, rdir, OPTIM_FILE)}: missing, and {where} holds no plain "
                                      "optimizer's per-parameter state (no optimizer state for this rank)")
    model = sd.get("model") or {}
    order = [n for n in model if not n.endswith("_extra_state")]
    no_wd = [n for n in order if n.endswith(".bias") or len(model[n].shape) == 1]
    by_mult = {1.0: [n for n in order if n not in no_wd], 0.0: no_wd}
    mults = [float(g.get("wd_mult", 1.0)) for g in groups]
    if len(set(mults)) != len(mults) or not set(mults) <= set(by_mult):
        raise MegatronCheckpointError(f"{where}: optimizer param groups with wd_mult {mults}: tenplex reads "
                                      "megatron-core's default groups (weight decay 1, bias and 1-D parameters 0)")
    fp32 = opt.get("fp32_from_fp16_params") if inner is not opt else None
    if "fp32_param" in wanted and fp32 is None:
        raise MegatronCheckpointError(f"{where}: no fp32_from_fp16_params (the fp32 main params of a bf16/fp16 model)")
    out = []
    for gi, (g, mult) in enumerate(zip(groups, mults)):
        names = by_mult[mult]
        if len(names) != len(g["params"]):
            raise MegatronCheckpointError(
                f"{where}: optimizer param group {gi} (wd_mult {mult}) numbers {len(g['params'])} parameters, the "
                f"rank's model has {len(names)} such: is it from a different model?")
        for i, (idx, name) in enumerate(zip(g["params"], names)):
            boxes, key, copy = by_name.get(name, (None, None, False))
            if key is None:
                raise MegatronCheckpointError(f"{where}: tensor {name!r} is not a parameter of the job's model")
            st = state.get(idx) or {}
            if set(st) - {"step"} != _ADAM:
                raise MegatronCheckpointError(f"{where}: optimizer state {sorted(st)} of {name!r} is not supported "
                                              "(tenplex reads Adam's: exp_avg, exp_avg_sq)")
            found = {n: (st[n], f"plain/{idx}/{n}") for n in sorted(_ADAM)}
            if "fp32_param" in wanted:
                found["fp32_param"] = (fp32[gi][i], f"fp32/{gi}/{i}")
            for n, (tensor, entry) in found.items():
                if tuple(tensor.shape) != tuple(model[name].shape):
                    raise MegatronCheckpointError(f"{where}: optimizer state {n} of {name!r} has shape "
                                                  f"{list(tensor.shape)}, the parameter {list(model[name].shape)}")
                if copy:  # the tied output layer's copy on the last stage: the word embedding's state is kept
                    continue
                okey = f"optimizer.state.{n}.{key}"
                tensors.setdefault(okey, replace(metas[key], key=okey, dtype="float32", param=key))
                for at, off, shape, _, _ in split_flat(0, tensor.numel(), boxes):
                    out.append(StoredChunk(Chunk(okey, tuple(off), tuple(shape)), Location(fname, f"{entry}:{at}",
                                                                                          rank)))
    return out




# the legacy state dict's (local transformer implementation's) names of what the sharded keys name after TE's modules
_TE_NAMES = MappingProxyType({"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                              "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
                              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
                              "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"})


def legacy_model_metas(path: str, load: Callable[[str], Any]) -> tuple[dict[str, TensorMeta], tuple[str, ...],
                                                                        dict[str, str]]:
    """The model's tensors as the legacy files show them (the live model's stand-in for ``plan``): the sharded keys'
    metadata (global shapes from TP rank 0's pieces), one layer's keys in module order (the state dict's order), and
    each key's state-dict name. At PP > 1 the last stage's ``output_layer.weight`` is the tied word embedding's copy
    unless the args record ``untie_embeddings_and_output_weights`` (megatron's default is tied)."""
    layout = legacy_layout(path)
    args = load(os.path.join(rank_dir(0, 0, layout.pp), MODEL_FILE)).get("args")
    layout = legacy_layout(path, args)
    untied = bool(getattr(args, "untie_embeddings_and_output_weights", False))
    local: dict[str, tuple[tuple[int, ...], str]] = {}
    names: dict[str, str] = {}
    order: list[str] = []
    layers = 0
    for p in range(layout.pp):
        stage = 0
        for name, v in (load(os.path.join(rank_dir(0, p, layout.pp), MODEL_FILE)).get("model") or {}).items():
            if name.endswith("_extra_state") or not hasattr(v, "shape"):
                continue
            dtype = str(v.dtype).removeprefix("torch.")
            m = _LAYER.fullmatch(name)
            if m:
                stage = max(stage, int(m.group(1)) + 1)
                key = "decoder.layers." + _TE_NAMES.get(m.group(2), m.group(2))
                if key not in local:
                    local[key] = (tuple(v.shape), dtype)
                    names[key] = "decoder.layers.{}." + m.group(2)
                    order.append(key)
            elif not (name == "output_layer.weight" and layout.pp > 1 and not untied):
                local.setdefault(name, (tuple(v.shape), dtype))
                names[name] = name
        layers += stage
    fc1, fc2 = local.get("decoder.layers.mlp.linear_fc1.weight"), local.get("decoder.layers.mlp.linear_fc2.weight")
    parts = fc1[0][0] // fc2[0][1] if fc1 is not None and fc2 is not None else 1
    vocab = int(getattr(args, "vocab_size", 0) or 0)
    tied = "output_layer.weight" not in local
    out = {}
    for key, (shape, dtype) in local.items():
        size = [layers, *shape] if key.startswith("decoder.layers.") else list(shape)
        axis = LAYER_TP_AXES.get(key[15:]) if key.startswith("decoder.layers.") else (
            0 if key in (PRE_KEYS[0], "output_layer.weight") else None)
        if axis is not None:
            size[axis] *= layout.tp
        out[key] = gpt_tensor_meta(path, key, tuple(size), dtype, vocab or None, tied, parts)
    return out, tuple(order), names
