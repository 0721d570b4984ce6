"""The one in-place runner of planned re-forms (the launcher's ``--reform``/``--join``), shared by every front door:
the reference trainer (``training/reform.py``) and Megatron-LM's ``pretrain_gpt.py`` (``megatron_lm_reform.py``).

The sequence, on torch's stores and process groups only (no NVRx, which admits only the processes it started):
this process's first generation (the launchers' initial ranks: generation 0; a newcomer: registered, then the first
generation that admits it), then for each generation it is a member of: ``RANK``/``WORLD_SIZE`` set for that world,
the front door's call made with a store on the new prefix ``tenplex-reform/<generation>`` (it makes its process
group there, builds its job, restores from host memory and trains, asking :class:`Boundary` at every iteration
boundary whether the world changes), then the process group destroyed and the front door's own state torn down. A
member that the next generation leaves out exits 0; the others re-enter with the newcomers.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tenplex_megatron import log
from tenplex_megatron.execute.collective import broadcast_json
from tenplex_megatron.frontdoor.membership import REFORM_ENV, Generation, Membership, MembershipError

_log = log.get("reform")

#: what a front door does for one generation: train until the world changes or training is over; given the
#: generation, the store its process group is made on (a fresh prefix) and the boundary hook to ask each iteration
OneCall = Callable[[Generation, Any, "Boundary"], None]


def say(msg: str) -> None:
    """A line of every rank's (before a process group, and naming the pid the tests check), through the logger."""
    log.every_rank(_log, msg)


class Boundary:
    """The trainer's hook at each iteration boundary, collective: True when the world changes after this iteration
    (the next generation kept in :attr:`next`, the time it was decided in :attr:`decided`). :attr:`first`: what a
    front door runs on every rank after the generation's first iteration (collective: the memory tier's helpers
    started, kept off the path to that iteration); :attr:`after`: what it runs once the world's process group is
    destroyed (its Checkpointer closed: a node that leaves waits on its helper there, not the ranks that stay in the
    world's last barrier); :attr:`since`: when the previous generation decided this one and was torn down
    (``time.time()``; empty for a process's first), for the front door's timeline."""

    def __init__(self, members: Membership, gen: Generation, legal: Callable[[int], bool],
                 since: Mapping[str, float] | None = None) -> None:
        self.members, self.gen, self.legal = members, gen, legal
        self.next: Generation | None = None
        self.decided: float | None = None
        self.first: Callable[[], None] | None = None
        self.after: Callable[[], None] | None = None
        self.since: dict[str, float] = dict(since or {})

    def __call__(self) -> bool:
        if self.first is not None:
            first, self.first = self.first, None
            first()
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
        self.next, self.decided = g, time.time()
        return True


def job_flags(args: Any, names: Iterable[str]) -> dict[str, Any]:
    """The flags that define a job (``names``: ``args``' attributes: the model, the global batch), by flag name,
    as they travel through the job's store (JSON)."""
    flags = {"--" + n.replace("_", "-"): getattr(args, n, None) for n in names}
    return dict(json.loads(json.dumps(flags, sort_keys=True, default=str)))


def differences(job: Mapping[str, Any], mine: Mapping[str, Any]) -> list[str]:
    """Each flag whose value differs between the running job's and a newcomer's, named with both values."""
    return [f"{k} {mine.get(k)} (the job's: {job.get(k)})" for k in sorted({*job, *mine}) if job.get(k) != mine.get(k)]


def first_generation(members: Membership, me: str, flags: Mapping[str, Any] | None = None,
                     prog: str = "pretrain_gpt.py", warm: Callable[[], None] | None = None) -> Generation | None:
    """This process's first world: generation 0 for the launchers' initial ranks, the first that admits it for a
    newcomer (None: the job ended before it was admitted). With ``flags`` (:func:`job_flags`) the initial rank 0
    publishes them and a newcomer whose flags differ is refused (``SystemExit`` naming each difference) before it
    registers: the running job is not touched. A newcomer runs ``warm`` (the front door's imports) before it
    registers: the running ranks stop at the next boundary for it, and must not wait for its imports then."""
    if os.environ.get(REFORM_ENV) == "join":
        if flags is not None:
            diff = differences(members.job(), flags)
            if diff:
                raise SystemExit(f"{prog}: error: --join: this launcher's flags differ from the running job's: "
                                 f"{'; '.join(diff)}; not registered (the job goes on unchanged)")
        if warm is not None:
            warm()
        members.register(me)
        say(f"re-form: {me} registered, waiting for the next re-form")
        return members.admitted(me)
    if flags is not None and int(os.environ["RANK"]) == 0:
        members.publish_job(flags)
    return members.start(me, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


def enter(gen: Generation, me: str) -> None:
    """This process's rank and world size in ``gen`` set where every front door reads them (torchrun's variables)."""
    rank = gen.rank(me)
    assert rank is not None
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(len(gen.members)))
    say(f"re-form: generation {gen.number}: rank {rank} of {len(gen.members)} (pid {os.getpid()})")


def session(store: Any, prefix: str, body: Callable[[Any], Any]) -> Any:
    """One world of every in-place sequence (planned or after a fault): ``body`` given a store on the fresh
    ``prefix`` (it makes its process group there and trains), then that process group destroyed."""
    out = body(torch.distributed.PrefixStore(prefix, store))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return out


def call(members: Membership, gen: Generation, me: str, legal: Callable[[int], bool], one: OneCall,
         teardown: Callable[[], None] | None = None,
         since: Mapping[str, float] | None = None) -> tuple[Generation | None, dict[str, float]]:
    """One generation's job (``one``; ``since``: :attr:`Boundary.since`), then its process group destroyed and
    ``teardown`` run: the next generation (None when training is over) and when it was decided and this one torn
    down (the next one's ``since``)."""
    enter(gen, me)
    boundary = Boundary(members, gen, legal, since)
    session(members.store, f"tenplex-reform/{gen.number}", lambda store: one(gen, store, boundary))
    if boundary.after is not None:
        boundary.after()
    if teardown is not None:
        teardown()
    if boundary.next is None:
        if gen.rank(me) == 0:
            members.end()
        return None, {}
    return boundary.next, {"boundary": boundary.decided or time.time(), "torn_down": time.time()}


@dataclass(frozen=True)
class Ends:
    """What a front door does when this process's part of the job ends: ``left`` (it left the job on notice) or
    ``over`` (training is over)."""

    left: Callable[[], None] | None = None
    over: Callable[[], None] | None = None


#: a generation failed in this process with an error: the generation to go on at (None: the job ended), or the
#: error raised again (no recovery)
Recover = Callable[[Generation, BaseException], "Generation | None"]


def run(prog: str, members: Membership, me: str, legal: Callable[[int], bool], one: OneCall,
        teardown: Callable[[], None] | None = None, first: Generation | None = None,
        flags: Mapping[str, Any] | None = None, recover: Recover | None = None, ends: Ends = Ends(),
        warm: Callable[[], None] | None = None) -> int:
    """The whole job in place: ``one`` called for each generation this process is a member of (from ``first``, by
    default :func:`first_generation`, ``flags`` checked and ``warm`` run there; a failed generation handed to
    ``recover`` where one is given); returns 0 when training is over or this process left the job."""
    gen = first
    if gen is None:
        try:
            gen = first_generation(members, me, flags, prog, warm)
        except MembershipError as e:
            raise SystemExit(f"{prog}: error: {e}") from None
        if gen is None:
            say(f"re-form: {me}: the job ended before admitting it")
    since: dict[str, float] = {}
    while gen is not None:
        try:
            gen, since = call(members, gen, me, legal, one, teardown, since)
        except Exception as e:
            if recover is None:
                raise
            gen, since = recover(gen, e), {}
        if gen is not None and gen.rank(me) is None:
            say(f"re-form: {me} leaves at generation {gen.number} (pid {os.getpid()})")
            if ends.left is not None:
                ends.left()
            return 0
    if ends.over is not None:
        ends.over()
    return 0
