"""Engine-level runner for the restart fallback (memory/fallback.py) with tiny tensors: each rank is a node
(``OUT/mem_<rank>``, K=2), one launch, every case. ``fallback_run.py OUT``: each rank writes ``OUT.rank<r>.json``."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch.distributed as dist

from tenplex_megatron.engine.load import load
from tenplex_megatron.engine.save import save
from tenplex_megatron.memory import background, fallback, state
from tenplex_megatron.memory import restart as memory_restart
from tenplex_megatron.storage import directory
from tests.harness import flip
from tests.multiproc.memory_run import Tiny, snap, tier


def restart(t: state.MemoryTier | None, ckpt: str) -> tuple[Tiny, fallback.Restart | str]:
    """What a trainer does: the memory choice (or the newest durable checkpoint), loaded with the fallback, at
    another layout (columns instead of rows)."""
    back = Tiny(0.0, axis=1)
    choice = memory_restart.choose(t, ckpt) if t is not None else None
    try:
        got = fallback.restart(lambda c: memory_restart.load_snapshot(back, t, c), lambda p: load(back, p), t, choice,
                               ckpt, None if choice is not None else directory.find_checkpoint(ckpt))
    except fallback.NoGoodCopyError as e:
        return back, str(e)
    return back, got


class Counted(Tiny):
    """A Tiny that records each non-tensor restore, as a learning-rate scheduler counts the steps it is given."""

    def __init__(self, value: float, axis: int = 0):
        super().__init__(value, axis)
        self.restored: list[int] = []

    def restore(self, metadata: Any) -> None:
        super().restore(metadata)
        self.restored.append(self.it)


def one_rank_damaged(out: str, me: int) -> dict[str, Any]:
    """The newest checkpoint's damage lies only in what rank 1 reads (same layout: each rank its own file), so rank
    0 copies its share of it soundly: the fallback to the previous one must leave no trace of it on any rank."""
    ckpt = os.path.join(out, "one_rank")
    for value in (4.0, 5.0):
        a = Tiny(value)
        a.it = int(value)
        save(a, ckpt)
    barrier_then(me, lambda: flip(os.path.join(ckpt, "iter_0000005", directory.rank_file_name(1))))
    back = Counted(0.0)
    got = fallback.restart(lambda c: None, lambda p: load(back, p), None, None, ckpt,
                           directory.find_checkpoint(ckpt))
    return {**report(back, got), "restored": back.restored}


def shared_blocks(out: str, me: int) -> dict[str, Any]:
    """Saved by rows, read by columns: both ranks read every block of both files, and each block is checked by one
    of them (one host); damage in rank 1's file is still found, by whichever rank checks that block."""
    ckpt = os.path.join(out, "shared")
    for value in (6.0, 7.0):
        a = Tiny(value)
        a.it = int(value)
        save(a, ckpt)
    back = Tiny(0.0, axis=1)
    got = load(back, os.path.join(ckpt, "iter_0000007"))
    res = {"verified": got.bytes_verified, "equal": back.matches(7.0)}
    barrier_then(me, lambda: flip(os.path.join(ckpt, "iter_0000007", directory.rank_file_name(1))))
    back = Tiny(0.0, axis=1)
    fell = fallback.restart(lambda c: None, lambda p: load(back, p), None, None, ckpt, directory.find_checkpoint(ckpt))
    return {**res, "damaged": report(back, fell)}


def report(back: Tiny, got: fallback.Restart | str) -> dict[str, Any]:
    if isinstance(got, str):
        return {"error": got}
    return {"iteration": back.it, "equal": back.matches(float(back.it)), "memory": got.memory is not None,
            "skipped": list(got.skipped),
            "received": got.memory.bytes_received if got.memory else 0,
            "from_durable": got.memory.bytes_from_durable if got.memory else None}


def barrier_then(me: int, fn: Any) -> None:
    dist.barrier()
    if me == 0:
        fn()
    dist.barrier()


def cases(out: str) -> dict[str, Any]:
    me = dist.get_rank()
    res: dict[str, Any] = {}
    ckpt = os.path.join(out, "ckpt")
    t = tier(out, persist_interval=1000)
    # a bad replica: node 0's copy of rank 1's file; node 1's copy is good
    snap(t, 1.0, 1)
    background.drain(t)
    barrier_then(me, lambda: flip(os.path.join(out, "mem_0", "iter_0000001", directory.rank_file_name(1))))
    res["bad_replica"] = report(*restart(t, ckpt))
    # a bad snapshot file (every copy of rank 1's file) and a durable checkpoint of the same iteration
    snap(t, 2.0, 2)
    background.drain(t)
    a = Tiny(2.0)
    a.it = 2
    save(a, ckpt)
    barrier_then(me, lambda: [flip(os.path.join(out, f"mem_{n}", "iter_0000002", directory.rank_file_name(1)))
                              for n in (0, 1)])
    res["bad_snapshot"] = report(*restart(t, ckpt))
    state.close(t)
    # the durable checkpoint only: the newest damaged, the previous complete iteration loads; then none is left
    a = Tiny(3.0)
    a.it = 3
    save(a, ckpt)
    barrier_then(me, lambda: flip(os.path.join(ckpt, "iter_0000003", directory.rank_file_name(0))))
    res["bad_durable"] = report(*restart(None, ckpt))
    barrier_then(me, lambda: flip(os.path.join(ckpt, "iter_0000002", directory.rank_file_name(1))))
    res["none_left"] = report(*restart(None, ckpt))
    res["one_rank_damaged"] = one_rank_damaged(out, me)
    res["shared_blocks"] = shared_blocks(out, me)
    return res


if __name__ == "__main__":
    dist.init_process_group("gloo")
    got = cases(sys.argv[1])
    with open(f"{sys.argv[1]}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()
