"""tenplex's own shards as a :class:`~tenplex_megatron.storage.source.Source`: files opened and size-checked once,
flat views of the stored chunks, and the CRC-32 blocks a load reads verified (``storage/block_verify.py``)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import torch

from tenplex_megatron.plan.planner import Piece
from tenplex_megatron.plan.ptc import DTYPE_SIZES, StoredChunk
from tenplex_megatron.storage.block_verify import BlockVerifier
from tenplex_megatron.storage.confine import confine, confine_all
from tenplex_megatron.storage.parallel_read import Extent, ReadPlan
from tenplex_megatron.storage.safetensors_header import TensorEntry, read_header
from tenplex_megatron.storage.safetensors_io import TORCH_DTYPES, CheckpointFileError, SafetensorsReader


class SourceFiles:
    """tenplex's own shards as a :class:`~tenplex_megatron.storage.source.Source`: each file opened once, flat
    views of the stored chunks handed out, and the blocks that are read verified against their CRC-32s.

    ``require_checksums``: a chunk with no recorded checksum is an error when
    verifying (format 2 records them for every chunk). ``names``: the file
    names the metadata uses; they and those of ``sizes`` are confined to
    ``ckpt_dir`` here, before anything is read (any other is, when first used).
    """

    def __init__(self, ckpt_dir: str, dtypes: dict[str, str], sizes: dict[str, int] | None = None, verify: bool = True,
                 require_checksums: bool = False, threads: int | None = None, names: Iterable[str] = ()):
        self.ckpt_dir = ckpt_dir
        self.dtypes = dtypes
        self.sizes = sizes or {}
        self.paths = confine_all(ckpt_dir, [*names, *self.sizes])
        self.verify = verify
        self.readers: dict[str, SafetensorsReader] = {}
        self.elsewhere: dict[str, str] = {}  # files read from another directory (a subclass's): name -> path
        self.verifier = BlockVerifier(ckpt_dir, require_checksums, threads,
                                      path_of=lambda name: self.elsewhere.get(name) or os.path.join(ckpt_dir, name))
        self._covered: dict[tuple[str, str, Piece], bool] = {}  # pieces already checked: not recomputed when copying
        self.headers: dict[str, tuple[dict[str, TensorEntry], int]] = {}  # files the parallel reader reads
        self.require = require_checksums

    @property
    def verifying(self) -> bool:
        return self.verify

    @property
    def bytes_verified(self) -> int:
        return self.verifier.bytes_verified

    def _path(self, file: str) -> str:
        path = self.paths.get(file)
        if path is None:
            path = self.paths[file] = confine(self.ckpt_dir, file)
        return path

    def _header(self, file: str) -> tuple[dict[str, TensorEntry], int]:
        """``file``'s validated header and size, read once and size-checked (no map: the parallel reader's)."""
        got = self.headers.get(file)
        if got is None:
            path = self._path(file)
            got = read_header(path)
            expected = self.sizes.get(file)
            if expected is not None and got[1] != expected:
                raise CheckpointFileError(f"{path}: size {got[1]} bytes, the metadata recorded {expected} (damaged or truncated)")
            self.headers[file] = got
        return got

    def extent(self, sc: StoredChunk) -> Extent | None:
        """Where ``sc``'s bytes lie in its file and the checksums that cover them (read by ``storage/parallel_read.py``)."""
        loc = sc.location
        path = self._path(loc.file)
        entries, _ = self._header(loc.file)
        entry = entries.get(loc.name)
        dtype = self.dtypes[sc.chunk.key]
        if entry is None:
            raise CheckpointFileError(f"{path}: tensor {loc.name!r} is not in the file")
        if entry.dtype != dtype:
            raise CheckpointFileError(f"{path}: tensor {loc.name!r} has dtype {entry.dtype}, metadata says {dtype}")
        if math.prod(entry.shape) != sc.chunk.numel:
            raise CheckpointFileError(f"{path}: tensor {loc.name!r} has {math.prod(entry.shape)} elements, "
                                      f"metadata says {sc.chunk.numel}")
        where = f"{self.verifier.path_of(loc.file)}: tensor {loc.name!r} (of {sc.chunk.key!r})"
        nbytes = entry.end - entry.begin
        block: int | None = None
        crcs: tuple[int, ...] | None = None
        whole = False
        if self.verify and loc.block_crc32 is not None and loc.block_bytes is not None:
            block, crcs = loc.block_bytes, tuple(loc.block_crc32)
        elif self.verify and loc.crc32 is not None:
            block, crcs, whole = max(1, nbytes), (loc.crc32,), True
        elif self.verify and self.require:
            raise CheckpointFileError(f"{where}: no checksum recorded in the metadata (damaged metadata)")
        return Extent(path, entry.begin, nbytes, DTYPE_SIZES[dtype], TORCH_DTYPES[dtype], block, crcs, where,
                      (loc.file, loc.name), whole)

    def read_done(self, plan: ReadPlan) -> None:
        """The parallel reader checked ``plan``'s blocks: they count as verified (and are not checked again)."""
        for run in plan.runs:
            for blk in run.blocks:
                self.verifier.verified.add((*plan.extents[blk.extent].key, blk.index))
        self.verifier.bytes_verified += plan.bytes_verified

    def _reader(self, file: str) -> SafetensorsReader:
        """``file`` opened and size-checked once."""
        reader = self.readers.get(file)
        if reader is None:
            path = self._path(file)
            reader = SafetensorsReader(path)
            expected = self.sizes.get(file)
            if expected is not None and reader.size != expected:
                reader.close()
                raise CheckpointFileError(f"{path}: size {reader.size} bytes, the metadata recorded {expected} (damaged or truncated)")
            self.readers[file] = reader
        return reader

    def flat(self, sc: StoredChunk) -> torch.Tensor:
        """The stored chunk as a flat tensor, its file opened and size-checked once; no checksum is checked here."""
        return self._reader(sc.location.file).flat(sc.location.name, self.dtypes[sc.chunk.key], sc.chunk.numel)

    def entry(self, file: str, name: str, nbytes: int) -> torch.Tensor:
        """A rank-local entry (``engine/rank_local.py``) of a stored file as uint8 bytes of its own (a copy: it
        outlives the file's mapping); the caller checks its block CRCs."""
        return self._reader(file).flat(name, "uint8", nbytes).clone()

    def check(self, sc: StoredChunk, flat: torch.Tensor, piece: Piece) -> bool:
        """Verify the checksummed blocks ``piece`` reads of ``flat`` (``sc``'s data); returns whether a checksum covers it."""
        if not self.verify:
            return False
        key = (sc.location.file, sc.location.name, piece)
        covered = self._covered.get(key)
        if covered is None:
            covered = self._covered[key] = self.verifier.check(sc, flat, piece)
        return covered

    def queue(self, sc: StoredChunk, flat: torch.Tensor, piece: Piece, todo: list, source: int = -1) -> None:
        """Queue the blocks ``piece`` reads for :meth:`run` (what :func:`prepare_sources` does)."""
        if not self.verify:
            return
        key = (sc.location.file, sc.location.name, piece)
        if key not in self._covered:
            self._covered[key] = self.verifier.collect(sc, flat, piece, todo, source)

    def run(self, todo: list) -> None:
        """Check the queued blocks (in parallel where this rank has cores to spare)."""
        self.verifier.run(todo)

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.readers.clear()
        self.headers.clear()
