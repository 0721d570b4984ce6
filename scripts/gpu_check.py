"""The GPU check (issue #33): everything the plugin does on a CUDA device, in one command, with one report.

Run through ``scripts/gpu_check.sh`` (which says what the machine needs); each step runs in its own process
group with its own time limit, so a crash or a hang costs only that step, and the whole check stays within
``--budget`` seconds (default 530: under 9 minutes, so a 10-minute command limit leaves time to copy the report):

  wheels    the wheels carried in ``.whl/`` installed into a private directory (pip ``--no-index``, or unzipped
            where there is no pip): only those the system lacks or has older; nothing from the network
  env       python, torch, CUDA, the GPU, megatron-core and the carried packages as the steps will import them
  pytest    ``pytest -m gpu tests/gpu`` with the system's torch
  identity  staged load and save on the device byte-identical to the direct path and the CPU (``gpu_check_steps.py``)
  snapshot  a host-memory rank file written from device tensors through the pinned ring, byte-identical
  resume    tiny GPT checkpoints saved on the CPU (CUDA hidden, 2 gloo ranks, the reference trainer) at TP2, PP2,
            DP2 and TP2 bf16, resumed at world size 1 on the device and on the CPU: losses of steps 4-6 equal
            within fp32/bf16 tolerance, and the state re-saved right after the load byte-identical
  bench     ``python -m benchmarks.gpu_reshard --device cuda:0`` at GPT-3 1.3B and 2.7B (2.7B without megatron-core's
            dist_checkpointing when the time left would not hold it)
  mlm       Megatron-LM's own ``pretrain_gpt.py`` (a copy patched with ``patches/``, ``--tenplex``, bf16, the
            distributed optimizer, ``--transformer-impl local``) saves a TP2 checkpoint on the CPU (CUDA hidden, 2
            gloo ranks, run through ``tests/megatron_lm/run_megatron_lm.py``), resumed at world size 1 on the device
            and on the CPU: losses of steps 4-6 equal within bf16 tolerance. Needs a Megatron-LM checkout
            (``--megatron-lm DIR``, else MEGATRON_LM_PATH, else ``.mlm/``): its ``pretrain_gpt.py`` and the modules
            beside it, ``megatron/training`` and ``megatron/legacy``; without one the step reports skip

Each step is a module of ``scripts/gpu_steps/`` (its run and its lines of the table); this script keeps the step
list, the options, the order the steps run in and the report. It imports them from the checkout: ``gpu_check.sh``
(and the Makefile) put the checkout on ``PYTHONPATH``.

Writes ``gpu_check.json`` (every figure), ``gpu_check.md`` (the table) and ``gpu_check.log`` (each step's
command and the end of its output) to OUTDIR. ``--cpu-dry-run``: the same steps on the CPU with CUDA hidden
from every process (tiny sizes, nothing installed), to exercise the plumbing where there is no GPU; its
figures are not GPU figures and its report says so. Exit status 0 when every step passed (a dry run: when
none failed).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from scripts.gpu_steps import env, gpu_bench, mlm, pytest_gpu, resume, torch_checks, wheels
from scripts.gpu_steps.gpu_bench import MODELS
from scripts.gpu_steps.launch import ROOT, Clock
from scripts.gpu_steps.resume import CASES

REPORT_VERSION = 1
JSON_NAME, TABLE_NAME, LOG_NAME = "gpu_check.json", "gpu_check.md", "gpu_check.log"
STEPS = ("wheels", "env", "pytest", "identity", "snapshot", "resume", "bench", "mlm")
LOG_TAIL = 12_000  # characters of each step's output kept in gpu_check.log


def table_rows(report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(check, status, seconds, figures) for each line of the table: each step's lines, in the steps' order."""
    rows_of: dict[str, Callable[[dict[str, Any]], list[tuple[str, str, str, str]]]] = {
        "wheels": wheels.rows, "env": env.rows, "pytest": pytest_gpu.rows, "identity": torch_checks.identity_rows,
        "snapshot": torch_checks.snapshot_rows, "resume": resume.rows, "bench": gpu_bench.rows, "mlm": mlm.rows}
    steps = report["steps"]
    return [row for name in STEPS if name in steps for row in rows_of[name](steps[name])]


def render_table(report: dict[str, Any]) -> str:
    """The markdown report: what ran where, then one line per check."""
    env = report["steps"].get("env", {})
    head = [f"# tenplex-megatron GPU check ({report['mode']})", ""]
    if report["mode"] != "gpu":
        head += ["**A dry run on the CPU (CUDA hidden): plumbing only, these are not GPU figures.**", ""]
    head += [f"Device {report['device']} ({env.get('gpu', 'no GPU')}); torch {env.get('torch', '?')}; "
             f"{report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget; result: "
             f"**{'PASS' if report['ok'] else 'FAIL'}**", "", "| check | result | s | figures |", "|---|---|---|---|"]
    body = [f"| {c} | {s} | {t} | {f.replace('|', '/')} |" for c, s, t, f in table_rows(report)]
    return "\n".join(head + body) + "\n"


def write_report(report: dict[str, Any], outdir: str, work: str | None = None) -> list[str]:
    """``gpu_check.json``, ``gpu_check.md`` and (with ``work``) ``gpu_check.log`` in ``outdir``; their paths."""
    os.makedirs(outdir, exist_ok=True)
    paths = [os.path.join(outdir, n) for n in (JSON_NAME, TABLE_NAME)]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(paths[1], "w") as f:
        f.write(render_table(report))
    if work is not None:
        paths.append(os.path.join(outdir, LOG_NAME))
        with open(paths[2], "w") as f:
            for log in sorted(glob.glob(os.path.join(work, "logs", "*.log"))):
                with open(log, errors="replace") as g:
                    text = g.read()
                cut = text if len(text) <= LOG_TAIL else text[:400] + "\n[...]\n" + text[-LOG_TAIL:]
                f.write(f"===== {os.path.basename(log)} ({len(text)} characters)\n{cut}\n")
    return paths


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, with the defaults that depend on the mode filled in (the device always with an index)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", nargs="?", default=os.path.join(ROOT, "out", "gpu-check"),
                    help="where the report goes (default out/gpu-check)")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the steps on the CPU, CUDA hidden, tiny sizes")
    ap.add_argument("--device", default=None, help="default cuda:0 (cpu in a dry run)")
    ap.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--models", nargs="+", default=None, help=f"bench models (default {' '.join(MODELS)}; dry run: tiny)")
    ap.add_argument("--systems", nargs="+", default=None, help="bench systems (default parallel staged direct mcore; "
                    "dry run: parallel staged direct)")
    ap.add_argument("--megatron-lm", default=None, help="the Megatron-LM checkout of the mlm step (default: "
                    "MEGATRON_LM_PATH, else .mlm/)")
    ap.add_argument("--reps", type=int, default=1, help="bench repetitions per system")
    ap.add_argument("--budget", type=float, default=530.0, help="seconds for the whole check (default 530)")
    ap.add_argument("--wheels", default=os.path.join(ROOT, ".whl"), help="the carried wheels (default .whl/)")
    ap.add_argument("--install-wheels", action="store_true", help="install the carried wheels in a dry run too "
                    "(a GPU run always does): a CPU Python with only torch then meets the steps as a GPU one would")
    ap.add_argument("--work", default=None, help="scratch directory (default: a new one under the temp directory)")
    opts = ap.parse_args(argv)
    opts.device = opts.device or ("cpu" if opts.cpu_dry_run else "cuda:0")
    if opts.device == "cuda":
        opts.device = "cuda:0"  # an explicit index for every CUDA call
    opts.models = opts.models or (["tiny"] if opts.cpu_dry_run else list(MODELS))
    opts.systems = opts.systems or (["parallel", "staged", "direct"] if opts.cpu_dry_run
                                    else ["parallel", "staged", "direct", "mcore"])
    return opts


def main(argv: list[str] | None = None) -> int:
    """Run the chosen steps in order within the budget, always write the report; 0 when the check passed."""
    opts = parse_args(argv)
    clock = Clock(opts.budget)
    own_work = opts.work is None
    opts.work = tempfile.mkdtemp(prefix="tenplex-gpu-check-") if own_work else opts.work
    os.makedirs(opts.work, exist_ok=True)
    opts.site = None
    report: dict[str, Any] = {"version": REPORT_VERSION, "mode": "cpu-dry-run" if opts.cpu_dry_run else "gpu",
                              "device": opts.device, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "budget_s": opts.budget, "argv": sys.argv[1:] if argv is None else argv, "steps": {}}
    steps: dict[str, Callable[[argparse.Namespace, Clock], dict[str, Any]]] = {
        "env": env.step_env, "pytest": pytest_gpu.step_pytest,
        "identity": lambda o, c: torch_checks.step_torch("identity", o, c),
        "snapshot": lambda o, c: torch_checks.step_torch("snapshot", o, c), "resume": resume.step_resume,
        "mlm": mlm.step_mlm, "bench": gpu_bench.step_bench}
    try:
        for name in STEPS:
            if name not in opts.steps:
                continue
            t0 = time.monotonic()
            if name != "wheels" and clock.left() < 5:
                result = {"status": "not run", "why": "the budget is spent"}
            else:
                try:
                    result = wheels.wheels_step(opts) if name == "wheels" else steps[name](opts, clock)
                except Exception as e:  # the check's own failure: reported, the next steps still run
                    result = {"status": "fail", "why": f"{type(e).__name__}: {e}"}
            result.setdefault("seconds", time.monotonic() - t0)
            report["steps"][name] = result
            print(f"gpu_check: {name}: {result['status']} ({result['seconds']:.0f} s)"
                  + (f": {result['why']}" if result.get("why") else ""), flush=True)
            if name in ("wheels", "env") and result["status"] == "fail":
                break  # nothing after it can run
    finally:
        bad = {"fail", "timeout"} if opts.cpu_dry_run else {"fail", "timeout", "skip", "not run"}
        report["seconds"] = time.monotonic() - clock.start
        report["ok"] = bool(report["steps"]) and not any(s["status"] in bad for s in report["steps"].values()) and \
            all(n in report["steps"] for n in opts.steps)
        paths = write_report(report, opts.outdir, opts.work)
        if own_work:
            shutil.rmtree(opts.work, ignore_errors=True)
    print(open(paths[1]).read(), end="")
    print(f"gpu_check: {'PASS' if report['ok'] else 'FAIL'}; report in {', '.join(paths)}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
