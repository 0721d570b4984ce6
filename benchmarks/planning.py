"""The cost of checking and planning a checkpoint of many chunks: it must grow as N log N, not N².

    python -m benchmarks.planning [--chunks 1000 10000 100000] [--repeat 3] [--out report.json]
    python -m benchmarks.planning --autolayout [--repeat 3]

For each N, two PTCs of one tensor, read from their JSON as ``verify``, ``plan`` and a load read
``metadata.json``'s ``ptc``: the hostile-checkpoint probe's N staggered, overlapping chunks (each row ``[i, i+N)``
of a ``[2N, 1]`` tensor: refused as overlapping), and a valid brick-wall partition of N chunks (two columns cut
at staggered rows, so the boxes form no grid and the overlap check sweeps them), then planned onto two ranks (the
tensor's halves); and a valid comb of N chunks (N/2 one-row pieces beside N/2 full-height columns) read, checked
and planned onto two ranks. Prints the median seconds of each step; ``--out`` writes them as JSON.

``--autolayout`` instead ranks every TP, PP, VPP, EP and expert TP of 1,024 GPUs for ``deepseek-v3-like`` (256
experts) with 4 micro-batch sizes, cold (the model's tensors built again each run), and prints the CPU seconds of
each run and the number of candidates: the target is under a second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from tenplex_megatron.plan.planner import partition_errors, plan_reshard
from tenplex_megatron.plan.ptc import PTC, Chunk

_AT = {"file": "rank_00000.safetensors", "name": "x", "rank": 0, "host": "h"}


def _ptc(shape: list[int], boxes: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    return {"ptc_version": 1, "layout": {}, "tensors": [{"key": "w", "dtype": "uint8", "shape": shape}],
            "chunks": [{"key": "w", "offsets": off, "shape": shp, "at": _AT} for off, shp in boxes]}


def staggered_overlap(n: int) -> dict[str, Any]:
    """The probe's PTC JSON: ``n`` chunks of ``n`` rows each starting one row after the last (all overlap)."""
    return _ptc([2 * n, 1], [([i, 0], [n, 1]) for i in range(n)])


def brick_wall(n: int) -> dict[str, Any]:
    """A valid PTC JSON of ``n`` chunks (``n`` even): two columns of 2-row bricks, the second shifted by one row."""
    rows = n  # column 0: n/2 bricks of 2 rows; column 1: a 1-row brick, n/2 - 1 bricks of 2, a 1-row brick
    left = [([r, 0], [2, 1]) for r in range(0, rows, 2)]
    right = [([0, 1], [1, 1])] + [([r, 1], [2, 1]) for r in range(1, rows - 1, 2)] + [([rows - 1, 1], [1, 1])]
    return _ptc([rows, 2], left + right)


def comb(n: int) -> dict[str, Any]:
    """A valid PTC JSON of ``2n`` chunks: ``n`` one-row pieces of column 0 beside ``n`` full-height columns (each
    column spans every row interval the pieces cut: a grid of cells listing what spans them holds ``n**2``)."""
    return _ptc([n, n + 1], [([r, 0], [1, 1]) for r in range(n)] + [([0, c], [n, 1]) for c in range(1, n + 1)])


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(n: int) -> dict[str, float]:
    """Seconds to read and check the staggered PTC, to read and check the brick wall, and to plan the brick wall."""
    s_check, errors = _timed(lambda: partition_errors(PTC.from_json(staggered_overlap(n))))
    if "overlap" not in errors.get("w", ""):
        raise SystemExit(f"{n} staggered chunks: the overlap was not found ({errors})")
    b_check, (ptc, errors) = _timed(lambda: (p := PTC.from_json(brick_wall(n)), partition_errors(p)))
    if errors:
        raise SystemExit(f"{n} chunks of a brick wall: refused ({errors})")
    rows = ptc.tensors["w"].global_shape[0]
    halves = {0: [Chunk("w", (0, 0), (rows // 2, 2))], 1: [Chunk("w", (rows // 2, 0), (rows - rows // 2, 2))]}
    b_plan, plan = _timed(lambda: plan_reshard(ptc, ptc.tensors, halves))
    if plan.total_bytes_read != rows * 2:
        raise SystemExit(f"{n} chunks of a brick wall: the plan reads {plan.total_bytes_read} bytes of {rows * 2}")
    half = n // 2
    c_plan, plan = _timed(lambda: plan_reshard(
        comb_ptc := PTC.from_json(comb(half)), comb_ptc.tensors,
        {0: [Chunk("w", (0, 0), (half // 2, half + 1))], 1: [Chunk("w", (half // 2, 0), (half - half // 2, half + 1))]}))
    if plan.total_bytes_read != half * (half + 1):
        raise SystemExit(f"{n} chunks of a comb: the plan reads {plan.total_bytes_read} bytes of {half * (half + 1)}")
    return {"staggered overlap: read + check": s_check, "brick wall: read + check": b_check,
            "brick wall: plan onto 2 ranks": b_plan, "comb: read + check + plan": c_plan}


def autolayout_seconds(repeat: int) -> tuple[list[float], int]:
    """CPU seconds of each cold ranking of deepseek-v3-like's layouts at 1,024 GPUs, and the candidates ranked."""
    from tenplex_megatron.plan import autolayout
    from tenplex_megatron.plan.sim.gpt_catalogue import load_model
    dims = load_model("deepseek-v3-like")
    times, ranked = [], 0
    for _ in range(repeat):
        autolayout._parameter_rows.cache_clear()
        autolayout._stage_parameters.cache_clear()
        start = time.process_time()
        ranked = len(autolayout.rank_layouts(dims, 1024, 8, 4096))
        times.append(time.process_time() - start)
    return times, ranked


def _autolayout(repeat: int) -> int:
    """Print the layout search's candidates and CPU seconds (the best run against the 1 s target)."""
    times, ranked = autolayout_seconds(repeat)
    print(f"deepseek-v3-like, 1,024 GPUs: {ranked} candidates ranked in {min(times):.2f} s of CPU (best of "
          f"{repeat}: {', '.join(f'{t:.2f}' for t in times)}); target 1 s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--autolayout", action="store_true", help="time the layout search at 1,024 GPUs instead")
    a = ap.parse_args(argv)
    if a.autolayout:
        return _autolayout(a.repeat)
    rows = []
    print(f"{'chunks':>8}  {'step':<32} {'median s':>9}  (min-max, {a.repeat} runs)")
    for n in a.chunks:
        runs = [measure(n + n % 2) for _ in range(a.repeat)]
        for step in runs[0]:
            got = [r[step] for r in runs]
            rows.append({"chunks": n + n % 2, "step": step, "median_s": statistics.median(got), "min_s": min(got),
                         "max_s": max(got)})
            print(f"{n + n % 2:>8}  {step:<32} {statistics.median(got):9.3f}  ({min(got):.3f}-{max(got):.3f})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"benchmark": "planning", "repeat": a.repeat, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
