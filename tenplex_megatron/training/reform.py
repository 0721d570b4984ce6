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
from collections.abc import Callable
from typing import Any

import torch

from tenplex_megatron.frontdoor import inprocess, reform_runner
from tenplex_megatron.frontdoor.membership import REFORM_ENV, Generation, Membership, member_id
from tenplex_megatron.frontdoor.reform_runner import Boundary, first_generation  # noqa: F401  (their home before)
from tenplex_megatron.training import cpu_shim
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
             timeout: float) -> reform_runner.OneCall:
    """The trainer's part of a generation (:mod:`~tenplex_megatron.frontdoor.reform_runner` does the rest): the
    flags parsed for this world, a process group on the generation's store, ``run`` with the boundary hook."""

    def one(gen: Generation, store: Any, boundary: reform_runner.Boundary) -> None:
        train_in_world(argv, parse, run, store, timeout, {"generation": gen.number}, boundary=boundary)

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
    return reform_runner.run(PROG, members, member_id(), lambda n: not reason(n),
                             one_call(argv, parse, run, settings.timeout), flags=flags)
