"""A chunk of a tensor this rank holds, tied to the live tensor behind it: what every adapter produces."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tenplex_megatron.plan.ptc import Chunk, PTCError, TensorMeta, dtype_size


@dataclass
class LocalChunk:
    """A chunk this rank holds and the live tensor behind it (``main``: the replica that should write it)."""

    meta: TensorMeta
    chunk: Chunk
    data: torch.Tensor
    main: bool

    def flat_view(self) -> torch.Tensor | None:
        """A writable 1-D view of the chunk's elements, or None if the tensor is not contiguous."""
        t = self.data
        if t.numel() != self.chunk.numel:
            raise PTCError(f"tensor {self.chunk.key!r}: local data has {t.numel()} elements, chunk {self.chunk.numel}")
        return t.view(-1) if t.is_contiguous() else None

    @property
    def nbytes(self) -> int:
        return self.chunk.numel * dtype_size(self.meta.dtype)


def chunk_name(c: Chunk) -> str:
    """The chunk's entry name inside a rank's safetensors file."""
    name = f"{c.key}@{','.join(map(str, c.offsets))}"
    return name + (f"#{c.flat[0]}-{c.flat[1]}" if c.flat is not None else "")


def tensor_table(chunks: list[LocalChunk]) -> dict[str, TensorMeta]:
    """Each tensor's metadata, checking that every chunk of it agrees."""
    tensors: dict[str, TensorMeta] = {}
    for lc in chunks:
        prev = tensors.setdefault(lc.meta.key, lc.meta)
        if prev != lc.meta:
            raise PTCError(f"tensor {lc.meta.key!r}: inconsistent metadata {prev} vs {lc.meta}")
    return tensors

