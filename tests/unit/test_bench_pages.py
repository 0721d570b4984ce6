"""``benchmarks.pages`` end to end on small files: every operation timed in every directory, the file's CRC checked,
the RATIO lines against the first directory, and the JSON report."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import pages as bench_pages


def test_bench_pages_times_every_operation_in_each_directory(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b, durable = tmp_path / "a", tmp_path / "b", tmp_path / "durable"
    for d in (a, b, durable):
        d.mkdir()
    out = tmp_path / "pages.json"
    assert bench_pages.main(["--dirs", str(a), str(b), "--mb", "2", "--reps", "2", "--durable", str(durable),
                             "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mb"] == 2 and report["reps"] == 2
    names = report["labels"]
    assert names[str(a)] != names[str(b)] and names[str(a)].endswith("1")  # the same filesystem: numbered
    for d in (a, b):
        row = report["dirs"][str(d)]
        assert set(row) >= set(bench_pages.OPS) - {"persist_direct"}  # O_DIRECT: where the filesystem takes it
        assert all(x["seconds"] >= 0 and x["cpu"] >= 0 for x in row.values())
        assert os.listdir(d) == []  # every file measured is gone
    assert os.listdir(durable) == []
    printed = capsys.readouterr().out
    first, second = names[str(a)], names[str(b)]
    assert f"RATIO map_crc_cpu 2mb {second}/{first} = " in printed or report["dirs"][str(a)]["map_crc"]["cpu"] == 0
    assert "write_fresh" in printed and "persist_sendfile" in printed


def test_labels_name_the_filesystem_and_its_huge_pages() -> None:
    assert bench_pages.labels(["/proc", "/proc/self"]) == ["proc1", "proc2"]
