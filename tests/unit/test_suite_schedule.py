"""The suite's own scheduling (tests/conftest.py): which test files share a worker's unit of work, and that the
recorded durations name test files that exist (a renamed file would silently lose its place in the queue)."""

from __future__ import annotations

import json
import os

from tests.conftest import DEFAULT_SECONDS, DURATIONS, HERE, RENDEZVOUS, SLURM, unit_of, unit_seconds


def test_durations_and_rendezvous_name_existing_multiprocess_test_files() -> None:
    with open(DURATIONS) as f:
        recorded = json.load(f)["cpu_seconds"]
    for name in [*recorded, *RENDEZVOUS, *SLURM]:
        assert os.path.isfile(os.path.join(HERE, "multiproc", name)), f"{DURATIONS}: no tests/multiproc/{name}"
    assert all(v > 0 for v in recorded.values()), recorded


def test_rendezvous_files_are_one_unit_the_slurm_files_another_the_others_one_each() -> None:
    assert {unit_of(f"tests/multiproc/{name}::test_x") for name in RENDEZVOUS} == {"rendezvous"}
    # each worker's session fixture stops the Slurm it started: the files submitting jobs share one worker
    assert {unit_of(f"tests/multiproc/{name}::test_x") for name in SLURM} == {"slurm"}
    assert unit_of("tests/multiproc/test_reshard_matrix.py::test_transition[TP2-TP1-distopt]") == \
        "tests/multiproc/test_reshard_matrix.py"
    assert unit_of("tests/unit/test_planner.py::TestX::test_y") == "tests/unit/test_planner.py"


def test_longest_first_and_unit_tests_last() -> None:
    with open(DURATIONS) as f:
        recorded = json.load(f)["cpu_seconds"]
    seconds = unit_seconds(["rendezvous", "tests/multiproc/test_new_one.py", "tests/unit/test_planner.py"])
    assert seconds["rendezvous"] == sum(recorded.get(n, DEFAULT_SECONDS) for n in RENDEZVOUS)
    assert seconds["tests/multiproc/test_new_one.py"] == DEFAULT_SECONDS
    assert seconds["tests/unit/test_planner.py"] == 0.0
