"""Host-memory snapshots at the engine level (tiny tensors, each of two ranks a node with its own memory).

One launch runs the scenarios of ``memory_run.py all`` (a helper process
SIGKILLed during the replication, another during the persist, among them); two
launches SIGKILL rank 1 during the snapshot copy and the commit, and one more
checks that each left the previous snapshot and the durable checkpoint
loadable and that the next snapshot cleans up.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from tests.harness import ROOT, torchrun
from tests.multiproc.memory_run import COLS, ROWS

pytestmark = pytest.mark.dist
RUNNER = os.path.join(ROOT, "tests", "multiproc", "memory_run.py")


def _ranks(out: str) -> list[dict]:
    return [json.load(open(f"{out}.rank{r}.json")) for r in range(2)]


def test_memory_tier_scenarios(tmp_path) -> None:
    out = str(tmp_path / "all")
    r = torchrun(2, ["all", out], script=RUNNER, timeout=600)
    assert r.returncode == 0, r.log[-4000:]
    got = _ranks(out)
    for me, g in enumerate(got):
        # K=2 on two nodes: both nodes' memory holds both rank files
        assert g["files"] == ["metadata.json", "rank_00000.safetensors", "rank_00001.safetensors"]
        assert g["replicated"] > 0
        # node 1 lost its memory: snapshot 1 is complete on node 0 alone and loads at another layout
        assert g["chosen"] == 1 and g["new_layout_equal"] and g["from_durable"] == 0
        assert g["new_layout_local_left"]  # rank-local state is taken back at the snapshot's layout only
        assert g["same_layout"][:2] == [True, True], g["same_layout"]  # ...where it comes back byte for byte
        assert g["verified"] > 0
        assert "does not fit" in g["overflow"] and "MemoryFullError" in g["overflow"] and g["overflow_untouched"]
        assert g["fallback"]
        assert "/some/other/job" in g["other_job"] and "never loaded" in g["other_job"]
        assert "'w'" in g["other_model"]
        assert g["kept"] == [6] and all(len(x) <= 2 for x in g["kept_while_replicating"])
        # a retired snapshot's replica is a spare: a later replica of the same rank file is received over its pages
        assert len(set(g["replica_inodes"])) < 3, g["replica_inodes"]
        assert g["after_restart"] == ["metadata.json", "rank_00000.safetensors", "rank_00001.safetensors"]
        assert g["durable_after"] == [12, True]
        assert g["persisted_killed"] == []
        assert g["persisted_after"] or me != 0
    assert got[0]["received"] == 0 and got[1]["received"] > 0  # node 1's rank received its part from node 0
    # at the same layout rank 1 receives from node 0 its rows of w, b (rank 0's file) and its 16 rank-local bytes
    assert got[0]["same_layout"][2] == 0 and got[1]["same_layout"][2] == (ROWS // 2 * COLS + COLS) * 4 + 16
    # mixed sources: node 0's file from its memory (node 1's rank receives its part), node 1's from durable storage
    assert got[0]["mixed"]["persisted"] == ["iter_0000013"]  # committed by rank 0
    for g in got:
        m = g["mixed"]
        assert m["chosen"] == 13 and m["durable"] == ["rank_00001.safetensors"] and m["equal"], m
        assert m["same_layout"] == [True, True], m  # rank 1's rank-local entry read from the durable file
        assert m["from_durable"] > 0
    assert got[0]["mixed"]["received"] == 0 and got[1]["mixed"]["received"] > 0
    assert got[0]["replica_warning"] and "one copy per node" in got[0]["replica_warning"][0]
    assert "exited" in got[0]["persist_killed_warning"][0] and got[0]["persist_cleaned"]
    # a helper that dies after its node said it was working is reported as one whose poll read the death
    late = got[0]["died_after_answer"]
    assert late["said"] == ["running"] and late["pending"] == [None, None] and late["restarted"], late
    assert [w for w in late["warnings"] if "persist" in w and "exited with status -9" in w], late
    assert [w for w in late["warnings"] if "replication" in w and "exited with status -9" in w], late
    assert not [w for w in late["warnings"] if "abandoned" in w], late
    assert got[0]["replicate_killed_warning"]
    # node 1's helper was killed writing node 0's file: node 1 never lists it (only its temporary name)
    assert "rank_00000.safetensors" not in got[1]["after_killed_replication"]
    _check_checkpointer_rebuilt(got)


def _check_checkpointer_rebuilt(got: list[dict]) -> None:
    """A Checkpointer closed and built again in the same process: the second restarts from the first's snapshot;
    each close leaves no lease held, no helper process, no thread and no file descriptor behind."""
    for me, g in enumerate(got):
        first, second = g["checkpointer"]
        # rank 0 holds --save's lease and its node's memory directory's; rank 1 (local rank 1) only checks them
        assert first["held"] == second["held"] and len(first["held"]) == (2 if me == 0 else 0), first
        assert first["loaded"] is None  # nothing there yet
        assert second["loaded"] == [20, True, True], second  # the first one's snapshot, from host memory
        for r in (first, second):
            assert r["helper_started"] and r["helper_gone"], r
            assert r["held_after"] == [] and all(r["released"]) and r["threads_left"] == [], r
            assert "closed" in r["closed_refuses"], r
        more, fewer = Counter(second["fds"]) - Counter(first["fds"]), Counter(first["fds"]) - Counter(second["fds"])
        assert not more and not fewer, (me, dict(more), dict(fewer))  # open at one round's end, not the other's


# a job SIGKILLed during its snapshot and restarted, about 50 s: make test-bench
@pytest.mark.slow
def test_sigkill_during_snapshot_keeps_previous_snapshot_and_durable(tmp_path) -> None:
    outs = []
    for point in ("memory.write", "memory.commit"):
        out = str(tmp_path / point.replace(".", "_"))
        r = torchrun(2, ["crash", point, out], script=RUNNER, timeout=120)
        assert r.returncode != 0, r.log[-3000:]
        assert os.path.isdir(os.path.join(out, "ckpt", "iter_0000001"))
        outs.append(out)
    r = torchrun(2, ["check", *outs], script=RUNNER, timeout=300)
    assert r.returncode == 0, r.log[-4000:]
    got = _ranks(outs[0])
    for out in outs:
        for g in got:
            it, equal = g[out]["memory"]
            assert equal and it in (1, 2), (out, g[out])  # 2 only where a node committed it before the kill
            assert g[out]["durable"] == [1, True]
        if "commit" not in out:
            assert got[0][out]["memory"][0] == 1
            assert got[0][out]["cleaned"] and got[1][out]["cleaned"], out  # the killed snapshot's staging
