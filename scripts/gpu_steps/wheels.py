"""The GPU check's ``wheels`` step: the wheels carried in ``.whl/`` installed into a private directory (pip
``--no-index``, or unzipped where there is no pip), only those the system lacks or has older; nothing from the
network."""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from typing import Any

from scripts.gpu_steps.cells import secs, why_text
from scripts.gpu_steps.launch import ROOT

WHEEL_LIST = os.path.join(ROOT, "scripts", "gpu_wheels.txt")
#: the distributions the steps import besides torch: without one of them a step fails at its first import
NEEDED = ("megatron-core", "numpy", "packaging", "psutil", "pytest")


def read_wheel_list(path: str = WHEEL_LIST) -> dict[str, str]:
    """``name==version`` lines of ``scripts/gpu_wheels.txt`` (comments and blank lines skipped), by name."""
    pins: dict[str, str] = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, _, version = line.partition("==")
                if not version:
                    raise ValueError(f"{path}: {line!r} is not pinned as name==version")
                pins[canonical(name)] = version.strip()
    return pins


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(filename: str) -> tuple[str, str]:
    """(name, version) from a wheel's file name (``name-version-...-tags.whl``)."""
    parts = os.path.basename(filename).split("-")
    if len(parts) < 5 or not filename.endswith(".whl"):
        raise ValueError(f"{filename}: not a wheel file name")
    return canonical(parts[0]), parts[1]


def version_key(version: str) -> tuple[int, ...]:
    """The leading numeric release parts of a version (enough to order the pinned releases here)."""
    out = []
    for part in version.split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
        if m.group() != part:
            break
    return tuple(out)


def installed_version(name: str) -> str | None:
    """The version of distribution ``name`` this Python would import, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_wheels(wheel_dir: str, target: str, have: Callable[[str], str | None] = installed_version,
                   python: str = sys.executable) -> dict[str, Any]:
    """Install the carried wheels the system lacks (or has older) into ``target``, never from the network.

    With pip: ``pip install --no-index --no-deps --no-compile --target``; without it (or where it refuses), each
    wheel is unzipped into ``target`` (the carried wheels need no scripts or data files installed). The
    system's own newer or equal versions are kept, so torch's own ecosystem stays as it is. Returns what was
    installed, what the system had, and which :data:`NEEDED` distributions are still missing.
    """
    record: dict[str, Any] = {"wheel_dir": wheel_dir, "target": target, "installed": {}, "system": {},
                              "method": None}
    todo = []
    for path in sorted(glob.glob(os.path.join(wheel_dir, "*.whl"))):
        name, version = wheel_name_version(path)
        system = have(name)
        if system is not None and version_key(system) >= version_key(version):
            record["system"][name] = system
            continue
        todo.append(path)
        record["installed"][name] = version
    if todo:
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target)
        env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
        try:
            p = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                "--target", target, *todo], capture_output=True, text=True, env=env, timeout=300)
            pip_error = None if p.returncode == 0 else (p.stderr.strip() or p.stdout.strip() or "failed")[-1000:]
        except (OSError, subprocess.TimeoutExpired) as e:
            pip_error = f"{type(e).__name__}: {e}"
        if pip_error is None:
            record["method"] = "pip --no-index --target"
        else:  # no pip, or one that refuses (an externally managed Python): a wheel is a zip of the tree to put there
            record["method"] = "unzip (no pip)"
            record["pip_error"] = pip_error
            shutil.rmtree(target, ignore_errors=True)
            os.makedirs(target)
            for path in todo:
                with zipfile.ZipFile(path) as z:
                    z.extractall(target, [n for n in z.namelist() if not n.split("/", 1)[0].endswith(".data")])
    for name in NEEDED:
        if name not in record["installed"] and name not in record["system"] and have(name) is not None:
            record["system"][name] = have(name)
    record["missing"] = [n for n in NEEDED if n not in record["installed"] and n not in record["system"]]
    return record


def wheels_step(opts: argparse.Namespace) -> dict[str, Any]:
    """Install the carried wheels (not in a dry run: it uses this Python's own packages) and put them first on
    every step's path."""
    if opts.cpu_dry_run and not opts.install_wheels:
        return {"status": "skip", "why": "a dry run uses this Python's own packages (unless --install-wheels)"}
    target = os.path.join(opts.work, "site")
    result = install_wheels(opts.wheels, target)
    if result["installed"]:
        opts.site = target
    result["status"] = "fail" if result["missing"] else "pass"
    if result["missing"]:
        result["why"] = (f"missing {', '.join(result['missing'])}: carry their wheels in {opts.wheels} "
                         "(see scripts/gpu_check.sh)")
    return result


def rows(w: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The carried wheels' line of the table."""
    rows: list[tuple[str, str, str, str]] = []
    carried = ", ".join(f"{k} {v}" for k, v in sorted(w.get("installed", {}).items())) or "none"
    system = ", ".join(f"{k} {v}" for k, v in sorted(w.get("system", {}).items())) or "none"
    rows.append(("carried wheels", w["status"], secs(w),
                 f"installed: {carried}; the system's: {system}" + (f"; MISSING: {', '.join(w['missing'])}"
                                                                    if w.get("missing") else "") + why_text(w)))
    return rows
