"""``scripts/gpu_check.sh --cpu-dry-run`` end to end on the CPU (CUDA hidden from every process it starts): every
step's plumbing as a GPU session would run it, at tiny sizes, one resume case (a TP2 checkpoint made by two gloo
ranks, resumed at world size 1 on the "device", here the CPU, and on the CPU), and the report it leaves.

What this cannot show is anything about a GPU: the report says so, and the GPU tests are counted as skipped, not
passed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # make test-bench runs it (make test's budget)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, str]:
    out = str(tmp_path_factory.mktemp("gpu-check-out"))
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), out, "--cpu-dry-run", "--cases", "tp2",
                        "--work", str(tmp_path_factory.mktemp("gpu-check-work"))],
                       env=env, capture_output=True, text=True, timeout=400)
    return p, out


def test_every_step_runs_and_passes_or_says_why_not(dry_run) -> None:
    p, out = dry_run
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert sorted(os.listdir(out)) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]  # few files to bring back
    report = json.load(open(os.path.join(out, "gpu_check.json")))
    steps = report["steps"]
    assert report["mode"] == "cpu-dry-run" and report["ok"] and list(steps) == [
        "wheels", "env", "pytest", "identity", "snapshot", "resume", "bench", "mlm"]
    # Megatron-LM's own script needs a checkout (MEGATRON_LM_PATH or .mlm/): without one, a skip naming the way
    mlm = steps["mlm"]
    if not (os.environ.get("MEGATRON_LM_PATH") or os.path.isdir(os.path.join(ROOT, ".mlm"))):
        assert mlm["status"] == "skip" and "--megatron-lm" in mlm["why"], mlm
    else:
        assert mlm["status"] == "pass" and mlm["device_vs_cpu"] is not None, mlm
    assert steps["wheels"]["status"] == "skip" and steps["env"]["status"] == "pass"
    assert steps["env"]["cuda_available"] is False and steps["env"]["megatron-core"]
    # the GPU tests were collected without megatron-core's unit modules, and all skipped: not counted as passing
    pt = steps["pytest"]
    assert pt["status"] == "skip" and pt["tests"] == pt["skipped"] >= 20 and pt["passed"] == 0


def test_staged_load_save_and_snapshot_are_byte_identical(dry_run) -> None:
    steps = json.load(open(os.path.join(dry_run[1], "gpu_check.json")))["steps"]
    ident = steps["identity"]
    assert ident["status"] == "pass" and ident["ok"] and len(ident["loads"]) == 2 and len(ident["saves"]) == 7
    for row in ident["loads"]:
        flags = {k: v for k, v in row.items() if k.endswith("_identical")}
        assert len(flags) == 7 and all(flags.values()), row  # direct, and staged and parallel at three budgets
    snap = steps["snapshot"]
    assert snap["status"] == "pass" and [r["mode"] for r in snap["rows"]] == ["auto", "copy", "direct"]
    assert all(r["identical"] and r["gbps"] > 0 for r in snap["rows"])


def test_the_resume_case_continues_on_the_device_as_on_the_cpu(dry_run) -> None:
    steps = json.load(open(os.path.join(dry_run[1], "gpu_check.json")))["steps"]
    res = steps["resume"]
    case = res["cases"]["tp2"]
    assert res["status"] == "pass" and case["status"] == "pass" and res["steps"] == [4, 5, 6]
    assert (case["from"], case["to"], case["loaded_iteration"]) == ("tp2pp1dp1", "tp1pp1dp1", 3)
    assert all(isinstance(x, float) for x in case["device_losses"] + case["cpu_losses"] + case["ref_losses"])
    assert case["device_losses"] == case["cpu_losses"]  # here the "device" is the CPU: the same computation
    assert case["cpu_vs_uninterrupted"] <= 2e-6  # the CPU suite's own oracle
    assert case["resave_identical"] and case["resave_files"] >= 1


def test_the_bench_runs_and_the_table_says_it_is_no_gpu_figure(dry_run) -> None:
    p, out = dry_run
    bench = json.load(open(os.path.join(out, "gpu_check.json")))["steps"]["bench"]["models"]["tiny"]
    assert bench["status"] == "pass" and bench["identical"] == {
        "staged==parallel": True, "direct==parallel": True,
        **{f"{k} {s}==parallel": True for k in ("save", "snapshot") for s in ("staged", "direct")}}
    assert bench["parallel_cold_gbps"] > 0 and bench["staged_cold_gbps"] > 0 and bench["direct_warm_gbps"] > 0
    md = open(os.path.join(out, "gpu_check.md")).read()
    assert "plumbing only, these are not GPU figures" in md and "result: **PASS**" in md
    assert "| resume tp2: tp2pp1dp1 (CPU) -> tp1pp1dp1 on the device | pass |" in md
    log = open(os.path.join(out, "gpu_check.log")).read()
    names = re.findall(r"^===== (\d\d)-(\S+)\.log", log, re.M)
    assert [n for _, n in names] == ["env", "pytest", "identity", "snapshot", "resume-tp2-make", "resume-tp2-cpu",
                                     "resume-tp2-device", "bench-tiny"]  # in the order they ran
    assert "torch.distributed.run" in log
    assert "gpu_check: PASS" in p.stdout
