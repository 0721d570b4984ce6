"""tenplex's own shards as a :class:`~tenplex_megatron.storage.source.Source`: files opened and size-checked once,
flat views of the stored chunks, and the CRC-32 blocks a load reads verified (``storage/block_verify.py``)."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from tenplex_megatron.plan.planner import Piece
from tenplex_megatron.plan.ptc import StoredChunk
from tenplex_megatron.storage.block_verify import BlockVerifier
from tenplex_megatron.storage.confine import confine, confine_all
from tenplex_megatron.storage.safetensors_io import CheckpointFileError, SafetensorsReader


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

    @property
    def verifying(self) -> bool:
        return self.verify

    @property
    def bytes_verified(self) -> int:
        return self.verifier.bytes_verified

    def _reader(self, file: str) -> SafetensorsReader:
        """``file`` opened and size-checked once."""
        reader = self.readers.get(file)
        if reader is None:
            path = self.paths.get(file)
            if path is None:
                path = self.paths[file] = confine(self.ckpt_dir, file)
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
