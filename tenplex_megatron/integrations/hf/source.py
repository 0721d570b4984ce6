"""A Hugging Face transformers checkpoint directory as a PTC source: each rank reads only its slice of the weights.

The directory (``config.json``, ``model.safetensors`` or shards named by
``model.safetensors.index.json``) is checked whole first: every file the index
names exists inside the directory and has a valid header whose byte ranges fit
its size, every tensor the index names is in its file, every tensor the model
needs is there with the right shape. Then each :class:`~tenplex_megatron.plan.hf_map.Link`
becomes a stored chunk of a megatron-core tensor whose bytes are rows of an HF
tensor (a column range, copied transposed, for GPT-2's ``Conv1D``), so the
planner and executor re-shard from it as from a tenplex checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from tenplex_megatron.plan.hf_map import (
    HFMapError,
    Link,
    Mapping,
    ModelFacts,
    build_mapping,
    check_flags,
    facts_from_hf_config,
    ignorable,
)
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, StoredChunk, TensorMeta
from tenplex_megatron.storage import formats
from tenplex_megatron.storage.confine import confine
from tenplex_megatron.storage.safetensors_io import CheckpointFileError, SafetensorsReader, TensorEntry, read_header
from tenplex_megatron.storage.source import ForeignMetadata, Opened, UncheckedSource

INDEX, SINGLE, CONFIG = formats.HF_INDEX, formats.HF_SINGLE, formats.HF_CONFIG  # recognised in storage/formats.py
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class HFDir:
    """A checked Hugging Face directory: its config, and every tensor's file and header entry."""

    path: str
    config: dict[str, Any]
    files: dict[str, str]  # tensor name -> file name
    entries: dict[str, TensorEntry]


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise CheckpointFileError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointFileError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(d, dict):
        raise CheckpointFileError(f"{path}: not a JSON object")
    return d


def read_hf_dir(path: str) -> HFDir:
    """Check a Hugging Face directory's config, index and every shard header; errors name the file and tensor."""
    if not os.path.isdir(path):
        raise CheckpointFileError(f"{path}: not a directory (a Hugging Face checkpoint directory is expected)")
    config = read_json(os.path.join(path, CONFIG))
    index_path = os.path.join(path, INDEX)
    if os.path.exists(index_path):
        wm = read_json(index_path).get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise CheckpointFileError(f"{index_path}: no weight_map of tensor name -> file name")
        weight_map: dict[str, str] = dict(wm)
    else:
        single = os.path.join(path, SINGLE)
        if not os.path.isfile(single):
            raise CheckpointFileError(f"{path}: neither {INDEX} nor {SINGLE} (not a safetensors checkpoint)")
        entries, _ = read_header(single)
        weight_map = dict.fromkeys(entries, SINGLE)
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        by_file.setdefault(fname, []).append(name)
    found: dict[str, TensorEntry] = {}
    for fname, names in sorted(by_file.items()):
        fpath = confine(path, fname, INDEX)
        if not os.path.isfile(fpath):
            raise CheckpointFileError(f"{fpath}: missing shard ({INDEX} maps tensor {names[0]!r}"
                                      f"{f' and {len(names) - 1} more' if len(names) > 1 else ''} to it)")
        entries, _ = read_header(fpath)  # a truncated file: the error names the file and the first tensor past its end
        for name in names:
            if name not in entries:
                raise CheckpointFileError(f"{fpath}: tensor {name!r} is not in the file, though {INDEX} maps it there")
            found[name] = entries[name]
    return HFDir(path, config, weight_map, found)


def describe_hf(d: HFDir, run: ModelFacts | None = None) -> tuple[Mapping, PTC, dict[tuple[str, str], Link]]:
    """The directory's weights as a PTC of megatron-core tensors (one stored chunk per link), checked against the
    mapping: every needed tensor present with its shape, nothing unexpected. ``run``: the flags' model, compared
    field by field with the config first."""
    cfg_path = os.path.join(d.path, CONFIG)
    hf = facts_from_hf_config(d.config, cfg_path)
    if run is not None:
        check_flags(hf, run, cfg_path)
    mapping = build_mapping(hf)
    expected = mapping.by_name()
    for name in d.files:
        if name not in expected and not ignorable(name, mapping, hf.tied):
            raise HFMapError(f"{os.path.join(d.path, d.files[name])}: tensor {name!r} is not part of a "
                             f"{mapping.arch} model of this config")
    dtypes: dict[str, str] = {}
    chunks: list[StoredChunk] = []
    links: dict[tuple[str, str], Link] = {}
    for t in mapping.hf:
        entry = d.entries.get(t.name)
        if entry is None:
            raise CheckpointFileError(f"{d.path}: tensor {t.name!r} is missing (no file holds it)")
        where = os.path.join(d.path, d.files[t.name])
        if entry.shape != t.shape:
            raise CheckpointFileError(f"{where}: tensor {t.name!r} has shape {list(entry.shape)}, the config needs "
                                      f"{list(t.shape)}")
        if entry.dtype not in FLOAT_DTYPES:
            raise CheckpointFileError(f"{where}: tensor {t.name!r} has dtype {entry.dtype} (floating point expected)")
        for link in t.links:
            if dtypes.setdefault(link.key, entry.dtype) != entry.dtype:
                raise CheckpointFileError(f"{where}: tensor {t.name!r} is {entry.dtype}, other parts of "
                                          f"{link.key!r} are {dtypes[link.key]}")
            name = f"{t.name}[{link.lo}:{link.lo + link.n}]{'.T' if link.transposed else ''}"
            links[(d.files[t.name], name)] = link
            chunks.append(StoredChunk(Chunk(link.key, link.offsets, link.shape), Location(d.files[t.name], name)))
    tensors = {k: TensorMeta(k, m.shape, dtypes[k], vocab_rows=m.vocab_rows) for k, m in mapping.megatron.items()}
    ptc = PTC(tensors, tuple(chunks), {"tp": 1, "pp": 1, "dp": 1})
    ptc.validate()
    return mapping, ptc, links


class HFSource(UncheckedSource):
    """Hands out each link's rows of an HF tensor as a flat tensor: a zero-copy view of the memory map, or for a
    transposed link a contiguous copy of its columns (only that slice)."""

    def __init__(self, d: HFDir, links: dict[tuple[str, str], Link]):
        self.dir = d
        self.links = links
        self.readers: dict[str, SafetensorsReader] = {}

    def tensor(self, name: str) -> torch.Tensor:
        fname = self.dir.files[name]
        reader = self.readers.get(fname)
        if reader is None:
            reader = self.readers[fname] = SafetensorsReader(confine(self.dir.path, fname, INDEX))
        return reader.flat(name).view(self.dir.entries[name].shape)

    def flat(self, sc: StoredChunk) -> torch.Tensor:
        link = self.links[(sc.location.file, sc.location.name)]
        t = self.tensor(link.hf)
        if link.transposed:
            return t[:, link.lo : link.lo + link.n].t().contiguous().view(-1)
        return t[link.lo : link.lo + link.n].reshape(-1)

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.readers.clear()


def check_hf_dir(path: str, run: ModelFacts) -> None:
    """Raise (naming the file and tensor, or the field and both values) unless ``path`` holds ``run``'s model."""
    describe_hf(read_hf_dir(path), run)


def open_hf(path: str, run: ModelFacts | None = None) -> Opened:
    """Check and describe a Hugging Face directory for a load (nothing of the job is touched here)."""
    d = read_hf_dir(path)
    _, ptc, links = describe_hf(d, run)
    meta = {"iteration": 0, "consumed_samples": 0, "layout": dict(ptc.layout), "format": "huggingface",
            "config": d.config}
    return Opened(path, ForeignMetadata.of("huggingface", meta), ptc, HFSource(d, links))
