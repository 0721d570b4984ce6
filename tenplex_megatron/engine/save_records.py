"""What the ranks of a save (or a memory snapshot) tell each other: their chunk lists before the assignment of
writers, and their files after the write. Frozen records that travel through the phase runner as JSON."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.plan.ptc import Chunk, TensorMeta


@dataclass(frozen=True)
class Held:
    """One chunk a rank holds: whether it is the main replica (the one that should write it), its bytes, its
    tensor's metadata (every rank's must agree)."""

    chunk: Chunk
    main: bool
    nbytes: int
    meta: TensorMeta


@dataclass(frozen=True)
class RankHoldings:
    """Every chunk one rank holds, gathered at the start of a save so that every rank assigns the writers alike."""

    held: tuple[Held, ...]

    @classmethod
    def of(cls, chunks: list[LocalChunk]) -> RankHoldings:
        return cls(tuple(Held(lc.chunk, lc.main, lc.nbytes, lc.meta) for lc in chunks))

    def to_json(self) -> list[Any]:
        return [[h.chunk.to_json(), h.main, h.nbytes, h.meta.to_json()] for h in self.held]

    @classmethod
    def from_json(cls, d: list[Any]) -> RankHoldings:
        return cls(tuple(Held(Chunk.from_json(c), bool(main), int(nbytes), TensorMeta.from_json(m))
                         for c, main, nbytes, m in d))


@dataclass(frozen=True)
class RankFile:
    """One rank's part of a save's metadata, gathered after its write: ``info`` (the framework's JSON: RNG state,
    rank-local records), its file (None: it wrote nothing), the file's size, its host, and the block CRC-32s of
    each entry (``block_bytes`` a block)."""

    info: Mapping[str, Any]
    file: str | None
    size: int
    host: str
    block_bytes: int
    block_crc32: Mapping[str, tuple[int, ...]]

    def to_json(self) -> dict[str, Any]:
        return {"info": dict(self.info), "file": self.file, "size": self.size, "host": self.host,
                "block_bytes": self.block_bytes, "block_crc32": {n: list(c) for n, c in self.block_crc32.items()}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankFile:
        return cls(dict(d["info"] or {}), d["file"], int(d["size"]), str(d["host"]), int(d["block_bytes"]),
                   {str(n): tuple(int(x) for x in c) for n, c in d["block_crc32"].items()})
