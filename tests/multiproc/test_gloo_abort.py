"""A survivor's pending gloo operation ends when its connections are shut down (the in-place restart's abort),
not at the gloo timeout: real gloo ranks under torchrun."""

from __future__ import annotations

import json
import os

from tests.harness import ROOT, torchrun

RUN = os.path.join(ROOT, "tests", "multiproc", "gloo_abort_run.py")


def test_shutting_the_gloo_connections_down_ends_a_pending_receive_at_once(tmp_path) -> None:
    out = tmp_path / "rank0.json"
    r = torchrun(2, [str(out)], timeout=120, script=RUN)
    assert r.returncode == 0, r.log[-3000:]
    got = json.loads(out.read_text())
    assert got["shut"] and got["shut"][0] >= 1  # rank 0's connection to rank 1 at least
    assert got["error"], "the receive returned without an error"
    assert got["ended_after"] < 9, got  # not the 60 s gloo timeout, nor rank 1's exit at 10 s
