"""The safetensors header, parsed and validated without torch (loads and the torch-free ``verify`` both use it).

Nothing in the file is trusted: the header length, JSON, dtypes, shapes and
byte ranges are checked against the file size, and every error names the file
(and the tensor).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from types import MappingProxyType

from tenplex_megatron.plan.ptc import DTYPE_SIZES
from tenplex_megatron.storage.bounded import open_regular
from tenplex_megatron.storage.files import CheckpointFileError

MAX_HEADER_BYTES = 64 * 1024 * 1024

ST_DTYPES = MappingProxyType({
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
})
ST_CODES = MappingProxyType({v: k for k, v in ST_DTYPES.items()})


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def read_header(path: str, allow_truncated: bool = False) -> tuple[dict[str, TensorEntry], int]:
    """Parse and validate a safetensors header; returns the entries and the file size.

    ``allow_truncated``: keep entries whose data lies past the end of the file
    (the caller checks each against the size) instead of failing on the first.
    """
    try:
        with open_regular(path) as f:  # a FIFO or a device is refused, never waited on
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointFileError(f"{path}: truncated ({size} bytes, no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointFileError(f"{path}: header length {n} does not fit in the file ({size} bytes)")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointFileError(f"{path}: file is missing") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # ValueError: JSON, UTF-8, a number of over 4300 digits; deep nesting
        raise CheckpointFileError(f"{path}: malformed safetensors header: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise CheckpointFileError(f"{path}: safetensors header is not a JSON object")
    base = 8 + n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = ST_DTYPES[info["dtype"]]
            shape = tuple(int(x) for x in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # OverflowError: int(Infinity)
            raise CheckpointFileError(f"{path}: tensor {name!r}: malformed header entry ({e})") from None
        if len(shape) > 64 or any(not 0 <= s < 2**63 for s in shape) or not 0 <= begin <= end < 2**63:
            raise CheckpointFileError(f"{path}: tensor {name!r}: invalid shape or offsets")
        if end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise CheckpointFileError(f"{path}: tensor {name!r}: byte range does not match shape {shape}")
        if base + end > size and not allow_truncated:
            raise CheckpointFileError(
                f"{path}: tensor {name!r}: data ends at byte {base + end} but the file has {size} "
                "(truncated file)"
            )
        entries[name] = TensorEntry(dtype, shape, base + begin, base + end)
    return entries, size
