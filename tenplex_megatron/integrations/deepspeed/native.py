"""Read DeepSpeed's own ZeRO checkpoints (``global_stepN/``) at any DP size, with no conversion on disk.

DeepSpeed refuses to load ZeRO optimizer state at another DP size; its route
is ``ds_to_universal.py`` (a consolidated copy of every parameter on disk),
then a universal load. Here the ``*_optim_states.pt`` files are described as a
PTC instead: each DP rank's flat fp32 partition holds a contiguous flat range
of each parameter it covers (stages 1/2: ``param_slice_mappings``; stage 3:
equal ``ceil(numel / dp)`` shares in ``param_shapes`` order), so the planner
reads only the ranges each new rank needs, memory-mapped, straight into the
engine. Model weights are then refreshed from the fp32 master by DeepSpeed
itself, as its universal load does.

The files are pickles. They are read with ``torch.load(weights_only=True)``,
allowing only DeepSpeed's own plain classes (loss scaler, ZeRO stage enum,
fragment address); anything else fails naming the file, unless the caller
passes ``trust_pickles=True`` (full unpickling: only for files you trust).
"""

from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.integrations.deepspeed.zero import (
    STATE_KEYS,
    DeepSpeedStateError,
)
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, StoredChunk, TensorMeta
from tenplex_megatron.storage.confine import confine
from tenplex_megatron.storage.files import CheckpointNotFoundError
from tenplex_megatron.storage.pickles import PicklePolicy, load_restricted
from tenplex_megatron.storage.safetensors_io import CheckpointFileError
from tenplex_megatron.storage.source import ForeignMetadata, Opened, UncheckedSource

OPTIM_STATES = ("fp32_param", *STATE_KEYS)


def step_dir(load_dir: str, tag: str | int | None) -> str:
    """The ``global_stepN`` directory to read: ``tag`` (a name or a step), else the one ``latest`` names.

    The tag is confined to ``load_dir`` (no absolute path, no ``..``, no link out) before anything in it is read.
    """
    if glob.glob(os.path.join(load_dir, "*_optim_states.pt")):
        return load_dir
    source = "the tag argument"
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            raise CheckpointNotFoundError(f"{load_dir}: no 'latest' file; pass the tag (global_stepN) to load")
        with open(latest, encoding="utf-8", errors="surrogateescape") as f:
            tag = f.read(4096).strip()
        source = "its 'latest' file"
    name = f"global_step{tag}" if isinstance(tag, int) else str(tag)
    path = confine(load_dir, name, source)
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"{path}: no such DeepSpeed checkpoint directory")
    return path


def _safe_globals() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def read_pickle(path: str, *, trust_pickles: bool = False) -> dict[str, Any]:
    """A DeepSpeed ``.pt`` file, memory-mapped; ``weights_only`` with DeepSpeed's plain classes allowed."""
    if not os.path.isfile(path):
        raise CheckpointFileError(f"{path}: missing (a DeepSpeed checkpoint needs one file per rank)")
    policy = PicklePolicy(tuple(_safe_globals()), "DeepSpeed", "a DeepSpeed checkpoint class", "trust_pickles=True",
                          CheckpointFileError)
    return load_restricted(path, path, policy, trust_pickles=trust_pickles, mmap=True)


@dataclass(frozen=True)
class NativeCheckpoint:
    """What a DeepSpeed ``global_stepN`` directory holds, found from its rank-0 model file."""

    path: str
    zero_stage: int
    dp: int
    prefix: str  # "bf16_" for bf16 runs, "" otherwise
    model_states: dict[str, Any]

    def optim_file(self, dp_rank: int) -> str:
        return f"{self.prefix}zero_pp_rank_{dp_rank}_mp_rank_00_optim_states.pt"


def inspect_native(path: str, *, trust_pickles: bool = False) -> NativeCheckpoint:
    """Find the ZeRO stage, DP size and file names of a DeepSpeed checkpoint directory (PP=TP=1)."""
    if glob.glob(os.path.join(path, "layer_*-model_states.pt")):
        raise DeepSpeedStateError(f"{path}: a PipelineModule checkpoint; reading DeepSpeed's own pipeline files "
                                  "is not supported (save with tenplex_megatron.integrations.deepspeed instead)")
    candidates = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"]
    model_file = next((confine(path, c, "the DeepSpeed layout") for c in candidates
                       if os.path.isfile(os.path.join(path, c))), None)
    if model_file is None:
        raise CheckpointFileError(f"{path}: no {' or '.join(candidates)} (not a DeepSpeed ZeRO checkpoint?)")
    ms = read_pickle(model_file, trust_pickles=trust_pickles)
    if int(ms.get("mp_world_size", 1)) != 1:
        raise DeepSpeedStateError(f"{model_file}: mp_world_size={ms['mp_world_size']}; only TP=1 is supported")
    zero = int((ms.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0))
    names = [os.path.basename(f) for f in glob.glob(os.path.join(path, "*zero_pp_rank_*_optim_states.pt"))]
    if zero not in (1, 2, 3) or not names:
        raise DeepSpeedStateError(f"{path}: not a ZeRO stage 1-3 checkpoint (stage {zero}, {len(names)} optimizer files)")
    prefix = "bf16_" if all(n.startswith("bf16_") for n in names) else ""
    return NativeCheckpoint(path, zero, int(ms["dp_world_size"]), prefix, ms)


def _param_shapes(ms: dict[str, Any], path: str) -> dict[str, tuple[int, ...]]:
    shapes = ms.get("param_shapes")
    if not shapes:
        raise CheckpointFileError(f"{path}: model states hold no param_shapes")
    groups = shapes if isinstance(shapes, list) else [shapes]
    return {name: tuple(int(x) for x in shape) for g in groups for name, shape in g.items()}


class NativeSources(UncheckedSource):
    """Hands out flat ranges of the partitions in DeepSpeed's optimizer files, each file read once (mmap)."""

    def __init__(self, path: str, *, trust_pickles: bool):
        self.path = path
        self.trust = trust_pickles
        self.readers: dict[str, dict[str, Any]] = {}

    def state_dict(self, fname: str) -> dict[str, Any]:
        sd = self.readers.get(fname)
        if sd is None:
            sd = self.readers[fname] = read_pickle(confine(self.path, fname, "the DeepSpeed layout"),
                                                          trust_pickles=self.trust)
            if "optimizer_state_dict" not in sd:
                raise CheckpointFileError(f"{os.path.join(self.path, fname)}: no optimizer_state_dict")
        return sd

    def partition(self, fname: str, state: str, group: int) -> torch.Tensor:
        osd = self.state_dict(fname)["optimizer_state_dict"]
        if "fp32_flat_groups" in osd:  # stage 3
            flats, inner = osd["fp32_flat_groups"], osd["optimizer_state_dict"]
        else:
            flats, inner = osd["single_partition_of_fp32_groups"], osd["base_optimizer_state"]
        t = flats[group] if state == "fp32_param" else inner["state"][group][state]
        return t.reshape(-1)

    def flat(self, sc: StoredChunk) -> torch.Tensor:
        state, group, start = sc.location.name.split("/")
        return self.partition(sc.location.file, state, int(group)).narrow(0, int(start), sc.chunk.numel)

    def close(self) -> None:
        self.readers.clear()


def _stored(key: str, shape: tuple[int, ...], lo: int, hi: int, fname: str, r: int, name: str) -> StoredChunk:
    return StoredChunk(Chunk(key, (0,) * len(shape), shape, (lo, hi)), Location(fname, name, r))


def _stage12_chunks(ck: NativeCheckpoint, src: NativeSources, shapes: dict[str, tuple[int, ...]]) -> list[StoredChunk]:
    """Fragments from ``param_slice_mappings``: (name, start in the rank's partition, numel)."""
    frags: list[tuple[int, int, str, int, int, int]] = []  # (global pos, numel, name, rank, group, start)
    for r in range(ck.dp):
        fname = ck.optim_file(r)
        osd = src.state_dict(fname)["optimizer_state_dict"]
        maps, parts = osd.get("param_slice_mappings"), osd.get("single_partition_of_fp32_groups")
        if maps is None or parts is None:
            raise CheckpointFileError(f"{os.path.join(ck.path, fname)}: no param_slice_mappings (DeepSpeed < 0.7?)")
        for g, (mapping, part) in enumerate(zip(maps, parts)):
            size = part.numel()
            for name, addr in mapping.items():
                frags.append((g * 2**62 + r * size + addr.start, addr.numel, name, r, g, addr.start))
    first: dict[str, int] = {}
    for pos, _, name, *_ in frags:  # a parameter's first fragment starts at its element 0
        first[name] = min(first.get(name, pos), pos)
    out = []
    for pos, n, name, r, g, start in frags:
        if name not in shapes:
            raise CheckpointFileError(f"{os.path.join(ck.path, ck.optim_file(r))}: parameter {name!r} "
                                      "is not in param_shapes")
        lo = pos - first[name]
        for state in OPTIM_STATES:
            out.append(_stored(f"optimizer.state.{state}.{name}", shapes[name], lo, lo + n, ck.optim_file(r), r,
                               f"{state}/{g}/{start}"))
    return out


def _stage3_chunks(ck: NativeCheckpoint, src: NativeSources, shapes: dict[str, tuple[int, ...]]) -> list[StoredChunk]:
    """Each parameter's equal share per rank, concatenated in ``param_shapes`` order over the sub-groups."""
    out = []
    for r in range(ck.dp):
        fname = ck.optim_file(r)
        flats = src.state_dict(fname)["optimizer_state_dict"].get("fp32_flat_groups")
        if flats is None:
            raise CheckpointFileError(f"{os.path.join(ck.path, fname)}: no fp32_flat_groups (not ZeRO-3?)")
        sizes = [f.numel() for f in flats]
        g, at = 0, 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            share = math.ceil(numel / ck.dp)
            while g < len(sizes) and at >= sizes[g]:
                g, at = g + 1, 0
            if g == len(sizes) or at + share > sizes[g]:
                raise CheckpointFileError(f"{os.path.join(ck.path, fname)}: parameter {name!r} does not fit "
                                          "the fp32 partitions (is it from another model or DP size?)")
            lo, hi = min(r * share, numel), min(r * share + share, numel)
            if hi > lo:
                for state in OPTIM_STATES:
                    out.append(_stored(f"optimizer.state.{state}.{name}", shape, lo, hi, fname, r, f"{state}/{g}/{at}"))
            at += share
    return out


def open_native(path: str, *, trust_pickles: bool = False) -> tuple[Opened, NativeCheckpoint]:
    """Describe a DeepSpeed checkpoint directory as a PTC over its own optimizer files."""
    ck = inspect_native(path, trust_pickles=trust_pickles)
    src = NativeSources(path, trust_pickles=trust_pickles)
    for r in range(ck.dp):  # every rank's file must be there (inside the directory), whoever reads it
        if not os.path.isfile(confine(path, ck.optim_file(r), "the DeepSpeed layout")):
            raise CheckpointFileError(f"{os.path.join(path, ck.optim_file(r))}: missing (the checkpoint was "
                                      f"written by {ck.dp} DP ranks)")
    shapes = _param_shapes(ck.model_states, path)
    stored = _stage3_chunks(ck, src, shapes) if ck.zero_stage == 3 else _stage12_chunks(ck, src, shapes)
    tensors = {f"optimizer.state.{s}.{n}": TensorMeta(f"optimizer.state.{s}.{n}", shape, "float32", param=n)
               for n, shape in shapes.items() for s in OPTIM_STATES}
    ptc = PTC(tensors, tuple(stored), {"tp": 1, "pp": 1, "dp": ck.dp, "zero_stage": ck.zero_stage})
    ptc.validate()
    osd = src.state_dict(ck.optim_file(0))["optimizer_state_dict"]
    inner = osd["optimizer_state_dict"] if ck.zero_stage == 3 else osd["base_optimizer_state"]
    steps = {float(s["step"]) for s in inner["state"].values() if "step" in s}
    ms = ck.model_states
    meta = {
        "layout": ptc.layout,
        "global_steps": int(ms.get("global_steps", 0)),
        "global_samples": int(ms.get("global_samples", 0)),
        "skipped_steps": int(ms.get("skipped_steps", 0)),
        "optimizer": {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]],
                      "step": int(max(steps)) if steps else 0},
        "scheduler": ms.get("lr_scheduler"),
    }
    return Opened(path, ForeignMetadata.of("deepspeed", meta, meta["global_samples"]), ptc, src), ck


def refresh_model_weights(engine: Any) -> None:
    """Model (bit16) weights from the fp32 master, by DeepSpeed's own means, as its universal load does."""
    zo = engine.optimizer
    if int(engine.zero_optimization_stage()) == 3:
        for fp32, lp in zip(zo.fp32_partitioned_groups_flat, zo.fp16_partitioned_groups_flat):
            lp.data.copy_(fp32.data)
        return
    zo.update_lp_params()


def check_model(ck: NativeCheckpoint, chunks: list[LocalChunk], path: str) -> None:
    """Refuse a checkpoint of another model: every engine parameter must be in it with the same shape."""
    shapes = _param_shapes(ck.model_states, path)
    mine = {lc.meta.param: lc.meta.global_shape for lc in chunks if lc.meta.param}
    for name, shape in sorted(mine.items()):
        if name not in shapes:
            raise DeepSpeedStateError(f"{path}: the checkpoint has no parameter {name!r}: is it from a different model?")
        if shapes[name] != shape:
            raise DeepSpeedStateError(f"{path}: parameter {name!r} has shape {list(shapes[name])} in the checkpoint, "
                                      f"{list(shape)} in the engine: is it from a different model?")

