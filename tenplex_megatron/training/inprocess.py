"""The reference trainer in place (``--tenplex-inprocess``): training inside NVIDIA Resiliency Extension's
``Wrapper``, re-entered in the same process after a fault.

Each call of the wrapped function is one job at the world NVRx admitted (``RANK``/``WORLD_SIZE`` rewritten by
it): the flags are parsed again for that world (``--tenplex-layout`` chooses anew; fixed layout flags must fit),
a process group is made on a prefix of the launcher's store, and the trainer's ``run`` builds megatron-core's
parallel state, model, optimizer and scheduler afresh and restores the newest state: the host-memory snapshot
(``--tenplex-memory``: own node's and peers' memory) re-sharded to the new layout, else the durable checkpoint.
After a fault NVRx aborts the process group; :func:`~tenplex_megatron.frontdoor.inprocess.end_aborted_call` ends what the aborted call left running (the
memory tier's helper process) before the next call. The checkpoint leases are claimed once, before the first call,
and kept across calls (``frontdoor/inprocess_lease.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psutil
import torch

from tenplex_megatron.frontdoor import inprocess, inprocess_lease, inprocess_runner, lease_flags, reform_runner
from tenplex_megatron.frontdoor.checkpointer import Checkpointer
from tenplex_megatron.frontdoor.elastic import world as launch_world
from tenplex_megatron.frontdoor.job_config import JobConfig
from tenplex_megatron.plan.layout import LayoutError
from tenplex_megatron.training import cpu_shim, layout_choice

PROG = "pretrain_gpt.py"


def why_not(parser: argparse.ArgumentParser, argv: list[str]) -> Callable[[int], str]:
    """Why the job's flags give no legal layout at a world size ("" when they do): ``--tenplex-layout``'s choice
    (every candidate refused), else the layout flags as given (TP x PP divides it, the global batch splits into
    micro-batches over DP)."""
    raw, _ = parser.parse_known_args(argv)
    _, local = launch_world()

    def reason(n: int) -> str:
        if raw.tenplex_layout:
            try:
                layout_choice.choose_for(raw, n, local)
            except (LayoutError, OSError, ValueError) as e:
                return f"--tenplex-layout {raw.tenplex_layout}: {e}"
            return ""
        tp, pp = raw.tensor_model_parallel_size or 1, raw.pipeline_model_parallel_size or 1
        ep, etp = raw.expert_model_parallel_size or 1, raw.expert_tensor_parallel_size or tp
        if n % (tp * pp):
            return f"--tensor-model-parallel-size x --pipeline-model-parallel-size = {tp} x {pp} does not divide it"
        if n % (etp * ep * pp):
            return (f"--expert-tensor-parallel-size x --expert-model-parallel-size x --pipeline-model-parallel-size = "
                    f"{etp} x {ep} x {pp} does not divide it")
        dp, mbs = n // (tp * pp), raw.micro_batch_size
        if mbs is not None and raw.global_batch_size % (mbs * dp):
            return (f"--global-batch-size {raw.global_batch_size} is not a multiple of --micro-batch-size x DP = "
                    f"{mbs} x {dp}")
        return ""

    return reason


def train_in_world(argv: list[str], parse: Callable[[list[str]], argparse.Namespace], run: Callable[..., None],
                   store: Any, timeout: float, timeline: dict[str, Any], leases: Any = None,
                   boundary: Any = None) -> None:
    """The trainer's part of one world in place (after a fault or planned; the runners do the rest): the flags
    parsed for this world (``RANK``/``WORLD_SIZE`` set by the runner), a process group on ``store``, ``run`` with
    the job's Checkpointer (``leases``: held across worlds) and, planned, the ``boundary`` hook (the memory tier's
    helpers then started after the world's first iteration, and the previous world's end in the timeline)."""
    a = parse(argv)  # the layout for this world
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                         world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=timeout))
    a.tenplex_timeline = {"process_start": psutil.Process().create_time(),
                          **(boundary.since if boundary is not None else {}), "process_group": time.time(), **timeline}
    a.tenplex_boundary = boundary
    held = lease_flags.stop_when_fenced(PROG) if leases is not None else contextlib.nullcontext()
    with held:  # leases held across worlds: a job that took a directory over stops this one (exit 3)
        ckpt = Checkpointer(JobConfig.from_args(a, PROG), leases, helpers_at_open=boundary is None)
        if boundary is not None:  # closed by the runner after the world's last barrier (run leaves it open)
            boundary.first, boundary.after = ckpt.start_background, ckpt.close
        run(a, ckpt)



def main(argv: list[str], args: argparse.Namespace, parser: argparse.ArgumentParser,
         parse: Callable[[list[str]], argparse.Namespace], run: Callable[..., None]) -> int:
    """Run the job in place: refused (naming the flag and the command) where it cannot be; else the wrapped
    training loop until the job is done. ``parse`` and ``run`` are the trainer's."""
    problem = inprocess.refusal(PROG, argv)
    if problem:
        raise SystemExit(problem)
    settings = inprocess.checked_settings(PROG, args.tenplex_inprocess_timeout)
    if not args.tenplex_memory and int(os.environ.get("RANK", "0")) == 0:
        print(f"> tenplex: warning: {inprocess.durable_only(args.save or args.load, args.save_interval)}",
              file=sys.stderr, flush=True)
    if not torch.cuda.is_available():
        cpu_shim.install()
    store = inprocess.job_store(settings.barrier)
    leases = inprocess_lease.claim(JobConfig.from_args(args, PROG), store, settings.barrier)  # kept through every call (no new generation)
    logfile = inprocess.monitor_logfile(PROG, int(os.environ["RANK"]))
    reason = why_not(parser, argv)
    wrap = inprocess.wrapper(settings, lambda n: not reason(n), finalize=inprocess.end_aborted_call, logfile=logfile,
                             why_not=reason)

    def train(it: int, store: Any) -> None:  # the job's leases are this process's across calls (claimed above)
        train_in_world(argv, parse, run, store, settings.timeout, {"inprocess_call": it}, leases)

    def no_layout() -> None:
        print(f"{PROG}: error: --tenplex-inprocess: no legal layout for the ranks left; exiting", file=sys.stderr,
              flush=True)

    inprocess_runner.wrapped(PROG, wrap, leases, store, train, lambda _it, line: reform_runner.say(line), no_layout)()
    return 0
