"""The GPU check's ``pytest`` step: ``pytest -m gpu tests/gpu`` with the system's torch, counted from its JUnit
report."""

from __future__ import annotations

import argparse
import os
from typing import Any
from xml.etree import ElementTree

from scripts.gpu_steps.cells import secs, why_text
from scripts.gpu_steps.launch import Clock, outcome, python_step


def parse_junit(path: str) -> dict[str, int]:
    """Counts of a pytest ``--junitxml`` report: tests, failures, errors, skipped (and passed)."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def step_pytest(opts: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """``pytest -m gpu tests/gpu``, counted from its JUnit report: a skipped test fails a GPU run."""
    xml = os.path.join(opts.work, "pytest.xml")
    launch = python_step(["-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider", "--junitxml", xml,
                          "tests/gpu"], opts.work, "pytest", opts.site, opts.cpu_dry_run, clock.limit("pytest"))
    out = outcome(launch)
    if os.path.exists(xml):
        out.update(parse_junit(xml))
        if out["status"] == "pass" and out["skipped"]:  # a skipped GPU test proves nothing
            out["status"] = "skip" if opts.cpu_dry_run and out["passed"] == 0 else "fail"
            out.setdefault("why", f"{out['skipped']} test(s) skipped")
    return out


def rows(p: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The GPU tests' line of the table."""
    rows: list[tuple[str, str, str, str]] = []
    rows.append(("`pytest -m gpu tests/gpu`", p["status"], secs(p),
                 f"{p.get('passed', '-')} passed, {p.get('failures', '-')} failed, {p.get('errors', '-')} errors, "
                 f"{p.get('skipped', '-')} skipped" + why_text(p)))
    return rows
