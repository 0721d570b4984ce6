"""The persist copy from node memory to durable storage: O_DIRECT body + buffered tail, byte for byte."""

from __future__ import annotations

import os

import pytest

from tenplex_megatron.memory import helper
from tenplex_megatron.memory.direct_copy import ALIGN, copy_direct


@pytest.mark.parametrize("size", [0, 100, ALIGN, 3 * ALIGN + 123, (1 << 20) + 1])
def test_copy_direct_is_byte_identical(tmp_path, size):
    src, dst = tmp_path / "src.safetensors", tmp_path / "dst.safetensors"
    data = os.urandom(size)
    src.write_bytes(data)
    calls = []
    got = copy_direct(str(src), str(dst), lambda: calls.append(1))
    if got is None:  # a filesystem without direct I/O: the caller copies the buffered way
        pytest.skip(f"{tmp_path}: O_DIRECT refused")
    assert got == size
    assert dst.read_bytes() == data
    assert len(calls) == (1 if size else 0)  # the fault point fires once, where there are bytes


def test_copy_direct_replaces_an_older_file(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(b"a" * (2 * ALIGN + 7))
    dst.write_bytes(b"b" * (5 * ALIGN))  # longer: truncated first
    if copy_direct(str(src), str(dst)) is None:
        pytest.skip(f"{tmp_path}: O_DIRECT refused")
    assert dst.read_bytes() == b"a" * (2 * ALIGN + 7)


@pytest.mark.parametrize("direct", ["1", "0"])
def test_helper_copy_file_either_way(tmp_path, monkeypatch, direct):
    """The helper's copy gives the same bytes with O_DIRECT and without (``TENPLEX_PERSIST_DIRECT=0``)."""
    monkeypatch.setenv("TENPLEX_PERSIST_DIRECT", direct)
    src, dst = tmp_path / "src", tmp_path / "dst"
    data = os.urandom(5 * ALIGN + 999)
    src.write_bytes(data)
    assert helper.copy_file(str(src), str(dst), 1) == len(data)
    assert dst.read_bytes() == data
