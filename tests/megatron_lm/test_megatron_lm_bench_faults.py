"""``python -m benchmarks.faults --megatron-lm DIR``: Megatron-LM's own script through the process restart and the
in-place rows (rank 3, rank 0 SIGKILLed): the rows come out sane (nothing lost beyond the snapshot interval, every
byte from host memory, the survivors in their own processes) with each in-place row's ratio to the process restart
of the same run. No timing threshold: a benchmark measures, its test checks the rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.megatron_lm.test_megatron_lm import MLM
from tests.megatron_lm.test_megatron_lm_inprocess import unavailable

pytestmark = [pytest.mark.megatron_lm,
              pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_faults_megatron_lm_rows(tmp_path) -> None:
    if unavailable():
        pytest.skip(unavailable())
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "benchmarks.faults", "--megatron-lm", MLM, "--faults",
                        "mlm-restart@rank3", "--out", str(out), "--keep", str(tmp_path / "runs")], env=env,
                       capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads(out.read_text())
    restart, *inplace = got["rows"]
    assert restart["fault"] == "SIGKILL rank 3, Megatron-LM process restart" and not restart["in_place"], restart
    assert [r["fault"] for r in inplace] == ["SIGKILL rank 3, Megatron-LM in place (NVRx)",
                                             "SIGKILL rank 0, Megatron-LM in place (NVRx)"]
    for r in got["rows"]:
        assert r["checkpoints_lost"] == 0 and r["iterations_lost_beyond_interval"] == 0, r
        assert r["iterations_lost"] == 1, r  # the victim died writing its snapshot of iteration 3: back to 2
        assert r["durable_mb_rank0"] == 0 and r["seconds_to_first_iteration"] > 0, r
        assert "did not reach" not in r["note"], r
    for r in inplace:
        assert r["survivors_kept"] and "survivors' processes kept" in r["note"] and "TP1 x DP2" in r["note"], r
        assert not r["survivors_ended"], r  # no survivor stuck in a gloo operation: the abort ended them all
        assert r["ratio_to_restart"] == pytest.approx(r["seconds_to_first_iteration"] /
                                                      restart["seconds_to_first_iteration"]), r
        name = r["fault"].split(",")[0].replace(" ", "_")
        assert f"RATIO in_place_over_restart mlm_{name} = {r['ratio_to_restart']:.2f} (target <= 0.25)" in p.stdout
