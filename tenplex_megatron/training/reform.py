"""The reference trainer re-formed in place on plan (the launcher's ``--reform``, its newcomers' ``--join``):
newcomers join and ranks leave on notice at an iteration boundary, on torch's stores and process groups, without
NVRx (which admits only the processes it started).

Each generation of the job's membership (:mod:`tenplex_megatron.frontdoor.membership`) is one call of the trainer's
``run`` at that world: the flags parsed again for it (``--tenplex-layout`` chooses anew; fixed layout flags must
fit), a process group made on the launcher's store under ``tenplex-reform/<generation>``. At every iteration
boundary rank 0 reads the membership's change counter and broadcasts what it decided; when the world changes the
call ends there (its last iteration snapshotted into host memory and replicated, so nothing is trained twice), the
process group is destroyed, the ranks that leave exit 0 and the others, with the newcomers, call ``run`` again at
the next world, restored from host memory (``--tenplex-memory``: own node's and peers', re-sharded; a newcomer's
parts all from peers).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psutil
import torch

from tenplex_megatron.execute.collective import broadcast_json
from tenplex_megatron.frontdoor import inprocess, inprocess_lease, lease_flags
from tenplex_megatron.frontdoor.checkpointer import Checkpointer
from tenplex_megatron.frontdoor.job_config import JobConfig
from tenplex_megatron.frontdoor.membership import REFORM_ENV, Generation, Membership, MembershipError, member_id
from tenplex_megatron.storage import faults
from tenplex_megatron.training import cpu_shim, reform_fault
from tenplex_megatron.training.inprocess import PROG, why_not


def _say(msg: str) -> None:
    """A line of every rank's (before a process group, and naming the pid the tests check)."""
    print(f"> tenplex-megatron: {msg}", flush=True)


class Boundary:
    """The trainer's hook at each iteration boundary (``args.tenplex_boundary``), collective: True when the world
    changes after this iteration (the next generation kept in :attr:`next`)."""

    def __init__(self, members: Membership, gen: Generation, legal: Callable[[int], bool]) -> None:
        self.members, self.gen, self.legal = members, gen, legal
        self.next: Generation | None = None

    def __call__(self) -> bool:
        decided = None
        if torch.distributed.get_rank() == 0 and self.members.pending(self.gen):
            g = self.members.propose(self.gen, self.legal)
            if g.number != self.gen.number:
                self.members.publish(g)
            decided = g.to_json()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" \
            else torch.device("cpu")
        flag = torch.tensor([decided is not None], dtype=torch.int32, device=device)
        torch.distributed.broadcast(flag, 0)  # the one collective of an iteration without a change
        if not int(flag.item()):
            return False
        g = Generation.from_json(broadcast_json(decided, 0))
        if g.number == self.gen.number:  # refused (no legal layout) or nothing left to change: seen
            self.gen = g
            return False
        self.next = g
        return True


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


def first_generation(members: Membership, me: str) -> Generation | None:
    """This process's first world: generation 0 for the launchers' initial ranks, the first that admits it for a
    newcomer (None: the job ended before it was admitted)."""
    if os.environ.get(REFORM_ENV) == "join":
        members.register(me)
        _say(f"re-form: {me} registered, waiting for the next re-form")
        return members.admitted(me)
    return members.start(me, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


def call(argv: list[str], parse: Callable[[list[str]], argparse.Namespace], run: Callable[..., None],
         members: Membership, gen: Generation, me: str, legal: Callable[[int], bool],
         timeout: float, leases: Any = None) -> Generation | None:
    """One generation's job: train until the world changes (returns the next generation) or training is over
    (None). ``leases``: the job's leases, claimed once for the process and kept across generations."""
    rank, world = gen.rank(me), len(gen.members)
    assert rank is not None
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    _say(f"re-form: generation {gen.number}: rank {rank} of {world} (pid {os.getpid()})")
    if leases is not None:
        inprocess_lease.check_kept(leases, PROG)  # another job took a directory over: this rank stops (exit 3)
    a = parse(argv)  # the layout for this world
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend, store=torch.distributed.PrefixStore(
        f"tenplex-reform/{gen.number}", members.store), rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout))
    faults.maybe_fail("reform.start", rank, gen.number)  # tests: a member lost as a generation starts
    a.tenplex_timeline = {"process_start": psutil.Process().create_time(), "process_group": time.time(),
                          "generation": gen.number}
    boundary = Boundary(members, gen, legal)
    a.tenplex_boundary = boundary
    with lease_flags.stop_when_fenced(PROG):
        run(a, Checkpointer(JobConfig.from_args(a, PROG), leases))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if boundary.next is None:
        if rank == 0:
            members.end()
        return None
    return boundary.next


def main(argv: list[str], args: argparse.Namespace, parser: argparse.ArgumentParser,
         parse: Callable[[list[str]], argparse.Namespace], run: Callable[..., None]) -> int:
    """Run the job re-forming in place on plan: refused (naming why) where it cannot be; else one call of ``run``
    per generation this process is a member of. ``parse`` and ``run`` are the trainer's."""
    problem = refusal(args)
    if problem:
        raise SystemExit(problem)
    settings = inprocess.checked_settings(PROG, args.tenplex_inprocess_timeout)
    if not torch.cuda.is_available():
        cpu_shim.install()
    members = Membership(inprocess.job_store(settings.barrier), settings.barrier)
    me, reason = member_id(), why_not(parser, argv)
    # one lease set for the process, in its launcher's name, kept across generations (no new lease generation)
    leases = inprocess_lease.claim(JobConfig.from_args(args, PROG), members.store, settings.barrier)
    try:
        gen = first_generation(members, me)
    except MembershipError as e:
        raise SystemExit(f"{PROG}: error: {e}") from None
    if gen is None:
        _say(f"re-form: {me}: the job ended before admitting it")

    def legal(n: int) -> bool:
        return not reason(n)

    while gen is not None:
        try:
            gen = call(argv, parse, run, members, gen, me, legal, settings.timeout, leases)
        except Exception as e:  # a member lost: the survivors agree on the next world (else raised again)
            gen = reform_fault.after_fault(members, gen, me, legal, settings.timeout, e)
        if gen is not None and gen.rank(me) is None:
            _say(f"re-form: {me} leaves at generation {gen.number} (pid {os.getpid()})")
            leases.stop_heartbeat_when_idle()  # nothing given back: the ranks that stay hold these leases
            return 0
    inprocess_lease.release(leases)
    return 0
