"""Export any tenplex megatron-core checkpoint, at whatever layout it was saved, as a Hugging Face transformers model.

No torch.distributed, and it streams: every Hugging Face tensor is planned
first (a TP1/PP1/DP1 target of the boxes it is made of, through the planner),
then each shard file's header is written and its tensors are assembled one at
a time from the checkpoint's own safetensors (checksums of the blocks read
verified) and appended, so memory holds one output tensor and at most one
more box of it, whatever the model size. ``config.json`` is written by
transformers' own config class (GPT2Config, LlamaConfig or MixtralConfig).
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass
from types import MappingProxyType

import torch

from tenplex_megatron._optional import require
from tenplex_megatron.engine.load import open_tenplex
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.execute.executor import execute_plan
from tenplex_megatron.integrations.hf.source import CONFIG, INDEX
from tenplex_megatron.plan.hf_map import HFMapError, HFTensor, ModelFacts, build_mapping, hf_config, shard_files
from tenplex_megatron.plan.planner import Planner, RankPlan
from tenplex_megatron.plan.ptc import Chunk, TensorMeta, dtype_size
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata
from tenplex_megatron.storage.safetensors_io import ST_CODES, TORCH_DTYPES, fsync_dir, fsync_file

DTYPES = MappingProxyType({"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"})


class OutputDirError(TenplexError, FileExistsError):
    """An export's output directory that is a file, or that holds files and ``--force`` was not given."""


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote: the directory, the architecture, its files, tensors and bytes, and the time it took."""

    path: str
    arch: str
    files: tuple[str, ...]
    tensors: int
    bytes: int
    largest_tensor_bytes: int
    seconds: float


def check_out_dir(out: str, force: bool) -> None:
    """Refuse a non-empty output directory unless ``force`` (then the old model files are removed)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputDirError(f"{out}: exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        if not force:
            raise OutputDirError(f"{out}: not empty (pass --force to write into it)")
        for name in os.listdir(out):
            if name.endswith(".safetensors") or name in (INDEX, CONFIG):
                os.remove(os.path.join(out, name))


def _link_plans(planner: Planner, t: HFTensor) -> list[RankPlan]:
    return [planner.rank_plan(0, (Chunk(lk.key, lk.offsets, lk.shape),)) for lk in t.links]


def _assemble(t: HFTensor, plans: list[RankPlan], sources: tuple, files: object, dtype: torch.dtype) -> torch.Tensor:
    """One HF tensor from its boxes: rows copied straight into place, transposed boxes through one box-sized buffer."""
    out = torch.empty(t.shape, dtype=dtype)
    for lk, plan in zip(t.links, plans):
        if lk.transposed:
            tmp = torch.empty(lk.shape[-2:], dtype=dtype)
            execute_plan(plan, sources, files, [tmp.view(-1)])  # type: ignore[arg-type]
            out[:, lk.lo : lk.lo + lk.n].copy_(tmp.t())
            del tmp
        else:
            execute_plan(plan, sources, files, [out[lk.lo : lk.lo + lk.n].view(-1)])  # type: ignore[arg-type]
    return out


def export_hf(ckpt: str, out: str, dtype: str | None = None, max_shard_bytes: int = 5 * 10**9,
              force: bool = False, verify: bool = True, metadata: CheckpointMetadata | None = None) -> ExportResult:
    """Write ``ckpt`` (a tenplex checkpoint directory or a save directory) to ``out`` as a transformers model.

    ``dtype``: ``bf16``, ``fp32`` or ``fp16`` (default: the checkpoint's model dtype). ``metadata``: ``ckpt`` is the
    checkpoint and this its record, read already (by the CLI's choice of copy).
    """
    t0 = time.perf_counter()
    transformers = require("transformers", "hf", needed_by="export-hf")
    if dtype is not None and dtype not in DTYPES:
        raise HFMapError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    opened = open_tenplex(ckpt, None, verify=verify, metadata=metadata)
    meta = opened.metadata
    assert isinstance(meta, CheckpointMetadata)  # open_tenplex's
    if meta.framework not in (None, "megatron-core"):
        raise HFMapError(f"{opened.path}: written by {meta.framework!r}; export-hf reads megatron-core "
                         "checkpoints")
    if meta.model is None:
        raise HFMapError(f"{opened.path}: the metadata has no model description")
    try:
        facts = ModelFacts.from_model_json(dict(meta.model))
    except HFMapError as e:
        raise HFMapError(f"{opened.path}: {e}") from None
    mapping = build_mapping(facts)
    src = opened.ptc
    for key in mapping.megatron:
        if key not in src.tensors:
            raise HFMapError(f"{opened.path}: tensor {key!r} of a {mapping.arch} model is not in the checkpoint")
    dst = {k: TensorMeta(k, m.shape, src.tensors[k].dtype, vocab_rows=m.vocab_rows)
           for k, m in mapping.megatron.items()}
    planner = Planner(src, dst)
    plans = [_link_plans(planner, t) for t in mapping.hf]  # every box planned before anything is written
    out_name = DTYPES[dtype] if dtype else src.tensors["embedding.word_embeddings.weight"].dtype
    torch_dtype = TORCH_DTYPES[out_name]
    sizes = [t.numel * dtype_size(out_name) for t in mapping.hf]
    shard_of = shard_files(sizes, max_shard_bytes)
    n_shards = shard_of[-1] + 1
    names = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    cls_name, kwargs = hf_config(facts, out_name)
    config = getattr(transformers, cls_name)(**kwargs)
    check_out_dir(out, force)
    os.makedirs(out, exist_ok=True)
    weight_map: dict[str, str] = {}
    try:
        for s, fname in enumerate(names):
            members = [i for i, x in enumerate(shard_of) if x == s]
            header: dict[str, object] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for i in members:
                t = mapping.hf[i]
                header[t.name] = {"dtype": ST_CODES[out_name], "shape": list(t.shape),
                                  "data_offsets": [offset, offset + sizes[i]]}
                offset += sizes[i]
                weight_map[t.name] = fname
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            path = os.path.join(out, fname)
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(raw)))
                f.write(raw)
                for i in members:
                    t = _assemble(mapping.hf[i], plans[i], src.chunks, opened.files, torch_dtype)
                    f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                    del t
                    opened.files.close()  # drop the maps of what was read: resident memory stays one tensor
            fsync_file(path)
    finally:
        opened.files.close()
    config.save_pretrained(out)
    with open(os.path.join(out, INDEX), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")
    fsync_dir(out)
    return ExportResult(out, mapping.arch, tuple(names), len(mapping.hf), sum(sizes), max(sizes),
                        time.perf_counter() - t0)
