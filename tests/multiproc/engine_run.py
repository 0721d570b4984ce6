"""Engine-level multi-rank runner with tiny tensors: the engine's save/load through a minimal Adapter (no model).

``faults OUT``: a good checkpoint, then for every fault point and every rank
that passes it, a save or load with ``TENPLEX_FAULT=<point>@<rank>:typeerror``
(an exception type no code path expects); each rank records what it raised and
how long it took, and after every failed save that the previous checkpoint is
still the newest complete one. ``uncaught DIR``: one save whose fault is not
caught, so the process exits with the error (the test checks exit status and time).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.load import load
from tenplex_megatron.engine.save import save
from tenplex_megatron.execute.collective import RankFailure
from tenplex_megatron.plan.ptc import Chunk, TensorMeta
from tenplex_megatron.storage import directory
from tenplex_megatron.storage.faults import POINTS, RANK0_ONLY
from tenplex_megatron.storage.source import Metadata

ROWS, COLS = 8, 6


@dataclass(frozen=True)
class TinyLayout:
    """The tiny job's layout: ``w``'s rows split over ``tp`` ranks."""

    tp: int

    def to_json(self) -> dict[str, Any]:
        return {"tp": self.tp}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TinyLayout:
        return cls(int(d["tp"]))


@dataclass(frozen=True)
class TinyRecord:
    """The tiny framework's own field of metadata.json."""

    note: str

    def to_json(self) -> dict[str, Any]:
        return {"note": self.note}


class TinyAdapter:
    """Two tensors: ``w`` split by rows over the ranks (as TP splits a weight), ``b`` replicated (rank 0 writes)."""

    framework = "tiny"
    seed = 7
    rng_tracker = False

    def __init__(self, rank: int, world: int, value: float):
        self.rank, self.world, self.it = rank, world, 0
        rows = ROWS // world
        self.w = torch.full((rows, COLS), value) + torch.arange(rows * COLS, dtype=torch.float32).view(rows, COLS)
        self.b = torch.full((COLS,), value)

    def layout(self) -> TinyLayout:
        return TinyLayout(self.world)

    def iteration(self) -> int:
        return self.it

    def describe(self) -> list[LocalChunk]:
        rows = ROWS // self.world
        return [
            LocalChunk(TensorMeta("w", (ROWS, COLS), "float32", tp_axis=0), Chunk("w", (self.rank * rows, 0), (rows, COLS)),
                       self.w, True),
            LocalChunk(TensorMeta("b", (COLS,), "float32"), Chunk("b", (0,), (COLS,)), self.b, self.rank == 0),
        ]

    def describe_for_load(self, metadata: Metadata) -> list[LocalChunk]:
        return self.describe()

    def metadata(self) -> TinyRecord:
        return TinyRecord("tiny")

    def restore(self, metadata: Metadata) -> None:
        self.it = metadata.require_iteration()

    def after_load(self, metadata: Metadata) -> None:
        return None


def _attempt(fn: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        fn()
        return {"raised": None, "seconds": time.perf_counter() - t0}
    except RankFailure as e:
        return {"raised": "RankFailure", "message": str(e), "failures": {str(k): str(v) for k, v in e.failures.items()},
                "seconds": time.perf_counter() - t0}


def faults(out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    save_dir = os.path.join(os.path.dirname(out), "ckpt")
    good = TinyAdapter(rank, world, 1.0)
    good.it = 1
    save(good, save_dir)
    results: dict[str, Any] = {}
    it = 1
    for point in POINTS:
        for failing in range(world):
            if point in RANK0_ONLY and failing != 0:
                continue
            it += 1
            os.environ["TENPLEX_FAULT"] = f"{point}@{failing}:typeerror"
            if point.startswith("save."):
                job = TinyAdapter(rank, world, float(it))
                job.it = it
                res = _attempt(lambda job=job: save(job, save_dir))
                res["newest_complete"] = directory.committed_iterations(save_dir)[-1:]
            else:
                job = TinyAdapter(rank, world, -1.0)
                before = job.w.clone()
                res = _attempt(lambda job=job: load(job, save_dir))
                res["untouched"] = bool(torch.equal(job.w, before))
            del os.environ["TENPLEX_FAULT"]
            results[f"{point}@{failing}"] = res
    # after every failure: a good save still works (and cleans partial saves); the newest checkpoint loads exactly
    final = TinyAdapter(rank, world, 5.0)
    final.it = 100
    saved = save(final, save_dir)
    back = TinyAdapter(rank, world, 0.0)
    load(back, save_dir)
    results["final"] = {"removed": list(saved.removed), "equal": bool(torch.equal(back.w, final.w)), "it": back.it,
                        "partials": directory.partial_dirs(save_dir)}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(results, f)


def uncaught(out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    job = TinyAdapter(rank, world, 1.0)
    job.it = 1
    save(job, os.path.join(out, "ckpt"))  # TENPLEX_FAULT comes from the environment: this raises on every rank


if __name__ == "__main__":
    dist.init_process_group("gloo")
    {"faults": faults, "uncaught": uncaught}[sys.argv[1]](sys.argv[2])
    dist.destroy_process_group()
