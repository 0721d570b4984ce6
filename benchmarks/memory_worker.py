"""The host-memory benchmark's worker: one rank (a node with a memory directory of its own) of the save phase at
layout A or the load phase at layout B, its records written as JSON by rank 0. ``python -m benchmarks.memory``
starts it under torchrun with internal flags; what is measured and why is that module's docstring."""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import faulthandler
import functools
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from benchmarks.kit import gpt_job, launch
from benchmarks.kit.disk import evict_page_cache, resident_bytes
from benchmarks.kit.measure import gathered, rotated, timed
from benchmarks.memory import LIVE, LOAD_SYSTEMS, RESTART_ONLY, SAVE_SYSTEMS
from tenplex_megatron.execute.collective import all_gather_json
from tenplex_megatron.integrations.megatron_core.adapter import MegatronCoreAdapter, load_job, save_job
from tenplex_megatron.integrations.megatron_core.optimizer import allocate_state
from tenplex_megatron.integrations.megatron_core.sharded import describe_job
from tenplex_megatron.memory import background, restart, state
from tenplex_megatron.memory.settings import MemorySettings
from tenplex_megatron.memory.snapshot import snapshot
from tenplex_megatron.memory.state import MemoryTier
from tenplex_megatron.training import gpt, mcore_dist_ckpt


@dataclasses.dataclass
class Worker:
    """This rank's job, its node's memory tier, where the durable systems save, and the records sent back."""

    args: argparse.Namespace
    job: gpt.GPTJob
    adapter: MegatronCoreAdapter
    tier: MemoryTier
    rank: int
    durable: str
    mcore_dir: str
    out: dict[str, Any]

    def rec(self, system: str, record: dict[str, Any]) -> None:
        """One repetition of ``system``: every rank's record."""
        self.out["reps"].setdefault(system, []).append(gathered(record))

    def profiled(self, system: str, rep: int, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn``, under cProfile when ``--profile`` names ``system`` and ``rep`` is the last repetition."""
        if self.args.profile != system or rep != self.args.reps - 1:
            return fn
        return _profiled(fn, os.path.join(self.args.profile_dir, f"profile_{system}_rank{self.rank}.pstats"))


def run(a: argparse.Namespace) -> None:
    """One rank of one phase: the job built, the phase run, the records written, the process group ended."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hang's stacks: kill -USR1 <pid>
    job = gpt_job.build(a.spec, a.layout, a.gbs, a.padded)
    rank = dist.get_rank()
    durable = os.path.join(a.dir, "durable")
    tier = state.open_tier(MemorySettings(os.path.join(a.memdir, f"mem_{rank}"), durable, durable,
                                          persist_interval=10**9, replicas=2, keep=1))
    w = Worker(a, job, MegatronCoreAdapter(job), tier, rank, durable, os.path.join(a.dir, "mcore"),
               {"phase": a.phase, "reps": {}})
    (save_phase if a.phase == "save" else load_phase)(w)
    state.close(tier)
    if rank == 0:
        launch.write_json(a.result, w.out)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the save phase


def save_phase(w: Worker) -> None:
    """One training step; the save rows and the step slowdown (not with --restart-only); then the final state
    saved by every system and the losses the loads must reproduce."""
    gpt.train_step(w.job, gpt_job.data(w.job, 0))
    _, own = describe_job(w.job)
    w.out["own_bytes"] = all_gather_json(sum(lc.data.numel() * lc.data.element_size() for lc in own))
    queue = AsyncCallsQueue()
    it0 = w.job.iteration  # every snapshot below is of this iteration (retention keeps the newest one)
    if not w.args.restart_only:
        first_snapshots(w)
        for rep in range(w.args.reps):
            for system in rotated(list(SAVE_SYSTEMS), rep):
                w.rec(system, save_once(w, system, rep, own, queue))
        w.out["steps"] = all_gather_json(slowdown(w, it0, queue))
    w.job.iteration = it0
    snapshot(w.adapter, w.tier, persist=False)
    background.drain(w.tier)
    save_job(w.job, w.durable)
    if not w.args.restart_only:
        mcore_dist_ckpt.save_checkpoint(w.job, w.mcore_dir, check=False)
    w.out["iteration"] = w.job.iteration
    w.out["ref"] = gpt_job.step2_losses(w.job)


def first_snapshots(w: Worker) -> None:
    """The job's first two snapshots, measured apart: they write fresh tmpfs pages (from the third on, each writes
    over the spare that the snapshot before the last left), so the repetitions are the steady state."""
    for _ in range(2):
        res, r = timed(lambda: snapshot(w.adapter, w.tier, persist=False))
        r["stall"] = res.seconds
        background.drain(w.tier)
        w.rec("snapshot_first", r)


def save_once(w: Worker, system: str, rep: int, own: list[Any], queue: AsyncCallsQueue) -> dict[str, Any]:
    """One repetition of one save system: this rank's record."""
    if system == "memcpy":
        return _memcpy(own)
    if system == "snapshot":
        return _snapshot_stall(w, rep)
    if system == "tenplex_sync":
        _, r = timed(lambda: save_job(w.job, os.path.join(w.durable + "_sync", f"rep{rep}")))
        return r
    return _mcore_async(w, rep, queue)


def _memcpy(own: list[Any]) -> dict[str, Any]:
    """The floor: a plain copy of every chunk the rank holds into fresh memory."""
    def copy() -> None:
        for lc in own:
            torch.empty_like(lc.data).copy_(lc.data)
    return timed(copy)[1]


def _snapshot_stall(w: Worker, rep: int) -> dict[str, Any]:
    """A snapshot's blocking part and its phases; its replicas put in place before the next system runs."""
    res, r = timed(w.profiled("snapshot", rep, lambda: snapshot(w.adapter, w.tier, persist=False)))
    r["stall"] = res.seconds
    r["phases"] = dict(res.phases)
    background.drain(w.tier)
    return r


def _mcore_async(w: Worker, rep: int, queue: AsyncCallsQueue) -> dict[str, Any]:
    """megatron-core's async save: its stall (the call) and its total (until the background write is finalized)."""
    target = os.path.join(w.mcore_dir + "_async", f"rep{rep}")
    t0 = time.perf_counter()
    _, r = timed(lambda: mcore_dist_ckpt.save_async(w.job, target, queue))
    queue.maybe_finalize_async_calls(blocking=True)
    dist.barrier()
    r["total"] = time.perf_counter() - t0
    return r


def slowdown(w: Worker, it0: int, queue: AsyncCallsQueue) -> dict[str, Any]:
    """The training steps alone, in each kind of background window, and after megatron-core's async save.

    The kinds: unlimited with the durable copy; the same without it (the snapshots between two persists, with
    --tenplex-persist-interval above 1); capped (--replication-rate) with the durable copy; auto
    (--tenplex-replication-rate auto: paced by the time since the window before's snapshot). Each kind --windows
    times (default --reps), round-robin, each window right after a step alone ("before"): its pair, so that the
    slowdown is read against the steps around it, not against one baseline a drift moves.
    """
    a = w.args
    start = w.job.consumed_samples  # each step the same data: only the time matters
    alone = steps(w, start, a.steps)
    kinds: list[tuple[float | str, bool]] = [(0.0, True), (0.0, False)] + (
        [(a.replication_rate, True)] if a.replication_rate else []) + [("auto", True)]
    windows = []
    for rep in range(a.windows or a.reps):
        for k in rotated(list(range(len(kinds))), rep):
            before = steps(w, start, 1)
            windows.append({**window(w, it0, start, *kinds[k]), "kind": k, "before": before})
    w.tier.settings = dataclasses.replace(w.tier.settings, replication_rate=0.0)  # the final snapshot: at once
    w.job.iteration = it0
    alone += steps(w, start, a.steps)  # the baseline on both sides of the windows: drift does not count as slowdown
    w.job.iteration = it0
    mcore_dist_ckpt.save_async(w.job, os.path.join(w.mcore_dir + "_async", "bg"), queue)
    during_mcore = steps(w, start, a.steps)
    queue.maybe_finalize_async_calls(blocking=True)
    return {"alone": alone, "windows": windows, "during_mcore": during_mcore}


def steps(w: Worker, start: int, n: int) -> list[float]:
    """``n`` training steps on the data from ``start``: each one's seconds."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        gpt.train_step(w.job, gpt_job.data(w.job, start))
        times.append(time.perf_counter() - t0)
    return times


def window(w: Worker, it0: int, start: int, rate: float | str, persist: bool = True) -> dict[str, Any]:
    """The steps begun while a snapshot's background work (replication at ``rate`` MB/s, 0: unlimited, or
    ``auto``: paced by the time since the last snapshot, then the durable copy if ``persist``, in the helper
    processes) runs: until it is done, at least 1, at most 8x --steps."""
    tier = w.tier
    tier.settings = dataclasses.replace(tier.settings, replication_rate=rate)
    w.job.iteration = it0
    cpu0 = _helper_cpu(tier)
    t_bg = time.perf_counter()
    since = None if tier.last_snapshot_at is None else t_bg - tier.last_snapshot_at  # what auto paces by
    res = snapshot(w.adapter, tier, persist=persist)
    times: list[float] = []
    while not times or (len(times) < 8 * w.args.steps and background.busy(tier)):
        times += steps(w, start, 1)  # at least one step: a background done before the first still counts
    finished = not background.busy(tier)
    background.drain(tier)
    return {"during": times, "background": time.perf_counter() - t_bg, "finished": finished,
            "helper_cpu": _helper_cpu(tier) - cpu0, "snapshot_stall": res.seconds, "rate": tier.settings.rate_cap,
            "pace": tier.settings.pace, "persist": persist, "since_last_snapshot": since}


# ---------------------------------------------------------------- the load phase


def load_phase(w: Worker) -> None:
    """Every load system, repetitions round-robin: first with every node alive (memory_live), then node 1 lost;
    each checked after its last repetition; then the first training step after a load."""
    a = w.args
    allocate_state(w.job.optimizer)
    dist.barrier()  # every rank is up: process start, imports, process group, model and optimizer built
    w.out["startup"] = max(all_gather_json(time.time() - a.t_launch))
    # the destination's pages touched once, untimed: the first load into fresh tensors pays their page faults
    # (~0.3 s at 125M), whatever its source, and memory_live always goes first
    gpt_job.zero_state(w.job)
    others = [x for x in LOAD_SYSTEMS if x not in LIVE and not (a.restart_only and x not in RESTART_ONLY)]
    order = [(rep, system) for rep in range(a.reps) for system in LIVE]  # every node alive
    order += [(rep, system) for rep in range(a.reps) for system in rotated(others, rep)]
    for i, (rep, system) in enumerate(order):
        if i == a.reps * len(LIVE) and "memory" in others:
            lose_node_1(w)
        load_once(w, system, rep)
    # the first training step after a load: the state is in the process's own memory by then, whatever the
    # source, so one step measured once stands for every system's
    _, r = timed(lambda: gpt.train_step(w.job, gpt_job.data(w.job, w.job.consumed_samples)))
    w.out["first_step"] = max(all_gather_json(r["seconds"]))


def lose_node_1(w: Worker) -> None:
    """Node 1 is lost (its id stays: empty memory): its rank deletes its own node's snapshots."""
    dist.barrier()
    if w.rank == 1:
        for name in os.listdir(w.tier.mem):
            if name.startswith("iter_"):
                shutil.rmtree(os.path.join(w.tier.mem, name))
    dist.barrier()


def load_once(w: Worker, system: str, rep: int) -> None:
    """One repetition of one load system; cold: the checkpoint's pages evicted first, and checked gone
    (mincore); the last repetition loads into zeroed state and is checked against the saved losses."""
    last = rep == w.args.reps - 1
    if last:
        gpt_job.zero_state(w.job)
    base = system.removesuffix("_cold").removesuffix("_live")
    cached = None
    if system.endswith("_cold"):
        target = w.durable if base == "durable" else w.mcore_dir
        evict_page_cache(target)
        cached = resident_bytes(target)
    got, r = timed(w.profiled(system, rep, functools.partial(LOADS[base], w)))
    w.rec(system, {**r, **got, "cached_before": cached})
    if last:
        w.out.setdefault("check", {})[system] = gpt_job.check(w.job)


def _from_memory(w: Worker) -> dict[str, Any]:
    """Restart from the newest snapshot complete in live memory (node 1's rank: received from node 0's)."""
    choice = restart.choose(w.tier, w.durable)
    if choice is None:
        raise RuntimeError("no complete snapshot in live memory")
    m = restart.load_snapshot(w.adapter, w.tier, choice)
    return {"from_durable": m.bytes_from_durable, "received": m.bytes_received}


def _from_durable(w: Worker) -> dict[str, Any]:
    """tenplex's load of the durable checkpoint."""
    res = load_job(w.job, w.durable)
    return {"from_durable": res.bytes_fetched, "received": 0}


def _from_mcore(w: Worker) -> dict[str, Any]:
    """megatron-core's load of its own checkpoint."""
    mcore_dist_ckpt.load_checkpoint(w.job, w.mcore_dir)
    return {"from_durable": None, "received": 0}


LOADS: dict[str, Callable[[Worker], dict[str, Any]]] = {
    "memory": _from_memory, "durable": _from_durable, "mcore": _from_mcore}


# ---------------------------------------------------------------- helpers


def _profiled(fn: Callable[[], Any], path: str) -> Callable[[], Any]:
    """``fn`` run under cProfile, its statistics written to ``path`` (``python -m pstats PATH`` reads them)."""
    def call() -> Any:
        prof = cProfile.Profile()
        prof.enable()
        try:
            return fn()
        finally:
            prof.disable()
            prof.dump_stats(path)
    return call


def _helper_cpu(tier: MemoryTier) -> float:
    """CPU seconds (user + system) this rank's node helper process has used so far (0 on a rank without one)."""
    if tier.helper is None or not tier.helper.alive:
        return 0.0
    t = psutil.Process(tier.helper.proc.pid).cpu_times()
    return float(t.user + t.system)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags ``benchmarks.memory`` passes (internal: the user's flags are that module's)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=("save", "load"), required=True)
    ap.add_argument("--layout", type=int, nargs=3, required=True)
    for flag in ("--spec", "--dir", "--memdir", "--result"):
        ap.add_argument(flag, required=True)
    for flag in ("--padded", "--gbs", "--reps", "--windows", "--steps"):
        ap.add_argument(flag, type=int, required=True)
    ap.add_argument("--replication-rate", type=float, default=0.0)
    ap.add_argument("--t-launch", type=float, required=True)
    ap.add_argument("--restart-only", action="store_true")
    ap.add_argument("--profile", choices=("snapshot", *LOAD_SYSTEMS), default=None)
    ap.add_argument("--profile-dir", default=None)
    return ap.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
    sys.exit(0)
