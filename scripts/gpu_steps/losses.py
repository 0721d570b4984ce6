"""What the GPU check's two resume steps (``resume``, ``mlm``) share: the schedule (saved at step 3 of 6), the
tolerances, and the losses read and compared."""

from __future__ import annotations

import json
import os

SAVED_AT, TRAIN_ITERS = 3, 6
#: max relative difference of a loss on the device from the CPU's at the same step (fp32: kernels differ in
#: rounding only; bf16: 8-bit mantissas), and of the CPU's resumed run from the uninterrupted one (only the
#: reduction order changes with the layout: the CPU suite's oracle is 2e-6 for fp32; bf16 was seen at 6e-6)
TOLERANCE = {"fp32": 5e-4, "bf16": 2e-2}
CPU_RESUME_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3}


def read_losses(path: str) -> dict[int, float]:
    """Loss by iteration from a ``--tenplex-metrics`` file (empty when there is none)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {int(r["iteration"]): float(r["loss"]) for r in map(json.loads, filter(str.strip, f))}


def max_rel(a: dict[int, float], b: dict[int, float], steps: list[int]) -> float | None:
    """The largest relative difference of ``a`` from ``b`` over ``steps`` (None if a step is missing)."""
    if any(s not in a or s not in b for s in steps):
        return None
    return max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-12) for s in steps)
