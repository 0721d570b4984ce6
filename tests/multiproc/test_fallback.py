"""Fall back, never fail, while a good copy exists (memory/fallback.py): a bad replica, a bad snapshot file, a bad
durable checkpoint, and none left; the checksum blocks two ranks of a host both read checked once, damage there
still found; real processes, real files, one torchrun launch (fallback_run.py)."""

from __future__ import annotations

import json
import os

import pytest

from tests.harness import ROOT, torchrun
from tests.multiproc.memory_run import COLS, ROWS

pytestmark = pytest.mark.dist
RUNNER = os.path.join(ROOT, "tests", "multiproc", "fallback_run.py")


def test_damaged_copies_are_skipped_in_order(tmp_path) -> None:
    out = str(tmp_path / "all")
    r = torchrun(2, [out], script=RUNNER, timeout=400)
    assert r.returncode == 0, r.log[-4000:]
    got = [json.load(open(f"{out}.rank{n}.json")) for n in range(2)]
    for g in got:
        # node 0's replica of rank 1's file fails its checksum: node 1's copy instead, nothing from durable storage
        b = g["bad_replica"]
        assert b["iteration"] == 1 and b["equal"] and b["memory"] and b["from_durable"] == 0, b
        assert len(b["skipped"]) == 1 and "rank_00001.safetensors" in b["skipped"][0], b["skipped"]
        assert "fails its checksum" in b["skipped"][0]
        # every copy of a snapshot file is bad: the durable checkpoint of the same iteration
        s = g["bad_snapshot"]
        assert s["iteration"] == 2 and s["equal"] and not s["memory"], s
        assert len(s["skipped"]) == 1 and "host-memory snapshot of iteration 2" in s["skipped"][0]
        # the newest durable checkpoint is damaged: the previous complete iteration
        d = g["bad_durable"]
        assert d["iteration"] == 2 and d["equal"] and not d["memory"], d
        assert len(d["skipped"]) == 1 and "iter_0000003/rank_00000.safetensors" in d["skipped"][0]
        # none left: the error names every copy tried
        e = g["none_left"]["error"]
        assert "no complete copy" in e and "iter_0000003" in e and "iter_0000002" in e, e
        # damage in rank 1's share only: rank 0 copied its share of iteration 5, yet every rank ends with iteration
        # 4 alone, element by element, its non-tensor state restored once (from iteration 4 only)
        o = g["one_rank_damaged"]
        assert o["iteration"] == 4 and o["equal"] and o["restored"] == [4], o
        assert len(o["skipped"]) == 1 and "iter_0000005" in o["skipped"][0], o["skipped"]
    # read by columns what was saved by rows: every block of both files is read by both ranks and checked by one
    # (the same host), the checked bytes are each file's once; damage in rank 1's file still makes both fall back
    sh = [g["shared_blocks"] for g in got]
    assert all(x["equal"] for x in sh), sh
    assert sum(x["verified"] for x in sh) == 2 * (ROWS // 2) * COLS * 4 + COLS * 4, sh  # w's two chunks and b, once
    for x in sh:
        d = x["damaged"]
        assert d["iteration"] == 6 and d["equal"] and len(d["skipped"]) == 1, d
        assert "rank_00001.safetensors" in d["skipped"][0] and "fails its checksum" in d["skipped"][0], d
    assert got[0]["bad_replica"]["received"] > 0  # node 0's rank received rank 1's file from node 1
    assert r.log.count("skipping a damaged copy") >= 1  # the warning, once per copy (rank 0)
