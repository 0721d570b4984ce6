"""Read Megatron-LM's legacy ``--ckpt-format torch`` checkpoints at any layout, in place, as a PTC.

``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holds one (TP, PP) rank's
model state dict (layers numbered locally), the optimizer's param groups, the
scheduler and ``args``; ``distrib_optim.pt`` holds the distributed
optimizer's state gathered over DP: per grad buffer one flat ``param`` /
``exp_avg`` / ``exp_avg_sq`` tensor, the buckets' unpadded contents end to end
(``get_parameter_state_dp_zero``). Each parameter's place in it follows
megatron-core 0.16.1's buffer layout at the saving (TP, PP)
(``plan/megatron_buffer.py``), checked against the file (sizes, every element
of the buffer). Files are memory-mapped and read with
``torch.load(weights_only=True)`` allowing only :data:`native.SAFE_GLOBALS`.
Without the distributed optimizer the state is ``model_optim_rng.pt``'s
``optimizer`` (megatron-core's plain, FP32 or Float16 optimizer's
``state_dict()``): the inner torch optimizer's per-parameter Adam state,
numbered through its param groups, and for bf16/fp16 the fp32 main params
(``fp32_from_fp16_params``, per group). The numbering follows megatron-core
0.16.1's ``_get_param_groups``: the rank's parameters in the model's order,
weight-decayed ones (group ``wd_mult`` 1) before bias and 1-D ones
(``wd_mult`` 0); every state's shape is checked against its parameter's.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from typing import Any

import torch

from tenplex_megatron.engine.optimizer_json import jsonable
from tenplex_megatron.integrations.megatron_core.native import load_pickle
from tenplex_megatron.integrations.megatron_core.sharded import describe_model
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.megatron_buffer import bucket_layout
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, PTCError, StoredChunk, TensorMeta
from tenplex_megatron.storage.confine import confine
from tenplex_megatron.storage.megatron_ptc import POST_KEYS, PRE_KEYS, MegatronCheckpointError, split_flat, stage_params
from tenplex_megatron.storage.source import Opened, UncheckedSource

SUPPORTED_VERSIONS = (3.0,)  # Megatron-LM's checkpoint_version
MODEL_FILE, OPTIM_FILE = "model_optim_rng.pt", "distrib_optim.pt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def _layout(path: str, args: Any = None) -> ParallelLayout:
    """The saving (TP, PP): ``args``' (Megatron-LM records them) or the rank directories', every rank's file
    checked to be there."""
    ranks = [(int(m.group(1)), int(m.group(2) or 0)) for n in os.listdir(path) if (m := _RANK_DIR.fullmatch(n))]
    tp = int(getattr(args, "tensor_model_parallel_size", 0) or max(t for t, _ in ranks) + 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 0) or max(p for _, p in ranks) + 1)
    for t in range(tp):
        for p in range(pp):
            name = _rank_dir(t, p, pp)
            f = os.path.join(path, name, MODEL_FILE)
            if not os.path.isfile(confine(path, os.path.join(name, MODEL_FILE), "the legacy layout")):
                raise MegatronCheckpointError(f"{f}: missing (the checkpoint was written at TP{tp} PP{pp})")
    return ParallelLayout(tp, pp, 1)


class LegacySource(UncheckedSource):
    """Flat ranges of the tensors in the legacy files, each file memory-mapped and unpickled once."""

    def __init__(self, path: str, trust: bool):
        self.path, self.trust = path, trust
        self.readers: dict[str, Any] = {}

    def load(self, name: str) -> Any:
        got = self.readers.get(name)
        if got is None:
            f = confine(self.path, name, "the legacy layout")
            if not os.path.isfile(f):
                raise MegatronCheckpointError(f"{f}: missing (every model-parallel rank's file must be there)")
            got = self.readers[name] = load_pickle(f, trust_pickles=self.trust, mmap=True)
        return got

    def tensor(self, name: str, entry: str) -> torch.Tensor:
        sd = self.load(name)
        if entry.startswith("model/"):
            return sd["model"][entry[len("model/"):]]
        if entry.startswith("plain/"):  # plain/<param index>/<state>: the inner optimizer's per-parameter state
            _, idx, state = entry.split("/")
            return _inner(sd["optimizer"])["state"][int(idx)][state]
        if entry.startswith("fp32/"):  # fp32/<group>/<i>: the Float16 optimizer's fp32 main param
            _, g, i = entry.split("/")
            return sd["optimizer"]["fp32_from_fp16_params"][int(g)][int(i)]
        state = entry.split("/")[1]
        (per_dtype,) = sd[0].values()
        return per_dtype[state]

    def flat(self, sc: StoredChunk) -> torch.Tensor:
        entry, start = sc.location.name.rsplit(":", 1)
        return self.tensor(sc.location.file, entry).reshape(-1).narrow(0, int(start), sc.chunk.numel)

    def close(self) -> None:
        self.readers.clear()


def _local_shape(boxes: list, axis: int | None, prepend: int) -> tuple[int, ...]:
    shape = list(boxes[0][1])
    if axis is not None and len(boxes) > 1:
        shape[axis] = sum(s[axis] for _, s in boxes)
    return tuple(shape[prepend:])


def open_legacy(path: str, job: Any, trust_pickles: bool = False) -> Opened:
    """Describe a legacy iteration directory for ``job`` (checked against it) and open it; the job is untouched."""
    layout = _layout(path)
    src = LegacySource(path, trust_pickles)
    model, layer_keys, module_names = describe_model(job)
    first = src.load(os.path.join(_rank_dir(0, 0, layout.pp), MODEL_FILE))
    version = first.get("checkpoint_version")
    if version not in SUPPORTED_VERSIONS:
        raise MegatronCheckpointError(f"{os.path.join(path, _rank_dir(0, 0, layout.pp), MODEL_FILE)}: "
                                      f"checkpoint_version {version} is not supported (tenplex reads "
                                      f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
    args = first.get("args")
    layout = _layout(path, args)  # again with the sizes Megatron-LM recorded: a missing rank directory is named
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
            rdir = _rank_dir(t, p, layout.pp)
            fname = os.path.join(rdir, MODEL_FILE)
            sd = src.load(fname)
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
                chunks.extend(_optimizer_chunks(path, src, rdir, sd, params, layout, t, p, wanted, tensors, metas))
            else:
                chunks.extend(_plain_optimizer_chunks(path, rdir, sd, by_name, t + p * layout.tp, wanted, tensors,
                                                      metas))
    unknown = sorted(k for k in (first.get("model") or {}) if not k.endswith("_extra_state")
                     and not _LAYER.fullmatch(k) and k not in PRE_KEYS + POST_KEYS)
    if unknown:
        raise MegatronCheckpointError(f"{os.path.join(path, _rank_dir(0, 0, layout.pp), MODEL_FILE)}: tensor(s) "
                                      f"{', '.join(unknown)} are not parameters of megatron-core's GPTModel")
    ptc = PTC(tensors, tuple(chunks), layout.to_json())
    try:
        ptc.validate()
    except PTCError as e:
        raise MegatronCheckpointError(f"{path}: {e}") from None
    opt = first.get("optimizer") or {}
    inner = opt.get("optimizer", opt)
    groups = inner.get("param_groups", [])
    steps = {int(g["step"]) for g in groups if "step" in g}
    iteration = int(first.get("iteration", 0))
    consumed = getattr(args, "consumed_train_samples", None)
    meta = {
        "layout": ptc.layout,
        "iteration": iteration,
        "consumed_samples": int(consumed if consumed is not None else iteration * job.global_batch_size),
        "optimizer": {"sub_optimizers": [{"param_groups": [_plain(g) for g in groups],
                                          "step": max(steps) if steps else iteration}]},
        "scheduler": first.get("opt_param_scheduler"),
        "padded_vocab_size": int(metas[PRE_KEYS[0]].global_shape[0]) if PRE_KEYS[0] in metas else None,
        "extra": {"num_floating_point_operations_so_far": float(first.get("num_floating_point_operations_so_far", 0.0) or 0.0)},
        "source_format": "megatron legacy torch",
    }
    return Opened(path, meta, ptc, src)


def _plain(group: dict[str, Any]) -> dict[str, Any]:
    return {k: jsonable(v) for k, v in group.items() if k != "params"}


def _rank_dir(t: int, p: int, pp: int) -> str:
    return f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"


def _optimizer_chunks(path: str, src: LegacySource, rdir: str, sd: dict[str, Any], params: list, layout: ParallelLayout,
                      t: int, p: int, wanted: set[str], tensors: dict[str, TensorMeta],
                      metas: dict[str, TensorMeta]) -> list[StoredChunk]:
    """The distributed optimizer's gathered buffer of one (TP, PP) rank as whole TP-local boxes."""
    fname = os.path.join(rdir, OPTIM_FILE)
    state = src.load(fname)
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


def _inner(opt: Any) -> dict[str, Any]:
    """The torch optimizer's state dict inside megatron-core's plain (itself) or Float16 (``optimizer``) one."""
    if not isinstance(opt, dict):
        return {}
    return opt if "param_groups" in opt else opt.get("optimizer") or {}


_ADAM = {"exp_avg", "exp_avg_sq"}


def _plain_optimizer_chunks(path: str, rdir: str, sd: dict[str, Any], by_name: dict[str, tuple[list, str, bool]],
                            rank: int, wanted: set[str], tensors: dict[str, TensorMeta],
                            metas: dict[str, TensorMeta]) -> list[StoredChunk]:
    """A plain optimizer's per-parameter state in one (TP, PP) rank's ``model_optim_rng.pt``, whole TP-local boxes.

    The state's parameter numbering is megatron-core's ``_get_param_groups``: in each param group (weight-decayed,
    ``wd_mult`` 1, first; bias and 1-D parameters, ``wd_mult`` 0, after) the rank's parameters in model order."""
    fname = os.path.join(rdir, MODEL_FILE)
    where = os.path.join(path, fname)
    opt = sd.get("optimizer")
    inner = _inner(opt)
    groups, state = inner.get("param_groups"), inner.get("state")
    if not groups or not state:
        raise MegatronCheckpointError(f"{os.path.join(path, rdir, OPTIM_FILE)}: missing, and {where} holds no plain "
                                      "optimizer's per-parameter state (no optimizer state for this rank)")
    model = sd.get("model") or {}
    order = [n for n in model if not n.endswith("_extra_state")]
    no_wd = [n for n in order if n.endswith(".bias") or model[n].dim() == 1]
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


def legacy_padded_vocab(path: str, trust_pickles: bool = False) -> int | None:
    """The padded vocabulary of a legacy checkpoint: its first rank's word-embedding rows times the saving TP."""
    layout = _layout(path)
    first = LegacySource(path, trust_pickles).load(os.path.join(_rank_dir(0, 0, layout.pp), MODEL_FILE))
    emb = (first.get("model") or {}).get(PRE_KEYS[0])
    return None if emb is None else int(emb.shape[0]) * layout.tp
