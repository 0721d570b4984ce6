"""The library's one logger (tenplex_megatron/log.py): one prefix, rank 0 only below WARNING, stdout and stderr."""

from __future__ import annotations

import subprocess
import sys

import pytest

_SCRIPT = """
from tenplex_megatron import log
x = log.get("test")
x.info("loaded iteration %d", 4)
x.warning("skipping %s", "a copy")
log.every_rank(x, "re-form: generation 2: rank 1 of 2")
"""


@pytest.mark.parametrize("rank", ["0", "3"])
def test_prefix_rank_filter_and_streams(rank: str) -> None:
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True,
                       env={"RANK": rank, "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    if rank == "0":
        assert r.stdout == "> tenplex: loaded iteration 4\n> tenplex: re-form: generation 2: rank 1 of 2\n"
        assert r.stderr == "> tenplex: warning: skipping a copy\n"
    else:  # information from rank 0 only (but what every rank says of itself); a warning from any rank, naming it
        assert r.stdout == "> tenplex: [rank 3] re-form: generation 2: rank 1 of 2\n"
        assert r.stderr == "> tenplex: [rank 3] warning: skipping a copy\n"


_PROGRAM = """
import logging
logging.basicConfig(format="%(name)s|%(levelname)s|%(message)s")
from tenplex_megatron import log
log.propagate(True)
log.get("test").warning("hello %s", "there")
"""


def test_propagate_hands_records_to_the_programs_handlers() -> None:
    """A program with its own logging set-up gets each record once, through its handlers, not ours."""
    r = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, check=True,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert r.stdout == "" and r.stderr == "tenplex_megatron.test|WARNING|hello there\n"


def test_records_go_to_the_streams_of_the_moment(capsys, monkeypatch) -> None:
    """The handlers write to sys.stdout/sys.stderr as they are when a record comes (pytest's capture, a program
    that redirects them), not as they were when the logger was first set up."""
    from tenplex_megatron import log

    monkeypatch.setenv("RANK", "0")
    log.get("test").info("first %d", 1)
    log.get("test").warning("second %d", 2)
    out, err = capsys.readouterr()
    assert out == "> tenplex: first 1\n" and err == "> tenplex: warning: second 2\n"
