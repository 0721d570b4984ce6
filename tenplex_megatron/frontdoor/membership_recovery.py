"""After a fault in a generation of a job that re-forms in place on plan (``--reform``): who is left, and the next
world, agreed on in the job's store without NVRx.

A member died (SIGKILLed, its node lost) while generation ``g`` ran or re-formed: its peers' collectives failed.
Every survivor reports itself alive under ``tenplex-members/fail/<g>/``; the first to report leads: it waits until
every member of ``g`` reported or ``settle`` seconds passed, then decides. The next world is the members of ``g``
that reported, in their order, less those a leave notice names (they go as on plan), cut to the largest size with a
legal layout; the ones cut off are spares (they register again as newcomers and wait). Registrations not yet
admitted stay pending (a newcomer that died before its admission must not be admitted now); the next boundary
proposes them. When every member reported (no one died: the fault was not a lost member) or no legal world is
left, the decision is to abort, and every survivor raises its error.

Keys: ``fail/<g>/alive`` (a counter) and ``fail/<g>/alive/<k>`` (the k-th reporter's id), ``fail/<g>/leader``
(a counter: whoever raised it to 1 leads), ``fail/<g>/decision`` (JSON: the generation's number and the spares,
or ``abort`` with why). The new generation is published with ``compare_set``: where a boundary had already
published ``g + 1`` before the fault, the next free number is used.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from tenplex_megatron import log as tlog
from tenplex_megatron.frontdoor.membership import PREFIX, Generation, Membership, MembershipError

log = tlog.get("membership")


@dataclass(frozen=True)
class Decision:
    """What the survivors of a failed generation do: train at ``gen`` (None: abort, ``why`` says why); ``spares``:
    survivors left out for want of a legal layout (they register again)."""

    gen: Generation | None
    spares: tuple[str, ...] = ()
    why: str = ""


def _key(g: int, name: str) -> str:
    return f"{PREFIX}fail/{g}/{name}"


def report(members: Membership, gen: Generation, me: str) -> bool:
    """``me`` survived generation ``gen``'s fault: reported alive; True when ``me`` leads the decision."""
    k = int(members.store.add(_key(gen.number, "alive"), 1))
    members.store.set(_key(gen.number, f"alive/{k}"), me)
    return int(members.store.add(_key(gen.number, "leader"), 1)) == 1


def survivors(members: Membership, gen: Generation, settle: float, poll: float = 0.05) -> list[str]:
    """The members of ``gen`` that reported alive: waited for until all did or ``settle`` seconds passed."""
    deadline = time.monotonic() + settle
    while int(members.store.add(_key(gen.number, "alive"), 0)) < len(gen.members) and time.monotonic() < deadline:
        time.sleep(poll)
    n = int(members.store.add(_key(gen.number, "alive"), 0))
    alive = {bytes(members.store.get(_key(gen.number, f"alive/{k}"))).decode() for k in range(1, n + 1)}
    return [m for m in gen.members if m in alive]


def leaving(members: Membership, gen: Generation) -> tuple[set[str], int]:
    """The ids every leave notice since ``gen`` names, and the notice counter read."""
    leaves = int(members.store.add(PREFIX + "leaves", 0))
    out: set[str] = set()
    for k in range(gen.leaves + 1, leaves + 1):
        out.update(str(m) for m in json.loads(bytes(members.store.get(f"{PREFIX}leave/{k}"))))
    return out, leaves


def decide(members: Membership, gen: Generation, alive: list[str], legal: Callable[[int], bool]) -> Decision:
    """The leader's decision from the survivors ``alive`` (in ``gen``'s order)."""
    if len(alive) == len(gen.members):
        return Decision(None, why=f"every member of generation {gen.number} is alive: the error was not a lost "
                                  "member")
    gone, leaves = leaving(members, gen)
    stay = [m for m in alive if m not in gone]
    n = next((k for k in range(len(stay), 0, -1) if legal(k)), 0)
    if n == 0:
        return Decision(None, why=f"{len(stay)} member(s) left after generation {gen.number}'s fault and no legal "
                                  "layout at any world size up to it")
    number = gen.number + 1
    while True:  # a boundary may have published gen.number + 1 before the fault: the next free number
        nxt = Generation(number, tuple(stay[:n]), gen.joins, leaves, gen.changes)
        if bytes(members.store.compare_set(f"{PREFIX}gen/{number}", "", nxt.to_json())).decode() == nxt.to_json():
            break
        number += 1
    lost = [m for m in gen.members if m not in alive]
    log.warning("membership: generation %d failed (lost: %s); generation %d: %d member(s)%s", gen.number,
                ", ".join(lost), number, n, f", {len(stay) - n} spare(s)" if len(stay) > n else "")
    return Decision(nxt, tuple(stay[n:]))


def _publish(members: Membership, g: int, d: Decision) -> None:
    record = {"abort": d.why} if d.gen is None else {"number": d.gen.number, "spares": list(d.spares)}
    members.store.set(_key(g, "decision"), json.dumps(record))


def _read(members: Membership, g: int) -> Decision:
    try:
        d = json.loads(members._get(f"fail/{g}/decision"))
    except ValueError as e:
        raise MembershipError(f"a malformed recovery decision in the job's store: {e}") from None
    if "abort" in d:
        return Decision(None, why=str(d["abort"]))
    return Decision(members.generation(int(d["number"])), tuple(str(m) for m in d["spares"]))


def recover(members: Membership, gen: Generation, me: str, legal: Callable[[int], bool], settle: float) -> Decision:
    """A survivor of generation ``gen``'s fault: what to do next, agreed with the other survivors."""
    if report(members, gen, me):
        _publish(members, gen.number, decide(members, gen, survivors(members, gen, settle), legal))
    return _read(members, gen.number)
