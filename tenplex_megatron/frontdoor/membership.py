"""Who trains next: the membership of a job that re-forms in place on plan (newcomers join, ranks leave on notice),
kept in the job's store (served by :mod:`tenplex_megatron.frontdoor.launch`) without NVRx.

Each process is a member, named by a stable id (:func:`member_id`: host and pid). A generation is one world: its
members in rank order (dense ranks 0..n-1) and the registrations and notices it accounts for. Keys, under
``tenplex-members/``:

- ``joins`` (a counter) and ``join/<k>`` (the k-th newcomer's id): :meth:`Membership.register`;
- ``leaves`` (a counter) and ``leave/<k>`` (a JSON list of the ids that leave): :meth:`Membership.notice_leave`;
- ``changes``: a counter raised by both, the one key the running ranks read at an iteration boundary;
- ``gen/<n>``: generation n as JSON, written once by the rank 0 that decided it; ``over``: the job ended;
- ``node/<r>``: the ids of node ``r``'s ranks (a JSON list, written by its launcher) and ``store-node``: the node
  whose launcher serves the store; a leave by command (``tenplex-megatron leave``) names a node by them.
- ``job``: the flags that define the job (model, global batch) as JSON, which a newcomer's must equal.

At a boundary rank 0 reads ``changes`` (:meth:`Membership.pending`); when it moved, rank 0 proposes the next world
(:meth:`Membership.propose`: the members that do not leave, in their order, then the newcomers in registration
order), publishes it when it is legal and differs, and every running rank learns it by one broadcast. A world with
no legal layout is refused: the old one is kept and the registrations stay pending (a later change may make them
legal). Newcomers wait for the first generation that names them (:meth:`Membership.admitted`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from tenplex_megatron import log as tlog
from tenplex_megatron.errors import TenplexError

log = tlog.get("membership")

PREFIX = "tenplex-members/"
REFORM_ENV = "TENPLEX_REFORM"  # set by the launcher's --reform ("run") and --join ("join") for its ranks
#: set for the ranks of a --reform launcher that does not serve the stores: their SIGTERM is ignored (Slurm signals
#: every process of a step), their launcher turns its own into their leave notice
LEAVES_ENV = "TENPLEX_REFORM_LEAVE_ON_SIGTERM"


class MembershipError(TenplexError, RuntimeError):
    """The job's membership could not be read or agreed on (a store key that never came, a malformed record)."""


def member_id(pid: int | None = None, host: str | None = None) -> str:
    """A process's id in the job: its host and pid (stable for the process's life, unique in the job)."""
    return f"{host or socket.gethostname()}:{os.getpid() if pid is None else pid}"


@dataclass(frozen=True)
class Generation:
    """One world of the job: ``members`` in rank order; ``joins``/``leaves``: the registrations and leave notices
    it accounts for; ``changes``: the change counter it has seen (a refused change is seen, not applied)."""

    number: int
    members: tuple[str, ...]
    joins: int = 0
    leaves: int = 0
    changes: int = 0

    def rank(self, member: str) -> int | None:
        """``member``'s rank in this world (None: not a member)."""
        return self.members.index(member) if member in self.members else None

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "members": list(self.members), "joins": self.joins,
                           "leaves": self.leaves, "changes": self.changes})

    @classmethod
    def from_json(cls, text: str | bytes) -> Generation:
        try:
            d = json.loads(text)
            return cls(int(d["number"]), tuple(str(m) for m in d["members"]), int(d["joins"]), int(d["leaves"]),
                       int(d["changes"]))
        except (ValueError, KeyError, TypeError) as e:
            raise MembershipError(f"a malformed generation record in the job's store: {e}") from None


class Membership:
    """The membership keys of a job's store (``store``: a ``torch.distributed`` store: the launcher's TCPStore, or
    a ``HashStore`` in tests); ``timeout``: seconds to wait for a key another process writes."""

    def __init__(self, store: Any, timeout: float = 300.0) -> None:
        self.store = store
        self.timeout = timeout

    def _counter(self, name: str, add: int = 0) -> int:
        return int(self.store.add(PREFIX + name, add))

    def _get(self, key: str) -> bytes:
        try:
            self.store.wait([PREFIX + key], timedelta(seconds=self.timeout))
            return bytes(self.store.get(PREFIX + key))
        except RuntimeError as e:  # torch's DistStoreError: the writer died before writing it
            raise MembershipError(f"the job's store key {PREFIX + key} did not come within {self.timeout:g} s "
                                  f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None

    # -- the writers ---------------------------------------------------------------------------------------------

    def register(self, member: str) -> int:
        """A newcomer asks to join: its registration number (1, 2, ...)."""
        k = self._counter("joins", 1)
        self.store.set(f"{PREFIX}join/{k}", member)
        self._counter("changes", 1)  # after the id is readable: whoever sees the change finds it
        log.info("membership: %s registered to join (registration %d)", member, k)
        return k

    def notice_leave(self, members: Sequence[str]) -> int:
        """``members`` leave at the next boundary (a scheduler's notice): the notice's number."""
        k = self._counter("leaves", 1)
        self.store.set(f"{PREFIX}leave/{k}", json.dumps(list(members)))
        self._counter("changes", 1)
        log.info("membership: leave notice %d for %s", k, ", ".join(members))
        return k

    def publish(self, gen: Generation) -> None:
        """Generation ``gen`` decided (by the running world's rank 0, or the initial one)."""
        self.store.set(f"{PREFIX}gen/{gen.number}", gen.to_json())

    def start(self, member: str, rank: int, world: int) -> Generation:
        """Every initial rank: generation 0, the launchers' ranks in their order (rank 0 gathers and publishes)."""
        self.store.set(f"{PREFIX}start/{rank}", member)
        if rank == 0:
            ids = tuple(self._get(f"start/{r}").decode() for r in range(world))
            self.publish(Generation(0, ids))  # a registration already made is pending for it
        return self.generation(0)

    def name_node(self, node: int, ids: Sequence[str], serving: bool) -> None:
        """Node ``node``'s launcher: its ranks' ids (a leave by command names the node); ``serving``: it serves the
        job's store."""
        self.store.set(f"{PREFIX}node/{node}", json.dumps(list(ids)))
        if serving:
            self.store.set(PREFIX + "store-node", str(node))

    def node(self, node: int) -> tuple[list[str] | None, int | None]:
        """Node ``node``'s rank ids (None: no launcher named it) and the node serving the store (None: unnamed)."""
        ids = json.loads(bytes(self.store.get(f"{PREFIX}node/{node}"))) if self.store.check(
            [f"{PREFIX}node/{node}"]) else None
        serving = int(bytes(self.store.get(PREFIX + "store-node"))) if self.store.check(
            [PREFIX + "store-node"]) else None
        return ids, serving
    def publish_job(self, flags: Mapping[str, Any]) -> None:
        """The initial rank 0: the flags that define the job (model, global batch), which a newcomer must match."""
        self.store.set(PREFIX + "job", json.dumps(dict(flags), sort_keys=True, default=str))

    def job(self) -> dict[str, Any]:
        """The running job's defining flags (:meth:`publish_job`), waited for."""
        try:
            return dict(json.loads(self._get("job")))
        except (ValueError, TypeError) as e:
            raise MembershipError(f"a malformed job record in the job's store: {e}") from None

    def end(self) -> None:
        """The job is over: newcomers still waiting stop waiting."""
        self.store.set(PREFIX + "over", "1")

    # -- the readers ---------------------------------------------------------------------------------------------

    def generation(self, number: int) -> Generation:
        """Generation ``number``, waited for."""
        return Generation.from_json(self._get(f"gen/{number}"))

    def pending(self, gen: Generation) -> bool:
        """Cheap (one store read): whether a registration or leave notice came since ``gen`` was decided."""
        return self._counter("changes") != gen.changes

    def propose(self, gen: Generation, legal: Callable[[int], bool]) -> Generation:
        """The world after ``gen``: its members that do not leave, then the newcomers; the next generation when it
        differs and ``legal`` admits its size, else ``gen`` with the change seen (the registrations and notices
        left pending, so that a later change may make them legal)."""
        changes = self._counter("changes")
        joins, leaves = self._counter("joins"), self._counter("leaves")
        newcomers = [self._get(f"join/{k}").decode() for k in range(gen.joins + 1, joins + 1)]
        leaving: set[str] = set()
        for k in range(gen.leaves + 1, leaves + 1):
            leaving.update(str(m) for m in json.loads(self._get(f"leave/{k}")))
        members = tuple(m for m in gen.members if m not in leaving) + tuple(
            m for m in newcomers if m not in leaving and m not in gen.members)
        if members == gen.members:
            return replace(gen, joins=joins, leaves=leaves, changes=changes)
        if not members or not legal(len(members)):
            log.warning("membership: a world of %d rank(s) (%d joining, %d leaving) has no legal layout: keeping "
                        "the %d rank(s) of generation %d", len(members), len(newcomers), len(leaving),
                        len(gen.members), gen.number)
            return replace(gen, changes=changes)
        return Generation(gen.number + 1, members, joins, leaves, changes)

    def admitted(self, member: str, first: int = 1, poll: float = 0.05) -> Generation | None:
        """A newcomer: the first generation from ``first`` on that names ``member`` (waits for as long as the job
        runs; a generation that leaves it out is skipped); None once the job is over (:meth:`end`)."""
        n = first
        while True:
            key = f"{PREFIX}gen/{n}"
            try:
                if not self.store.check([key]):
                    if self.store.check([PREFIX + "over"]):
                        return None
                    time.sleep(poll)
                    continue
                gen = Generation.from_json(bytes(self.store.get(key)))
            except RuntimeError as e:  # torch's DistNetworkError: the job's store (its node 0's launcher) is gone
                raise MembershipError(f"the job's store went away while {member} waited to join "
                                      f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
            if member in gen.members:
                return gen
            n += 1
