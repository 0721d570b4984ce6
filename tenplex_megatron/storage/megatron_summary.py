"""What a Megatron ``torch_dist`` or legacy ``--ckpt-format torch`` checkpoint holds, read without torch (for
``python -m tenplex_megatron inspect``).

The index comes from ``distcp_index.py``; ``common.pt`` (a ``torch.save`` zip)
is unpickled by a restricted unpickler that allows plain data, argparse's
Namespace and torch dtypes only, and reads no tensor data. The saving layout:
TP from the word embedding's pieces, PP the number of distributed-optimizer
groups over TP, DP the ranks that wrote files over TP x PP.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tenplex_megatron.plan.experts import ExpertSummary, expert_summary
from tenplex_megatron.plan.sim.gpt_catalogue import LAYER_TP_AXES
from tenplex_megatron.storage.distcp_index import DTYPE_NAMES, DcpIndex, read_dcp_metadata
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.megatron_ptc import describe_torch_dist, index_model_metas
from tenplex_megatron.storage.megatron_torch_dist import (
    TorchDistCheckpoint,
    common_dict,
    common_state,
    is_optimizer_key,
    sharding_type,
)

# a dense buffer's bucket (a chained optimizer's first sub-optimizer, or the only one)
_BUCKET = re.compile(r"(?:chained_0\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_\d+\.dtype_.+\.bucket_idx_\d+"
                     r"\.\w+")
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")


_STORAGE_DTYPES = MappingProxyType({
    "FloatStorage": "float32", "BFloat16Storage": "bfloat16", "HalfStorage": "float16", "DoubleStorage": "float64",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool"})
_NUMPY = frozenset({("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.dtypes", "UInt32DType")})


@dataclass(frozen=True)
class TensorStub:
    """A pickled tensor's shape and dtype, its data not read."""

    shape: tuple[int, ...]
    dtype: str

    def numel(self) -> int:
        return math.prod(self.shape)


class _Dict(dict):
    """An ``OrderedDict`` as a dict that takes the attributes pickled with it (a state dict's ``_metadata``)."""


class _Opaque:
    """A numpy value (an RNG state) in a Megatron pickle: accepted, not built."""

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def _rebuild_tensor(storage: Any, offset: int, size: tuple[int, ...], *rest: Any) -> TensorStub:
    return TensorStub(tuple(int(n) for n in size), storage if isinstance(storage, str) else "unknown")


class _CommonUnpickler(pickle.Unpickler):
    def __init__(self, f: Any, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("argparse", "Namespace"):
            return argparse.Namespace
        if (module, name) == ("collections", "OrderedDict"):
            return _Dict
        if module == "torch" and name in DTYPE_NAMES:
            return name
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch", "Size"):
            return tuple
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):  # a tensor subclass: its tensor
            return lambda func, new_type, args, state: func(*args)
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return lambda data, *rest: data
        if (module, name) in (("torch", "Tensor"), ("torch.nn.parameter", "Parameter")):
            return _Opaque
        if (module, name) in _NUMPY:
            return _Opaque
        if (module, name) == ("_codecs", "encode"):  # a numpy array's bytes under protocol 2
            return _Opaque
        raise CheckpointFileError(f"{self.path}: names {module}.{name}, not a plain class (not read)")

    def persistent_load(self, pid: Any) -> Any:
        return pid[1] if isinstance(pid, tuple) and len(pid) > 1 and isinstance(pid[1], str) else None


def read_torch_pickle(path: str, data: bytes | None = None) -> Any:
    """A ``torch.save`` zip's plain values, tensors as :class:`TensorStub` (data not read), without torch: the file
    ``path``, or ``data`` read from it (``path`` then names it in errors)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data) if data is not None else path) as z:
            name = next(n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            with z.open(name) as f:
                return _CommonUnpickler(f, path).load()
    except (OSError, zipfile.BadZipFile, StopIteration, pickle.UnpicklingError, EOFError) as e:
        raise CheckpointFileError(f"{path}: not a readable torch.save file ({type(e).__name__}: {e})") from None


def read_common(path: str, data: bytes | None = None) -> dict[str, Any]:
    """``common.pt``'s (or 0.19's ``common_state`` object's ``data``) plain values (tensors as :class:`TensorStub`),
    without torch."""
    return common_dict(path, data, read_torch_pickle(path, data))


def saved_layout(index: DcpIndex) -> dict[str, int]:
    """The saving (TP, PP, DP) as far as the index shows it (PP is 1 without a distributed optimizer's groups).

    TP: the word embedding's pieces along the vocabulary (megatron-core always splits it over TP); without one,
    the fewest pieces any split model tensor is cut into (SwiGLU's fc1 has two parts per TP rank)."""
    emb = index.tensors.get("embedding.word_embeddings.weight")
    tp = len({offsets[0] for offsets, _ in emb.chunks}) if emb is not None else 0
    for key, t in index.tensors.items() if not tp else ():
        if is_optimizer_key(key):
            continue
        first = 1 if key.startswith("decoder.layers.") else 0
        for axis in range(first, len(t.size)):
            n = len({offsets[axis] for offsets, _ in t.chunks})
            if n > 1:
                tp = n if tp == 0 else min(tp, n)
    tp = tp or 1
    groups = {int(m.group(1)) for k in index.tensors if (m := _BUCKET.fullmatch(k))}
    pp = max(len(groups) // tp, 1) if groups else 1
    ranks = {int(m.group(1)) for i in index.items.values() if (m := _RANK_FILE.fullmatch(i.relative_path))}
    world = max(ranks) + 1 if ranks else 1
    return {"tp": tp, "pp": pp, "dp": max(world // (tp * pp), 1)}


def _described(path: str, index: DcpIndex, common: dict[str, Any], sharding: str | None,
               source: str) -> tuple[dict[str, Any] | None, ExpertSummary | None, str | None]:
    """The saving layout (EP and expert TP included) and the experts as ``plan`` describes the checkpoint, or why it
    cannot (a model ``plan`` does not know, buffers that do not fit): (layout, experts, error)."""
    try:
        ck = TorchDistCheckpoint(path, index, common, sharding, source)
        metas, layer_keys = index_model_metas(ck)
        wanted = {"exp_avg", "exp_avg_sq"} | ({"fp32_param"} if any(t.dtype != "float32" for t in metas.values())
                                              else set())
        ptc = describe_torch_dist(ck, metas, layer_keys, wanted)
    except CheckpointFileError as e:
        return None, None, str(e)
    return dict(ptc.layout), expert_summary(ptc, ptc.layout), None


def summarize(path: str) -> dict[str, Any]:
    """Iteration, layout, optimizer format, tensors and bytes of the ``torch_dist`` checkpoint ``path``; the layout
    and the experts as ``plan`` describes it where it can (else the layout as the index alone shows it)."""
    index = read_dcp_metadata(path)
    try:
        source, data = common_state(path, index)
        common = read_common(source, data)
        problem = None
    except CheckpointFileError as e:
        source, common, problem = "common.pt", {}, str(e)
    args = common.get("args")
    sharding = sharding_type(path, common, index)
    model = {k: t for k, t in index.tensors.items() if not is_optimizer_key(k)}
    files = sorted({i.relative_path for i in index.items.values()})
    layout, experts, why = _described(path, index, common, sharding, source) if problem is None else (None, None,
                                                                                                       problem)
    return {
        "path": path,
        "format": f"megatron torch_dist ({sharding or 'no distributed optimizer'})",
        "iteration": common.get("iteration"),
        "consumed_samples": common.get("consumed_samples", getattr(args, "consumed_train_samples", None)),
        "layout": layout or saved_layout(index),
        "layout_source": ("as plan describes it" if layout else f"as the index alone shows it (not described: {why})"),
        "experts": experts.to_json() if experts is not None else None,
        "experts_line": experts.line() if experts is not None else None,
        "distributed_optimizer": sharding is not None,
        "padded_vocab_size": (model.get("embedding.word_embeddings.weight").size[0]
                              if "embedding.word_embeddings.weight" in model else None),
        "tensors": len(index.tensors),
        "model_parameters": sum(math.prod(t.size) for t in model.values()),
        "chunks": sum(len(t.chunks) for t in index.tensors.values()),
        "bytes": sum(os.path.getsize(os.path.join(path, f)) for f in files if os.path.isfile(os.path.join(path, f))),
        "files": {f: os.path.getsize(os.path.join(path, f)) for f in files if os.path.isfile(os.path.join(path, f))},
        "tensor_table": {k: {"shape": list(t.size), "dtype": t.dtype, "chunks": len(t.chunks)}
                         for k, t in index.tensors.items()},
        "common_pt": problem or "read",
    }


_LEGACY_RANK = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")
_LEGACY_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def _legacy_tp_axis(name: str) -> int | None:
    """The axis TP splits a legacy (unstacked) tensor along, by megatron-core's GPTModel's names (None: replicated)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    m = _LEGACY_LAYER.fullmatch(name)
    axis = LAYER_TP_AXES.get(m.group(2)) if m else None
    return None if axis is None else axis - 1


def summarize_legacy(path: str) -> dict[str, Any]:
    """Iteration, layout, optimizer, tensors and bytes of Megatron-LM's legacy ``--ckpt-format torch`` iteration
    directory ``path``, read without torch (tensor data not read): TP and PP from the ``mp_rank_TT[_PPP]`` directories,
    DP from the args when they record it; global shapes from the TP ranks' pieces. Parameters are counted as stored:
    at PP > 1 the last stage's ``output_layer.weight`` is counted, whether it is a tied model's copy of the word
    embedding or an untied output layer (the files alone do not tell)."""
    ranks = sorted((int(m.group(1)), int(m.group(2) or 0), n) for n in os.listdir(path)
                   if (m := _LEGACY_RANK.fullmatch(n)))
    if not ranks:
        raise CheckpointFileError(f"{path}: no mp_rank_* directory")
    dirs = {(t, p): n for t, p, n in ranks}
    args = read_torch_pickle(os.path.join(path, ranks[0][2], "model_optim_rng.pt")).get("args")
    tp = int(getattr(args, "tensor_model_parallel_size", 0) or max(t for t, _, _ in ranks) + 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 0) or max(p for _, p, _ in ranks) + 1)
    files: dict[str, int] = {}
    table: dict[str, dict[str, Any]] = {}
    first: dict[str, Any] = {}
    layer_base = 0
    optimizer = None
    for p in range(pp):
        stage_layers = 0
        for t in range(tp):
            rdir = dirs.get((t, p))
            mfile = os.path.join(path, rdir or "", "model_optim_rng.pt")
            if rdir is None or not os.path.isfile(mfile):
                want = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                raise CheckpointFileError(f"{mfile if rdir else os.path.join(path, want)}: missing (the checkpoint "
                                          f"was written at TP{tp} PP{pp})")
            for name in sorted(os.listdir(os.path.join(path, rdir))):
                f = os.path.join(rdir, name)
                if os.path.isfile(os.path.join(path, f)):
                    files[f] = os.path.getsize(os.path.join(path, f))
            sd = read_torch_pickle(mfile)
            if not isinstance(sd, dict) or not isinstance(sd.get("model"), dict):
                raise CheckpointFileError(f"{mfile}: no model state dict")
            first = first or sd
            has_dist = os.path.isfile(os.path.join(path, rdir, "distrib_optim.pt"))
            optimizer = ("distributed (distrib_optim.pt)" if has_dist else
                         "plain (in model_optim_rng.pt)" if sd.get("optimizer") else "none")
            for name, v in sd["model"].items():
                if not isinstance(v, TensorStub):
                    continue
                m = _LEGACY_LAYER.fullmatch(name)
                key = name
                if m:
                    stage_layers = max(stage_layers, int(m.group(1)) + 1)
                    key = f"decoder.layers.{layer_base + int(m.group(1))}.{m.group(2)}"
                axis = _legacy_tp_axis(name)
                entry = table.setdefault(key, {"shape": list(v.shape), "dtype": v.dtype, "chunks": 0})
                if axis is not None and entry["chunks"]:
                    entry["shape"][axis] += v.shape[axis]
                entry["chunks"] += 1
        layer_base += stage_layers
    emb = table.get("embedding.word_embeddings.weight")
    return {
        "path": path,
        "format": f"megatron legacy torch (optimizer: {optimizer})",
        "checkpoint_version": first.get("checkpoint_version"),
        "iteration": first.get("iteration"),
        "consumed_samples": getattr(args, "consumed_train_samples", None),
        "layout": {"tp": tp, "pp": pp, "dp": getattr(args, "data_parallel_size", None)},
        "layout_source": "TP, PP as the rank directories show them, DP as the args record it",
        "distributed_optimizer": optimizer == "distributed (distrib_optim.pt)",
        "padded_vocab_size": emb["shape"][0] if emb else None,
        "num_layers": layer_base,
        "hidden_size": emb["shape"][1] if emb else None,
        "tensors": len(table),
        "model_parameters": sum(math.prod(e["shape"]) for e in table.values()),
        "chunks": sum(e["chunks"] for e in table.values()),
        "bytes": sum(files.values()),
        "files": files,
        "tensor_table": table,
    }
