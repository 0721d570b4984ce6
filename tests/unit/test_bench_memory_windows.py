"""How ``benchmarks.memory`` reads its slowdown windows: each kind over its repetitions, each against the step alone
right before it, from hand-made per-rank records (the figure #13's 5% target is read from)."""

from __future__ import annotations

import pytest

from benchmarks.memory import _window_kind


def _w(kind: int, before: float, during: list[float], cpu: float = 0.5, rate: float = 0.0) -> dict:
    return {"kind": kind, "before": [before], "during": during, "rate": rate, "persist": kind != 1,
            "finished": True, "background": 2.0 * kind, "helper_cpu": cpu}


def test_each_window_is_read_against_its_own_step_alone() -> None:
    # two ranks, two repetitions; kind 0 then 1 in rep 0, 1 then 0 in rep 1 (round-robin). The machine slows down
    # between the repetitions (steps alone 1.0 then 2.0 s): a window of the same relative cost reads the same
    rank0 = {"windows": [_w(0, 1.0, [1.1, 1.1]), _w(1, 1.0, [1.0]), _w(1, 2.0, [2.0]), _w(0, 2.0, [2.2])]}
    rank1 = {"windows": [_w(0, 1.0, [1.1, 1.1], cpu=0.25), _w(1, 1.0, [1.0]), _w(1, 2.0, [2.0]),
                         _w(0, 2.0, [2.2], cpu=0.25)]}
    k0 = _window_kind([rank0, rank1], 0)
    assert k0["slowdowns"] == pytest.approx([1.1, 1.1])  # each repetition against its own step alone
    assert k0["steps"] == [2, 1]
    assert k0["before"] == pytest.approx(1.5) and k0["during"] == pytest.approx((1.1 + 1.1 + 2.2) / 3)
    assert k0["slowdown"] == pytest.approx(k0["during"] / k0["before"])
    assert k0["helper_cpu"] == pytest.approx(0.75)  # per window, summed over the nodes
    assert k0["persist"] is True and k0["finished"] is True and k0["background"] == 0.0
    k1 = _window_kind([rank0, rank1], 1)
    assert k1["slowdowns"] == pytest.approx([1.0, 1.0]) and k1["persist"] is False and k1["background"] == 2.0


def test_ranks_are_averaged_step_by_step() -> None:
    rank0 = {"windows": [_w(0, 1.0, [1.2])]}
    rank1 = {"windows": [_w(0, 3.0, [1.0])]}
    k = _window_kind([rank0, rank1], 0)
    assert k["during"] == pytest.approx(1.1) and k["before"] == pytest.approx(2.0)
    assert k["slowdowns"] == pytest.approx([0.55])
