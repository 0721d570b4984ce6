"""The ``.distcp`` files of a torch.distributed.checkpoint (DCP) directory, read in place.

Where each item lies comes from the index (``distcp_index.py``). ``FileSystemWriter``
stores each tensor item as its own ``torch.save`` archive in the stream (an
uncompressed zip whose ``data/0`` record holds the raw elements), so an item's
elements are found by reading only the archive's directory, then memory-mapped.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from tenplex_megatron.storage.confine import confine
from tenplex_megatron.storage.safetensors_io import CheckpointFileError


class _Slice(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file as a seekable stream (for zipfile)."""

    def __init__(self, f: Any, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = {0: off, 1: self.pos + off, 2: self.length + off}[whence]
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        data = self.f.read(n)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


@dataclass(frozen=True)
class ItemData:
    """Where a stored tensor item's raw elements lie in its file."""

    offset: int  # of the first element, in the file
    nbytes: int


def locate_item(f: Any, path: str, offset: int, length: int, nbytes: int) -> ItemData:
    """The raw elements of the item stored at ``[offset, offset + length)`` of ``path``: raw bytes
    (``length == nbytes``) or a ``torch.save`` archive whose one storage record must hold exactly ``nbytes``."""
    if length == nbytes:
        return ItemData(offset, nbytes)
    try:
        with zipfile.ZipFile(_Slice(f, offset, length)) as z:
            records = [i for i in z.infolist() if "/data/" in i.filename and not i.filename.endswith("/")]
            if len(records) != 1:
                raise CheckpointFileError(f"{path}: item at byte {offset} holds {len(records)} storages, not 1")
            info = records[0]
            if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
                raise CheckpointFileError(
                    f"{path}: item at byte {offset}: storage of {info.file_size} bytes "
                    f"({'stored' if info.compress_type == zipfile.ZIP_STORED else 'compressed'}), the index says "
                    f"{nbytes} bytes")
            f.seek(offset + info.header_offset)
            header = f.read(30)
            if len(header) != 30 or header[:4] != b"PK\x03\x04":
                raise CheckpointFileError(f"{path}: item at byte {offset}: bad zip record header")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            return ItemData(offset + info.header_offset + 30 + name_len + extra_len, nbytes)
    except zipfile.BadZipFile as e:
        raise CheckpointFileError(f"{path}: item at byte {offset} (length {length}) is neither raw data nor a "
                                  f"torch.save archive ({e})") from None


class DistcpFiles:
    """The ``.distcp`` files of one DCP directory, each memory-mapped once; items located once."""

    def __init__(self, ckpt_dir: str):
        self.ckpt_dir = ckpt_dir
        self.readers: dict[str, Any] = {}  # file name -> (file, mmap)
        self._items: dict[tuple[str, int], ItemData] = {}
        self.plain: dict[str, Any] = {}  # file name -> (file, size): opened for the parallel reader, not mapped

    def _open(self, name: str) -> tuple[Any, mmap.mmap]:
        got = self.readers.get(name)
        if got is None:
            path = confine(self.ckpt_dir, name, "the torch_dist index")
            if not os.path.isfile(path):
                raise CheckpointFileError(f"{path}: missing (a torch_dist checkpoint needs every rank's file)")
            f = open(path, "rb")
            got = self.readers[name] = (f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
        return got

    def tensor(self, name: str, offset: int, length: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The item at ``offset`` of file ``name`` as a flat (copy-on-write mapped) tensor of ``numel`` ``dtype``."""
        f, mm = self._open(name)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        item = self._items.get((name, offset))
        if item is None:
            path = os.path.join(self.ckpt_dir, name)
            if offset + length > len(mm):
                raise CheckpointFileError(f"{path}: the index names bytes {offset}-{offset + length}, the file has "
                                          f"{len(mm)} (truncated?)")
            item = self._items[(name, offset)] = locate_item(f, path, offset, length, nbytes)
        return torch.frombuffer(mm, dtype=dtype, count=numel, offset=item.offset)

    def locate(self, name: str, offset: int, length: int, nbytes: int) -> tuple[str, ItemData]:
        """The path of file ``name`` and where the item at ``offset`` keeps its ``nbytes`` raw bytes (no map: the
        parallel reader reads them)."""
        path = confine(self.ckpt_dir, name, "the torch_dist index")
        got = self.plain.get(name)
        if got is None:
            if not os.path.isfile(path):
                raise CheckpointFileError(f"{path}: missing (a torch_dist checkpoint needs every rank's file)")
            f = open(path, "rb")
            got = self.plain[name] = (f, os.fstat(f.fileno()).st_size)
        f, size = got
        item = self._items.get((name, offset))
        if item is None:
            if offset + length > size:
                raise CheckpointFileError(f"{path}: the index names bytes {offset}-{offset + length}, the file has "
                                          f"{size} (truncated?)")
            item = self._items[(name, offset)] = locate_item(f, path, offset, length, nbytes)
        return path, item

    def read_bytes(self, name: str, offset: int, length: int) -> bytes:
        f, mm = self._open(name)
        return bytes(mm[offset:offset + length])

    def close(self) -> None:
        for f, mm in self.readers.values():
            try:
                mm.close()
            except BufferError:  # a tensor still views the map: the file closes when it is collected
                pass
            f.close()
        self.readers.clear()
        for f, _ in self.plain.values():
            f.close()
        self.plain.clear()
