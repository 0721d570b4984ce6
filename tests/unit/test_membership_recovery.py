"""After a fault in a re-forming job (frontdoor/membership_recovery.py) on real torch stores: the survivors report,
the first leads, the next world is the survivors less the leavers cut to a legal size (the rest spares), pending
registrations stay pending, a fault with no member lost aborts, a generation number a boundary already published is
skipped."""

from __future__ import annotations

import threading

import torch.distributed as dist

from tenplex_megatron.frontdoor import membership_recovery as mr
from tenplex_megatron.frontdoor.membership import Generation, Membership

FOUR = Generation(0, ("h:0", "h:1", "h:2", "h:3"))


def powers_of_two(n: int) -> bool:
    return n in (1, 2, 4, 8)


def survive(m: Membership, gen: Generation, alive: list[str], settle: float = 0.5) -> dict[str, mr.Decision]:
    """Each of ``alive`` recovers in its own thread (as the survivors' processes do); their decisions."""
    got: dict[str, mr.Decision] = {}

    def one(me: str) -> None:
        got[me] = mr.recover(Membership(m.store, timeout=10), gen, me, powers_of_two, settle)

    threads = [threading.Thread(target=one, args=(me,)) for me in alive]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(got) == sorted(alive)
    return got


def test_the_survivors_agree_on_a_legal_world_and_the_rest_are_spares() -> None:
    m = Membership(dist.HashStore())
    m.publish(FOUR)
    got = survive(m, FOUR, ["h:0", "h:2", "h:3"])  # h:1 lost; 3 ranks: no legal layout
    decisions = {(d.gen, d.spares) for d in got.values()}
    assert len(decisions) == 1  # every survivor read the same decision
    d = got["h:0"]
    assert d.gen is not None and d.gen.number == 1 and d.gen.members == ("h:0", "h:2") and d.spares == ("h:3",)
    assert m.generation(1) == d.gen


def test_a_leave_notice_and_a_fault_at_once_leave_the_others() -> None:
    m = Membership(dist.HashStore())
    m.publish(FOUR)
    m.notice_leave(["h:2", "h:3"])
    d = survive(m, FOUR, ["h:0", "h:2", "h:3"])["h:2"]  # h:1 lost, h:2 and h:3 go on their notice
    assert d.gen is not None and d.gen.members == ("h:0",) and d.spares == () and d.gen.leaves == 1
    assert mr.leaving(m, FOUR)[0] == {"h:2", "h:3"}


def test_a_pending_newcomer_is_not_admitted_by_the_recovery_but_stays_pending() -> None:
    m = Membership(dist.HashStore())
    gen = Generation(0, ("h:0", "h:1"))
    m.publish(gen)
    m.register("h:9")  # registered before the fault: may have died since
    d = survive(m, gen, ["h:0"])["h:0"]
    assert d.gen is not None and d.gen.members == ("h:0",)
    assert m.pending(d.gen)  # the next boundary proposes it
    assert m.propose(d.gen, powers_of_two).members == ("h:0", "h:9")


def test_no_member_lost_aborts() -> None:
    m = Membership(dist.HashStore())
    gen = Generation(0, ("h:0", "h:1"))
    m.publish(gen)
    got = survive(m, gen, ["h:0", "h:1"], settle=5)
    assert all(d.gen is None and "every member of generation 0 is alive" in d.why for d in got.values())


def test_a_number_a_boundary_already_published_is_skipped() -> None:
    m = Membership(dist.HashStore())
    m.publish(FOUR)
    m.publish(Generation(1, ("h:0", "h:1", "h:2", "h:3", "h:8", "h:9")))  # published, then rank 0's peer died
    d = survive(m, FOUR, ["h:0", "h:1"])["h:1"]
    assert d.gen is not None and d.gen.number == 2 and d.gen.members == ("h:0", "h:1")
    assert m.generation(2) == d.gen and m.generation(1).members[-1] == "h:9"
