"""``--tenplex-layout measure`` (training/measure.py) at world size 2, in one torchrun launch (measure_run.py).

The first start times the best three candidates in the running processes (each one's parallel state,
model and optimizer built, the newest checkpoint loaded re-sharded to it, forward+backward timed, no
optimizer step), writes their times into the checkpoint directory's versioned JSON and trains at the fastest;
a second start at the same world size runs no trial. The losses of iterations 1-6 (auto, then the measured
layout twice) equal an uninterrupted run's (at the auto layout the job started at: the initial weights depend
on the layout; re-sharded restarts continue its losses), so no trial changed the state.
"""

from __future__ import annotations

import json
import os

import pytest

from tenplex_megatron.plan.autolayout import parse_candidate_key
from tenplex_megatron.plan.layout_files import LAYOUT_TIMES_FILE, read_layout_times
from tests.harness import ROOT, TINY_GPT, metrics, torchrun

pytestmark = pytest.mark.dist
_MBS = TINY_GPT.index("--micro-batch-size")
FLAGS = [*TINY_GPT[:_MBS], *TINY_GPT[_MBS + 2:], "--vocab-size", "96", "--train-iters", "6"]


def test_measure_times_the_best_candidates_once_and_trains_at_the_fastest(tmp_path) -> None:
    r = torchrun(2, [str(tmp_path), *FLAGS], script=os.path.join(ROOT, "tests", "multiproc", "measure_run.py"),
                 timeout=400)
    assert r.returncode == 0, r.log[-4000:]
    path = tmp_path / "ckpt" / LAYOUT_TIMES_FILE
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and set(doc["times"]) == {"2"}
    times = read_layout_times(str(path))[2]
    assert len(times) == 3 and all(s > 0 for s in times.values())
    fastest, _ = min(times.items(), key=lambda kv: kv[1])
    layout, mbs = parse_candidate_key(fastest)
    assert json.loads((tmp_path / "chosen.json").read_text()) == [layout.tp, layout.pp, mbs]
    assert r.log.count("--tenplex-layout measure: timing 3 candidates at world size 2 from ") == 1  # with the ckpt
    assert r.log.count("measure: 3 times for world size 2 from") == 1 and "no trial" in r.log  # second start
    assert r.log.count(f"--tenplex-layout measure: {layout}, micro-batch {mbs} (measure: best of ") == 2
    got, ref = metrics(str(tmp_path / "m.jsonl")), {m["iteration"]: m for m in metrics(str(tmp_path / "ref.jsonl"))}
    assert [m["iteration"] for m in got] == [1, 2, 3, 4, 5, 6]
    assert all(m["layout"] == layout.to_json() for m in got[2:])
    for m in got:
        assert m["samples"] == ref[m["iteration"]]["samples"]
        assert m["loss"] == pytest.approx(ref[m["iteration"]]["loss"], rel=1e-5), m["iteration"]
