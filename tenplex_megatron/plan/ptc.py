"""The parallelizable tensor collection (PTC): tensors, the chunks ranks hold, where they are stored.

A chunk is a box of a global tensor (offsets and sizes per dimension) and,
optionally, a contiguous flat range ``[start, stop)`` of that box's row-major
order: exactly what megatron-core's distributed optimizer holds per DP rank,
so describing it needs no gather. Pure Python, JSON-serialisable, versioned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tenplex_megatron.errors import TenplexError
from tenplex_megatron.plan.versioned import VersionedFormat

PTC_FORMAT_VERSION = 1

DTYPE_SIZES = MappingProxyType({
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
})


class PTCError(TenplexError, ValueError):
    """A PTC (or a chunk in it) that is malformed or inconsistent."""


PTC_FORMAT = VersionedFormat('a PTC: {"ptc_version": 1, "tensors": [...], "chunks": [...]}', "ptc_version",
                             (PTC_FORMAT_VERSION,), PTCError, version_label="PTC version")


def dtype_size(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise PTCError(f"unsupported dtype {dtype!r}") from None


@dataclass(frozen=True)
class TensorMeta:
    """A logical tensor of the job and the layout-independent facts of how megatron-core shards it.

    ``vocab_rows``: real rows when dim 0 is a padded vocabulary. ``tp_axis``: the
    axis TP splits (None: replicated over TP), in ``tp_parts`` equal groups each
    split over TP (2 for SwiGLU's fc1). ``stage``: ``layers`` (axis 0 is the layer
    axis, split by PP), ``first`` or ``last`` pipeline stage. ``tied``: the word
    embedding that the last stage also holds as its output layer. ``param``: for
    optimizer state, the model tensor it belongs to (sharded flat by DP under
    the distributed optimizer).
    """

    key: str
    global_shape: tuple[int, ...]
    dtype: str
    vocab_rows: int | None = None
    tp_axis: int | None = None
    tp_parts: int = 1
    stage: str = ""
    tied: bool = False
    param: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"key": self.key, "shape": list(self.global_shape), "dtype": self.dtype}
        for name in ("vocab_rows", "tp_axis", "param"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        if self.tp_parts != 1:
            d["tp_parts"] = self.tp_parts
        if self.stage:
            d["stage"] = self.stage
        if self.tied:
            d["tied"] = True
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorMeta:
        def opt_int(name: str) -> int | None:
            return None if d.get(name) is None else int(d[name])

        return cls(
            key=str(d["key"]),
            global_shape=tuple(int(x) for x in d["shape"]),
            dtype=str(d["dtype"]),
            vocab_rows=opt_int("vocab_rows"),
            tp_axis=opt_int("tp_axis"),
            tp_parts=int(d.get("tp_parts", 1)),
            stage=str(d.get("stage", "")),
            tied=bool(d.get("tied", False)),
            param=None if d.get("param") is None else str(d["param"]),
        )


@dataclass(frozen=True)
class Chunk:
    """A box of tensor ``key`` and an optional flat range of it (None: the whole box)."""

    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    flat: tuple[int, int] | None = None

    def __hash__(self) -> int:  # cached: chunks key the planner's memo tables
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.key, self.offsets, self.shape, self.flat))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def box_numel(self) -> int:
        return math.prod(self.shape)

    @property
    def numel(self) -> int:
        if self.flat is None:
            return self.box_numel
        return self.flat[1] - self.flat[0]

    @property
    def flat_range(self) -> tuple[int, int]:
        return self.flat if self.flat is not None else (0, self.box_numel)

    def validate(self, meta: TensorMeta) -> None:
        """Raise :class:`PTCError` naming the tensor if this chunk does not fit in ``meta``."""
        if len(self.offsets) != len(meta.global_shape) or len(self.shape) != len(meta.global_shape):
            raise PTCError(
                f"tensor {self.key!r}: chunk rank {len(self.shape)} != tensor rank {len(meta.global_shape)}"
            )
        for o, s, g in zip(self.offsets, self.shape, meta.global_shape):
            if o < 0 or s < 0 or o + s > g:
                raise PTCError(
                    f"tensor {self.key!r}: chunk offsets {self.offsets} sizes {self.shape} "
                    f"fall outside the global shape {meta.global_shape}"
                )
        if self.flat is not None:
            a, b = self.flat
            if not (0 <= a <= b <= self.box_numel):
                raise PTCError(f"tensor {self.key!r}: flat range {self.flat} outside box of {self.box_numel}")

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"key": self.key, "offsets": list(self.offsets), "shape": list(self.shape)}
        if self.flat is not None:
            d["flat"] = list(self.flat)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Chunk:
        flat = d.get("flat")
        return cls(
            key=str(d["key"]),
            offsets=tuple(int(x) for x in d["offsets"]),
            shape=tuple(int(x) for x in d["shape"]),
            flat=None if flat is None else (int(flat[0]), int(flat[1])),
        )


@dataclass(frozen=True)
class Location:
    """Where a stored chunk lives: a file, the tensor name in it, the rank/host that wrote it, its checksums.

    ``block_crc32``: CRC-32 of each ``block_bytes`` block of the tensor's bytes
    (the last block may be short), so a load verifies only the blocks it reads.
    ``crc32``: one CRC-32 of the whole tensor, as older checkpoints recorded it.
    """

    file: str
    name: str
    rank: int = 0
    host: str = ""
    crc32: int | None = None
    block_crc32: tuple[int, ...] | None = None
    block_bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.block_crc32 is None) != (self.block_bytes is None):
            raise PTCError(f"{self.file}: tensor {self.name!r}: block_crc32 and block_bytes must be given together")
        if self.block_bytes is not None and self.block_bytes <= 0:
            raise PTCError(f"{self.file}: tensor {self.name!r}: block_bytes must be positive, got {self.block_bytes}")

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"file": self.file, "name": self.name, "rank": self.rank, "host": self.host}
        if self.crc32 is not None:
            d["crc32"] = self.crc32
        if self.block_crc32 is not None:
            d["block_bytes"] = self.block_bytes
            d["block_crc32"] = list(self.block_crc32)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Location:
        crc = d.get("crc32")
        blocks = d.get("block_crc32")
        block_bytes = d.get("block_bytes")
        return cls(
            file=str(d["file"]),
            name=str(d["name"]),
            rank=int(d.get("rank", 0)),
            host=str(d.get("host", "")),
            crc32=None if crc is None else int(crc),
            block_crc32=None if blocks is None else tuple(int(x) for x in blocks),
            block_bytes=None if block_bytes is None else int(block_bytes),
        )


@dataclass(frozen=True)
class StoredChunk:
    """A chunk and one place its bytes can be read from (several replicas may exist)."""

    chunk: Chunk
    location: Location

    def to_json(self) -> dict[str, Any]:
        return {**self.chunk.to_json(), "at": self.location.to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StoredChunk:
        return cls(chunk=Chunk.from_json(d), location=Location.from_json(d["at"]))


@dataclass(frozen=True)
class PTC:
    """A whole job's tensors and the stored chunks that make them up."""

    tensors: dict[str, TensorMeta]
    chunks: tuple[StoredChunk, ...]
    layout: dict[str, Any] = field(default_factory=dict)  # degrees; ``split`` (an uneven pipeline) a list

    def validate(self) -> None:
        for sc in self.chunks:
            meta = self.tensors.get(sc.chunk.key)
            if meta is None:
                raise PTCError(f"chunk of unknown tensor {sc.chunk.key!r} at {sc.location.file}")
            sc.chunk.validate(meta)

    def chunks_by_key(self) -> dict[str, list[StoredChunk]]:
        out: dict[str, list[StoredChunk]] = {k: [] for k in self.tensors}
        for sc in self.chunks:
            out[sc.chunk.key].append(sc)
        return out

    def total_bytes(self) -> int:
        """Every stored chunk's bytes, replicas included: what the checkpoint holds."""
        return sum(sc.chunk.numel * dtype_size(self.tensors[sc.chunk.key].dtype) for sc in self.chunks)

    def distinct_bytes(self) -> int:
        """Each stored tensor's bytes once: the state itself, whatever copies of it the checkpoint keeps."""
        stored = {sc.chunk.key for sc in self.chunks}
        return sum(t.numel * dtype_size(t.dtype) for k, t in self.tensors.items() if k in stored)

    def to_json(self) -> dict[str, Any]:
        return {
            "ptc_version": PTC_FORMAT_VERSION,
            "layout": dict(self.layout),
            "tensors": [t.to_json() for t in self.tensors.values()],
            "chunks": [c.to_json() for c in self.chunks],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PTC:
        PTC_FORMAT.check(d, "PTC metadata")
        try:
            tensors = {t.key: t for t in (TensorMeta.from_json(x) for x in d["tensors"])}
            chunks = tuple(StoredChunk.from_json(x) for x in d["chunks"])
            layout = {str(k): [int(n) for n in v] if isinstance(v, list) else int(v)  # split: layers per chunk
                      for k, v in d.get("layout", {}).items()}
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
            raise PTCError(f"malformed PTC metadata: {type(e).__name__}: {e}") from None
        ptc = cls(tensors=tensors, chunks=chunks, layout=layout)
        ptc.validate()
        return ptc
