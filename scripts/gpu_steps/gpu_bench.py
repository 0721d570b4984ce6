"""The GPU check's ``bench`` step: ``python -m benchmarks.gpu_reshard --device cuda:0`` at GPT-3 1.3B and 2.7B, one
model per process (2.7B without megatron-core's dist_checkpointing when the time left would not hold it)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from typing import Any

from scripts.gpu_steps.cells import gbps, secs, why_text
from scripts.gpu_steps.launch import Clock, outcome, python_step

MODELS = ("gpt3-1.3b", "gpt3-2.7b")

#: relative size of each model's share (source files of rank 0 of TP4 from TP2: 1.3B 9.24 GB, 2.7B 18.60 GB)
SIZE_HINT = {"gpt3-1.3b": 9.24, "gpt3-2.7b": 18.60, "tiny": 0.001}


def bench_systems(model: str, systems: list[str], prev: tuple[float, float] | None, left: float,
                  free_gb: float = math.inf) -> tuple[list[str], str | None]:
    """The systems to measure ``model`` with: all, unless megatron-core's would not fit in the ``left`` seconds,
    judged by the last model measured with all of them (``prev``: its seconds and :data:`SIZE_HINT`) scaled by
    size, or its copy of the files (as large as tenplex's) would not fit in ``free_gb`` of disk; then without
    ``mcore`` (its save and loads take the longest), and a note saying why. No systems: not even tenplex's
    files fit."""
    size = SIZE_HINT.get(model, 1.0)
    if size * 1.1 + 1 > free_gb:
        return [], f"{model}: not run (its files need ~{size * 1.1 + 1:.0f} GB of disk, {free_gb:.0f} GB free)"
    if "mcore" not in systems:
        return systems, None
    if 2 * size * 1.1 + 1 > free_gb:
        return [s for s in systems if s != "mcore"], (f"{model}: without mcore (two copies of the files need "
                                                       f"~{2 * size * 1.1 + 1:.0f} GB of disk, {free_gb:.0f} GB free)")
    if prev is None:
        return systems, None
    need = prev[0] * size / prev[1] * 1.15
    if need <= left:
        return systems, None
    return [s for s in systems if s != "mcore"], f"{model}: without mcore (needs ~{need:.0f} s, {left:.0f} s left)"


def step_bench(opts: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """``benchmarks.gpu_reshard`` one model per process (a model that runs out of time costs only itself); the 2.7B
    run keeps megatron-core's system only when the 1.3B run's time, scaled by size, fits in what is left."""
    t0 = time.monotonic()
    models = list(opts.models)
    out: dict[str, Any] = {"models": {}}
    bench_dir = os.path.join(opts.work, "bench")
    os.makedirs(bench_dir, exist_ok=True)
    prev: tuple[float, float] | None = None  # (seconds, SIZE_HINT) of the last model run with every system
    for model in models:
        left = clock.left()
        systems, note = bench_systems(model, list(opts.systems), prev, left,
                                      shutil.disk_usage(bench_dir).free / 1e9)
        if note:
            out.setdefault("notes", []).append(note)
        if left < 30 or not systems:
            out["models"][model] = {"status": "not run", "why": note if not systems else
                                    f"{left:.0f} s left of the budget"}
            continue
        result = os.path.join(opts.work, f"bench-{model}.json")
        launch = python_step(["-m", "benchmarks.gpu_reshard", "--device", opts.device,
                              "--models", model, "--reps", str(opts.reps), "--systems", *systems, "--dir", bench_dir,
                              "--out", result], opts.work, f"bench-{model}", opts.site, opts.cpu_dry_run, left)
        row = outcome(launch)
        row["systems"] = systems
        if os.path.exists(result):
            with open(result) as f:
                data = json.load(f)
            if data["rows"]:
                row.update(data["rows"][0])
                out.setdefault("device_name", data.get("device"))
        errors = [k for k in row if k.endswith("_error")]
        if row["status"] == "pass" and (errors or not all(row.get("identical", {}).values()) or not row.get("identical")):
            row.update(status="fail", why="; ".join([*(f"{k}: {row[k]}" for k in errors),
                                                      *(f"{k}: different bytes" for k, v in
                                                        row.get("identical", {}).items() if not v)]) or "no check")
        if row["status"] == "pass" and systems == list(opts.systems):
            prev = (launch.seconds, float(SIZE_HINT.get(model, 1.0)))
        out["models"][model] = row
    statuses = {r["status"] for r in out["models"].values()}
    out["status"] = next((s for s in ("fail", "timeout", "not run") if s in statuses), "pass" if statuses else "not run")
    out["seconds"] = time.monotonic() - t0
    return out


def rows(b: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The bench's lines of the table: each model, then its notes."""
    rows: list[tuple[str, str, str, str]] = []
    for model, m in b.get("models", {}).items():
        if "dst_bytes" not in m:
            rows.append((f"bench {model}", m["status"], secs(m), why_text(m).strip(" ()") or "-"))
            continue
        limit = min(m.get("parallel_cold_read_gbps", m.get("storage_read_gbps", math.inf)),
                    m.get("h2d_gbps", math.inf))
        which = "parallel" if "parallel_cold_gbps" in m else "staged"
        cold = m.get(f"{which}_cold_gbps")
        figs = (f"{m['transition']}, {m['dst_bytes'] / 1e9:.2f} GB; storage {gbps(m.get('storage_read_gbps'))}, "
                f"h2d {gbps(m.get('h2d_gbps'))} GB/s; warm/cold GB/s: " + ", ".join(
                    f"{s} {gbps(m.get(f'{s}_warm_gbps'))}/{gbps(m.get(f'{s}_cold_gbps'))}"
                    for s in m.get("systems", [])) +
                (f"; {which} cold / limit {cold / limit:.2f}" if cold and limit != math.inf else "") +
                f"; identical: {m.get('identical')}")
        rows.append((f"bench {model}", m["status"], secs(m), figs + why_text(m)))
    for note in b.get("notes", []):
        rows.append(("bench note", "-", "-", note))
    return rows
