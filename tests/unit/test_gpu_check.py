"""The GPU check's parts that need no GPU (``scripts/gpu_check.py`` and its steps, ``scripts/gpu_steps/``): the
carried-wheel list and its offline installation, process groups stopped on a clock, the pytest and metrics readers,
the bench's choice of systems, and the report (JSON, markdown table, log). The whole check's plumbing runs on the
CPU in ``tests/multiproc/test_gpu_check_dry_run.py``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zipfile

import pytest

from benchmarks.kit import mlm_checkout
from scripts import gpu_check as gc
from scripts.gpu_steps import gpu_bench, launch, mlm, pytest_gpu, resume
from scripts.gpu_steps import losses as resume_losses
from scripts.gpu_steps import wheels as carried_wheels
from tests.harness import ROOT


def _wheel(directory: str, name: str, version: str, body: str = "VALUE = 1\n") -> str:
    """A real (minimal, pure-Python) wheel file: one module and its dist-info."""
    path = os.path.join(directory, f"{name}-{version}-py3-none-any.whl")
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", body)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{name}.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def _imports(target: str, module: str) -> str:
    p = subprocess.run([sys.executable, "-S", "-c", f"import {module}; print({module}.VALUE, {module}.__file__)"],
                       env={"PYTHONPATH": target, "PATH": os.environ.get("PATH", "")}, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_the_wheel_list_is_the_tested_set() -> None:
    """gpu_wheels.txt, the script's header and requirements.txt agree; everything the steps import is carried."""
    pins = carried_wheels.read_wheel_list()
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        required = {carried_wheels.canonical(n): v for n, v in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", f.read(), re.M)}
    shared = set(pins) & set(required)
    assert {"megatron-core", "numpy", "psutil", "isal", "pytest"} <= shared
    assert {n: pins[n] for n in shared} == {n: required[n] for n in shared}
    assert set(carried_wheels.NEEDED) <= set(pins)
    with open(os.path.join(ROOT, "scripts", "gpu_check.sh")) as f:
        header = "".join(line for line in f if line.startswith("#"))
    listed = dict((carried_wheels.canonical(n), v) for n, v in re.findall(r"\b([a-z][a-z0-9_-]*)==([0-9][0-9.]*)\b", header))
    assert listed == pins


def test_wheel_names_and_versions() -> None:
    assert carried_wheels.wheel_name_version("megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.whl") == ("megatron-core",
                                                                                                    "0.16.1")
    assert carried_wheels.wheel_name_version("/x/psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.whl") == ("psutil", "7.2.2")
    with pytest.raises(ValueError, match="not a wheel"):
        carried_wheels.wheel_name_version("numpy-2.4.6.tar.gz")
    assert carried_wheels.version_key("2.4.6") > carried_wheels.version_key("1.26.4") and carried_wheels.version_key("26.4") > carried_wheels.version_key("24.2")
    assert carried_wheels.version_key("2.11.0+cu128") == (2, 11, 0) and carried_wheels.version_key("9.2.0rc1") == (9, 2, 0)


def test_wheels_unzip_where_there_is_no_pip(tmp_path) -> None:
    wheels, target = tmp_path / "whl", str(tmp_path / "site")
    wheels.mkdir()
    _wheel(str(wheels), "gpucheck_demo", "1.2.0")
    _wheel(str(wheels), "gpucheck_kept", "1.0.0")
    have = {"gpucheck-kept": "1.1", "numpy": "2.0.0"}.get  # the system's newer one wins; numpy comes from it
    rec = carried_wheels.install_wheels(str(wheels), target, have=have, python="/bin/false")  # `false -m pip` fails: no pip
    assert rec["method"] == "unzip (no pip)" and rec["pip_error"] == "failed"
    assert rec["installed"] == {"gpucheck-demo": "1.2.0"} and rec["system"] == {"gpucheck-kept": "1.1", "numpy": "2.0.0"}
    assert rec["missing"] == [n for n in carried_wheels.NEEDED if n != "numpy"]
    assert _imports(target, "gpucheck_demo").startswith(f"1 {target}")
    assert not os.path.exists(os.path.join(target, "gpucheck_kept.py"))


def test_wheels_install_with_pip_and_no_index(tmp_path) -> None:
    wheels, target = tmp_path / "whl", str(tmp_path / "site")
    wheels.mkdir()
    _wheel(str(wheels), "gpucheck_demo", "1.2.0", "VALUE = 7\n")
    rec = carried_wheels.install_wheels(str(wheels), target, have={"gpucheck-demo": "1.1.9"}.get)  # older: replaced
    assert rec["method"] == "pip --no-index --target" and rec["installed"] == {"gpucheck-demo": "1.2.0"}
    assert _imports(target, "gpucheck_demo").startswith("7 ")
    assert os.path.isdir(os.path.join(target, "gpucheck_demo-1.2.0.dist-info"))


def test_a_launch_past_its_time_is_stopped_with_its_children(tmp_path) -> None:
    pidfile = tmp_path / "child.pid"
    script = f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; " \
             f"time.sleep(60)']); open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(60)"
    slow = launch.Launch([sys.executable, "-c", script], dict(os.environ), str(tmp_path / "logs" / "slow.log"))
    fast = launch.Launch([sys.executable, "-c", "print('done')"], dict(os.environ), str(tmp_path / "logs" / "fast.log"))
    t0 = time.monotonic()
    launch.run_all([slow, fast], timeout=3)
    assert time.monotonic() - t0 < 30
    assert (slow.rc, fast.rc) == (124, 0)
    child = int(pidfile.read_text())
    for _ in range(50):  # the grandchild was in the stopped process group
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {child} of the stopped launch is still running")
    assert "stopped after 3 s" in open(slow.log).read() and "done" in open(fast.log).read()
    assert launch.outcome(slow)["status"] == "timeout" and launch.outcome(fast) == {"status": "pass", "seconds": fast.seconds}


def test_pytest_junit_counts(tmp_path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" '
                   'errors="1" failures="2" skipped="3" tests="10" time="1.0"></testsuite></testsuites>')
    assert pytest_gpu.parse_junit(str(xml)) == {"tests": 10, "failures": 2, "errors": 1, "skipped": 3, "passed": 4}


def test_losses_and_resaved_files(tmp_path) -> None:
    m = tmp_path / "m.jsonl"
    m.write_text("\n".join(json.dumps({"iteration": i, "loss": 4.0 + i}) for i in (4, 5, 6)) + "\n")
    losses = resume_losses.read_losses(str(m))
    assert losses == {4: 8.0, 5: 9.0, 6: 10.0} and resume_losses.read_losses(str(tmp_path / "none.jsonl")) == {}
    assert resume_losses.max_rel({4: 8.0, 5: 9.09}, {4: 8.0, 5: 9.0}, [4, 5]) == pytest.approx(0.01)
    assert resume_losses.max_rel(losses, {4: 8.0}, [4, 5]) is None
    for d in ("a", "b"):
        (tmp_path / d / "iter_0000003").mkdir(parents=True)
        (tmp_path / d / "iter_0000003" / "rank_00000.safetensors").write_bytes(b"same")
        (tmp_path / d / "iter_0000003" / "metadata.json").write_text(d)  # not compared: it records times, RNG
    a, b = resume.tree_digests(str(tmp_path / "a")), resume.tree_digests(str(tmp_path / "b"))
    assert list(a) == [os.path.join("iter_0000003", "rank_00000.safetensors")] and a == b


def test_the_trainer_load_line_is_read() -> None:
    line = ("> tenplex: loaded iteration 3 from /w/ckpt/iter_0000003: layout tp=2,pp=1,dp=1 -> tp=1,pp=1,dp=1, "
            "42 tensors, 1.25 MB read on rank 0 in 0.31 s (rng re-seeded: layout changed)")
    m = resume.LOADED.search(line)
    assert m is not None and (m.group(1), m.group(5), m.group(6)) == ("3", "1.25", "0.31")


def test_the_bench_drops_megatron_core_only_when_time_is_short() -> None:
    systems = ["staged", "direct", "mcore"]
    assert gpu_bench.bench_systems("gpt3-1.3b", systems, None, 100.0) == (systems, None)
    prev = (100.0, gpu_bench.SIZE_HINT["gpt3-1.3b"])  # 1.3B took 100 s: 2.7B needs ~2.0 x 1.15 of it
    assert gpu_bench.bench_systems("gpt3-2.7b", systems, prev, 300.0) == (systems, None)
    kept, note = gpu_bench.bench_systems("gpt3-2.7b", systems, prev, 200.0)
    assert kept == ["staged", "direct"] and note is not None and "without mcore (needs ~" in note
    kept, note = gpu_bench.bench_systems("gpt3-2.7b", systems, None, 900.0, free_gb=30.0)  # 2 x 18.6 GB do not fit
    assert kept == ["staged", "direct"] and note is not None and "GB of disk, 30 GB free" in note
    kept, note = gpu_bench.bench_systems("gpt3-2.7b", systems, None, 900.0, free_gb=15.0)
    assert kept == [] and note is not None and "not run" in note


def _report(mode: str) -> dict:
    loads = [{"transition": "2,1,1->4,1,1", "dst_bytes": 1_270_000_000, "pieces": 300, "budgets_mb": ["3", "256"],
              "direct_identical": True, "staged_3mb_identical": True, "staged_256mb_identical": True,
              "staged_gbps": 9.5, "direct_gbps": 2.25}]
    saves = [{"mode": "copy", "staging_mb": "256", "bytes": 1_270_000_000, "identical": True, "gbps": 3.5},
             {"mode": "direct", "staging_mb": None, "bytes": 1_270_000_000, "identical": True, "gbps": 1.5}]
    case = {"from": "tp2pp1dp1", "to": "tp1pp1dp1", "dtype": "bf16", "status": "fail", "device_vs_cpu": 0.031,
            "cpu_vs_uninterrupted": 1e-7, "resave_identical": True, "load_seconds": 0.4,
            "why": "device loss differs from the CPU's by more than 0.02"}
    bench = {"status": "pass", "seconds": 120.0, "systems": ["staged", "direct", "mcore"], "model": "gpt3-1.3b",
             "transition": "tp2pp1-tp4pp1", "dst_bytes": 4_650_000_000, "storage_read_gbps": 2.0, "h2d_gbps": 25.0,
             "staged_warm_gbps": 12.0, "staged_cold_gbps": 1.8, "direct_warm_gbps": 3.0, "direct_cold_gbps": 1.5,
             "mcore_warm_gbps": 1.0, "mcore_cold_gbps": 0.8, "identical": {"direct==staged": True, "mcore==staged": True}}
    return {"version": 1, "mode": mode, "device": "cuda:0", "budget_s": 530.0, "seconds": 501.0, "ok": False,
            "steps": {"wheels": {"status": "pass", "seconds": 4.0, "installed": {"megatron-core": "0.16.1"},
                                 "system": {"numpy": "2.1.0"}, "missing": []},
                      "env": {"status": "pass", "seconds": 6.0, "python": "3.12.3", "torch": "2.11.0+cu128",
                              "torch_cuda": "12.8", "gpu": "NVIDIA H200", "megatron-core": "0.16.1"},
                      "pytest": {"status": "pass", "seconds": 40.0, "tests": 24, "passed": 24, "failures": 0,
                                 "errors": 0, "skipped": 0},
                      "identity": {"status": "pass", "seconds": 30.0, "model": "gpt3-350m", "loads": loads,
                                   "saves": saves, "ok": True},
                      "resume": {"status": "fail", "seconds": 50.0, "steps": [4, 5, 6], "cases": {"tp2-bf16": case}},
                      "bench": {"status": "pass", "seconds": 120.0, "models": {"gpt3-1.3b": bench,
                                                                               "gpt3-2.7b": {"status": "not run",
                                                                                             "why": "12 s left"}}}}}


def test_the_report_has_every_figure(tmp_path) -> None:
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    (work / "logs" / "02-pytest.log").write_text("$ pytest\n" + "x" * 20_000 + "\nLAST LINE\n")
    report = _report("gpu")
    paths = gc.write_report(report, str(tmp_path / "out"), str(work))
    assert sorted(os.listdir(tmp_path / "out")) == sorted([gc.JSON_NAME, gc.TABLE_NAME, gc.LOG_NAME])
    assert json.loads(open(paths[0]).read()) == report
    md = open(paths[1]).read()
    assert "not GPU figures" not in md and "result: **FAIL**" in md and "NVIDIA H200" in md
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    checks = [r.split(" | ")[0][2:] for r in rows]
    assert checks == ["carried wheels", "environment", "`pytest -m gpu tests/gpu`",
                      "parallel and staged load == direct == CPU, 2,1,1->4,1,1", "staged save == CPU file",
                      "identity step",
                      "resume tp2-bf16: tp2pp1dp1 (CPU) -> tp1pp1dp1 on the device", "resume step",
                      "bench gpt3-1.3b", "bench gpt3-2.7b"]
    assert all(r.count(" | ") == 3 for r in rows)  # no figure breaks the table
    text = "\n".join(rows)
    for figure in ("installed: megatron-core 0.16.1; the system's: numpy 2.1.0", "24 passed, 0 failed",
                   "1.270 GB, 300 pieces; identical at 3mb, 256mb; parallel - GB/s, staged 9.50 GB/s, direct 2.25 GB/s",
                   "ring 3.50 GB/s, direct 1.50 GB/s", "max rel diff vs CPU 3.1e-02 (tol 0.02)",
                   "staged 12.00/1.80, direct 3.00/1.50, mcore 1.00/0.80", "staged cold / limit 0.90",
                   "| not run |", "12 s left"):
        assert figure in text, figure
    log = open(paths[2]).read()
    assert "===== 02-pytest.log" in log and "LAST LINE" in log and len(log) < 14_000


def test_a_dry_run_report_says_it_is_not_a_gpu_one(tmp_path) -> None:
    report = _report("cpu-dry-run")
    report["steps"] = {"env": report["steps"]["env"]}
    paths = gc.write_report(report, str(tmp_path))
    assert len(paths) == 2 and "plumbing only, these are not GPU figures" in open(paths[1]).read()


def test_the_shell_entry_point_parses(tmp_path) -> None:
    sh = os.path.join(ROOT, "scripts", "gpu_check.sh")
    assert subprocess.run(["bash", "-n", sh]).returncode == 0
    assert os.access(sh, os.X_OK)
    p = subprocess.run(["bash", sh, "--help"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert p.returncode == 0 and "--cpu-dry-run" in p.stdout and "OUTDIR" in p.stdout.upper()


def test_options() -> None:
    o = gc.parse_args(["--device", "cuda"])
    assert o.device == "cuda:0" and o.models == list(gc.MODELS) and o.systems == ["parallel", "staged", "direct",
                                                                                  "mcore"]
    o = gc.parse_args(["/x", "--cpu-dry-run", "--cases", "tp2"])
    assert (o.outdir, o.device, o.models, o.systems, o.cases) == ("/x", "cpu", ["tiny"], ["parallel", "staged", "direct"],
                                                                  ["tp2"])


def test_the_resumed_run_sees_the_device_asked_for() -> None:
    assert launch.visible_device("cuda:0", None) == "0" and launch.visible_device("cuda:3", None) == "3"
    assert launch.visible_device("cuda:1", "4,6") == "6" and launch.visible_device("cuda:0", "GPU-5e3f") == "GPU-5e3f"
    with pytest.raises(ValueError, match="shows 2 device"):
        launch.visible_device("cuda:2", "4,6")


def test_the_mlm_step_finds_its_checkout_or_says_why_not(tmp_path) -> None:
    mlm = tmp_path / "mlm"
    assert mlm_checkout.mlm_checkout(str(mlm), {})[0] is None and "lacks pretrain_gpt.py" in mlm_checkout.mlm_checkout(str(mlm), {})[1]
    (mlm / "megatron" / "training").mkdir(parents=True)
    (mlm / "pretrain_gpt.py").write_text("")
    found, why = mlm_checkout.mlm_checkout(None, {"MEGATRON_LM_PATH": str(mlm)})
    assert found is None and f"MEGATRON_LM_PATH {mlm} lacks megatron/legacy" == why
    (mlm / "megatron" / "legacy").mkdir()
    assert mlm_checkout.mlm_checkout(None, {"MEGATRON_LM_PATH": str(mlm)}) == (str(mlm), None)
    assert mlm_checkout.mlm_checkout(str(mlm), {"MEGATRON_LM_PATH": "/nonexistent"}) == (str(mlm), None)  # the flag first
    if not os.path.isdir(os.path.join(ROOT, ".mlm")):
        found, why = mlm_checkout.mlm_checkout(None, {})
        assert found is None and "--megatron-lm" in why and "make gpu-mlm" in why
    (mlm / "megatron" / "core").mkdir()
    (mlm / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 16\nPATCH = 1\n")
    assert mlm_checkout.mlm_release(str(mlm)) == (0, 16)


def test_the_mlm_step_skips_without_a_checkout_and_reports_a_row(tmp_path) -> None:
    opts = gc.parse_args([str(tmp_path), "--cpu-dry-run", "--steps", "mlm", "--megatron-lm", str(tmp_path / "none")])
    result = mlm.step_mlm(opts, launch.Clock(100))
    assert result["status"] == "skip" and str(tmp_path / "none") in result["why"]
    report = {"version": 1, "mode": "gpu", "device": "cuda:0", "budget_s": 530, "seconds": 3, "ok": False,
              "steps": {"mlm": {"status": "fail", "seconds": 90, "checkout": "/m", "from": "tp2pp1dp1",
                                "to": "tp1pp1dp1", "dtype": "bf16", "steps": [4, 5, 6], "tolerance": 0.02,
                                "device_vs_cpu": 0.03, "why": "device loss differs"}}}
    (row,) = gc.table_rows(report)
    assert row[:3] == ("Megatron-LM resume", "fail", "90") and "3.0e-02 (tol 0.02)" in row[3] and "(/m)" in row[3]
    report["steps"]["mlm"] = result
    assert gc.table_rows(report)[0][1:] == ("skip", "-", result["why"])


def test_megatron_lm_losses_undo_the_second_line_mean() -> None:
    log = "".join(f" iteration        {i}/       6 | consumed samples:           {8 * i} | elapsed: 1 | lm loss: "
                  f"{loss:E} |\n" for i, loss in ((4, 4.0), (5, 3.5), (6, 3.0)))
    assert mlm.mlm_losses(log, (0, 16)) == {4: 4.0, 5: 3.0, 6: 3.0}
    assert mlm.mlm_losses(log, (0, 15)) == {4: 4.0, 5: 3.5, 6: 3.0}
