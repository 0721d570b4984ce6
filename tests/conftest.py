"""The multi-process tests on both cores, and an optional record of each test's CPU time.

``pytest -n 2 --dist loadfile`` (the Makefile's ``make test``) gets the scheduler below: each test file is one unit
of work, so its module- and session-scoped fixtures (the shared torchrun launches) run once, on one worker; the
files whose jobs are torchrun elastic agents meeting at a rendezvous or killed on a clock (RENDEZVOUS) are one unit
together, so they never run beside each other, and so are the files submitting to the local Slurm (SLURM: each
worker's session fixture stops the cluster it started); the longest unit left (tests/multiproc/durations.json) goes to the
next free worker, so that the two workers finish together; in a session with the unit tests, their files come last,
filling in. (pytest-xdist's own ``loadgroup`` does not group under pytest 9: it renames ``item._nodeid``, which
pytest 9 no longer reads.)

``TENPLEX_TEST_CPU=FILE`` appends one JSON line per test: its wall time and the CPU seconds (user + system) of the
processes it started and waited for (torchrun, its ranks, scripts), set-up and tear-down included.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Generator, Iterator
from typing import Any

import pytest

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # a GPU machine's system Python (scripts/gpu_check.sh) has pytest but not pytest-xdist
    LoadFileScheduling = object  # type: ignore[assignment,misc]

HERE = os.path.dirname(os.path.abspath(__file__))
DURATIONS = os.path.join(HERE, "multiproc", "durations.json")
#: test files whose agents rendezvous or are killed on a clock: one unit of work, never run beside each other
RENDEZVOUS = ("test_elastic.py", "test_bench_elastic.py", "test_memory_nodes.py", "test_signal_save.py",
              "test_cluster_safety.py", "test_inprocess_nodes.py")
#: test files that submit to the local Slurm: one unit of work, on one worker, so that the session fixture of one
#: worker never stops the cluster (cancelling every job) under the other's jobs
SLURM = ("test_slurm.py", "test_slurm_inplace.py")
GROUPS = {"rendezvous": RENDEZVOUS, "slurm": SLURM}
DEFAULT_SECONDS = 30.0  # a multi-process test file not in durations.json yet (a unit test file: 0, they fill in last)


def unit_of(nodeid: str) -> str:
    """The unit of work of a test: its file, or the name of its group (``rendezvous``, ``slurm``)."""
    path = nodeid.split("::", 1)[0]
    return next((g for g, files in GROUPS.items() if os.path.basename(path) in files), path)


def unit_seconds(units: list[str]) -> dict[str, float]:
    """The recorded length of each unit: its files' CPU seconds (durations.json, from a TENPLEX_TEST_CPU record)."""
    with open(DURATIONS) as f:
        data = json.load(f)
    if data.get("version") != 1:
        raise ValueError(f"{DURATIONS}: version {data.get('version')!r} is not supported (1 is)")
    seconds = {k: float(v) for k, v in data["cpu_seconds"].items()}
    out = {}
    for u in units:
        files = GROUPS.get(u, (os.path.basename(u),))
        default = 0.0 if u.startswith("tests/unit/") else DEFAULT_SECONDS
        out[u] = sum(seconds.get(f, default) for f in files)
    return out


class LongestFileFirst(LoadFileScheduling):
    """Whole files (the RENDEZVOUS ones together) to the next free worker, the longest first."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node: Any) -> None:
        seconds = unit_seconds(list(self.workqueue))
        self.workqueue.move_to_end(max(self.workqueue, key=lambda u: seconds[u]), last=False)
        super()._assign_work_unit(node)

    def _reschedule(self, node: Any) -> None:
        # a worker runs a test once it knows the next one: a new unit when one test of its last is left
        if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
            return
        super()._reschedule(node)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: unknown to pytest without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LongestFileFirst | None:
    return LongestFileFirst(config, log) if config.getoption("dist", None) == "loadfile" else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    path = os.environ.get("TENPLEX_TEST_CPU")
    if not path:
        return (yield)
    t0, c0, s0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(
        resource.RUSAGE_SELF)
    try:
        return (yield)
    finally:
        c1, s1 = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
        line = json.dumps({"test": item.nodeid, "wall": round(time.perf_counter() - t0, 2),
                           "cpu_children": round(c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime, 2),
                           "cpu_pytest": round(s1.ru_utime - s0.ru_utime + s1.ru_stime - s0.ru_stime, 2)})
        with open(path, "a") as f:
            f.write(line + "\n")


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[None]:
    """A real Slurm on this machine for the tests marked ``slurm`` (scripts/slurm/start.sh: munged, slurmctld, two
    slurmd nodes; its packages installed where missing), started once per session and stopped at its end (left
    running where it ran before the session). One that cannot be started fails the test, naming ``make slurm``."""
    from benchmarks.kit import slurm

    was_up = slurm.cluster_up()
    try:
        slurm.start_cluster()
        why = ""
    except slurm.SlurmError as e:
        why = str(e)
    if why:
        pytest.fail(f"no local Slurm for the tests marked slurm (`make slurm` starts one, as root): {why}", pytrace=False)
    yield
    if not was_up:
        slurm.stop_cluster()
