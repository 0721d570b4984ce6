"""CRC-32 (the zlib/gzip polynomial) of a buffer: ISA-L's carry-less-multiply kernel where installed, zlib's otherwise.

Both give the same value, so checkpoints stay readable either way; ISA-L's runs
about 6x faster here (26 vs 4 GB/s on one core), which is what a verified load
costs on top of its copies. Both release the GIL, so blocks check in parallel.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

try:
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # optional speed-up: zlib gives the same checksums
    _isal_crc32 = None

IMPLEMENTATION = "isal" if _isal_crc32 is not None else "zlib"
_crc32: Callable[..., int] = _isal_crc32 if _isal_crc32 is not None else zlib.crc32


def crc32(data: Any, value: int = 0) -> int:
    """CRC-32 of ``data`` (any contiguous buffer: bytes, memoryview, numpy array), continuing from ``value``."""
    return _crc32(data, value)
