"""Host-memory checkpoints for real DeepSpeed engines (tiny GPT-2, gloo): a lost node, a restart at another DP size.

Two launches run every ZeRO stage in sequence (``ds_memory_run.py``): DP2 on two nodes (memory directories)
snapshots after steps 2 and 4 (the second persisted) and replicates the last to both nodes; then node 1 is
lost (its directory deleted), the durable checkpoint's rank files are emptied, and DP4 on node 0 and a new,
empty node 2 resumes from memory. Oracle: the fp32 master weights and Adam moments after the load equal
the state at the snapshot exactly; the losses of steps 5-6 continue the uninterrupted run's; after every
node's memory is lost, the durable checkpoint persisted at the end loads.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch

from tests.harness import ROOT, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # about 100 CPU seconds: make test-bench
RUNNER = os.path.join(ROOT, "tests", "multiproc", "ds_memory_run.py")
STAGES = (1, 3)


def _ranks(d: str, mode: str, n: int) -> list[dict]:
    out = []
    for r in range(n):
        with open(os.path.join(d, f"{mode}.rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def _opened(d: str, mode: str, r: int) -> list[str]:
    with open(os.path.join(d, f"open_{mode}.rank{r}.log")) as f:
        return [line.split("\t", 1)[1].strip() for line in f if line.strip()]


def test_deepspeed_restarts_from_peer_memory_at_another_dp_size_after_losing_a_node(tmp_path) -> None:
    dirs = {s: str(tmp_path / f"z{s}") for s in STAGES}
    jobs = []
    for s, d in dirs.items():
        os.makedirs(d)
        jobs += ["--job", json.dumps({"stage": s, "bf16": False, "dir": d})]
    r = torchrun(2, ["train", *jobs], script=RUNNER, timeout=240 * len(STAGES))
    assert r.returncode == 0, r.log[-4000:]
    for d in dirs.values():
        a = _ranks(d, "train", 2)
        assert a[0]["persisted"] == [os.path.join(d, "ckpt", "iter_0000004")], a[0]
        assert all(g["fresh"] for g in a)  # nothing to load at the start
        for g in a:  # K=2 on two nodes: each node's memory holds both rank files of the last snapshot
            assert g["files"]["4"] == ["metadata.json", "rank_00000.safetensors", "rank_00001.safetensors"], g
            assert [s[2] for s in g["snapshots"]] == [False, True]  # persist interval 2
        shutil.rmtree(os.path.join(d, "mem_1"))  # node 1 is lost
        files = glob.glob(os.path.join(d, "ckpt", "iter_0000004", "rank_*.safetensors"))
        assert len(files) == 2
        for f in files:  # a read from the durable checkpoint would now fail
            open(f, "w").close()
    r = torchrun(4, ["resume", *jobs], script=RUNNER, timeout=240 * len(STAGES))
    assert r.returncode == 0, r.log[-4000:]
    for s, d in dirs.items():
        a, b = _ranks(d, "train", 2), _ranks(d, "resume", 4)
        for rank, g in enumerate(b):
            assert g["load"]["iteration"] == 4 and g["load"]["from_durable"] == 0, (s, rank, g["load"])
            assert g["load"]["source"] == {"tp": 1, "pp": 1, "dp": 2, "zero_stage": s}
            # node 0 holds everything; node 2 (ranks 2-3) joined empty and receives its part from node 0
            assert (g["load"]["received"] > 0) == (rank >= 2), (s, rank, g["load"])
            mine = g["mem"] + os.sep
            assert all(p.startswith(mine) for p in _opened(d, "resume", rank)), (s, rank)
            rebooted = g["mem"] + "_rebooted" + os.sep
            assert all(p.startswith(rebooted) for p in _opened(d, "rebooted", rank)), (s, rank)
        for rank, g in enumerate(a):
            assert all(p.startswith(g["mem"] + os.sep) for p in _opened(d, "train", rank)), (s, rank)
        want, got = a[0]["state"], b[0]["state"]
        assert got.keys() == want.keys()
        differ = [k for k in want if not torch.equal(torch.tensor(got[k]), torch.tensor(want[k]))]
        assert not differ, f"ZeRO-{s}: {len(differ)} tensors differ after the load, e.g. {differ[:3]}"
        assert sorted(b[0]["losses"]) == ["5", "6"]
        for step in ("5", "6"):  # fp32: only the reduction order changes with the DP size
            assert b[0]["losses"][step] == pytest.approx(a[0]["losses"][step], rel=2e-6), (s, step)
        assert b[0]["persisted"] == [os.path.join(d, "ckpt", "iter_0000006")], b[0]
        assert all(g["rebooted"] == ["LoadResult", 6, True] for g in b), [g["rebooted"] for g in b]
        assert b[0]["files"]["6"] == ["metadata.json", *(f"rank_{i:05d}.safetensors" for i in range(4))]
