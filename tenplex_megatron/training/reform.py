"""The reference trainer re-formed in place on plan (the launcher's ``--reform``, its newcomers' ``--join``):
newcomers join and ranks leave on notice at an iteration boundary, on torch's stores and process groups, without
NVRx (which admits only the processes it started).

Each generation of the job's membership (:mod:`tenplex_megatron.frontdoor.membership`) is one call of the trainer's
``run`` at that world, made by the runner every front door shares (:mod:`tenplex_megatron.frontdoor.reform_runner`): the flags parsed again for it (``--tenplex-layout`` chooses anew; fixed layout flags must
fit), a process group made on the launcher's store under ``tenplex-reform/<generation>``. At every iteration
boundary rank 0 reads the membership's change counter and broadcasts what it decided; when the world changes the
call ends there (its last iteration snapshotted into host memory and replicated, so nothing is trained twice), the
process group is destroyed, the ranks that leave exit 0 and the others, with the newcomers, call ``run`` again at
the next world, restored from host memory (``--tenplex-memory``: own node's and peers', re-sharded; a newcomer's
parts all from peers).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from tenplex_megatron.frontdoor import inprocess, inprocess_lease, reform_fault, reform_runner
from tenplex_megatron.frontdoor.job_config import JobConfig
from tenplex_megatron.frontdoor.membership import REFORM_ENV, Generation, Membership, member_id
from tenplex_megatron.frontdoor.reform_runner import Boundary, first_generation  # noqa: F401  (their home before)
from tenplex_megatron.storage import faults
from tenplex_megatron.training import cpu_shim, gpt
from tenplex_megatron.training.gpt import GPTSpec
from tenplex_megatron.training.inprocess import PROG, train_in_world, why_not

#: the flags that define the job (the model and its optimizer, the global batch): a newcomer's must equal them
JOB_FLAGS = (*(f.name for f in dataclasses.fields(GPTSpec)), "global_batch_size")


def refusal(args: argparse.Namespace) -> str | None:
    """Why this process cannot re-form in place (None: it can)."""
    if inprocess.store_address() is None:
        return f"{PROG}: error: {REFORM_ENV} is set only by {inprocess.LAUNCH} --reform (or --join), which serves " \
               "the job's store"
    if args.tenplex_inprocess:
        return f"{PROG}: error: --tenplex-inprocess (NVRx) and the launcher's --reform are two ways of re-forming " \
               "in place: give one"
    if not args.tenplex or not args.tenplex_memory:
        return f"{PROG}: error: the launcher's --reform needs --tenplex and --tenplex-memory (the next world " \
               "restores from the ranks' host memory)"
    return None


def one_call(argv: list[str], parse: Callable[[list[str]], argparse.Namespace], run: Callable[..., None],
             timeout: float, leases: Any = None) -> reform_runner.OneCall:
    """The trainer's part of a generation (:mod:`~tenplex_megatron.frontdoor.reform_runner` does the rest): the
    flags parsed for this world, a process group on the generation's store, ``run`` with the boundary hook and the
    job's leases (claimed once for the process, kept across generations)."""

    def one(gen: Generation, store: Any, boundary: reform_runner.Boundary) -> None:
        if leases is not None:
            inprocess_lease.check_kept(leases, PROG)  # another job took a directory over: this rank stops (exit 3)

        def started(a: argparse.Namespace, ckpt: Any) -> None:
            faults.maybe_fail("reform.start", int(os.environ["RANK"]), gen.number)  # tests: a member lost at start
            run(a, ckpt)

        train_in_world(argv, parse, started, store, timeout, {"generation": gen.number}, leases=leases,
                       boundary=boundary)

    return one


def main(argv: list[str], args: argparse.Namespace, parser: argparse.ArgumentParser,
         parse: Callable[[list[str]], argparse.Namespace], run: Callable[..., None]) -> int:
    """Run the job re-forming in place on plan: refused (naming why) where it cannot be; else one call of ``run``
    per generation this process is a member of. ``parse`` and ``run`` are the trainer's."""
    problem = refusal(args)
    if problem:
        raise SystemExit(problem)
    settings = inprocess.timeouts(PROG, args.tenplex_inprocess_timeout)  # planned: no NVRx needed
    if not torch.cuda.is_available():
        cpu_shim.install()
    members = Membership(inprocess.job_store(settings.barrier), settings.barrier)
    reason = why_not(parser, argv)
    flags = reform_runner.job_flags(args, JOB_FLAGS)  # a newcomer's must equal the job's
    # one lease set for the process, in its launcher's name, kept across generations (no new lease generation)
    leases = inprocess_lease.claim(JobConfig.from_args(args, PROG), members.store, settings.barrier)
    me = member_id()

    def legal(n: int) -> bool:
        return not reason(n)

    def recover(gen: Generation, error: BaseException) -> Generation | None:  # a member lost: the survivors agree
        return reform_fault.after_fault(members, gen, me, legal, settings.timeout, error)

    return reform_runner.run(PROG, members, me, legal, one_call(argv, parse, run, settings.timeout, leases),
                             flags=flags, recover=recover, ends=reform_runner.Ends(
                                 left=leases.stop_heartbeat_when_idle,  # nothing given back: the others hold them
                                 over=lambda: inprocess_lease.release(leases)), warm=gpt.warm)
