"""The GPU check's ``identity`` and ``snapshot`` steps: ``scripts/gpu_check_steps.py`` in a process of its own (staged
load and save on the device byte-identical to the direct path and the CPU; a host-memory rank file written from
device tensors through the pinned ring)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from scripts.gpu_steps.cells import gbps, secs, why_text
from scripts.gpu_steps.launch import ROOT, Clock, outcome, python_step


def step_torch(name: str, opts: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """``identity`` or ``snapshot``: ``gpu_check_steps.py`` in its own process."""
    result = os.path.join(opts.work, f"{name}.json")
    args = [os.path.join(ROOT, "scripts", "gpu_check_steps.py"), name, "--device", opts.device, "--work", opts.work,
            "--out", result]
    launch = python_step(args, opts.work, name, opts.site, opts.cpu_dry_run, clock.limit(name))
    out = outcome(launch)
    if os.path.exists(result):
        with open(result) as f:
            out.update(json.load(f))
    return out


def identity_rows(d: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The identity step's lines of the table: each load, the saves, the step."""
    rows: list[tuple[str, str, str, str]] = []
    for r in d.get("loads", []):
        same = [k.split("_")[1] for k, v in r.items() if k.startswith("staged_") and k.endswith("identical") and v]
        rows.append((f"parallel and staged load == direct == CPU, {r['transition']}", "pass" if all(
            v for k, v in r.items() if k.endswith("identical")) else "fail", "-",
            f"{r['dst_bytes'] / 1e9:.3f} GB, {r['pieces']} pieces; identical at {', '.join(same)}; "
            f"parallel {gbps(r.get('parallel_gbps'))} GB/s, staged {gbps(r.get('staged_gbps'))} GB/s, "
            f"direct {gbps(r.get('direct_gbps'))} GB/s"))
    saves = d.get("saves", [])
    if saves:
        best = {r["mode"]: r.get("gbps") for r in saves if r.get("gbps") is not None}
        rows.append(("staged save == CPU file", "pass" if all(r["identical"] for r in saves) else "fail",
                     "-", f"{saves[0]['bytes'] / 1e9:.3f} GB from the device, {len(saves)} ways identical; "
                          f"parallel {gbps(best.get('parallel'))} GB/s, ring {gbps(best.get('copy'))} GB/s, "
                          f"direct {gbps(best.get('direct'))} GB/s"))
    rows.append(("identity step", d["status"], secs(d), f"model {d.get('model', '-')}" + why_text(d)))
    return rows


def snapshot_rows(s: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The snapshot step's line of the table."""
    rows: list[tuple[str, str, str, str]] = []
    by = {r["mode"]: r for r in s.get("rows", [])}
    rows.append(("snapshot through the pinned ring", s["status"], secs(s),
                 f"{s.get('bytes', 0) / 1e9:.3f} GB into {s.get('dir', '-')}: ring (auto) "
                 f"{gbps(by.get('auto', {}).get('gbps'))} GB/s, .to('cpu') {gbps(by.get('direct', {}).get('gbps'))}"
                 f" GB/s, from CPU tensors {gbps(s.get('cpu_tensors_gbps'))} GB/s; identical: "
                 f"{all(r['identical'] for r in s.get('rows', [])) and bool(s.get('rows'))}" + why_text(s)))
    return rows
