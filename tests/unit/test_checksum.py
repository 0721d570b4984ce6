"""The fast CRC-32 gives zlib's values (checkpoints written with either verify with the other) and is the one in use."""

from __future__ import annotations

import importlib.util
import random
import zlib

import numpy as np
import pytest

from tenplex_megatron.storage import checksum


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 1 << 20, (1 << 20) + 3])
def test_crc32_equals_zlib(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(memoryview(data)) == zlib.crc32(bytes(data))


def test_crc32_continues_from_a_value() -> None:
    data = bytes(random.Random(3).randbytes(10_000))
    assert checksum.crc32(data[5000:], checksum.crc32(data[:5000])) == zlib.crc32(data)


def test_fast_implementation_used_when_installed() -> None:
    expected = "isal" if importlib.util.find_spec("isal") is not None else "zlib"
    assert checksum.IMPLEMENTATION == expected
