"""Read-ahead hints: ranges merge as documented, and announcing mapped ranges changes nothing that is read."""

from __future__ import annotations

import mmap

import numpy as np

from tenplex_megatron.storage.prefetch import merge_ranges, willneed


def test_merge_ranges_joins_overlapping_and_close_ranges() -> None:
    assert merge_ranges([(100, 200), (0, 50), (150, 300), (10_000, 10_010), (400, 400)], gap=100) == [
        (0, 300), (10_000, 10_010)]
    assert merge_ranges([], gap=10) == []


def test_willneed_on_a_mapped_file_keeps_its_bytes(tmp_path) -> None:
    data = np.random.default_rng(0).integers(0, 256, 3 * mmap.PAGESIZE + 17, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = np.frombuffer(mm, dtype=np.uint8)
        base = view.ctypes.data
        assert willneed([(base + 5, base + 1000), (base + 2 * mmap.PAGESIZE, base + len(data))]) >= 1
        assert np.array_equal(view, data)
        del view
