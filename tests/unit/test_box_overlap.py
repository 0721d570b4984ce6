"""The overlap check of a tensor's chunks sweeps them: it agrees with comparing every pair, and the hostile-checkpoint
probe's 16,000 staggered overlapping chunks (quadratic before: 110 s and 3.2 GB) are refused in seconds."""

from __future__ import annotations

import itertools
import os
import random
import resource
import subprocess
import sys
import textwrap

import pytest

from tenplex_megatron.plan.box_overlap import first_overlap
from tenplex_megatron.plan.geometry import intersect
from tests.harness import ROOT


def _pairwise_overlap(boxes) -> bool:
    return any(intersect(a[0], a[1], b[0], b[1]) is not None and all(a[1]) and all(b[1])
               for a, b in itertools.combinations(boxes, 2))


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_the_sweep_agrees_with_comparing_every_pair(ndim: int) -> None:
    rng = random.Random(ndim)
    found = {True: 0, False: 0}
    for _ in range(1500):
        boxes = []
        for _ in range(rng.randint(2, 9)):
            off = tuple(rng.randint(0, 12) for _ in range(ndim))
            boxes.append((off, tuple(rng.randint(0 if rng.random() < 0.05 else 1, 5) for _ in range(ndim))))
        hit = first_overlap(boxes)
        assert (hit is not None) == _pairwise_overlap(boxes), boxes
        if hit is not None:
            (a_off, a_shp), (b_off, b_shp) = boxes[hit[0]], boxes[hit[1]]
            assert hit[0] < hit[1] and intersect(a_off, a_shp, b_off, b_shp) is not None
        found[hit is not None] += 1
    assert min(found.values()) > 100  # both answers were really exercised


def test_a_partition_into_a_brick_wall_is_disjoint_and_one_shared_element_is_not() -> None:
    left = [((r, 0), (2, 1)) for r in range(0, 40, 2)]
    right = [((0, 1), (1, 1))] + [((r, 1), (2, 1)) for r in range(1, 39, 2)] + [((39, 1), (1, 1))]
    assert first_overlap(left + right) is None
    assert first_overlap([*left, *right, ((20, 0), (1, 2))]) is not None
    assert first_overlap([((), ()), ((), ())]) == (0, 1)  # a scalar stored twice
    assert first_overlap([((0, 0, 0), (4, 4, 1)), ((0, 0, 1), (4, 4, 1)), ((3, 3, 0), (1, 1, 2))]) in ((0, 2), (1, 2))


def _limit_child() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # the old check took 3.2 GB
    resource.setrlimit(resource.RLIMIT_CPU, (30, 30))  # and 110 s


def _run_capped(code: str) -> list[str]:
    """The lines ``code`` prints, run in a child process under :func:`_limit_child`'s memory and CPU caps."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       preexec_fn=_limit_child)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.splitlines()


def test_the_probes_16000_staggered_overlapping_chunks_are_refused_in_seconds_and_bounded_memory() -> None:
    code = textwrap.dedent("""
        import time
        from benchmarks.planning import staggered_overlap
        from tenplex_megatron.plan.planner import partition_errors
        from tenplex_megatron.plan.ptc import PTC
        t0 = time.process_time()
        print(partition_errors(PTC.from_json(staggered_overlap(16000)))["w"])
        print("cpu", time.process_time() - t0)
    """)
    why, cpu = _run_capped(code)
    assert why.startswith("tensor 'w': source chunks overlap ((0, 0)/(16000, 1)/None and (1, 0)/(16000, 1)/None)")
    assert float(cpu.split()[1]) < 15, cpu  # seconds of CPU: about 1 on a loaded 2-core machine


def test_a_valid_comb_of_16000_chunks_is_planned_in_seconds_and_bounded_memory() -> None:
    """8000 one-row pieces beside 8000 full-height columns: valid, and a grid index over its rows held 64 million
    entries (2000 + 2000 chunks took 11 s and 600 MB); the planner's index grows as N log N."""
    code = textwrap.dedent("""
        import time
        from benchmarks.planning import comb
        from tenplex_megatron.plan.planner import plan_reshard
        from tenplex_megatron.plan.ptc import PTC, Chunk
        t0 = time.process_time()
        ptc = PTC.from_json(comb(8000))
        halves = {0: [Chunk("w", (0, 0), (4000, 8001))], 1: [Chunk("w", (4000, 0), (4000, 8001))]}
        plan = plan_reshard(ptc, ptc.tensors, halves)
        print(plan.total_bytes_read, sum(len(p.pieces) for p in plan.ranks.values()))
        print("cpu", time.process_time() - t0)
    """)
    counts, cpu = _run_capped(code)
    assert counts.split() == [str(8000 * 8001), str(8000 + 2 * 8000)]  # every element once; each column cut in two
    assert float(cpu.split()[1]) < 15, cpu  # seconds of CPU: under 1 on a loaded 2-core machine
