"""Rank-local state: opaque bytes a rank keeps for itself (Transformer Engine's ``_extra_state``), saved in its own file.

A framework's module may hold state that is not a tensor of the PTC: it cannot be re-sharded, only given back to
the same rank at the same layout. The adapter hands such state over as flat uint8 tensors (never unpickled here);
the engine writes them into the rank's safetensors file beside its chunks (so megabytes per rank stay out of
metadata.json), and records in metadata.json which rank holds which entry, its byte count and block CRC-32s
(``rank_local``). At load the adapter decides whether they apply (same layout, same modules) before any tensor is
copied, and the engine reads back only the entries of the loading rank's own number, checksums verified.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tenplex_megatron.engine.save_records import RankFile
from tenplex_megatron.storage.checkpoint_metadata import RankLocalEntry, RankLocalSection
from tenplex_megatron.storage.confine import confine
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.safetensors_io import SafetensorsReader, block_crc32

#: the entry names in a rank's file start with this (chunk names are ``<tensor key>@<offsets>``: no clash)
PREFIX = "rank_local:"


def rank_local_sections(infos: list[RankFile]) -> dict[int, RankLocalSection]:
    """metadata.json's ``rank_local`` section from every rank's save info: per rank, its file and each entry's
    record (what the adapter said about it) with its bytes' block CRC-32s; empty when no rank has any."""
    out: dict[int, RankLocalSection] = {}
    for r, info in enumerate(infos):
        records = info.info.get("rank_local") or {}
        if not records:
            continue
        entries = {name: RankLocalEntry.written(name, rec, tuple(info.block_crc32.get(name, ())))
                   for name, rec in records.items()}
        out[r] = RankLocalSection(r, info.file, info.block_bytes, entries)
    return out


def saved_entries(sections: Mapping[int, RankLocalSection], rank: int) -> dict[str, Mapping[str, Any]] | None:
    """The records of the entries rank ``rank`` saved (None: the checkpoint has no rank-local section for it).
    ``sections``: the checked metadata's (``CheckpointMetadata.rank_local``)."""
    section = sections.get(rank)
    return None if section is None else {name: e.record for name, e in section.entries.items()}


def stored_entries(sections: Mapping[int, RankLocalSection], rank: int) -> list[tuple[str, str, int]]:
    """(file, entry, byte count) of each rank-local entry with bytes that rank ``rank`` saved (an empty entry is its
    record alone: nothing to read)."""
    section = sections.get(rank)
    if section is None or section.file is None:
        return []
    return [(section.file, name, e.nbytes) for name, e in sorted(section.entries.items()) if e.nbytes]


def entry_sizes(sections: Mapping[int, RankLocalSection]) -> dict[tuple[str, str], int]:
    """(file, entry) -> byte count of every rank's rank-local entries with bytes."""
    return {(f, n): b for r in sections for f, n, b in stored_entries(sections, r)}


def read_file_entry(path: str, file: str, name: str, nbytes: int) -> torch.Tensor:
    """Entry ``name`` (``nbytes`` uint8) of ``file`` in checkpoint ``path``, as a tensor of its own (a copy)."""
    f = SafetensorsReader(confine(path, file))
    try:
        return f.flat(name, "uint8", nbytes).clone()
    finally:
        f.close()


def reader(path: str, sections: Mapping[int, RankLocalSection], rank: int,
           raw: Callable[[str, str, int], torch.Tensor] | None = None) -> Callable[[str], torch.Tensor]:
    """``read(name)``: entry ``name`` of rank ``rank``'s rank-local state in checkpoint ``path`` as a uint8 tensor of
    its own (a copy, not a view of the file), its size and every block CRC checked; errors name the file and entry.
    ``raw(file, name, nbytes)``: where the bytes come from (default: the file in ``path``; a host-memory snapshot's
    source reads its node's memory, the durable checkpoint, or what a peer sent)."""
    section = sections.get(rank)
    fetch = raw or (lambda file, name, nbytes: read_file_entry(path, file, name, nbytes))

    def read(name: str) -> torch.Tensor:
        entry = None if section is None else section.entries.get(name)
        if section is None or entry is None:
            raise CheckpointFileError(f"{path}: rank {rank} saved no rank-local entry {name!r}")
        if entry.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        fname = section.file
        if fname is None:
            raise CheckpointFileError(f"{path}: metadata.json names no file for rank {rank}'s rank-local state")
        data = fetch(fname, name, entry.nbytes)
        got = list(block_crc32(data, section.block_bytes))
        if got != list(entry.block_crc32):
            raise CheckpointFileError(f"{path}/{fname}: rank-local entry {name!r} fails its block checksums "
                                      "(damaged file)")
        return data

    return read
