"""The GPU check's ``env`` step: python, torch, CUDA, the GPU, megatron-core and the carried packages as the steps will
import them."""

from __future__ import annotations

import argparse
import json
from typing import Any

from scripts.gpu_steps.cells import secs, why_text
from scripts.gpu_steps.launch import Clock, outcome, python_step

ENV_PROBE = r"""
import importlib.metadata as md, json, os, shutil, sys
import torch
out = {"python": sys.version.split()[0], "executable": sys.executable, "torch": torch.__version__,
       "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out.update(gpu=p.name, gpus=torch.cuda.device_count(), capability=f"{p.major}.{p.minor}",
               gpu_memory_gib=round(p.total_memory / 2**30, 1))
for name in ("megatron-core", "numpy", "packaging", "psutil", "isal", "pytest"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
try:
    import megatron.core
    out["megatron_core_from"] = os.path.dirname(megatron.core.__file__)
except Exception as e:
    out["megatron_core_error"] = f"{type(e).__name__}: {e}"
for where in ("/dev/shm", sys.argv[1]):
    if os.path.isdir(where):
        out[f"free_gib {where}"] = round(shutil.disk_usage(where).free / 2**30, 1)
print("GPU_CHECK_ENV " + json.dumps(out))
"""


def step_env(opts: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """What the steps will run with, probed by the same Python and path they get; no GPU (outside a dry run) or no
    megatron-core fails here, before anything else is tried."""
    launch = python_step(["-c", ENV_PROBE, opts.work], opts.work, "env", opts.site, opts.cpu_dry_run,
                         clock.limit("env"))
    out = outcome(launch)
    with open(launch.log) as f:
        for line in f:
            if line.startswith("GPU_CHECK_ENV "):
                out.update(json.loads(line[len("GPU_CHECK_ENV "):]))
    if out["status"] == "pass" and not opts.cpu_dry_run and not out.get("cuda_available"):
        out.update(status="fail", why="torch sees no CUDA device (use --cpu-dry-run on a machine without one)")
    if out["status"] == "pass" and "megatron_core_error" in out:
        out.update(status="fail", why=f"megatron.core does not import: {out['megatron_core_error']}")
    return out


def rows(e: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The environment's line of the table."""
    rows: list[tuple[str, str, str, str]] = []
    rows.append(("environment", e["status"], secs(e),
                 f"Python {e.get('python', '?')}, torch {e.get('torch', '?')} (CUDA {e.get('torch_cuda')}), "
                 f"{e.get('gpu', 'no GPU')}, megatron-core {e.get('megatron-core')}" + why_text(e)))
    return rows
