"""Engine-level runner for host-memory snapshots with tiny tensors: each rank is a node (``OUT/mem_<rank>``).

``all OUT``: replication and a load at a new layout and at the same one after one
node lost its memory (each rank's rank-local entry, opaque bytes as Transformer
Engine's ``_extra_state`` is, back exactly at the same layout: rank 1's received
from node 0's replica), a snapshot that does not fit (error, or the durable fallback), another
job's snapshot, another model's, more replicas than nodes, retention, a killed
persist helper, and a job's :class:`~tenplex_megatron.frontdoor.checkpointer.Checkpointer` built from its flags,
used, closed and built again in the same process. ``crash POINT OUT``: a durable and a memory snapshot of
iteration 1, then a snapshot of iteration 2 whose rank 1 is SIGKILLed at
``POINT``. ``check OUT...``: after crashes, what each directory loads, and
that the next snapshot cleans up. Each rank writes what it saw to
``OUT.rank<r>.json`` for the test to assert on.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from tenplex_megatron import flags
from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.load import load
from tenplex_megatron.execute.collective import RankFailure, gather_records
from tenplex_megatron.frontdoor.checkpointer import Checkpointer
from tenplex_megatron.frontdoor.job_config import JobConfig
from tenplex_megatron.memory import background, node_dir, restart, state
from tenplex_megatron.memory.settings import MemorySettings
from tenplex_megatron.memory.snapshot import snapshot
from tenplex_megatron.plan.ptc import Chunk, TensorMeta
from tenplex_megatron.storage import directory, lease
from tenplex_megatron.storage.source import Metadata
from tests.logs import logged

ROWS, COLS = 8, 6


LOCAL = "rank_local:tiny._extra_state"


def expected(value: float, cols: int = COLS) -> torch.Tensor:
    return torch.full((ROWS, cols), value) + torch.arange(ROWS * cols, dtype=torch.float32).view(ROWS, cols)


def local_state(value: float, rank: int) -> torch.Tensor:
    """A rank's own state at ``value``: different on every rank, as an FP8 amax history is."""
    return torch.tensor([value, float(rank), -value, 0.5 + rank], dtype=torch.float32)


@dataclass(frozen=True)
class TinyLayout:
    """The tiny job's layout: ``w`` split along ``axis`` over ``world`` ranks."""

    axis: int
    world: int

    def to_json(self) -> dict[str, Any]:
        return {"axis": self.axis, "world": self.world}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TinyLayout:
        return cls(int(d["axis"]), int(d["world"]))


@dataclass(frozen=True)
class NoFields:
    """The tiny framework keeps no fields of its own in metadata.json."""

    def to_json(self) -> dict[str, Any]:
        return {}


class Tiny:
    """``w`` split over the ranks by rows (``axis`` 0) or columns (1: another layout), ``b`` replicated; with
    ``local``, ``state``: rank-local bytes (the engine's optional ``rank_local`` / ``prepare_rank_local``), taken
    back at the same layout only."""

    framework = "tiny"
    seed = 7
    rng_tracker = False

    def __init__(self, value: float, axis: int = 0, cols: int = COLS, local: bool = False):
        self.rank, self.world, self.axis, self.cols, self.it = dist.get_rank(), dist.get_world_size(), axis, cols, 0
        full = expected(value, cols)
        n = (ROWS if axis == 0 else cols) // self.world
        self.off = [0, 0]
        self.off[axis] = self.rank * n
        self.w = full.narrow(axis, self.rank * n, n).contiguous()
        self.b = torch.full((cols,), value)
        self.local, self.state = local, local_state(value, self.rank)

    def layout(self) -> TinyLayout:
        return TinyLayout(self.axis, self.world)

    def iteration(self) -> int:
        return self.it

    def describe(self) -> list[LocalChunk]:
        return [LocalChunk(TensorMeta("w", (ROWS, self.cols), "float32"), Chunk("w", tuple(self.off), self.w.shape),
                           self.w, True),
                LocalChunk(TensorMeta("b", (self.cols,), "float32"), Chunk("b", (0,), (self.cols,)), self.b,
                           self.rank == 0)]

    def describe_for_load(self, metadata: Metadata) -> list[LocalChunk]:
        return self.describe()

    def metadata(self) -> NoFields:
        return NoFields()

    def rank_local(self) -> dict[str, Any]:
        return {LOCAL: (self.state.view(torch.uint8), {"nbytes": self.state.numel() * 4})} if self.local else {}

    def prepare_rank_local(self, metadata: Metadata, read: Any) -> Any:
        if not self.local or metadata.layout != self.layout().to_json():
            return None
        got = read(LOCAL).view(torch.float32)
        return lambda: setattr(self, "state", got)

    def restore(self, metadata: Metadata) -> None:
        self.it = metadata.require_iteration()

    def after_load(self, metadata: Metadata) -> None:
        return None

    def state_is(self, value: float) -> bool:
        return bool(torch.equal(self.state, local_state(value, self.rank)))

    def matches(self, value: float) -> bool:
        full = expected(value, self.cols)
        return bool(torch.equal(self.w, full.narrow(self.axis, self.off[self.axis], self.w.shape[self.axis]))
                    and torch.equal(self.b, torch.full((self.cols,), value)))


def tier(out: str, **options: Any) -> state.MemoryTier:
    job = options.pop("job", os.path.join(out, "ckpt"))
    return state.open_tier(MemorySettings(os.path.join(out, f"mem_{dist.get_rank()}"), job, os.path.join(out, "ckpt"),
                                          **options))


@contextmanager
def warnings_logged() -> Iterator[list[str]]:
    """The warnings the library logs meanwhile."""
    got: list[str] = []
    with logged() as records:
        try:
            yield got
        finally:
            got.extend(r.getMessage() for r in records if r.levelno >= logging.WARNING)


def snap(t: state.MemoryTier, value: float, it: int, persist: bool | None = None, local: bool = False) -> Any:
    a = Tiny(value, local=local)
    a.it = it
    return snapshot(a, t, persist=persist)


def error_of(fn: Any) -> str | None:
    try:
        fn()
    except RankFailure as e:
        return str(e)
    return None


def scenarios(out: str) -> dict[str, Any]:
    me = dist.get_rank()
    res: dict[str, Any] = {}
    t = tier(out, persist_interval=1000)
    s = snap(t, 1.0, 1, local=True)
    background.drain(t)  # the helper processes copy the replicas in the background
    res["files"] = sorted(os.listdir(s.path))
    res["replicated"] = s.bytes_replicated
    dist.barrier()
    if me == 0:  # node 1 loses its memory (its id stays: a node with empty memory)
        shutil.rmtree(os.path.join(out, "mem_1", "iter_0000001"))
    dist.barrier()
    choice = restart.choose(t, None)
    res["chosen"] = choice.iteration if choice else None
    back = Tiny(0.0, axis=1, local=True)  # another layout: columns instead of rows
    loaded = restart.load_snapshot(back, t, choice)
    res["new_layout_equal"] = back.matches(1.0)
    res["new_layout_local_left"] = back.state_is(0.0)  # another layout: rank-local state not taken back
    res["received"], res["from_durable"] = loaded.bytes_received, loaded.bytes_from_durable
    res["verified"] = loaded.result.bytes_verified
    same = Tiny(0.0, local=True)  # the snapshot's layout: rank 1's file (chunks, rank-local entry) from node 0's
    loaded = restart.load_snapshot(same, t, choice)
    res["same_layout"] = [same.matches(1.0), same.state_is(1.0), loaded.bytes_received]

    small = tier(out, limit=1000)
    before = directory.committed_iterations(small.mem)
    res["overflow"] = error_of(lambda: snap(small, 2.0, 2))
    res["overflow_untouched"] = (directory.committed_iterations(small.mem) == before
                                 and not directory.partial_dirs(small.mem))
    fb = tier(out, limit=1000, fallback=True)
    r = snap(fb, 3.0, 3)
    res["fallback"] = r.fallback is not None and os.path.isdir(os.path.join(out, "ckpt", "iter_0000003"))

    other = tier(out, job="/some/other/job")
    res["other_job"] = error_of(lambda: restart.choose(other, None))
    wide = Tiny(0.0, cols=COLS + 2)
    res["other_model"] = error_of(lambda: restart.load_snapshot(wide, t, choice))
    with warnings_logged() as caught:
        state.close(tier(out, replicas=3))
    res["replica_warning"] = [w for w in caught if "replicas" in w]

    k = tier(out, keep=1, persist_interval=1000)
    for it in (4, 5, 6):
        snap(k, float(it), it)
        res.setdefault("kept_while_replicating", []).append(directory.committed_iterations(k.mem))
        background.drain(k)
        replica = os.path.join(node_dir.snapshot_dir(k.mem, it), directory.rank_file_name(1 - me))
        res.setdefault("replica_inodes", []).append(os.stat(replica).st_ino)  # the other node's file, received
    res["kept"] = directory.committed_iterations(k.mem)
    state.close(k)

    rep = tier(out, persist_interval=1000)
    os.environ["TENPLEX_FAULT"] = "memory.replicate@1"  # the helpers start now: node 1's dies storing a replica
    snap(rep, 9.0, 9)
    del os.environ["TENPLEX_FAULT"]
    with warnings_logged() as caught:
        background.drain(rep)
    res["replicate_killed_warning"] = [w for w in caught if "replication" in w]
    res["after_killed_replication"] = sorted(os.listdir(os.path.join(rep.mem, "iter_0000009")))
    snap(rep, 10.0, 10)  # the restarted helpers replicate the next snapshot
    background.drain(rep)
    res["after_restart"] = sorted(os.listdir(os.path.join(rep.mem, "iter_0000010")))
    state.close(rep)

    p = tier(out, persist_interval=1)
    os.environ["TENPLEX_FAULT"] = "persist.copy"  # the helper starts now and inherits it: killed half way
    snap(p, 11.0, 11)
    del os.environ["TENPLEX_FAULT"]
    p.helper.proc.wait(timeout=300)  # the event (every rank is a node's first): the helper's death, then the job looks
    dist.barrier()
    with warnings_logged() as caught:
        res["persisted_killed"] = list(background.drain(p))  # the helper's death is reported, nothing committed
    res["persist_killed_warning"] = [w for w in caught if "persist" in w]
    r = snap(p, 12.0, 12)  # persisted by a new helper; the killed persist's staging directory is removed
    res["persist_cleaned"] = [x for x in r.removed if x.endswith(".tenplex-partial")]
    res["persisted_after"] = list(background.drain(p))
    state.close(p)
    back = Tiny(0.0)
    load(back, os.path.join(out, "ckpt"))
    res["durable_after"] = [back.it, back.matches(12.0)]
    res["died_after_answer"] = died_after_answer(out)

    res["mixed"] = mixed(os.path.join(out, "mixed"))
    res["checkpointer"] = checkpointer_rebuilt(os.path.join(out, "rebuilt"))
    for x in (t, small, fb, other):
        state.close(x)
    return res


def died_after_answer(out: str) -> dict[str, Any]:
    """The other timing of a helper's death: each node's helper (stopped, so that it cannot answer) says it is
    still working, then dies before the job checks on it: the same report as a death its poll reads."""
    d = tier(os.path.join(out, "late"), persist_interval=1)
    state.start_helpers(d)
    os.kill(d.helper.proc.pid, signal.SIGSTOP)  # the requests wait in its pipe, unanswered
    snap(d, 14.0, 14)
    answers = gather_records("asking", lambda: background.node_progress(d, 0.0), background.NodeProgress)
    said = sorted({p.state for a in answers for p in a.ops.values()})
    d.helper.proc.kill()
    d.helper.proc.wait(timeout=60)  # the event: the helper is gone
    dist.barrier()
    with warnings_logged() as caught:
        background.resolve(d, answers, "checking")
    res = {"said": said, "warnings": caught, "pending": [d.pending, d.replicating],
           "restarted": d.helper is not None and d.helper.alive}
    state.close(d)
    return res


def mixed(out: str) -> dict[str, Any]:
    """K=1 (no replicas), every snapshot persisted; node 1 loses its memory: snapshot 13 is incomplete in memory and
    whole in the durable checkpoint of the same iteration, which completes it (node 1's rank file only)."""
    me = dist.get_rank()
    m = tier(out, replicas=1, persist_interval=1)
    snap(m, 13.0, 13, local=True)
    persisted = [os.path.basename(x) for x in background.drain(m)]
    dist.barrier()
    if me == 0:
        shutil.rmtree(os.path.join(out, "mem_1", "iter_0000013"))
    dist.barrier()
    c = restart.choose(m, os.path.join(out, "ckpt"))
    back = Tiny(0.0, axis=1, local=True)
    got = restart.load_snapshot(back, m, c)
    same = Tiny(0.0, local=True)  # its layout: rank 1's rank-local entry from the durable file, rank 0's from memory
    restart.load_snapshot(same, m, c)
    state.close(m)
    return {"persisted": persisted, "chosen": c.iteration, "durable": list(c.durable), "equal": back.matches(13.0),
            "from_durable": got.bytes_from_durable, "received": got.bytes_received,
            "same_layout": [same.matches(13.0), same.state_is(13.0)]}


def checkpointer_rebuilt(out: str) -> list[dict[str, Any]]:
    """One job's Checkpointer from its flags (the hook's ``--tenplex*`` rows, ``--save``, ``--load``), twice in this
    process: restart from what is there, snapshot, finish, close; after each close, what is left of it (the
    lease, the helper process, threads, open file descriptors). The second one restarts from the first one's
    snapshot in host memory."""
    parser = argparse.ArgumentParser()
    flags.add_flags(parser.add_argument_group("tenplex"), flags.HOOK)
    parser.add_argument("--save")
    parser.add_argument("--load")
    ckpt_dir = os.path.join(out, "ckpt")
    args = parser.parse_args(["--tenplex", "--tenplex-memory", os.path.join(out, f"mem_{dist.get_rank()}"),
                              "--save", ckpt_dir, "--load", ckpt_dir, "--tenplex-job-id", "rebuilt",
                              "--tenplex-persist-interval", "1"])
    threads = {t.ident for t in threading.enumerate()}
    rounds = []
    for value in (20.0, 21.0):
        ckpt = Checkpointer(JobConfig.from_args(args, "memory_run.py"))
        held = list(ckpt.leases)
        back = Tiny(0.0, axis=1)
        engine = SimpleNamespace(adapter=lambda b=back: b,
                                 load=lambda path, scope=None, metadata=None, b=back: load(b, path, metadata=metadata))
        r = ckpt.resume(engine)
        loaded = [r.result.iteration, r.memory is not None, back.matches(r.result.iteration)] if r.loaded else None
        a = Tiny(value)
        a.it = int(value)
        ckpt.save(SimpleNamespace(adapter=lambda scope=None, t=a: t))
        ckpt.finish(over=True, say=lambda line: None)
        helper = ckpt.tier.helper if ckpt.tier is not None else None
        ckpt.close()
        gc.collect()  # what only waits for the collector (a closed Popen's pipes) is not a leak of close()
        rounds.append({
            "held": held, "loaded": loaded, "helper_started": helper is not None,
            "helper_gone": helper is None or helper.proc.poll() is not None,
            "held_after": list(ckpt.leases),
            "released": [lease.current(d).released for d in held],
            "threads_left": sorted(t.name for t in threading.enumerate() if t.ident not in threads),
            "fds": open_files(), "closed_refuses": error_of_closed(ckpt)})
    return rounds


def open_files() -> list[str]:
    """What this process's file descriptors point at (sockets and pipes by kind), sorted: a leak names itself."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        out.append(target.split(":[", 1)[0])
    return sorted(out)


def error_of_closed(ckpt: Checkpointer) -> str | None:
    try:
        ckpt.memory()
    except RuntimeError as e:
        return str(e)
    return None


def crash(point: str, out: str) -> None:
    t = tier(out, persist_interval=1000)
    snap(t, 1.0, 1, persist=True)
    background.drain(t)
    os.environ["TENPLEX_FAULT"] = f"{point}@1"
    snap(t, 2.0, 2)  # rank 1 is killed; rank 0 fails in the next collective


def check(outs: list[str]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for out in outs:
        t = tier(out, persist_interval=1000)
        choice = restart.choose(t, os.path.join(out, "ckpt"))
        a = Tiny(0.0, axis=1)
        restart.load_snapshot(a, t, choice)
        d = Tiny(0.0)
        load(d, os.path.join(out, "ckpt"))
        s = snap(t, 3.0, 3)
        res[out] = {"memory": [a.it, a.matches(float(a.it))], "durable": [d.it, d.matches(1.0)],
                    "cleaned": [x for x in s.removed if x.endswith(".tenplex-partial")]}
        state.close(t)
    return res


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hang's stacks: kill -USR1 <pid>
    dist.init_process_group("gloo")
    cmd = sys.argv[1]
    if cmd == "crash":
        crash(sys.argv[2], sys.argv[3])
    else:
        got = scenarios(sys.argv[2]) if cmd == "all" else check(sys.argv[2:])
        with open(f"{sys.argv[2]}.rank{dist.get_rank()}.json", "w") as f:
            json.dump(got, f)
    dist.destroy_process_group()
