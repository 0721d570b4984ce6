"""No rank can hang on an error: every collective phase of save and load runs through the phase runner.

One torchrun launch (two ranks, the engine with tiny tensors, no model) injects
a ``TypeError`` (a type no code path expects) at every fault point on rank 0
and on rank 1 in turn. Every rank must raise one ``RankFailure`` naming the
failing rank, the exception type and its message, within seconds; a failed save
leaves the previous checkpoint the newest complete one; a failed load before
the copy leaves the destination untouched. A second launch lets the error
escape: every rank exits non-zero within 60 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tenplex_megatron.storage.faults import POINTS, RANK0_ONLY
from tests.harness import ROOT

pytestmark = pytest.mark.dist
RUNNER = os.path.join(ROOT, "tests", "multiproc", "engine_run.py")
CASES = [(p, r) for p in POINTS for r in (0, 1) if not (p in RANK0_ONLY and r != 0)]


def _launch(mode: str, arg: str, fault: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("TENPLEX_FAULT", None)
    if fault:
        env["TENPLEX_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", RUNNER, mode, arg]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("faults") / "res")
    p = _launch("faults", out, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return [json.load(open(f"{out}.rank{r}.json")) for r in (0, 1)]


@pytest.mark.parametrize("point,failing", CASES, ids=[f"{p}@{r}" for p, r in CASES])
def test_unexpected_error_reaches_every_rank(results: list[dict], point: str, failing: int) -> None:
    for rank, res in enumerate(results):
        got = res[f"{point}@{failing}"]
        assert got["raised"] == "RankFailure", (rank, got)
        assert list(got["failures"]) == [str(failing)], (rank, got)  # only the failing rank is named
        assert got["failures"][str(failing)].startswith(f"TypeError: injected unexpected TypeError at {point}")
        assert f"rank {failing}: TypeError" in got["message"]
        assert got["seconds"] < 30, got  # no rank waited for a collective timeout
        if point.startswith("save."):
            assert got["newest_complete"] == [1], got  # the previous checkpoint is still the newest complete one
        elif point in ("load.read", "load.verify"):
            assert got["untouched"], got  # failed before any rank copied a byte


def test_a_good_save_after_the_failures_cleans_up_and_loads(results: list[dict]) -> None:
    for res in results:
        assert res["final"]["equal"] and res["final"]["it"] == 100 and res["final"]["partials"] == []
    assert any(p.endswith(".tenplex-partial") for p in results[0]["final"]["removed"])


def test_uncaught_error_ends_every_rank_fast(tmp_path) -> None:
    t0 = time.perf_counter()
    p = _launch("uncaught", str(tmp_path), fault="save.metadata_callback@0:typeerror", timeout=90)
    assert p.returncode != 0
    assert time.perf_counter() - t0 < 60
    log = p.stdout + p.stderr
    # both ranks raised the same error naming rank 0 (each prints its own traceback)
    assert log.count("rank 0: TypeError: injected unexpected TypeError at save.metadata_callback") >= 2, log[-4000:]
